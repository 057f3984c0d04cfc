"""Only vsup's own child answers for an instance (issue 20 §1), as attacks with real processes:

- by default (vllm.listen: unix) the instances listen on Unix sockets in a private 0700 folder
  of vsup's runtime directory, with no TCP port; another uid can neither connect to one nor put
  a socket of its own there;
- under vllm.listen: tcp, a squatter of another uid that binds an instance's port while it
  restarts and answers /health (and every POST with a forged completion) is never routed to:
  vsup names who holds the port and keeps the instance out of the rotation.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.vsup_harness import VSUP

pytestmark = pytest.mark.timeout(180)
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as uid 65534")
FORGED = "FORGED-ANSWER"


def completion(port: int, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 3})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def unix_get(path: str, route: str) -> int:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    try:
        sock.connect(path)
        sock.sendall(f"GET {route} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        return int(sock.recv(4096).split()[1])
    finally:
        sock.close()


def tcp_listeners(pids: list[int]) -> list:
    found = []
    for pid in pids:
        try:
            found += [c for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture
def shared_runtime():
    """A runtime directory others may enter (like systemd's /run/vsup at RuntimeDirectoryMode 0755,
    under a world-writable /tmp): only the instances' own folder keeps other users out."""
    directory = Path(tempfile.mkdtemp(prefix="vsup-rt-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    subprocess.run(["rm", "-rf", str(directory)], check=False)


def test_default_run_puts_instances_on_private_unix_sockets_without_a_tcp_port(vsup, shared_runtime):
    run = vsup(env={"RUNTIME_DIRECTORY": str(shared_runtime)})
    status = run.wait_ready(2)
    folder = shared_runtime / f"instances-{run.proxy_port}"
    info = folder.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    for index, inst in enumerate(status["instances"]):
        assert inst["address"] == str(folder / f"{index}.sock")
        sock = os.lstat(inst["address"])
        assert stat.S_ISSOCK(sock.st_mode) and sock.st_uid == os.getuid()
        assert unix_get(inst["address"], "/health") == 200
        assert tcp_listeners(run.tree(inst["pid"])) == [], "an instance listens on TCP"
    for _ in range(4):  # both instances, through the proxy
        code, text = completion(run.proxy_port)
        assert code == 200 and json.loads(text)["choices"], text
    shown = subprocess.run([*VSUP, "status", "--socket", run.socket], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and str(folder / "0.sock") in shown.stdout, shown.stdout + shown.stderr
    assert run.terminate() == 0
    assert not list(folder.glob("*.sock")), "sockets left after a clean stop"


@needs_root
def test_another_uid_can_neither_reach_nor_replace_an_instance_socket(vsup, shared_runtime):
    run = vsup(instances=1, env={"RUNTIME_DIRECTORY": str(shared_runtime)})
    path = run.wait_ready(1)["instances"][0]["address"]
    probe = ("import socket,sys,errno\n"
             "p=sys.argv[1]; s=socket.socket(socket.AF_UNIX)\n"
             "try:\n    s.connect(p); print('connected')\nexcept OSError as e: print(errno.errorcode[e.errno])\n"
             "t=socket.socket(socket.AF_UNIX)\n"
             "try:\n    t.bind(p + '.evil'); print('created')\nexcept OSError as e: print(errno.errorcode[e.errno])\n")
    out = subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-c", probe, path], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["EACCES", "EACCES"], out.stdout + out.stderr
    removed = subprocess.run([*AS_NOBODY, "rm", "-f", path], capture_output=True, text=True, timeout=30)
    assert removed.returncode != 0 and os.path.exists(path)
    assert completion(run.proxy_port)[0] == 200


SQUATTER = r"""
import json, socket, sys, time
port = int(sys.argv[1])
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
while True:  # every few ms until the instance's port is free
    try:
        sock.bind(("127.0.0.1", port))
        break
    except OSError:
        time.sleep(0.002)
sock.listen(64)
print("bound", flush=True)
forged = json.dumps({"id": "x", "object": "text_completion", "model": "fake-model",
                     "choices": [{"index": 0, "text": "FORGED-ANSWER", "finish_reason": "length"}]}).encode()
while True:
    conn, _ = sock.accept()
    conn.settimeout(2)
    try:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")), 0)
        while len(rest) < length:
            rest += conn.recv(65536)
        body = b"{}" if head.startswith(b"GET /health") else forged
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    except OSError:
        pass
    finally:
        conn.close()
"""


@needs_root
def test_a_squatter_on_a_restarting_instances_tcp_port_is_never_routed_to(vsup):
    run = vsup(instances=1, faults={0: {"START_DELAY": "1"}}, vllm={"listen": "tcp"},
               restart={"max_delay": 0.3, "stable_after": 300, "max_failures": 100})
    first = run.wait_ready(1)["instances"][0]
    assert first["address"] == f"127.0.0.1:{run.port(0)}"
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def clients() -> None:
        while not stop.is_set():
            try:
                answers.append(completion(run.proxy_port, timeout=5))
            except OSError as exc:
                answers.append((0, str(exc)))
            time.sleep(0.02)

    squatter = subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-c", SQUATTER, str(run.port(0))],
                                stdout=subprocess.PIPE, text=True)
    worker = threading.Thread(target=clients, daemon=True)
    worker.start()
    try:
        seen = len(first["transitions"])
        os.kill(first["pid"], signal.SIGKILL)  # the instance dies: its port is free for a moment
        assert squatter.stdout.readline().strip() == "bound"  # type: ignore[union-attr]
        holder = f"port {run.port(0)} is held by pid {squatter.pid} (uid 65534, /usr/bin/python3 -c"

        def refused(status: dict) -> bool:
            return any(holder in (t["reason"] or "") for t in status["instances"][0]["transitions"])
        status = run.wait_for(refused, 40, "the squatter named in a transition")
        assert status["instances"][0]["state"] != "ready"
        assert holder in run.log()
        time.sleep(2)  # a few more restarts with the squatter in place
        since = run.instance(0)["transitions"][seen:]
        assert sum(holder in (t["reason"] or "") for t in since) >= 2, since  # refused again after each restart
        assert not any(t["to"] in ("warming", "ready") for t in since), since
    finally:
        squatter.kill()
        squatter.wait()
        squatter.stdout.close()  # type: ignore[union-attr]
    run.wait_ready(1, timeout=40)  # the squatter is gone: the instance itself comes back
    time.sleep(0.5)
    stop.set()
    worker.join(10)
    assert not any(FORGED in text for _, text in answers), "a forged answer reached a client"
    assert any(code == 200 for code, _ in answers[-5:]), answers[-5:]
    assert {code for code, _ in answers} <= {200, 502, 503, 504}, {code for code, _ in answers}
