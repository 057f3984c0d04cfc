"""Fakes for the lifecycle driver's seam (vsup/supervisor/operations.py) on a virtual clock.

`VirtualClock` is time that moves only when every task is waiting on it (trio's autojump clock,
by hand): `run_until(predicate)` lets the event loop settle, and while the predicate is false
jumps to the earliest sleeper's deadline. A restart policy's 60 s delay or a 600 s startup
timeout thus take microseconds, and the order of events is exact.

`FakeOps` plays processes, /health, the warm-up and memory: each spawned `FakeProcess` "loads"
for `load_time` virtual seconds (its port refuses connections), then answers its `health` (200 by
default, another status, or "hang": the probe runs into its timeout) and its `warmup` the same
way after `warmup_time` virtual seconds; `tree_rss` reads its `rss`; `progress` reads its output
(`process.say(line)` feeds it, as the real process's reader is fed) and its tree's CPU time and
bytes read, which grow at `cpu_rate` CPU seconds and `read_rate` bytes per virtual second (0: a
tree doing nothing, like a hung one). The test makes a process exit with `process.exit(status)`. `stop_tree` takes `stop_time` virtual seconds and ends the process
with SIGTERM's status unless it exited on its own meanwhile.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import signal
from collections.abc import Callable

from vsup.errors import VsupError
from vsup.proxy.health import HealthResult
from vsup.supervisor import oomkill
from vsup.supervisor.phases import OutputReader, Progress
from vsup.supervisor.processes import StopReport
from vsup.supervisor.warmup import ROUTES

SETTLE = 60  # event-loop turns that let every ready task run before the clock may move


class VirtualClock:
    def __init__(self) -> None:
        self.time = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.time + max(0.0, seconds), next(self._order), future))
        await future

    async def settle(self) -> None:
        for _ in range(SETTLE):
            await asyncio.sleep(0)

    async def run_until(self, predicate: Callable[[], bool], limit: float = 10_000.0, what: str = "condition") -> None:
        """Run (jumping the clock) until predicate() holds; fails when nothing is left to wait
        for or the virtual time passes `limit` seconds from now."""
        end = self.time + limit
        while True:
            await self.settle()
            if predicate():
                return
            if not self._jump(end):
                raise AssertionError(f"{what} never happened (virtual time {self.time:g}s)")

    async def advance(self, seconds: float) -> None:
        """Let exactly `seconds` of virtual time pass, firing every sleeper due meanwhile."""
        end = self.time + seconds
        await self.settle()
        while self._jump(end):
            await self.settle()
        self.time = end
        await self.settle()

    def _jump(self, end: float) -> bool:
        while self._sleepers and self._sleepers[0][2].done():  # cancelled sleeps
            heapq.heappop(self._sleepers)
        if not self._sleepers or self._sleepers[0][0] > end:
            return False
        self.time = max(self.time, self._sleepers[0][0])
        while self._sleepers and self._sleepers[0][0] <= self.time:
            future = heapq.heappop(self._sleepers)[2]
            if not future.done():
                future.set_result(None)
        return True


class FakeProcess:
    def __init__(self, pid: int, argv: list[str], started: float, load_time: float) -> None:
        self.pid = pid
        self.argv = argv
        self.ready_at = started + load_time
        self.health: int | str = 200
        self.warmup: int | str = 200  # the warm-up's answer: a status, or "hang"
        self.rss = 100 * 2**20  # what tree_rss reads, bytes
        self.output = OutputReader()
        self.cpu_rate = 0.0  # CPU seconds its tree uses per virtual second
        self.read_rate = 0  # bytes its tree reads per virtual second
        self.counters_readable = True  # False: /proc cannot tell its CPU time (progress says None)
        self._cpu, self._read, self._counted_at = 0.0, 0, started
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def say(self, *lines: str) -> None:
        """Lines of its output (what the real process's reader is fed)."""
        self.output.feed(lines)

    def work(self, now: float) -> tuple[float, int]:
        """(CPU seconds, bytes read) of its tree so far, at the rates of each stretch of time."""
        elapsed, self._counted_at = max(0.0, now - self._counted_at), now
        self._cpu += self.cpu_rate * elapsed
        self._read += int(self.read_rate * elapsed)
        return self._cpu, self._read

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    def sigkill_cause(self) -> str:
        return oomkill.UNKNOWN  # no kernel to ask: the words of an unreadable one

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def exit(self, status: int) -> None:
        if not self._exit.done():
            self._exit.set_result(status)


class FakeOps:
    def __init__(self, clock: VirtualClock | None = None, *, load_time: float = 3.0, stop_time: float = 0.5,
                 warmup_time: float = 0.25) -> None:
        self.clock = clock or VirtualClock()
        self.load_time = load_time
        self.stop_time = stop_time
        self.warmup_time = warmup_time
        self.warmups: list[tuple[int, dict]] = []  # (pid, body) of every warm-up request
        self.warmup_routes: list[tuple[int, str]] = []  # (pid, route) of every warm-up request
        self.spawn_error: str | None = None  # the next spawns fail with VsupError(this)
        self.processes: list[FakeProcess] = []
        self.stopped: list[int] = []  # pids stop_tree was called for, in order
        self.probes = 0
        self.readings = 0  # progress() calls
        self.impostor: str | None = None  # owns_address answers this (someone else holds the address)
        self._pids = itertools.count(1000)

    def now(self) -> float:
        return self.clock.now()

    async def sleep(self, seconds: float) -> None:
        await self.clock.sleep(seconds)

    @property
    def current(self) -> FakeProcess | None:
        return self.processes[-1] if self.processes else None

    def process_at(self, url: str) -> FakeProcess | None:
        """The latest process started with `--port P` or `--uds PATH` of this URL (several instances
        share one FakeOps in the supervisor's tests); else the latest process."""
        flag, where = ("--uds", url[len("unix:"):]) if url.startswith("unix:") else ("--port", url.rsplit(":", 1)[-1])
        for process in reversed(self.processes):
            if flag in process.argv and process.argv[process.argv.index(flag) + 1] == where:
                return process
        return None if any(f in p.argv for p in self.processes for f in ("--port", "--uds")) else self.current

    async def spawn(self, argv, env, log) -> FakeProcess:
        if self.spawn_error is not None:
            raise VsupError(self.spawn_error)
        process = FakeProcess(next(self._pids), list(argv), self.now(), self.load_time)
        self.processes.append(process)
        return process

    async def stop_tree(self, process: FakeProcess, timeout: float) -> StopReport:
        began = self.now()
        self.stopped.append(process.pid)
        await self.clock.sleep(min(self.stop_time, timeout))
        process.exit(-signal.SIGTERM)
        return StopReport(graceful=True, exit_status=process.returncode, killed=[], escaped=[], shm_removed=[],
                          duration=self.now() - began)

    async def probe(self, url: str, timeout: float) -> HealthResult:
        self.probes += 1
        process = self.process_at(url)
        if process is None or process.returncode is not None or self.now() < process.ready_at:
            return HealthResult(False, "cannot connect: connection refused")
        if process.health == "hang":
            await self.clock.sleep(timeout)
            return HealthResult(False, f"timeout after {timeout:g}s")
        return HealthResult(process.health == 200, f"HTTP {process.health}")

    async def clear_address(self, url: str) -> None:
        pass

    async def owns_address(self, process: FakeProcess, url: str, who: str) -> str | None:
        return self.impostor

    async def warm_up(self, url: str, body: dict, timeout: float, kind: str = "completion") -> HealthResult:
        route = ROUTES[kind]  # type: ignore[index]
        process = self.process_at(url)
        if process is None or process.returncode is not None:
            return HealthResult(False, f"POST {route}: cannot connect: connection refused")
        self.warmups.append((process.pid, body))
        self.warmup_routes.append((process.pid, route))
        if process.warmup == "hang":
            await self.clock.sleep(timeout)
            return HealthResult(False, f"POST {route}: timeout after {timeout:g}s")
        await self.clock.sleep(self.warmup_time)
        return HealthResult(process.warmup == 200, f"POST {route}: HTTP {process.warmup}")

    async def tree_rss(self, process: FakeProcess) -> int | None:
        return process.rss if process.returncode is None else None

    async def progress(self, process: FakeProcess) -> Progress:
        self.readings += 1
        cpu, read = process.work(self.now())
        if not process.counters_readable:
            return Progress(process.output.snapshot())
        return Progress(process.output.snapshot(), cpu, read, 0)
