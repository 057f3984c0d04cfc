"""The lifecycle driver's seam: everything an `Instance` does to the world, in one small object.

The driver (vsup/supervisor/lifecycle.py) never starts a process, sends a signal, opens a socket
or reads a clock itself; it asks an `Operations` object — the role of supervisord's `options`
object and of trio's `deliver_cancel` parameter. `SystemOperations` is the real one (processes.py,
a /health GET, the monotonic clock); the unit tests pass fakes on a virtual clock, so every
transition and race runs in-process in milliseconds.

Ten operations, and no more: the five the lifecycle started with (spawn, stop_tree, probe, now,
sleep), the three measurements a feature could not be built without — `warm_up` (the warm-up
request of `warming`), `tree_rss` (the memory watchdog's reading) and `progress` (a starting
instance's phase from its output, and its tree's CPU time and bytes read: a start is judged by
its progress, vsup/supervisor/phases.py) — and the two that keep
another user from answering for an instance: `clear_address` before each start and `owns_address`
before it counts as healthy (vsup/supervisor/listener.py). Draining needs none (the
proxy's in-flight count is handed to the instance), reload and rolling restart none (they are
intents). A new lifecycle feature is a new state or intent in the driver built from these, not a
new hook here.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from vsup.proxy.address import Sessions, host_port, socket_path
from vsup.proxy.health import HealthResult, probe_health
from vsup.supervisor import listener, proctree
from vsup.supervisor.phases import Progress
from vsup.supervisor.processes import Child, StopReport, spawn, stop_tree, tree_rss, tree_work
from vsup.supervisor.warmup import WarmupKind, warm_up

if TYPE_CHECKING:
    from vsup.supervisor.logs import InstanceLog


class Process(Protocol):
    """A started instance process, as the driver sees it."""

    pid: int

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has exited (negative: killed by that signal)."""

    async def wait(self) -> int:
        """Wait for the exit; cancelling a waiter must not disturb the process or other waiters."""

    def sigkill_cause(self) -> str:
        """After it died of SIGKILL: who sent it, in words (the kernel's OOM killer or not)."""


class Operations(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock."""

    async def sleep(self, seconds: float) -> None:
        """Sleep on the same clock as `now`."""

    async def spawn(self, argv: list[str], env: dict[str, str], log: InstanceLog | None) -> Process:
        """Start the instance's command, its output into `log` (None: an instance that keeps no
        output, the fakes' tests); VsupError (one line) when it cannot be started."""

    async def stop_tree(self, process: Process, timeout: float) -> StopReport:
        """Stop the whole process tree (SIGTERM, `timeout` of grace, SIGKILL, sweep, /dev/shm);
        also when the process has already exited."""

    async def probe(self, url: str, timeout: float) -> HealthResult:
        """One readiness/health probe of the instance at `url`, bounded by `timeout`; an answer
        that is not the instance's own (a vsup proxy's) is a failure."""

    async def warm_up(self, url: str, body: dict[str, Any], timeout: float, kind: WarmupKind = "completion") -> HealthResult:
        """The warm-up request of the model's `kind` (vsup/supervisor/warmup.py: a completion, an
        embedding, a pooling request) to the instance at `url`, bounded by `timeout`: ok, or why not."""

    async def clear_address(self, url: str) -> None:
        """Before a start: remove the socket a dead instance left at its Unix address (nothing for
        TCP); VsupError (one line) when something else is there."""

    async def owns_address(self, process: Process, url: str, who: str) -> str | None:
        """None when what listens at `url` is the process's own tree (a Unix socket of ours; every
        listener on a TCP port one of the tree's sockets); else why not, naming the holder."""

    async def tree_rss(self, process: Process) -> int | None:
        """Resident memory of the process's whole tree (API server, EngineCore, Worker) in bytes;
        None when it cannot be read (the tree is gone)."""

    async def progress(self, process: Process) -> Progress:
        """A starting instance now: what its output has said (phase, lines, the load's shards) and
        the CPU time and bytes read of its whole tree so far (sums that never go down; None where
        /proc cannot tell)."""


class SystemOperations:
    """The real world: child processes, /health over HTTP or the instance's Unix socket, /proc,
    time.monotonic."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def spawn(self, argv: list[str], env: dict[str, str], log: InstanceLog | None) -> Child:
        if log is None:  # a real process's output must go somewhere (its pipes would fill up)
            raise ValueError("a real instance process needs an InstanceLog")
        return await spawn(argv, env, log=log)

    async def stop_tree(self, process: Process, timeout: float) -> StopReport:
        assert isinstance(process, Child), process
        return await stop_tree(process, timeout)

    async def probe(self, url: str, timeout: float) -> HealthResult:
        session, base = self.sessions.get(url)
        return await probe_health(session, base, timeout, expect_instance=True)

    async def warm_up(self, url: str, body: dict[str, Any], timeout: float, kind: WarmupKind = "completion") -> HealthResult:
        session, base = self.sessions.get(url)
        return await warm_up(session, base, body, timeout, kind)

    async def clear_address(self, url: str) -> None:
        path = socket_path(url)
        if path is not None:
            listener.clear_socket(path)

    async def owns_address(self, process: Process, url: str, who: str) -> str | None:
        path = socket_path(url)
        if path is not None:
            return listener.check_socket(path)  # its directory is ours alone: the socket is the instance's
        assert isinstance(process, Child), process
        port = host_port(url)[1]
        # reading /proc for every process on the machine takes a while: not on the proxy's loop
        tree = await asyncio.to_thread(proctree.find_tree, process.pid, token=process.token, known=dict(process.seen))
        process.seen.update((pid, st.start) for pid, st in tree.items())
        return await asyncio.to_thread(listener.check_port, port, tree, who)

    async def tree_rss(self, process: Process) -> int | None:
        assert isinstance(process, Child), process
        # reading /proc for every process on the machine takes a while: not on the proxy's loop
        found, rss = await asyncio.to_thread(tree_rss, process.pid, process.token, dict(process.seen))
        process.seen.update(found)  # a later stop_tree knows these members too
        return rss if found else None

    async def progress(self, process: Process) -> Progress:
        assert isinstance(process, Child), process
        # reading /proc for every process on the machine takes a while: not on the proxy's loop
        found, readings = await asyncio.to_thread(tree_work, process.pid, process.token, dict(process.seen))
        process.seen.update(found)
        work = process.work
        work.add(readings)
        return Progress(process.output.snapshot(), work.cpu_seconds if readings else None, work.rchar, work.read_bytes)
