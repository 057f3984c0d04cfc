"""The fake vLLM's `--uds PATH`, as vLLM 0.32 has it: host and port ignored, a plain bind of the
path (EADDRINUSE if it exists), `unix:PATH` in the log; and vsup's clients over such a socket: the
proxy's own upstream client and the aiohttp sessions of address.Sessions (probe, warm-up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.fakevllm.fixtures import REPO_ROOT
from tests.vsup_harness import instance_get
from vsup.proxy.address import Sessions, unix_url
from vsup.proxy.health import probe_health
from vsup.proxy.upstream import UpstreamClient
from vsup.supervisor.warmup import warm_up

pytestmark = pytest.mark.timeout(60)


def start(path: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "FAKE_VLLM_EVENTS": ""}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-P", "-m", "tests.fakevllm", "serve", "fake-model", "--host", "0.0.0.0",
                                 "--port", "1", "--uds", str(path)], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_socket(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the fake never bound its socket"
        time.sleep(0.05)


@pytest.fixture
def served(tmp_path):
    path = tmp_path / "0.sock"
    proc = start(path, tmp_path / "fake.log")
    try:
        wait_for_socket(path, proc)
        yield path, proc, tmp_path / "fake.log"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its session: the engine core too, not only the API server
        proc.wait()


def test_uds_binds_the_path_and_no_tcp_port(served):
    path, proc, log = served
    assert instance_get(str(path), "/health")[0] == 200
    listening = [c for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert listening == []  # --host 0.0.0.0 --port 1 ignored
    assert f"Starting vLLM API server 0 on unix:{path}" in log.read_text()


def test_uds_refuses_a_path_that_exists(served, tmp_path):
    path, _proc, _log = served
    second = start(path, tmp_path / "second.log")
    assert second.wait(30) == 1
    assert "Address already in use" in (tmp_path / "second.log").read_text()
    assert instance_get(str(path), "/health")[0] == 200  # the first one's socket was not taken over


async def test_vsups_clients_speak_http_over_the_socket(served):
    path, _proc, _log = served
    url = unix_url(path)
    client = UpstreamClient(limit=4, connect_timeout=5, keepalive=10)
    try:
        assert await client.listening(url)
        conn = await client.connect(url)
        response = await client.send(conn, "GET", b"/v1/models", b"", b"")
        assert response.status == 200
        body = b""
        while chunk := await response.read_chunk():
            body += chunk
        response.close()
        assert b"fake-model" in body
    finally:
        client.close()
    sessions = Sessions(timeout=None)
    try:
        session, base = sessions.get(url)
        assert (await probe_health(session, base, 5, expect_instance=True)).ok
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, "temperature": 0}
        assert (await warm_up(session, base, body, 10)).ok
    finally:
        await sessions.close()
    assert not await UpstreamClient(limit=1, connect_timeout=5, keepalive=1).listening(unix_url(path.with_name("none.sock")))
