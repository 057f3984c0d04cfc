"""One candidate through `vsup run`, seen from outside: the same start, warm-up, supervision and
stop as in production, no second launcher.

`CandidateRun` starts `vsup run --config <candidate>.yaml` in its own session (its log to a file),
waits until the proxy's /ready counts every instance, and fails the candidate (with the reason vsup
gives in its control socket's /status: "instance 1: exit code 1", "killed by SIGKILL (out of
memory?)") as soon as an instance exits or restarts, vsup itself exits, or the start takes longer
than allowed. Leaving the `with` block - normally, on an error, on Ctrl-C - SIGTERMs vsup (which
stops its instances and sweeps /dev/shm) and waits; whatever is still alive afterwards (vsup
SIGKILLed after its grace time) is killed by pid and its shared-memory files removed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from vsup.errors import VsupError
from vsup.ownfiles import open_binary
from vsup.supervisor import control
from vsup.supervisor.ports import port_is_free
from vsup.supervisor.shm import files_in_use, remove_unused

FAILED_STATES = ("backoff", "failed")
# Set the affinity, then exec the command: affinity from its first instruction on, no race, no taskset needed.
AFFINITY = (sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
            "os.execvp(sys.argv[2], sys.argv[2:])")


class CandidateFailed(Exception):
    """The candidate could not be measured; the message is the reason, one line."""


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free loopback ports."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65536 and all(port_is_free(base + i) for i in range(count)):
            return base
    raise VsupError(f"no {count} consecutive free ports on 127.0.0.1")


class CandidateRun:
    def __init__(self, vsup: Sequence[str], config_path: Path, log_path: Path, *, proxy_port: int, socket_path: Path,
                 instances: int, fsroot: str = "/", env: Mapping[str, str] | None = None, stop_timeout: float = 60.0,
                 cpus: frozenset[int] | None = None) -> None:
        self.argv = [*vsup, "run", "--config", str(config_path)] + (["--fsroot", fsroot] if fsroot != "/" else [])
        if cpus is not None:  # one model of a fleet: vsup runs on that model's CPUs (it plans within its affinity)
            self.argv = [*AFFINITY, ",".join(map(str, sorted(cpus))), *self.argv]
        self.log_path = log_path
        self.proxy_url = f"http://127.0.0.1:{proxy_port}"
        self.socket_path = socket_path
        self.instances = instances
        self.env = dict(env if env is not None else os.environ)
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        # every process of vsup's tree seen (psutil checks a pid is still the same process)
        self.family: dict[int, psutil.Process] = {}
        self.left_behind: list[int] = []

    # ---- start and stop ------------------------------------------------------------------------

    def __enter__(self) -> CandidateRun:
        with open_binary(self.log_path, "a") as log:  # in the report's folder: never through a link
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        # a second Ctrl-C must not cut the stop short: that would leave instances behind
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        if self.proc is None:
            return
        self._remember_family()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        survivors = [p for pid, p in self.family.items() if pid != self.proc.pid and _alive(p)]
        if survivors:
            shm = files_in_use({p.pid for p in survivors})
            for p in survivors:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(survivors, timeout=10)
            remove_unused(shm)
            self.left_behind = sorted(p.pid for p in survivors)

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError("CandidateRun used outside `with`")
        return self.proc

    def _remember_family(self, pids: Sequence[int] = ()) -> None:
        for pid in (self._started().pid, *pids):
            try:
                top = psutil.Process(pid)
                for p in (top, *top.children(recursive=True)):
                    self.family.setdefault(p.pid, p)
            except psutil.Error:
                pass
        for p in list(self.family.values()):  # instances live in sessions of their own, under vsup
            try:
                for child in p.children(recursive=True):
                    self.family.setdefault(child.pid, child)
            except psutil.Error:
                pass

    # ---- looking from outside ------------------------------------------------------------------

    def log_tail(self, lines: int = 1) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        errors = [line for line in text if "vsup: error:" in line]
        return (errors[-1] if errors else " | ".join(text[-lines:]))[-400:]

    async def status(self) -> dict | None:
        try:
            return await control.request(self.socket_path, "GET", "/status", timeout=5.0)
        except VsupError:
            return None

    async def ready_count(self) -> int:
        def get() -> int:
            with urllib.request.urlopen(f"{self.proxy_url}/ready", timeout=5) as response:
                return int(json.load(response).get("instances_ready", 0))
        try:
            return await asyncio.to_thread(get)
        except (OSError, ValueError):
            return 0

    def check(self, status: dict | None, during: str) -> None:
        """CandidateFailed when vsup exited or an instance failed/restarted."""
        proc = self._started()
        if proc.poll() is not None:
            tail = self.log_tail()
            raise CandidateFailed(f"vsup exited with code {proc.returncode} {during}" + (f": {tail}" if tail else ""))
        if status is None:
            return
        self._remember_family([inst["pid"] for inst in status.get("instances", []) if inst.get("pid")])
        for inst in status.get("instances", []):
            if inst.get("restarts") or inst.get("state") in FAILED_STATES:
                why = inst.get("last_exit") or inst.get("state")
                raise CandidateFailed(f"instance {inst['index']} failed {during}: {why}")

    async def wait_ready(self, timeout: float) -> float:
        """Seconds until every instance is in the proxy's rotation."""
        began = time.monotonic()
        while True:
            status = await self.status()
            self.check(status, "while starting")
            if status is not None and await self.ready_count() >= self.instances:
                self._remember_family()
                return time.monotonic() - began
            if time.monotonic() - began > timeout:
                states = ", ".join(f"{i['index']}: {i['state']}" for i in (status or {}).get("instances", []))
                raise CandidateFailed(f"not ready within {timeout:.0f}s" + (f" (instances {states})" if states else ""))
            await asyncio.sleep(0.3)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
