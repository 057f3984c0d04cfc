"""bench/batch_bench.py end to end in its fake mode, at a tiny size: a real `vsup run` over fake vLLM
processes, batches through the real `openai` SDK, the supervisor killed with SIGKILL at half a batch
and started again with the same config and store. The result file's shape, and the issue's
durability proof over `vsup run`: the resumed batch (the same id) ends `completed` with exactly one
result per custom_id, none missing. Plus the check itself, which must catch a duplicate and a gap."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "batch_bench.py"

pytestmark = pytest.mark.timeout(120)


def load_bench():
    spec = importlib.util.spec_from_file_location("batch_bench", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["batch_bench"] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def result_line(cid: str, status: int = 200) -> dict:
    return {"id": f"batch_req_{cid}", "custom_id": cid, "response": {"status_code": status, "request_id": "r", "body": {}},
            "error": None}


def test_the_check_finds_a_duplicate_a_gap_and_a_stranger():
    ids = ["a", "b", "c"]
    assert bench.one_per_custom_id(ids, [result_line("a"), result_line("b"), result_line("c")], [])["met"]
    twice = bench.one_per_custom_id(ids, [result_line("a"), result_line("a"), result_line("b"), result_line("c")], [])
    assert not twice["met"] and twice["duplicates"] == 1 and twice["examples"] == ["a"]
    gap = bench.one_per_custom_id(ids, [result_line("a"), result_line("c")], [])
    assert not gap["met"] and gap["missing"] == 1 and gap["examples"] == ["b"]
    stranger = bench.one_per_custom_id(ids, [result_line("a"), result_line("b"), result_line("c"), result_line("z")], [])
    assert not stranger["met"] and stranger["unknown"] == 1
    # a line in the error file is a result: also in the output, it is a duplicate; only there, not an answer
    both = bench.one_per_custom_id(ids, [result_line("a"), result_line("b"), result_line("c")], [{"custom_id": "c", "error": {}}])
    assert not both["met"] and both["duplicates"] == 1
    failed = bench.one_per_custom_id(ids, [result_line("a"), result_line("b")], [{"custom_id": "c", "response": None}])
    assert not failed["met"] and failed["missing"] == 0 and failed["error_results"] == 1
    assert not bench.one_per_custom_id(ids, [result_line("a"), result_line("b"), result_line("c", 500)], [])["met"]


def test_the_input_file_is_openai_lines_of_the_endpoint():
    args = bench.parse_args(["--fake", "--lines", "3", "--endpoint", "/v1/embeddings"])
    data, ids = bench.jsonl(bench.line_bodies(args, "x"), args.endpoint, "x")
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert [line["custom_id"] for line in lines] == ids and len(set(ids)) == 3
    assert all(line["method"] == "POST" and line["url"] == "/v1/embeddings" and line["body"]["model"] == "embed" for line in lines)
    # fresh text per phase: no phase meets a prefix cache another one filled
    assert bench.line_bodies(args, "x") != bench.line_bodies(args, "y")


def test_the_fake_run_end_to_end_with_a_kill_halfway(tmp_path):
    out = tmp_path / "batch_bench.json"
    done = subprocess.run([sys.executable, str(BENCH), "--fake", "--lines", "30", "--beside-lines", "90", "--chats", "5",
                           "--concurrency", "6,8", "--kill-halfway", "--quiet-after", "2", "--result", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=110, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "batch_bench" and data["command"].startswith(".venv/bin/python bench/batch_bench.py --fake")
    f = data["figures"]
    assert f["backend"] == "fake" and f["settings"]["lines"] == 30 and f["settings"]["endpoint"] == "/v1/chat/completions"
    assert f["alone"]["requests"] == 5 and 0 < f["alone"]["ttft_p50_s"] <= f["alone"]["ttft_p90_s"]
    assert 1 <= f["beside"]["requests"] <= 5 and f["beside"]["ttft_p50_s"] > 0
    assert [row["concurrency"] for row in f["loop"]] == [6, 8] and all(row["errors"] == 0 and row["lines"] == 30 for row in f["loop"])
    assert f["best_loop"]["lines_per_s"] == max(row["lines_per_s"] for row in f["loop"])
    assert f["batch"]["status"] == "completed" and f["batch"]["lines_per_s"] > 0 and f["batch"]["failed"] == 0
    # the throughput ratio's baseline: the sweep's best concurrency measured again after the batch
    assert f["again"]["concurrency"] == f["best_loop"]["concurrency"] and f["again"]["lines"] == 30 and f["again"]["errors"] == 0
    assert f["ratios"]["batch_over_best_loop"] == pytest.approx(f["batch"]["lines_per_s"] / f["again"]["lines_per_s"], abs=1e-3)
    assert f["ratios"]["batch_over_sweep_best"] == pytest.approx(f["batch"]["lines_per_s"] / f["best_loop"]["lines_per_s"], abs=1e-3)
    kill = f["kill"]
    # killed at half the batch, never after its end; the same id resumed to completion, one result each
    assert 15 <= kill["lines_done_at_kill"] < 30 and kill["killed_exit"] == -9 and kill["new_supervisor"], kill
    assert kill["status"] == "completed" and kill["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    assert (kill["custom_ids"], kill["output_results"], kill["output_answers_200"]) == (30, 30, 30)
    assert (kill["duplicates"], kill["missing"], kill["unknown"], kill["error_results"]) == (0, 0, 0, 0) and kill["met"]
    assert [b["met"] for b in f["bars"]][2] is True and len(f["bars"]) == 3
    assert "kill -9 vsup at" in done.stderr and "one result per custom_id" in done.stdout
