"""The life of one vLLM instance: the driver that moves it through the state machine.

(Over 400 lines for a reason: it is one class, `Instance`, whose methods are the handlers of its
states and the races between them; split, one state machine would be read across files.)

The states, events and every transition are the tables in vsup/supervisor/states.py
(`TRANSITIONS`, `ON_INTENT`, `AFTER_STOP`); `states.diagram()` draws them, and
`scripts/lifecycle_diagram.py` writes that drawing into ARCHITECTURE.md and docs/supervisor.md.

`warming`: /health answered; one short completion (`health.warmup`; one embedding for a pooling
model, warmup.py) runs before the instance joins
the rotation, so its first client does not pay for the first-call paths; a failed warm-up is a
failed start. `draining`: out of the rotation, alive, until the proxy has no request in flight to
it (at most `proxy.drain_timeout`); a rolling restart, a reload and the memory watchdog drain an
instance before they stop it.

`stopping` always runs `stop_tree` (also after the process exited by itself: it removes the
orphaned EngineCore/Worker and their /dev/shm files), then leaves by one of four events chosen
by why the instance stopped: `cleaned_up` (a failure: wait out the backoff), `crash_loop` (too
many failures: `failed`), `unrunnable` (an exit every restart would repeat, SIGILL: `failed` at
once), `restart` (asked for: start again at once), `halted` (asked to stop).
A failure is any exit (code 0 too: vLLM exits 0 when its EngineCore dies), a stalled start, a
start past the startup timeout, a failed warm-up, or `health.failures` failed /health polls in a row.

`starting` is judged by its progress (vsup/supervisor/phases.py): every `PROGRESS_POLL` seconds
the instance's phase (from its output) and its tree's CPU time and bytes read are read through
`Operations.progress`; a start that shows none of them move for `health.startup_stall` seconds is
stopped as `stalled in <phase> for N s`, one that keeps moving runs up to `health.startup_timeout`,
the ceiling. `watch` (a `StartWatch`) is what `vsup status` shows of a start. Only `ready` is in the
proxy's rotation; ready requires a live process, /health 200 and a warm-up that answered.

`Instance` drives one instance through the table from a single asyncio task (`run`). Requests
from outside (`start`, `restart`, `recycle`, `retire`, `stop`) only record an `Intent` and wake
the task, so every transition happens in one place and is logged with its reason. The instance
holds one intent at a time, and a stronger one is never replaced by a weaker (`ask`; the order is
`Intent`'s). What an intent does in each state is the table `ON_INTENT`; how a stop ends is
`AFTER_STOP`. Everything the driver does to the world (spawn, stop a tree, probe, warm up, measure
memory, clock) goes through an `Operations` object (vsup/supervisor/operations.py), so the tests
drive it with fakes on a virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import deque
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from vsup.config.schema import VsupConfig
from vsup.errors import VsupError
from vsup.supervisor import oomkill
from vsup.supervisor.backoff import RestartPolicy
from vsup.supervisor.phases import Phase, StartWatch
from vsup.supervisor.states import (
    AFTER_STOP,
    ASKED_FOR,
    ON_INTENT,
    RUNNING,
    Event,
    Intent,
    State,
    Transition,
    next_state,
)
from vsup.supervisor.warmup import warmup_body, warmup_kind
from vsup.topology.isa import SIGILL_CAUSE

if TYPE_CHECKING:
    from vsup.proxy.health import HealthResult
    from vsup.supervisor.logs import InstanceLog
    from vsup.supervisor.operations import Operations, Process

logger = logging.getLogger("vsup.lifecycle")


def describe_exit(status: int | None, sigkill: Callable[[], str] | None = None) -> str:
    """An exit status in words (negative: killed by that signal, asyncio's convention); `sigkill`
    tells who sent a SIGKILL (the process's `sigkill_cause`: the OOM killer or not)."""
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
    if status == -signal.SIGKILL:
        return sigkill() if sigkill is not None else oomkill.UNKNOWN
    if status == -signal.SIGILL:
        return f"killed by SIGILL (illegal instruction): {SIGILL_CAUSE}"
    return f"killed by {name}"


# Exit statuses every restart would repeat: the instance goes to `failed` at once (no backoff, no
# crash loop). SIGILL: the CPU lacks an instruction the build executes; it does not grow one.
UNRUNNABLE_EXITS = frozenset({-signal.SIGILL})


class Wake(Enum):
    """Why `Instance._race` returned."""

    DONE = "done"  # the awaited work finished (its result comes along)
    EXITED = "exited"  # the process exited (its status comes along)
    ASKED = "asked"  # an intent is waiting
    TIMEOUT = "timeout"  # the deadline passed


# While starting, /health is polled this often (but never more often than health.interval).
STARTUP_POLL = 0.5
# While starting, its progress (phase, the tree's CPU time and bytes read) is read this often.
PROGRESS_POLL = 2.0
# While draining, the proxy's in-flight count is read this often.
DRAIN_POLL = 0.1
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
        url: str | None = None,
        config: VsupConfig,
        log: InstanceLog | None,
        ops: Operations,
        on_transition: Listener | None = None,
        name: str | None = None,
        in_flight: Callable[[], int] | None = None,
        model: str = "",
        weights_bytes: int | None = None,
    ) -> None:
        self.index = index
        self.weights_bytes = weights_bytes  # its model's weight files (the plan's): a load's progress is measured against it
        self.model = model  # the served name of the model it runs (fleet.plans[name].model)
        self.name = name if name is not None else str(index)
        self.argv = argv
        self.env = env
        self.port = port  # its slot (base_port + i or spare_base_port + i); its TCP port under vllm.listen: tcp
        self.url = url if url is not None else f"http://127.0.0.1:{port}"  # vsup.proxy.address
        self.config = config
        self.log = log
        self.ops = ops
        self.policy = RestartPolicy(config.restart)
        # requests the proxy has in flight to this instance (draining waits for 0)
        self.in_flight: Callable[[], int] = in_flight or (lambda: 0)
        self._listeners: list[Listener] = [on_transition] if on_transition else []

        self.state = State.STOPPED
        self.since = ops.now()  # when the current state was entered
        self.intent: Intent | None = None  # the one request from outside not yet carried out
        self.intent_why: str | None = None  # the reason given with it (named by the transition it fires)
        self.launch: tuple[list[str], dict[str, str]] | None = None  # argv and env for the next start (reload)
        self.failure: str | None = None  # why the current run is ending, if it failed (None: on request)
        self.unrunnable = False  # the current run ended by an exit every restart would repeat (UNRUNNABLE_EXITS)
        self.child: Process | None = None
        self.started_at: float | None = None  # when the current process was started
        self.watch: StartWatch | None = None  # the current run's start: its phase, when it last moved
        self.starts = 0  # how many times the process was started
        self.halts = 0  # how many halts were carried out (stop() waits for the next)
        self.failures = 0  # how many runs ended in a failure (a reload waits for ready or the next)
        self.last_exit: str | None = None  # why the last run ended
        self.next_start_at: float | None = None  # in backoff: when the next start is due
        self.history: deque[Transition] = deque(maxlen=HISTORY)
        self.health_failures = 0  # consecutive failed polls while ready
        self._ready_since: float | None = None  # when this run became ready (backoff reset)
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._exit: asyncio.Future[int] | None = None  # the running process's wait()

    # ---- requests from outside (the supervisor, the control endpoint) --------------------------

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None and self.child.returncode is None else None

    def subscribe(self, listener: Listener) -> None:
        """Call `listener(instance, transition)` after every transition."""
        self._listeners.append(listener)

    def ask(self, intent: Intent, why: str | None = None) -> None:
        """Record `intent` (and why it was asked for) unless a stronger one is pending, and wake
        the driver."""
        if self.intent is None or intent >= self.intent:
            if intent != self.intent or why is not None:
                self.intent_why = why
            self.intent = intent
        self._wake.set()
        self._notify_changed()

    def relaunch(self, argv: list[str], env: dict[str, str]) -> None:
        """Start with this argv and env from the next start on (a reload that replaces the
        instance in place; ask RECYCLE to make that start happen)."""
        self.launch = (list(argv), dict(env))

    def start(self) -> None:
        """Ask for the instance to run (from stopped or failed; in backoff: at once); no-op while it runs."""
        self.ask(Intent.RUN)

    async def restart(self) -> State:
        """Restart now (a failed instance gets a new chance) and wait until it is ready again, or
        failed, or halted by a shutdown. Returns that state."""
        first, halts = self.starts, self.halts
        self.ask(Intent.RESTART)
        await self.wait_for(lambda: self.halts > halts or (self.starts > first and self.state in (State.READY, State.FAILED)))
        return self.state

    async def recycle(self, why: str | None = None) -> State:
        """Drain (if ready), stop and start again, and wait until the new run is ready, or that
        run failed (its state then: backoff or failed), or a halt came first. Returns the state."""
        first, failures, halts = self.starts, self.failures, self.halts
        self.ask(Intent.RECYCLE, why)
        await self.wait_for(lambda: self.halts > halts or (self.starts > first and (
            self.state is State.READY or (self.failures > failures and self.state in (State.BACKOFF, State.FAILED)))))
        return self.state

    async def retire(self, why: str | None = None) -> None:
        """Drain (if ready), stop, and stay stopped; waits until it is stopped."""
        halts = self.halts
        self.ask(Intent.RETIRE, why)
        await self.wait_for(lambda: self.halts > halts)

    async def stop(self) -> None:
        """Stop the instance (stop_tree with stop.timeout) and wait until that is done."""
        halts = self.halts
        self.ask(Intent.HALT)
        await self.wait_for(lambda: self.halts > halts)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            changed = self._changed
            await changed.wait()

    # ---- the driver ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The instance's one task: carries out intents and events until cancelled."""
        phases: dict[State, Callable[[], Awaitable[None]]] = {
            State.STOPPED: self._at_rest,
            State.FAILED: self._at_rest,
            State.BACKOFF: self._backoff,
            State.STARTING: self._starting,
            State.WARMING: self._warming,
            State.READY: self._ready,
            State.UNHEALTHY: self._unhealthy,
            State.DRAINING: self._draining,
            State.STOPPING: self._stopping,
        }
        try:
            while True:
                await phases[self.state]()
        finally:
            self._forget_exit()

    def _fire(self, event: Event, reason: str) -> None:
        old = self.state
        new = next_state(old, event)
        now = self.ops.now()
        transition = Transition(now, old, new, event, reason)
        self.state, self.since = new, now
        self.history.append(transition)
        level = (logging.WARNING if new in (State.UNHEALTHY, State.FAILED) or event in (Event.EXITED, Event.WARMUP_FAILED)
                 else logging.INFO)
        logger.log(level, "instance %s: %s -> %s (%s: %s)", self.name, old.value, new.value, event.value, reason)
        if new is State.STARTING:
            self.starts += 1
            self.failure = None
            self.unrunnable = False
            self._ready_since = None
        elif new is State.READY:
            self._ready_since = now
            if event is Event.WARMED and self.watch is not None:
                self.watch.finish(now)  # the start's own times end here (status' "start")
            self.health_failures = 0
        elif new is State.STOPPED:
            self.halts += 1  # every way into stopped carries out a halt
        if new is not State.BACKOFF:
            self.next_start_at = None
        for listener in list(self._listeners):
            listener(self, transition)
        self._notify_changed()

    def _fail(self, event: Event, why: str) -> None:
        """A failure of the running process: remembered for the stop that follows."""
        self.failure = self.last_exit = why
        self.failures += 1
        self._fire(event, why)

    def _notify_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _forget_exit(self) -> None:
        if self._exit is not None:
            self._exit.cancel()
            self._exit = None

    async def _race(self, work: Awaitable[Any] | None, timeout: float | None) -> tuple[Wake, Any]:
        """Wait for `work`, the process's exit, an intent, or `timeout` seconds (on the ops clock),
        whichever comes first. An exit wins over everything else that is ready at the same time.
        An intent wakes it once per request (`ask`): a held intent (draining holds its own) does not."""
        if self._exit is not None and self._exit.done():
            early: tuple[Wake, Any] | None = (Wake.EXITED, self._exit.result())
        elif self._wake.is_set():
            self._wake.clear()
            early = (Wake.ASKED, None)
        else:
            early = None
        if early is not None:
            if asyncio.iscoroutine(work):
                work.close()  # never started: no "coroutine was never awaited" warning
            return early
        wake = asyncio.ensure_future(self._wake.wait())
        job = asyncio.ensure_future(work) if work is not None else None
        timer = asyncio.ensure_future(self.ops.sleep(timeout)) if timeout is not None else None
        waiting = {f for f in (wake, job, timer, self._exit) if f is not None}
        try:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (wake, job, timer):
                if future is not None and not future.done():
                    future.cancel()
        if self._exit is not None and self._exit in done:
            return Wake.EXITED, self._exit.result()
        if job is not None and job in done:
            return Wake.DONE, job.result()
        if wake in done:
            self._wake.clear()
            return Wake.ASKED, None
        return Wake.TIMEOUT, None

    def _interrupted(self, wake: Wake, value: Any) -> bool:
        """Handle an exit or an intent that arrived while the process runs; True when the state changed."""
        if wake is Wake.EXITED:
            self.unrunnable = value in UNRUNNABLE_EXITS
            self._fail(Event.EXITED, describe_exit(value, self.child.sigkill_cause if self.child is not None else None))
            return True
        if wake is Wake.ASKED:
            return self._apply_intent()
        return False

    def _apply_intent(self) -> bool:
        """Carry out the held intent in the current state (`ON_INTENT`); True when the state changed."""
        intent = self.intent
        if intent is None:
            return False
        event = ON_INTENT[(self.state, intent)]
        # carried out here, except on the way down: a stop or a drain keeps it until `stopping`
        # ends the stop (AFTER_STOP), and in `draining` it is the drain's
        keep = self.state in RUNNING and (event in (Event.STOP, Event.DRAIN) or self.state is State.DRAINING)
        why = self.intent_why or ASKED_FOR[intent]
        if not keep:
            self.intent, self.intent_why = None, None
        if event is None:
            if self.state is State.STOPPED:
                self.halts += 1  # halting a stopped instance: nothing to do, but done
            self._notify_changed()
            return False
        if event is Event.DRAIN:
            reason = f"{why}: out of the rotation, {self.in_flight()} request(s) in flight may finish " \
                     f"(up to proxy.drain_timeout {self.config.proxy.drain_timeout:g}s)"
        elif event is Event.STOP:
            reason = why
        elif self.state in (State.FAILED, State.BACKOFF):
            if intent is Intent.RUN and why == ASKED_FOR[Intent.RUN]:
                why = ASKED_FOR[Intent.RESTART]  # from here a plain start is a restart of the instance
            if self.state is State.FAILED:
                self.policy.reset()
                after = "the crash loop" if self.history[-1].event is Event.CRASH_LOOP else "its last exit"
                reason = f"{why}: a new chance after {after}"
            else:
                reason = f"{why}: skipping the rest of the backoff delay"
        else:
            reason = why
        self._fire(event, reason)
        return True

    # ---- one coroutine per state ---------------------------------------------------------------

    async def _at_rest(self) -> None:
        """stopped / failed: wait for an intent."""
        await self._race(None, None)
        self._apply_intent()

    async def _backoff(self) -> None:
        due = self.next_start_at if self.next_start_at is not None else self.ops.now()
        wake, _ = await self._race(None, max(0.0, due - self.ops.now()))
        if wake is Wake.TIMEOUT:
            self._fire(Event.DELAY_OVER, f"waited {self.ops.now() - self.since:.2f}s")
        else:
            self._apply_intent()

    async def _starting(self) -> None:
        health = self.config.health
        started = self.ops.now()
        deadline = started + health.startup_timeout
        if self.launch is not None:
            (self.argv, self.env), self.launch = self.launch, None
        self.watch = StartWatch(started, self.weights_bytes)
        try:
            await self.ops.clear_address(self.url)
            self.child = await self.ops.spawn(self.argv, self.env, self.log)
        except VsupError as exc:
            self.child = None
            self._fail(Event.EXITED, f"could not start: {exc}")
            return
        self.started_at = self.ops.now()
        self._exit = asyncio.ensure_future(self.child.wait())
        poll = min(STARTUP_POLL, health.interval)
        last = "no answer yet"
        reading_due = self.ops.now()
        while True:
            if self.ops.now() >= reading_due:
                wake, result = await self._race(self.ops.progress(self.child), None)
                if self._interrupted(wake, result):
                    return
                if wake is Wake.DONE:
                    self.watch.update(self.ops.now(), result)
                reading_due = self.ops.now() + PROGRESS_POLL
            now = self.ops.now()
            watch = self.watch
            if now >= deadline:
                self._fail(Event.STARTUP_TIMEOUT,
                           f"not healthy after the startup timeout of {health.startup_timeout:g}s (health.startup_timeout; "
                           f"in {watch.phase.value} for {now - watch.phase_since:.0f} s, last progress {watch.idle(now):.0f} s ago; "
                           f"last /health: {last})")
                return
            if watch.judged and watch.idle(now) >= health.startup_stall:
                self._fail(Event.STALLED,
                           f"stalled in {watch.phase.value} for {watch.idle(now):.0f} s: no new phase, output, CPU time or "
                           f"reads in its process tree (health.startup_stall {health.startup_stall:g}s; last /health: {last})")
                return
            remaining = deadline - now
            if watch.judged:
                remaining = min(remaining, watch.moved_at + health.startup_stall - now)
            wake, result = await self._race(self.ops.probe(self.url, health.timeout), max(0.0, remaining))
            if self._interrupted(wake, result):
                return
            if wake is Wake.DONE:
                last = result.detail
                if result.ok and self.child.returncode is None:
                    impostor = await self.ops.owns_address(self.child, self.url, f"instance {self.name}")
                    if impostor is not None:
                        logger.error("instance %s: %s", self.name, impostor)
                        self._fail(Event.IMPOSTOR, impostor)
                        return
                    # one last reading: what the output reached since the previous one (the phases named below)
                    wake, result = await self._race(self.ops.progress(self.child), None)
                    if self._interrupted(wake, result):
                        return
                    now = self.ops.now()
                    if wake is Wake.DONE:
                        self.watch.update(now, result)
                    self._fire(Event.HEALTHY, f"pid {self.child.pid} alive and /health 200 after {now - started:.1f}s "
                                              f"({self.watch.summary(now)})")
                    return
            pause = min(poll, max(0.0, deadline - self.ops.now()), max(0.0, reading_due - self.ops.now()))
            wake, result = await self._race(self.ops.sleep(pause), None)
            if self._interrupted(wake, result):
                return

    async def _warming(self) -> None:
        """One short completion before the instance joins the rotation (health.warmup)."""
        warmup = self.config.health.warmup
        if self.watch is not None:
            self.watch.enter(Phase.WARMING, self.ops.now())
        if not warmup.enabled:
            self._fire(Event.WARMED, "warm-up off (health.warmup.enabled: false)")
            return
        began = self.ops.now()
        # one request, however often an intent that changes nothing wakes the race
        kind = warmup_kind(self.config.vllm.args, self.config.model)  # a completion, an embedding, a pooling request
        job = asyncio.ensure_future(self.ops.warm_up(self.url, warmup_body(self.config, kind), warmup.timeout, kind))
        try:
            while True:
                wake, result = await self._race(asyncio.shield(job), None)
                if self._interrupted(wake, result):
                    return
                if wake is Wake.DONE:
                    break
        finally:
            job.cancel()
        outcome: HealthResult = result
        took = self.ops.now() - began
        if outcome.ok and self.child is not None and self.child.returncode is None:
            self._fire(Event.WARMED, f"warm-up answered in {took:.1f}s ({outcome.detail})")
        else:
            self._fail(Event.WARMUP_FAILED, f"warm-up failed after {took:.1f}s: {outcome.detail}")

    async def _draining(self) -> None:
        """Out of the rotation: wait until the proxy has nothing in flight to it, at most
        proxy.drain_timeout; an exit or a stronger intent (restart, halt) ends the wait early."""
        timeout = self.config.proxy.drain_timeout
        deadline = self.since + timeout
        while True:
            left, now = self.in_flight(), self.ops.now()
            if left == 0:
                self._fire(Event.DRAINED, f"no request in flight after {now - self.since:.1f}s")
                return
            if now >= deadline:
                self._fire(Event.DRAINED, f"proxy.drain_timeout of {timeout:g}s passed with {left} request(s) "
                                          "still in flight; stopping cuts them off")
                return
            wake, result = await self._race(self.ops.sleep(min(DRAIN_POLL, deadline - now)), None)
            if self._interrupted(wake, result):
                return

    async def _ready(self) -> None:
        health = self.config.health
        wake, result = await self._race(self.ops.sleep(health.interval), None)
        if self._interrupted(wake, result) or wake is not Wake.DONE:
            return
        wake, result = await self._race(self.ops.probe(self.url, health.timeout), None)
        if self._interrupted(wake, result) or wake is not Wake.DONE:
            return
        outcome: HealthResult = result
        if outcome.ok:
            self.health_failures = 0
            return
        self.health_failures += 1
        logger.warning("instance %s: /health failed (%s), %d of %d", self.name, outcome.detail, self.health_failures, health.failures)
        if self.health_failures >= health.failures:
            self._fail(Event.UNHEALTHY, f"unhealthy: {self.health_failures} failed /health polls in a row (last: {outcome.detail})")

    async def _unhealthy(self) -> None:
        # stopped anyway; a held restart or halt only changes how the stop ends (AFTER_STOP)
        if self._apply_intent():
            return
        self._fire(Event.STOP, "restarting the unhealthy instance")

    async def _stopping(self) -> None:
        child = self.child
        if child is not None:
            report = await self.ops.stop_tree(child, self.config.stop.timeout)
            how = "gracefully" if report.graceful else "after SIGKILL"
            logger.info(
                "instance %s: process tree of pid %d gone %s in %.1fs%s%s%s",
                self.name, child.pid, how, report.duration,
                f"; killed {report.killed}" if report.killed else "",
                f"; swept escaped {report.escaped}" if report.escaped else "",
                f"; removed {len(report.shm_removed)} /dev/shm files" if report.shm_removed else "",
            )
            if self.failure is None:
                self.last_exit = f"{self.intent_why or 'stopped on request'} ({describe_exit(report.exit_status)})"
        self.child = None
        self.started_at = None
        self._forget_exit()
        (intent, why), self.intent, self.intent_why = (self.intent, self.intent_why), None, None
        event = AFTER_STOP.get(intent) if intent is not None else None
        if event is not None:
            self._fire(event, why or ("stopped on request" if event is Event.HALTED else "restart requested"))
        elif self.unrunnable:  # a restart would die the same way: no backoff, no crash loop
            self._fire(Event.UNRUNNABLE, f"not restarted: {self.last_exit}; `vsup restart {self.name}` tries again")
        else:
            now = self.ops.now()
            decision = self.policy.on_failure(now, self._ready_since)
            if decision.delay is None:  # give up (decision.give_up)
                stable = self.config.restart.stable_after
                self._fire(
                    Event.CRASH_LOOP,
                    f"crash loop: {decision.attempt} failures in a row, no start ready for {stable:g}s "
                    f"(last: {self.last_exit}); `vsup restart {self.name}` gives it a new chance",
                )
            else:
                self.next_start_at = now + decision.delay
                self._fire(Event.CLEANED_UP, f"next start in {decision.delay:.2f}s (failure {decision.attempt})")
