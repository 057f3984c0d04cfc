"""`vsup proxy --upstream ...` as a real process: health checks take an instance out of rotation
and back in, SIGTERM drains, bad input is one line and exit 2."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.fakevllm.fixtures import free_port, start_fake
from tests.proxy_support import LEAN, start_fakes

REPO = Path(__file__).resolve().parents[1]
VSUP = [sys.executable, "-c", "from vsup.cli.main import main; main()"]


def vsup(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=60, cwd=REPO, **kw)


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 10.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body) if body else None, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def served_by(port: int) -> str:
    status, headers, _ = request(port, "POST", "/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert status == 200
    return headers["X-Fake-Instance"]


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://127.0.0.1:1", "expected a base URL like http://127.0.0.1:8100"),
        ("https://127.0.0.1:8443", "expected a base URL like http://127.0.0.1:8100"),
        ("http://127.0.0.1", "no port"),
        ("http://127.0.0.1:8100/v1", "no path"),
        ("http://127.0.0.1:99999", "Port out of range"),
    ],
)
def test_bad_upstream_is_one_line_and_exit_2(url, message):
    result = vsup("proxy", "--upstream", url)
    assert result.returncode == 2
    assert result.stderr.startswith(f"vsup: error: --upstream {url!r}") and message in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_port_in_use_is_one_line_and_exit_2():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = vsup("proxy", "--upstream", "http://127.0.0.1:9", "--port", str(port))
    assert result.returncode == 2
    assert f"vsup: error: proxy cannot listen on 127.0.0.1:{port}: the port is already in use" in result.stderr


def test_bad_config_file_names_the_key(tmp_path):
    config = tmp_path / "proxy.yaml"
    config.write_text("proxy:\n  policy: random\n")
    result = vsup("proxy", "--upstream", "http://127.0.0.1:9", "--config", str(config))
    assert result.returncode == 2 and "proxy.policy" in result.stderr and ":2:" in result.stderr


def test_standalone_proxy_health_checks_and_drain(tmp_path):
    a, b = start_fakes(["a", "b"])
    port = free_port()
    config = tmp_path / "proxy.yaml"
    config.write_text("proxy:\n  drain_timeout: 5\nhealth:\n  interval: 0.2\n  timeout: 1\n  failures: 2\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), VSUP_API_KEY="")
    proc = subprocess.Popen(
        [*VSUP, "proxy", "--upstream", a.url, "--upstream", b.url + "/", "--port", str(port), "--config", str(config)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    replacement = None
    try:
        wait_until(lambda: request(port, "GET", "/ready")[0] == 200, what="the proxy to see a ready upstream")
        wait_until(lambda: {served_by(port) for _ in range(4)} == {"a", "b"}, what="both upstreams in rotation")

        a.kill_group()  # its port closes; the health checks take it out
        wait_until(lambda: b'vsup_instance_ready{instance="%s"} 0.0' % a.url.encode() in request(port, "GET", "/metrics")[2],
                   what="the dead upstream to leave the rotation")
        assert Counter(served_by(port) for _ in range(6)) == {"b": 6}

        replacement = start_fake(a.port, name="a2", env=LEAN)  # back on the same address
        wait_until(lambda: "a2" in {served_by(port) for _ in range(4)}, what="the upstream to come back")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stderr.close()
        for fake in (a, b, replacement):
            if fake is not None:
                fake.cleanup()


def test_standalone_proxy_answers_503_at_once_when_every_upstream_is_gone(tmp_path):
    # Health checks far apart: only passive ejection can notice the deaths in time.
    a, b = start_fakes(["a", "b"])
    port = free_port()
    config = tmp_path / "proxy.yaml"
    config.write_text("health:\n  interval: 1\n  timeout: 1\n  failures: 1000\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), VSUP_API_KEY="")
    proc = subprocess.Popen(
        [*VSUP, "proxy", "--upstream", a.url, "--upstream", b.url, "--port", str(port), "--config", str(config)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    revived = None
    try:
        # a request before the first health check gets 503: wait for the proxy to see its upstreams
        wait_until(lambda: request(port, "GET", "/ready")[0] == 200, what="the proxy to see a ready upstream")
        wait_until(lambda: {served_by(port) for _ in range(4)} == {"a", "b"}, what="both upstreams in rotation")
        a.kill_group()
        b.kill_group()
        status, headers, body = request(port, "POST", "/v1/chat/completions",
                                        {"model": "fake-model", "messages": [{"role": "user", "content": "x"}]})
        assert status == 503 and headers["Retry-After"] == "1"
        error = json.loads(body)["error"]
        assert error["code"] == "no_ready_instance" and "could be reached" in error["message"]
        # the active checker brings an upstream back once it answers again
        revived = start_fake(a.port, name="a2", env=LEAN)
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        wait_until(lambda: request(port, "POST", "/v1/chat/completions", chat)[1].get("X-Fake-Instance") == "a2",
                   what="the revived upstream to be back in rotation")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        stderr = proc.stderr.read()
        proc.stderr.close()
        for fake in (a, b, revived):
            if fake is not None:
                fake.cleanup()
    assert "Traceback" not in stderr
