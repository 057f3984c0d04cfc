"""`vsup proxy --upstream MODEL=URL` as a real process (the front of a fleet export): requests go
by the body's model to that model's upstreams, an unknown model is a 404 naming the served ones,
each model balanced by its own policy from a fleet --config; bad input is one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.fakevllm.fixtures import free_port, start_fake
from tests.proxy_support import LEAN
from tests.test_proxy_cli import REPO, VSUP, request, vsup, wait_until


def chat(port: int, model: str):
    return request(port, "POST", "/v1/chat/completions",
                   {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})


@pytest.mark.parametrize("config", [None, "fleet"])
def test_upstreams_named_by_model_route_by_the_body_s_model(tmp_path, config):
    fakes = [start_fake(name=name, served_model_names=[model], env=LEAN)
             for name, model in (("c0", "chat"), ("c1", "chat"), ("e0", "org/embed"))]
    port = free_port()
    args = [*VSUP, "proxy", "--port", str(port)]
    for fake, model in zip(fakes, ("chat", "chat", "org/embed"), strict=True):
        args += ["--upstream", f"{model}={fake.url}"]
    path = tmp_path / "front.yaml"
    path.write_text("health:\n  interval: 0.2\n" + (
        "models:\n  - model: /m/chat\n    served_model_name: chat\n    proxy: {policy: least_outstanding}\n"
        "  - model: /m/embed\n    served_model_name: org/embed\n" if config else ""))
    args += ["--config", str(path)]
    proc = subprocess.Popen(args, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), VSUP_API_KEY=""),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for fake in fakes:
            fake.wait_ready()
        wait_until(lambda: request(port, "GET", "/ready")[0] == 200, what="the proxy to see a ready upstream")
        wait_until(lambda: {chat(port, "chat")[1].get("X-Fake-Instance") for _ in range(6)} == {"c0", "c1"},
                   what="both chat upstreams in rotation")
        assert {chat(port, "org/embed")[1].get("X-Fake-Instance") for _ in range(4)} == {"e0"}
        status, _, body = chat(port, "rerank")
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
        assert "'chat'" in json.loads(body)["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for fake in fakes:
            fake.cleanup()
    with proc.stderr:
        assert "Traceback" not in proc.stderr.read()


@pytest.mark.parametrize("upstreams, message", [
    (["=http://127.0.0.1:9"], "--upstream '=http://127.0.0.1:9': no model before '='"),
    (["chat=http://127.0.0.1:9", "http://127.0.0.1:10"], "--upstream 'http://127.0.0.1:10': names no model while"),
    (["chat=ftp://x:1"], "--upstream 'ftp://x:1': expected a base URL"),
])
def test_bad_model_upstreams_are_one_line_and_exit_2(upstreams, message):
    result = vsup("proxy", *(a for u in upstreams for a in ("--upstream", u)))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_a_model_the_fleet_config_does_not_serve_is_named(tmp_path):
    path = tmp_path / "front.yaml"
    path.write_text("models:\n  - model: /m/chat\n    served_model_name: chat\n")
    result = vsup("proxy", "--upstream", "embed=http://127.0.0.1:9", "--config", str(path))
    assert result.returncode == 2 and "--config serves no model 'embed'; it serves 'chat'" in result.stderr, result.stderr
