"""Helpers for tests that run the fake vLLM server as a real process (see docs/fakevllm.md).

    # the pytest fixture `fake_vllm` (a factory) is registered for every test module by tests/conftest.py

    def test_x(fake_vllm):
        srv = fake_vllm(env={"FAKE_VLLM_START_DELAY": "1"})
        srv.wait_ready()
        ... srv.base_url, srv.events("finished"), srv.pids() ...
        # every instance is SIGKILLed with its whole group and its shm files removed at teardown

Without pytest: `start_fake(...)` returns a `FakeVllm`; call `.cleanup()` when done.
Each instance runs in its own session (process group), writes stdout+stderr to a file (never a
pipe that could fill) and its events to a JSONL file, both in a private temp directory.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from . import WRAPPER

try:  # the helpers also serve bench scripts, which may run without pytest
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

REPO_ROOT = Path(__file__).resolve().parents[2]
START_MARKER = "FAKE_VLLM_START "


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fake_command() -> list[str]:
    """argv prefix that stands in for `vllm serve` (e.g. as vsup's `vllm.command`)."""
    return [str(WRAPPER), "serve"]


def read_events(path: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """Records of a FAKE_VLLM_EVENTS file, oldest first; only `kind` events if given."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in records if kind is None or r["event"] == kind]


def start_records(text: str) -> list[dict]:
    """The FAKE_VLLM_START records found in a server's output (one per start)."""
    out = []
    for line in text.splitlines():
        at = line.find(START_MARKER)
        if at >= 0:
            out.append(json.loads(line[at + len(START_MARKER):]))
    return out


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    out = []
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None and st[2] == pgid and st[0] != "Z":
            out.append(pid)
    return sorted(out)


def fake_processes(port: int | None = None) -> list[int]:
    """Live processes of fake servers (API server, EngineCore, Worker), any parent and any group;
    only those of the instance on `port` if given. For asserting "nothing left behind"."""
    out = []
    for pid in _all_pids():
        argv = _cmdline(pid)
        if not argv:
            continue
        st = _stat(pid)
        if st is None or st[0] == "Z":
            continue
        is_server = "tests.fakevllm" in argv and "-m" in argv
        is_child = len(argv) >= 4 and argv[2] in ("fakevllm-enginecore", "fakevllm-worker")
        if not (is_server or is_child):
            continue
        if port is not None:
            if is_child and argv[3] != str(port):
                continue
            if is_server and not _server_port_is(argv, port):
                continue
        out.append(pid)
    return sorted(out)


def _server_port_is(argv: list[str], port: int) -> bool:
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return argv[i + 1] == str(port)
        if arg.startswith("--port="):
            return arg.split("=", 1)[1] == str(port)
    return port == 8000


def http_get(port: int, path: str, timeout: float = 2.0, host: str = "127.0.0.1") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class FakeVllm:
    """One fake server process started by `start_fake`."""

    def __init__(self, proc: subprocess.Popen, port: int, name: str, workdir: Path, events_path: Path | None,
                 own_workdir: bool) -> None:
        self.proc = proc
        self.port = port
        self.name = name
        self.workdir = workdir
        self.events_path = events_path
        self.log_path = workdir / "output.log"
        self._own_workdir = own_workdir
        self._shm_seen: set[str] = set()

    # ---------------------------------------------------------------- addresses and state

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """For the openai SDK: OpenAI(base_url=srv.base_url, api_key="x")."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """Everything the server (and its children) wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start_record(self, timeout: float = 10.0) -> dict:
        """The FAKE_VLLM_START record: pid, port, env seen, affinity, engine_pid, shm paths, argv."""
        deadline = time.monotonic() + timeout
        while True:
            records = start_records(self.output())
            if records:
                self._shm_seen.update(records[-1]["shm"])
                return records[-1]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fake vLLM on port {self.port} wrote no {START_MARKER.strip()} line "
                                   f"(exit code {self.proc.poll()}); output:\n{self.output()[-2000:]}")
            time.sleep(0.02)

    def health(self, timeout: float = 2.0) -> int | None:
        """Status of GET /health, None when nothing answers (port closed, timeout)."""
        try:
            return http_get(self.port, "/health", timeout)[0]
        except OSError:
            return None

    def wait_ready(self, timeout: float = 30.0) -> "FakeVllm":
        """Block until /health answers 200 from THIS process; raise if it exits or the timeout passes.

        "From this process": other test runs share the machine, and a port picked by free_port()
        can be taken by someone else's server before ours binds it (ours then exits 1). So a 200
        counts only once our own event log says we are listening (when there is one)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.health(timeout=1.0) == 200 and self._listening():
                return self
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"fake vLLM on port {self.port} exited with {code} before ready; "
                                   f"output:\n{self.output()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake vLLM on port {self.port} not ready after {timeout} s")
            time.sleep(0.05)

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            return False
        if self.events_path is None:
            return True  # no event log: the live process is the best evidence there is
        return any(r.get("pid") == self.proc.pid for r in self.events("ready"))

    def events(self, kind: str | None = None) -> list[dict]:
        return [] if self.events_path is None else read_events(self.events_path, kind)

    def wait_event(self, kind: str, timeout: float = 10.0, **match) -> dict:
        """First `kind` event whose fields equal `match`, waiting for it to appear."""
        deadline = time.monotonic() + timeout
        while True:
            for record in self.events(kind):
                if all(record.get(k) == v for k, v in match.items()):
                    return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind!r} event {match or ''} from fake vLLM on port {self.port} "
                                   f"within {timeout} s; events: {self.events()[-10:]}")
            time.sleep(0.02)

    def pids(self) -> list[int]:
        """Live processes of this instance: server, EngineCore, Worker — orphans included (the group
        outlives its leader)."""
        return group_pids(self.proc.pid)

    def shm_files(self) -> list[str]:
        """The instance's /dev/shm files that still exist."""
        try:
            self.start_record(timeout=0)
        except RuntimeError:
            pass
        return sorted(p for p in self._shm_seen if os.path.exists(p))

    # ---------------------------------------------------------------- stopping

    def send_signal(self, sig: int) -> None:
        _kill_quietly(self.proc.pid, sig)

    def wait(self, timeout: float = 10.0) -> int:
        """Exit code of the server process (the group's leader), waiting for it."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM like a supervisor would; SIGKILL the group if it does not exit in time.
        Returns the exit code (negative: killed by that signal)."""
        try:
            self.start_record(timeout=0)  # remember the shm paths before they may vanish
        except RuntimeError:
            pass
        self.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL of the API server alone (its EngineCore and Worker are orphaned)."""
        try:
            self.start_record(timeout=0)
        except RuntimeError:
            pass
        self.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def kill_group(self, timeout: float = 10.0) -> None:
        """SIGKILL every process of the group and wait until none is left."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.02)

    def cleanup(self) -> None:
        """Leave nothing behind: the whole group killed, shm files and temp files removed."""
        try:
            self.start_record(timeout=0)
        except RuntimeError:
            pass
        self.kill_group()
        for path in self._shm_seen:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_fake(
    port: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    model: str = "fake-model",
    served_model_names: Iterable[str] = (),
    args: Iterable[str] = (),
    workdir: str | os.PathLike | None = None,
) -> FakeVllm:
    """Start `python -m tests.fakevllm serve MODEL --host 127.0.0.1 --port PORT ...` in a new
    session. `env` adds/overrides FAKE_VLLM_* (and any) variables; FAKE_VLLM_EVENTS defaults to
    `<workdir>/events.jsonl`. Returns at once: call `.wait_ready()`."""
    port = free_port() if port is None else port
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix=f"fakevllm-{port}-")) if own else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    full_env.setdefault("FAKE_VLLM_EVENTS", str(wd / "events.jsonl"))
    if name is not None:
        full_env["FAKE_VLLM_NAME"] = name
    full_env.update(env or {})
    events_path = Path(full_env["FAKE_VLLM_EVENTS"]) if full_env["FAKE_VLLM_EVENTS"] else None
    argv = [sys.executable, "-P", "-m", "tests.fakevllm", "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    names = list(served_model_names)
    if names:
        argv += ["--served-model-name", *names]
    argv += list(args)
    with open(wd / "output.log", "ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return FakeVllm(proc, port, full_env.get("FAKE_VLLM_NAME") or str(port), wd, events_path, own)


def _fake_vllm(tmp_path):
    """Factory fixture: `fake_vllm(**start_fake kwargs) -> FakeVllm`; all are cleaned up after the test."""
    started: list[FakeVllm] = []

    def start(port: int | None = None, **kwargs) -> FakeVllm:
        kwargs.setdefault("workdir", tmp_path / f"fakevllm-{len(started)}")
        srv = start_fake(port, **kwargs)
        started.append(srv)
        return srv

    yield start
    leftovers = []
    for srv in started:
        srv.cleanup()
        leftovers += [f"pid {pid}" for pid in srv.pids()]
        leftovers += srv.shm_files()
    assert not leftovers, f"fake vLLM cleanup left behind: {leftovers}"


if pytest is not None:
    fake_vllm = pytest.fixture(_fake_vllm, name="fake_vllm")
