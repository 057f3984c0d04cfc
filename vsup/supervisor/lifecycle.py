"""The life of one vLLM instance: its states, the events that move it, and the driver.

Every transition an instance can make is in `TRANSITIONS`, and nowhere else::

    stopped ──start──▶ starting ──healthy──▶ ready ──unhealthy──▶ unhealthy
                         │ exited,             │ exited,               │ exited,
                         │ startup_timeout,    │ stop                  │ stop
                         │ stop                ▼                       │
                         └───────────────▶ stopping ◀──────────────────┘
                                             ├── cleaned_up ──▶ backoff ──delay_over, start──▶ starting
                                             ├── crash_loop ──▶ failed ──start──▶ starting
                                             ├── restart ─────▶ starting
                                             └── halted ──────▶ stopped
    backoff ──stop──▶ stopped        failed ──stop──▶ stopped

`stopping` always runs `stop_tree` (also after the process exited by itself: it removes the
orphaned EngineCore/Worker and their /dev/shm files), then leaves by one of four events chosen
by why the instance stopped: `cleaned_up` (a failure: wait out the backoff), `crash_loop` (too
many failures: `failed`), `restart` (asked for: start again at once), `halted` (asked to stop).
A failure is any exit (code 0 too: vLLM exits 0 when its EngineCore dies), a startup timeout,
or `health.failures` failed /health polls in a row. Only `ready` is in the proxy's rotation;
ready requires both a live process and /health 200.

`Instance` drives one instance through the table from a single asyncio task (`run`); requests
from outside (`start`, `restart`, `stop`) only set a wish and wake the task, so every transition
happens in one place and is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp

from vsup.supervisor.backoff import RestartPolicy
from vsup.supervisor.config import VsupConfig
from vsup.supervisor.errors import VsupError
from vsup.supervisor.health import HealthResult, probe_health
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.processes import Child, spawn, stop_tree

logger = logging.getLogger("vsup.lifecycle")


class State(StrEnum):
    STOPPED = "stopped"  # not running and not meant to (before the first start, after a stop)
    STARTING = "starting"  # process started, waiting for /health 200 (the model is loading)
    READY = "ready"  # alive and healthy: in the proxy's rotation
    UNHEALTHY = "unhealthy"  # was ready, /health failed too often: about to be restarted
    STOPPING = "stopping"  # stop_tree running (SIGTERM, grace, SIGKILL, sweep, /dev/shm)
    BACKOFF = "backoff"  # after a failure, waiting before the next start
    FAILED = "failed"  # crash loop: left down until `vsup restart` gives it a new chance


class Event(StrEnum):
    START = "start"  # a start was asked for (first start, vsup restart of a failed/waiting instance)
    HEALTHY = "healthy"  # process alive and /health answered 200
    STARTUP_TIMEOUT = "startup_timeout"  # not healthy within health.startup_timeout
    UNHEALTHY = "unhealthy"  # health.failures failed polls in a row
    EXITED = "exited"  # the process ended by itself (any exit status)
    STOP = "stop"  # a stop was asked for (shutdown, restart) or follows from unhealthy
    CLEANED_UP = "cleaned_up"  # stopped after a failure: back off
    CRASH_LOOP = "crash_loop"  # stopped after a failure, too many failures in the window
    RESTART = "restart"  # stopped because a restart was asked for: start again now
    HALTED = "halted"  # stopped because a stop was asked for
    DELAY_OVER = "delay_over"  # the backoff delay elapsed


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.STOPPED, E.START): S.STARTING,
    (S.STARTING, E.HEALTHY): S.READY,
    (S.STARTING, E.STARTUP_TIMEOUT): S.STOPPING,
    (S.STARTING, E.EXITED): S.STOPPING,
    (S.STARTING, E.STOP): S.STOPPING,
    (S.READY, E.UNHEALTHY): S.UNHEALTHY,
    (S.READY, E.EXITED): S.STOPPING,
    (S.READY, E.STOP): S.STOPPING,
    (S.UNHEALTHY, E.EXITED): S.STOPPING,
    (S.UNHEALTHY, E.STOP): S.STOPPING,
    (S.STOPPING, E.CLEANED_UP): S.BACKOFF,
    (S.STOPPING, E.CRASH_LOOP): S.FAILED,
    (S.STOPPING, E.RESTART): S.STARTING,
    (S.STOPPING, E.HALTED): S.STOPPED,
    (S.BACKOFF, E.DELAY_OVER): S.STARTING,
    (S.BACKOFF, E.START): S.STARTING,
    (S.BACKOFF, E.STOP): S.STOPPED,
    (S.FAILED, E.START): S.STARTING,
    (S.FAILED, E.STOP): S.STOPPED,
}
del S, E


class InvalidTransition(RuntimeError):
    """An event that the state does not accept: a bug in the driver, never a user error."""


def next_state(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"event {event.value!r} is not valid in state {state.value!r}") from None


@dataclass(frozen=True)
class Transition:
    at: float  # time.monotonic()
    old: State
    new: State
    event: Event
    reason: str


def describe_exit(status: int | None) -> str:
    """An exit status in words (negative: killed by that signal, asyncio's convention)."""
    if status is None:
        return "exit status unknown"
    if status == 0:
        return "exited with code 0 (vLLM exits 0 when its engine dies)"
    if status > 0:
        return f"exited with code {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    hint = " (out of memory? check the memory plan)" if status == -signal.SIGKILL else ""
    return f"killed by {name}{hint}"


# While starting, /health is polled this often (but never more often than health.interval).
STARTUP_POLL = 0.5
HISTORY = 50  # transitions kept per instance for `vsup status`

Listener = Callable[["Instance", Transition], None]


class Instance:
    """One instance: spawns it, probes it, restarts it, stops it — through `TRANSITIONS` only."""

    def __init__(
        self,
        index: int,
        argv: list[str],
        env: dict[str, str],
        *,
        port: int,
        config: VsupConfig,
        log: InstanceLog,
        session: aiohttp.ClientSession,
        on_transition: Listener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.name = str(index)
        self.argv = argv
        self.env = env
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.config = config
        self.log = log
        self.session = session
        self.policy = RestartPolicy(config.restart)
        self._listeners: list[Listener] = [on_transition] if on_transition else []
        self._clock = clock

        self.state = State.STOPPED
        self.since = clock()  # when the current state was entered
        self.child: Child | None = None
        self.starts = 0  # how many times the process was started
        self.last_exit: str | None = None  # why the last run ended
        self.next_start_at: float | None = None  # in backoff: when the next start is due
        self.history: deque[Transition] = deque(maxlen=HISTORY)
        self.health_failures = 0  # consecutive failed polls while ready
        self._ready_since: float | None = None  # when this run became ready (backoff reset)
        self._wish: str | None = None  # "run" | "restart" | "halt": set from outside, applied by run()
        self._stop_intent = "failure"  # why the current stop happens: failure | restart | halt
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._exit_task: asyncio.Future[int] | None = None
        self._halting = False

    # ---- requests from outside (the supervisor, the control endpoint) --------------------------

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child and self.child.returncode is None else None

    def start(self) -> None:
        """Ask for the instance to run (from stopped or failed); no-op while it runs."""
        self._halting = False
        self._request("run")

    async def restart(self) -> State:
        """Restart now (a failed instance gets a new chance) and wait until it is ready again,
        or failed, or stopped by a shutdown. Returns that state."""
        first = self.starts
        self._halting = False
        self._request("restart")
        await self.wait_for(lambda: self._halting or (self.starts > first and self.state in (State.READY, State.FAILED)))
        return self.state

    async def stop(self) -> None:
        """Stop the instance (stop_tree with stop.timeout) and wait until it is stopped."""
        self._halting = True
        self._request("halt")
        await self.wait_for(lambda: self.state is State.STOPPED and self._wish is None)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            changed = self._changed
            await changed.wait()

    def _request(self, wish: str) -> None:
        if wish == "run" and self._wish in ("restart", "halt"):
            return  # a stronger wish is pending
        self._wish = wish
        self._wake.set()
        self._notify_changed()

    # ---- the driver ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The instance's one task: applies wishes and events until cancelled."""
        phases: dict[State, Callable[[], Awaitable[None]]] = {
            State.STOPPED: self._idle,
            State.FAILED: self._idle,
            State.STARTING: self._starting,
            State.READY: self._ready,
            State.UNHEALTHY: self._unhealthy,
            State.STOPPING: self._stopping,
            State.BACKOFF: self._backoff,
        }
        try:
            while True:
                await phases[self.state]()
        finally:
            if self._exit_task is not None:
                self._exit_task.cancel()

    def _fire(self, event: Event, reason: str) -> None:
        old = self.state
        new = next_state(old, event)
        now = self._clock()
        transition = Transition(now, old, new, event, reason)
        self.state, self.since = new, now
        self.history.append(transition)
        level = logging.WARNING if new in (State.UNHEALTHY, State.FAILED) or event is Event.EXITED else logging.INFO
        logger.log(level, "instance %s: %s -> %s (%s: %s)", self.name, old.value, new.value, event.value, reason)
        if new is State.STARTING:
            self.starts += 1
            self._ready_since = None
        elif new is State.READY:
            self._ready_since = now
            self.health_failures = 0
        if new is not State.BACKOFF:
            self.next_start_at = None
        for listener in list(self._listeners):
            listener(self, transition)
        self._notify_changed()

    def _notify_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _race(self, awaitable: Awaitable[Any] | None, timeout: float | None) -> tuple[str, Any]:
        """Wait for `awaitable`, the process's exit, a wish from outside, or `timeout`, whichever
        comes first. Returns ("done", result) | ("exit", status) | ("wish", None) | ("timeout", None)."""
        if self._wish is not None:
            return "wish", None
        if self._exit_task is not None and self._exit_task.done():
            return "exit", self._exit_task.result()
        self._wake.clear()
        wake = asyncio.ensure_future(self._wake.wait())
        work = asyncio.ensure_future(awaitable) if awaitable is not None else None
        waiting = {wake} | ({work} if work else set()) | ({self._exit_task} if self._exit_task else set())
        try:
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            if work is not None and not work.done():
                work.cancel()
        if self._exit_task is not None and self._exit_task in done:
            return "exit", self._exit_task.result()
        if work is not None and work in done:
            return "done", work.result()
        if wake in done or self._wish is not None:
            return "wish", None
        return "timeout", None

    def _interrupt(self, kind: str, status: Any) -> bool:
        """Handle an exit or a wish while the process runs; True when the state changed."""
        if kind == "exit":
            self.last_exit = describe_exit(status)
            self._stop_intent = "failure"
            self._fire(Event.EXITED, self.last_exit)
            return True
        if kind == "wish":
            wish, self._wish = self._wish, None
            if wish == "restart":
                self._stop_intent = "restart"
                self._fire(Event.STOP, "restart requested")
                return True
            if wish == "halt":
                self._stop_intent = "halt"
                self._wish = "halt"  # kept until stopping has handled it
                self._fire(Event.STOP, "stop requested")
                return True
        return False  # "done" / "timeout", or "run" while running: nothing to do

    async def _idle(self) -> None:
        """stopped / failed: wait for a wish."""
        await self._race(None, None)
        wish, self._wish = self._wish, None
        if wish in ("run", "restart"):
            if self.state is State.FAILED:
                self.policy.reset()
                self._fire(Event.START, "restart requested: a new chance after the crash loop")
            else:
                self._fire(Event.START, "start requested" if wish == "run" else "restart requested")
        elif wish == "halt" and self.state is State.FAILED:
            self._fire(Event.STOP, "stop requested")
        self._notify_changed()

    async def _starting(self) -> None:
        started = self._clock()
        deadline = started + self.config.health.startup_timeout
        self._stop_intent = "failure"
        try:
            self.child = await spawn(self.argv, self.env, log=self.log)
        except VsupError as exc:
            self.child, self._exit_task = None, None
            self.last_exit = f"could not start: {exc}"
            self._fire(Event.EXITED, self.last_exit)
            return
        self._exit_task = asyncio.ensure_future(self.child.wait())
        poll = min(STARTUP_POLL, self.config.health.interval)
        last = "no answer yet"
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                self.last_exit = f"not healthy after the startup timeout of {self.config.health.startup_timeout:g}s (last /health: {last})"
                self._fire(Event.STARTUP_TIMEOUT, self.last_exit)
                return
            kind, result = await self._race(probe_health(self.session, self.url, self.config.health.timeout), remaining)
            if self._interrupt(kind, result):
                return
            if kind == "done":
                last = result.detail
                if result.ok and self.child.returncode is None:
                    self._fire(Event.HEALTHY, f"pid {self.child.pid} alive and /health 200 after {self._clock() - started:.1f}s")
                    return
            kind, result = await self._race(asyncio.sleep(poll), max(0.0, deadline - self._clock()))
            if self._interrupt(kind, result):
                return

    async def _ready(self) -> None:
        health = self.config.health
        kind, result = await self._race(asyncio.sleep(health.interval), None)
        if self._interrupt(kind, result):
            return
        kind, result = await self._race(probe_health(self.session, self.url, health.timeout), None)
        if self._interrupt(kind, result):
            return
        if kind != "done":
            return
        outcome: HealthResult = result
        if outcome.ok:
            self.health_failures = 0
            return
        self.health_failures += 1
        logger.warning("instance %s: /health failed (%s), %d of %d", self.name, outcome.detail, self.health_failures, health.failures)
        if self.health_failures >= health.failures:
            self.last_exit = f"unhealthy: {self.health_failures} failed /health polls in a row (last: {outcome.detail})"
            self._fire(Event.UNHEALTHY, self.last_exit)

    async def _unhealthy(self) -> None:
        # A wish to halt wins over the restart an unhealthy instance gets anyway.
        self._stop_intent = "halt" if self._wish == "halt" else "failure"
        if self._wish == "restart":
            self._wish = None
            self._stop_intent = "restart"
        self._fire(Event.STOP, "restarting the unhealthy instance" if self._stop_intent != "halt" else "stop requested")

    async def _stopping(self) -> None:
        child = self.child
        if child is not None:
            report = await stop_tree(child, self.config.stop.timeout)
            how = "gracefully" if report.graceful else "after SIGKILL"
            logger.info(
                "instance %s: process tree of pid %d gone %s in %.1fs%s%s%s",
                self.name, child.pid, how, report.duration,
                f"; killed {report.killed}" if report.killed else "",
                f"; swept escaped {report.escaped}" if report.escaped else "",
                f"; removed {len(report.shm_removed)} /dev/shm files" if report.shm_removed else "",
            )
            if self._stop_intent != "failure":
                self.last_exit = f"stopped on request ({describe_exit(report.exit_status)})"
        self.child = None
        if self._exit_task is not None:
            self._exit_task.cancel()
            self._exit_task = None
        wish, self._wish = self._wish, None
        if wish == "halt" or self._halting:
            self._fire(Event.HALTED, "stopped on request")
        elif wish == "restart" or self._stop_intent == "restart":
            self._fire(Event.RESTART, "restart requested")
        else:
            now = self._clock()
            decision = self.policy.on_failure(now, self._ready_since)
            if decision.give_up:
                window = self.config.restart.crash_loop_window
                self._fire(
                    Event.CRASH_LOOP,
                    f"crash loop: {decision.failures_in_window} failures within {window:g}s "
                    f"(last: {self.last_exit}); `vsup restart {self.name}` gives it a new chance",
                )
            else:
                self.next_start_at = now + decision.delay
                self._fire(Event.CLEANED_UP, f"next start in {decision.delay:.2f}s (failure {decision.attempt})")

    async def _backoff(self) -> None:
        due = self.next_start_at if self.next_start_at is not None else self._clock()
        kind, _ = await self._race(asyncio.sleep(max(0.0, due - self._clock())), None)
        if kind == "wish":
            wish, self._wish = self._wish, None
            if wish == "halt":
                self._fire(Event.STOP, "stop requested")
            elif wish in ("run", "restart"):
                self._fire(Event.START, "restart requested: skipping the rest of the backoff delay")
            return
        self._fire(Event.DELAY_OVER, f"waited {self._clock() - self.since:.2f}s")
