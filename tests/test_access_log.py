"""vllm.access_log under `vsup run` with the fake vLLM, which writes uvicorn's access lines exactly
when vLLM would (--disable-uvicorn-access-log, --disable-access-log-for-endpoints): a client's
request appears in the instance's log, vsup's own /health and /metrics polls do not."""

from __future__ import annotations

import re
import time
import urllib.request
from collections import Counter

import pytest

from tests.vsup_harness import VsupRun, make_config

pytestmark = pytest.mark.timeout(120)
ACCESS = re.compile(r'INFO: +\S+ - "(GET|POST) (\S+) HTTP/1.1" \d+')


def access_lines(tmp_path) -> Counter:
    text = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
    return Counter(m.group(2) for m in ACCESS.finditer(text))


def run_with(tmp_path, mode: str | None) -> Counter:
    tmp_path.mkdir(parents=True, exist_ok=True)
    vllm = {"access_log": mode} if mode else {}
    config = make_config(tmp_path, instances=1, health={"interval": 0.2}, metrics={"interval": 0.3},
                         log={"dir": str(tmp_path / "logs"), "echo": False, "level": "info"})
    config["vllm"].update(vllm)
    run = VsupRun(tmp_path, config)
    try:
        run.wait_ready()
        time.sleep(2.0)  # ~10 /health and ~6 /metrics polls
        request = urllib.request.Request(
            f"http://127.0.0.1:{run.proxy_port}/v1/chat/completions", method="POST",
            data=b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        time.sleep(0.3)  # the line reaches the log file
        return access_lines(tmp_path)
    finally:
        run.close()


def test_by_default_clients_requests_are_logged_and_vsups_polls_are_not(tmp_path):
    lines = run_with(tmp_path, None)
    assert lines["/v1/chat/completions"] == 1  # the client's request
    assert lines["/v1/completions"] == 1  # vsup's warm-up: its path is a client's path too
    assert lines["/health"] == 0 and lines["/metrics"] == 0


def test_all_logs_the_polls_too_and_off_logs_nothing(tmp_path):
    lines = run_with(tmp_path / "all", "all")
    assert lines["/v1/chat/completions"] == 1 and lines["/health"] >= 5 and lines["/metrics"] >= 2
    assert run_with(tmp_path / "off", "off") == Counter()


def test_a_clients_query_reaches_the_instances_log_without_its_key_and_percent_encoded(tmp_path):
    config = make_config(tmp_path, instances=1, log={"dir": str(tmp_path / "logs"), "echo": False, "level": "info"})
    run = VsupRun(tmp_path, config)
    try:
        run.wait_ready()
        request = urllib.request.Request(
            f"http://127.0.0.1:{run.proxy_port}/v1/chat/completions?note=$(id)`id`&api_key=sk-leaked", method="POST",
            data=b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        deadline = time.monotonic() + 5
        while "note=" not in "".join(access_lines(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        run.close()
    assert list(k for k in access_lines(tmp_path) if "note=" in k) == ["/v1/chat/completions?note=%24%28id%29%60id%60"]
    text = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
    assert "sk-leaked" not in text and "$(id)" not in text
