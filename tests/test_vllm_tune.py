"""`vsup tune` on real vLLM (marked vllm): the tiny model on this machine's two cores, a reduced
budget. The layouts of the issue (2 × 1 core and 1 × 2 cores), two --max-num-seqs values (the
config's 32 and 8), one load level; every candidate is a real `vsup run` of vLLM's CPU build.

vsup runs from this checkout's .venv with `vllm.venv` pointing at the cached vLLM venv (the README's
second install path), so nothing is installed into vLLM's venv here. The full report with both
objectives is `scripts/tune-report` (docs/tune.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml

from tests.test_vllm_e2e import processes_with_env
from tests.vsup_harness import VSUP
from vsup.config.planning import plan_from_config
from vsup.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]
BUDGET = "12m"

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def test_vsup_tune_picks_a_layout_of_real_vllm_and_writes_a_config_that_plans(vllm_install, tmp_path):
    venv, model = vllm_install
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["model"] = str(model)
    config["vllm"]["venv"] = str(venv)
    cache = tmp_path / "vllm-cache"
    config["vllm"]["env"] = {**config["vllm"].get("env", {}), "VLLM_CACHE_ROOT": str(cache)}
    config["health"] = {"interval": 1.0, "timeout": 10.0, "startup_timeout": 600}
    config["stop"] = {"timeout": 30}
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    report = tmp_path / "report"
    argv = [*VSUP, "tune", "--config", str(path), "--report", str(report), "--budget", BUDGET,
            "--omp-threads", "all", "--housekeeping-core", "off", "--preload", "none", "--max-num-seqs", "8", "--kvcache-gib", "0.0625",
            "--concurrency", "8", "--input-len", "32", "--output-len", "32", "--min-duration", "15s", "--max-duration", "20s",
            "--write-config", str(tmp_path / "tuned.yaml")]
    marker = f"VLLM_CACHE_ROOT={cache}"
    try:
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    finally:
        leftovers = processes_with_env(marker)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert not leftovers, f"vLLM processes left behind: {[(p, psutil.Process(p).name()) for p in leftovers]}"

    entries = [json.loads(line) for line in (report / "results.jsonl").read_text().splitlines() if line.strip()]
    runs = [e for e in entries if e["type"] == "run"]
    screened = {e["candidate"]: e for e in runs if e["stage"] == "screen"}
    assert set(screened) == {"i1", "i2"}, runs
    for run in screened.values():
        assert run["ok"], run["error"]
        [level] = run["levels"]
        assert level["completed"] > 0 and level["errors"] == 0 and level["output_throughput"] > 0
        assert 0 < level["latency"]["ttft"]["p50"] <= level["latency"]["ttft"]["p99"]
        assert 0 < run["extra"]["roofline"]["fraction"] < 2, run["extra"]
    result = entries[-1]
    assert result["type"] == "result" and result["spent_s"] <= 12 * 60
    best = result["best"]
    assert best.split("-")[0] in ("i1", "i2")
    assert any(e["stage"] == "tweak" and "seqs8" in e["candidate"] for e in runs), "the --max-num-seqs tweak did not run"

    tuned = load_config(tmp_path / "tuned.yaml")
    _machine, plan = plan_from_config(tuned)
    assert len(plan.instances) == int(best.split("-")[0][1:])
    assert (report / "chart.png").stat().st_size > 10_000
    assert f"**Best: `{best}`**" in (report / "summary.md").read_text()
