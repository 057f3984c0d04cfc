"""Batches seen end to end under a real `vsup run` (a fake vLLM instance): a batch made by the openai
SDK shows in `vsup status` (text and JSON, through the control socket), on the /status page, in
/metrics, and `vsup batch list` finds the local proxy through the control socket (no --url)."""

from __future__ import annotations

import json
import os
import subprocess

import openai
import pytest

from tests.vsup_harness import VSUP, VsupRun, make_config

pytestmark = pytest.mark.timeout(180)

KEY = "admin-key"
METADATA = {"job": "\x1b]0;pwned\x07 <script>x</script>"}


def test_a_running_batch_in_status_the_page_metrics_and_vsup_batch(tmp_path):
    config = make_config(tmp_path, instances=1, proxy={"api_key": KEY}, batch={"dir": str(tmp_path / "batches"), "slots_per_instance": 3})  # 6 lines at a time (quiet: 3 slots, twice that), 1 s each
    run = VsupRun(tmp_path, config)
    try:
        run.wait_ready()
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "fake-model", "prompt": "hi", "max_tokens": 10,
                                             "fake": {"token_delay": 0.1}}}) + "\n" for i in range(30))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{run.proxy_port}/v1", api_key=KEY, max_retries=0, timeout=30)
        file = client.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h", metadata=METADATA)
        status = run.wait_for(lambda s: any(b["id"] == batch.id and b["status"] == "in_progress" and b["completed"]
                                            for b in s.get("batches", ())), timeout=60, what="the batch running, a line done")
        [entry] = [b for b in status["batches"] if b["id"] == batch.id]
        assert entry["models"] == ["fake-model"] and entry["total"] == 30 and entry["metadata"] == METADATA
        assert KEY not in json.dumps(status)

        text = subprocess.run([*VSUP, "status", "--socket", run.socket], capture_output=True, text=True, timeout=30,
                              check=True).stdout
        assert "\x1b" not in text
        lines_out = text.splitlines()
        row = lines_out[lines_out.index("batches:") + 2]
        assert row.startswith(batch.id) and row.split()[1] == "in_progress" and row.endswith("job=\\x1b]0;pwned\\x07 <script>x</script>")

        env = {**os.environ, "VSUP_API_KEY": KEY}
        env.pop("VSUP_URL", None)
        listed = subprocess.run([*VSUP, "batch", "list", "--socket", run.socket], capture_output=True, text=True, timeout=30, env=env)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[1].startswith(batch.id)

        code, page = run_page(run)
        assert code == 200 and '<table id="batches">' in page and batch.id in page
        assert "<script>x" not in page and "&lt;script&gt;x" in page
        client.batches.cancel(batch.id)
        run.wait_for(lambda s: any(b["id"] == batch.id and b["status"] == "cancelled" for b in s.get("batches", ())),
                     timeout=60, what="the batch cancelled")
        metrics = get(run, "/metrics")[1]
        assert 'vsup_batch_batches{status="cancelled"} 1.0' in metrics
        assert 'vsup_batch_lines_total{model="fake-model",outcome="completed"}' in metrics
        assert 'vsup_batch_lines_total{model="fake-model",outcome="failed"}' in metrics  # the cancelled lines
        assert batch.id not in metrics
        client.close()
    finally:
        run.close()


def get(run: VsupRun, path: str) -> tuple[int, str]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", run.proxy_port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def run_page(run: VsupRun) -> tuple[int, str]:
    return get(run, "/status")
