"""The Batch API over real vLLM CPU (0.32, scripts/vllm-env), sized to prove behaviour, not to
benchmark (bench/batch_bench.py measures): one `vsup run` of the tiny random Llama as a chat
model and the same weights as an embedding model (`--runner pooling --convert embed`), one
instance each on a core of its own (tests/test_vllm_fleet.py's fleet); a 40-line chat batch and a
40-line embeddings batch through the real `openai` SDK; vsup killed with SIGKILL at half the chat
batch and started again with the same config and store; both batches, the same ids, end
`completed` with exactly one result per custom_id, every one an answer of the instance.

Marked `vllm` (the venv and model are built once per machine and cached); `VSUP_SKIP_VLLM=1`
skips it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import openai
import pytest

from tests.test_vllm_e2e import STARTUP_TIMEOUT
from tests.test_vllm_fleet import CHAT, EMBED, fleet_config
from tests.vsup_harness import VsupRun

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

LINES = 40
TERMINAL = ("completed", "failed", "expired", "cancelled")


def batch_file(endpoint: str) -> tuple[bytes, list[str]]:
    ids = [f"{endpoint.rsplit('/', 1)[1]}-{n:03d}" for n in range(LINES)]
    if endpoint == "/v1/embeddings":
        bodies = [{"model": EMBED, "input": f"document {n}: " + "the river runs by the stone city " * 20} for n in range(LINES)]
    else:  # 48 tokens each, 8 at a time on the instance (--max-num-seqs 4, twice that: no chat comes): seconds, not one wave
        bodies = [{"model": CHAT, "messages": [{"role": "user", "content": f"summarize line {n}"}], "max_tokens": 48,
                   "ignore_eos": True, "temperature": 0} for n in range(LINES)]
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body}) + "\n"
                   for cid, body in zip(ids, bodies, strict=True))
    return data.encode(), ids


def done(batch) -> int:
    return batch.request_counts.completed + batch.request_counts.failed if batch.request_counts else 0


def wait(client: openai.OpenAI, batch_id: str, until, timeout: float):
    """batches.retrieve until until(batch) or a terminal status; a refused connection (vsup being
    started again) is waited out."""
    deadline = time.monotonic() + timeout
    batch = None
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except openai.APIConnectionError:
            time.sleep(0.2)
            continue
        if batch.status in TERMINAL or until(batch):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} not done within {timeout:.0f} s: {batch}")


def test_chat_and_embeddings_batches_survive_a_kill9_of_vsup_with_one_result_per_custom_id(vllm_install, tmp_path):
    venv, model = vllm_install
    config = fleet_config(venv, model, tmp_path)
    config["batch"] = {"dir": str(tmp_path / "batches")}
    for entry in config["models"]:  # 4 slots an instance: the chat batch takes 8 at a time (4 queued in vLLM)
        args = list(entry.get("vllm", {}).get("args", config["vllm"]["args"]))
        args[args.index("--max-num-seqs") + 1] = "4"
        entry["vllm"] = {"args": args}
    first = VsupRun(tmp_path, config)
    second = None
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{first.proxy_port}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        first.wait_ready(count=2, timeout=STARTUP_TIMEOUT)
        ids, batches = {}, {}
        for endpoint in ("/v1/chat/completions", "/v1/embeddings"):
            data, ids[endpoint] = batch_file(endpoint)
            uploaded = client.files.create(file=(f"{endpoint[4:]}.jsonl", data), purpose="batch")
            batches[endpoint] = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                                      completion_window="24h").id

        chat = wait(client, batches["/v1/chat/completions"], lambda b: done(b) >= LINES // 2, 600)
        assert chat.status == "in_progress", f"the chat batch ended before half its lines: {chat}"
        os.kill(first.proc.pid, signal.SIGKILL)  # the supervisor: its proxy and batch runner with it
        assert first.proc.wait(30) == -signal.SIGKILL
        at_kill = done(chat)
        assert 0 < at_kill < LINES

        second = VsupRun(tmp_path, config)  # the same config and store: the same batches resume
        second.wait_ready(count=2, timeout=STARTUP_TIMEOUT)
        for endpoint, batch_id in batches.items():
            batch = wait(client, batch_id, lambda b: False, 600)
            assert batch.status == "completed", batch
            assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (LINES, LINES, 0)
            assert batch.error_file_id is None
            output = [json.loads(line) for line in client.files.content(batch.output_file_id).read().splitlines()]
            seen = Counter(line["custom_id"] for line in output)
            assert set(seen) == set(ids[endpoint]) and max(seen.values()) == 1, (endpoint, seen.most_common(3))
            assert [line["custom_id"] for line in output] == ids[endpoint]  # in the input's order
            for line in output:
                response = line["response"]
                assert line["error"] is None and response["status_code"] == 200 and response["request_id"], line
                if endpoint == "/v1/embeddings":
                    assert response["body"]["model"] == EMBED and response["body"]["data"][0]["embedding"]
                else:
                    assert response["body"]["model"] == CHAT and response["body"]["usage"]["completion_tokens"] == 48
    finally:
        for run in (second, first):
            if run is not None:
                run.close()
