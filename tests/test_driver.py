"""The lifecycle driver (`lifecycle.Instance`) in-process, against fake operations on a virtual clock
(tests/lifecycle_fakes.py): every transition path and the races between exits, intents and
timers, each in milliseconds. The same driver runs real processes in tests/test_supervisor.py."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tests.lifecycle_fakes import FakeOps
from vsup.config.schema import VsupConfig
from vsup.supervisor import backoff
from vsup.supervisor.lifecycle import STARTUP_POLL, Instance, describe_exit
from vsup.supervisor.states import AFTER_STOP, ON_INTENT, TRANSITIONS, Event, Intent, State, next_state

pytestmark = pytest.mark.timeout(10)

RESTART = {"max_delay": 8.0, "stable_after": 100.0, "max_failures": 50}
HEALTH = {"interval": 5.0, "timeout": 2.0, "failures": 3, "startup_timeout": 60.0}


def make_config(health=None, restart=None, stop_timeout: float = 10.0, drain_timeout: float = 30.0) -> VsupConfig:
    return VsupConfig.model_validate({
        "model": "m",
        "health": {**HEALTH, **(health or {})},
        "restart": {**RESTART, **(restart or {})},
        "stop": {"timeout": stop_timeout},
        "proxy": {"drain_timeout": drain_timeout},
    })


class Driven:
    """One Instance over FakeOps, its task running; `path` is the list of (from, event, to)."""

    def __init__(self, ops: FakeOps, config: VsupConfig) -> None:
        self.ops = ops
        self.clock = ops.clock
        self.in_flight = 0  # what the proxy would have in flight to the instance
        self.inst = Instance(0, ["vllm", "serve", "m"], {}, port=8100, config=config, log=None, ops=ops,
                             in_flight=lambda: self.in_flight)
        self.task = asyncio.create_task(self.inst.run())

    @property
    def path(self) -> list[tuple[str, str, str]]:
        return [(t.old.value, t.event.value, t.new.value) for t in self.inst.history]

    def events(self) -> list[str]:
        return [t.event.value for t in self.inst.history]

    async def until(self, predicate, what: str = "condition", limit: float = 10_000.0) -> None:
        if self.task.done():
            self.task.result()  # the driver crashed: show why
        await self.clock.run_until(lambda: predicate() or self.task.done(), limit, what)
        if self.task.done():
            self.task.result()
            raise AssertionError(f"the driver ended while waiting for {what}")

    async def until_state(self, state: State, limit: float = 10_000.0) -> None:
        await self.until(lambda: self.inst.state is state, f"state {state.value}", limit)

    async def ready(self) -> None:
        self.inst.start()
        await self.until_state(State.READY)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch):
    """Delays exactly 1, 2, 4, ... s (the jitter would draw from `random`)."""
    monkeypatch.setattr(backoff, "JITTER", 0.0)


@pytest.fixture
async def driven():
    made: list[Driven] = []

    def make(*, load_time: float = 3.0, stop_time: float = 0.5, warmup_time: float = 0.25, **config) -> Driven:
        d = Driven(FakeOps(load_time=load_time, stop_time=stop_time, warmup_time=warmup_time), make_config(**config))
        made.append(d)
        return d

    yield make
    for d in made:
        await d.close()


async def run_concurrently(d: Driven, coroutine) -> asyncio.Task:
    """Start a request coroutine (restart(), stop()) beside the driver and let it take effect."""
    task = asyncio.create_task(coroutine)
    await d.clock.settle()
    return task


# ---- the tables ----------------------------------------------------------------------------------

def test_every_waiting_state_knows_every_intent_and_each_reaction_is_a_valid_transition():
    waiting = set(State) - {State.STOPPING}  # stopping finishes its tree stop first, then AFTER_STOP decides
    assert set(ON_INTENT) == {(state, intent) for state in waiting for intent in Intent}
    for (state, _), event in ON_INTENT.items():
        if event is not None:
            assert (state, event) in TRANSITIONS
    for event in AFTER_STOP.values():
        next_state(State.STOPPING, event)


def test_intent_precedence_is_halt_retire_restart_recycle_run():
    assert Intent.HALT > Intent.RETIRE > Intent.RESTART > Intent.RECYCLE > Intent.RUN


def test_only_the_gentle_intents_drain_and_only_a_ready_instance():
    drains = {(state, intent) for (state, intent), event in ON_INTENT.items() if event is Event.DRAIN}
    assert drains == {(State.READY, Intent.RECYCLE), (State.READY, Intent.RETIRE)}
    assert AFTER_STOP[Intent.RECYCLE] is Event.RESTART and AFTER_STOP[Intent.RETIRE] is Event.HALTED


async def test_a_stronger_intent_is_never_replaced_by_a_weaker(driven):
    d = driven()
    inst = d.inst
    inst.ask(Intent.HALT)
    inst.ask(Intent.RESTART)
    inst.start()
    assert inst.intent is Intent.HALT
    await d.clock.settle()
    assert inst.state is State.STOPPED and inst.starts == 0  # the halt won: nothing started


# ---- starting --------------------------------------------------------------------------------------

async def test_first_start_is_ready_only_once_health_answers(driven):
    d = driven(load_time=3.0)
    d.inst.start()
    await d.until_state(State.STARTING)
    assert d.inst.pid == d.ops.current.pid
    await d.clock.advance(2.9)
    assert d.inst.state is State.STARTING  # the port is still closed while the model loads
    await d.until_state(State.READY)
    assert d.path == [("stopped", "start", "starting"), ("starting", "healthy", "warming"), ("warming", "warmed", "ready")]
    healthy, warmed = list(d.inst.history)[-2:]
    assert 3.0 <= healthy.at <= 3.0 + STARTUP_POLL and "/health 200" in healthy.reason
    assert warmed.at == healthy.at + d.ops.warmup_time and "warm-up answered" in warmed.reason
    assert d.ops.probes == pytest.approx(3.0 / STARTUP_POLL + 1, abs=1)  # polled every STARTUP_POLL s
    assert d.inst.starts == 1 and d.inst.restarts == 0 and d.inst.last_exit is None


async def test_start_while_running_changes_nothing(driven):
    d = driven()
    await d.ready()
    d.inst.start()
    await d.clock.advance(30)
    assert d.inst.state is State.READY and d.inst.starts == 1 and d.inst.intent is None


async def test_startup_timeout_stops_the_tree_and_backs_off(driven):
    d = driven(load_time=1e9, health={"startup_timeout": 20})
    d.inst.start()
    await d.until_state(State.BACKOFF)
    assert d.path == [("stopped", "start", "starting"), ("starting", "startup_timeout", "stopping"),
                      ("stopping", "cleaned_up", "backoff")]
    timed_out = d.inst.history[1]
    assert timed_out.at == pytest.approx(20.0) and "startup timeout of 20s" in timed_out.reason
    assert "connection refused" in timed_out.reason  # the last /health answer is named
    assert d.ops.stopped == [d.ops.processes[0].pid]
    assert d.inst.last_exit.startswith("not healthy after the startup timeout")


async def test_exit_while_starting_is_a_failure_and_the_delay_doubles_up_to_the_cap(driven):
    d = driven(load_time=1e9)
    d.inst.start()
    delays = []
    for attempt in range(6):
        await d.until(lambda a=attempt: len(d.ops.processes) == a + 1 and d.inst.state is State.STARTING, "a start")
        await d.clock.advance(0.2)
        d.ops.current.exit(3)
        await d.until_state(State.BACKOFF)
        delays.append(d.inst.next_start_at - d.clock.now())
    assert delays == pytest.approx([1.0, 2.0, 4.0, 8.0, 8.0, 8.0])
    assert d.inst.last_exit == "exited with code 3"
    assert d.events().count("exited") == 6 and d.events().count("delay_over") == 5


async def test_a_program_that_cannot_start_is_a_failure_without_a_tree_to_stop(driven):
    d = driven()
    d.ops.spawn_error = "cannot start 'vllm': program not found"
    d.inst.start()
    await d.until_state(State.BACKOFF)
    assert d.path[1] == ("starting", "exited", "stopping")
    assert d.inst.last_exit == "could not start: cannot start 'vllm': program not found"
    assert d.ops.stopped == []  # nothing was started, nothing to stop
    d.ops.spawn_error = None
    await d.until_state(State.READY)  # the next start, after the delay, works


# ---- ready ------------------------------------------------------------------------------------------

async def test_exit_of_a_ready_instance_restarts_it_after_the_backoff(driven):
    d = driven()
    await d.ready()
    first = d.ops.current
    first.exit(-signal.SIGKILL)
    await d.until_state(State.STOPPING)
    assert d.inst.state is State.STOPPING  # out of rotation at once, not at the next poll
    await d.until(lambda: d.inst.state is State.READY and d.ops.current is not first, "ready again")
    assert d.path[3:] == [("ready", "exited", "stopping"), ("stopping", "cleaned_up", "backoff"),
                          ("backoff", "delay_over", "starting"), ("starting", "healthy", "warming"),
                          ("warming", "warmed", "ready")]
    assert d.ops.stopped == [first.pid]  # the orphans of a dead leader are swept too
    assert d.inst.restarts == 1 and d.inst.last_exit.startswith("killed by SIGKILL")


@pytest.mark.parametrize("answer, detail", [(500, "HTTP 500"), ("hang", "timeout after 2s")])
async def test_failed_polls_in_a_row_make_it_unhealthy_and_it_is_restarted(driven, answer, detail):
    d = driven()
    await d.ready()
    sick = d.ops.current
    sick.health = answer
    cycle = HEALTH["interval"] + (HEALTH["timeout"] if answer == "hang" else 0)  # sleep, then the probe
    await d.clock.advance(2 * cycle + 1)  # two failed polls ...
    assert d.inst.health_failures == 2 and d.inst.state is State.READY
    sick.health = 200
    await d.clock.advance(cycle + 1)  # ... one good one resets the count
    assert d.inst.health_failures == 0 and d.inst.state is State.READY
    sick.health = answer
    await d.until(lambda: d.inst.state is State.READY and d.ops.current is not sick, "restarted")
    assert d.path[3:6] == [("ready", "unhealthy", "unhealthy"), ("unhealthy", "stop", "stopping"),
                           ("stopping", "cleaned_up", "backoff")]
    unhealthy = d.inst.history[3]
    assert detail in unhealthy.reason and "3 failed /health polls" in unhealthy.reason
    assert d.inst.history[4].reason == "restarting the unhealthy instance"
    assert d.ops.stopped == [sick.pid]
    assert d.inst.last_exit.startswith("unhealthy: 3 failed")


# ---- restart policy: crash loop and stable reset ---------------------------------------------------

async def test_max_failures_in_a_row_fail_the_instance_until_asked(driven):
    d = driven(load_time=0.5, restart={"max_failures": 3})
    d.inst.start()
    for _ in range(3):
        await d.until(lambda: d.inst.state is State.READY, "ready")
        d.ops.current.exit(1)
        await d.until(lambda: d.inst.state in (State.BACKOFF, State.FAILED), "handled")
    assert d.inst.state is State.FAILED
    assert d.path[-1] == ("stopping", "crash_loop", "failed")
    assert "crash loop: 3 failures in a row, no start ready for 100s" in d.inst.history[-1].reason
    await d.clock.advance(1000)
    assert d.inst.state is State.FAILED and d.inst.starts == 3  # stays down on its own
    d.inst.start()  # SIGHUP / `vsup restart`: a new chance, with a clean count
    await d.until_state(State.READY)
    assert d.inst.history[-3].reason == "restart requested: a new chance after the crash loop"
    assert d.inst.policy.attempt == 0


async def test_failures_far_apart_still_make_a_crash_loop_when_no_start_counted(driven):
    d = driven(load_time=0.5, restart={"max_failures": 3, "stable_after": 1e6})
    d.inst.start()
    for _ in range(3):
        await d.until(lambda: d.inst.state is State.READY, "ready")
        await d.clock.advance(600)  # each run lives 10 minutes: never stable_after
        d.ops.current.exit(1)
        await d.until(lambda: d.inst.state in (State.BACKOFF, State.FAILED), "handled")
    assert d.inst.state is State.FAILED


async def test_an_instance_killed_by_sigill_is_failed_at_once_and_never_restarted_on_its_own(driven):
    d = driven(load_time=1e9)
    d.inst.start()
    await d.until(lambda: d.inst.state is State.STARTING and d.ops.current is not None, "started")
    await d.clock.advance(2.0)
    doomed = d.ops.current
    doomed.exit(-signal.SIGILL)  # vLLM's x86 build on a CPU without AVX2, importing its kernels
    await d.until_state(State.FAILED)
    assert d.path == [("stopped", "start", "starting"), ("starting", "exited", "stopping"),
                      ("stopping", "unrunnable", "failed")]
    assert d.inst.last_exit == describe_exit(-signal.SIGILL)
    assert d.inst.last_exit.startswith("killed by SIGILL (illegal instruction): the CPU lacks an instruction this vLLM build uses")
    assert d.inst.history[-1].reason == f"not restarted: {d.inst.last_exit}; `vsup restart 0` tries again"
    assert d.ops.stopped == [doomed.pid]  # its tree was swept like any other
    assert d.inst.next_start_at is None and d.inst.policy.attempt == 0  # no backoff was planned
    await d.clock.advance(10_000)
    assert d.inst.state is State.FAILED and d.inst.starts == 1 and len(d.ops.processes) == 1  # no crash loop
    # `vsup restart 0` (say after a reload to another build): a new chance, and a SIGILL of a
    # ready instance (bf16 on AMX at its first request) is failed at once too
    d.ops.load_time = 1.0
    d.inst.start()
    await d.until_state(State.READY)
    assert d.inst.history[-3].reason == "restart requested: a new chance after its last exit"
    d.ops.current.exit(-signal.SIGILL)
    await d.until_state(State.FAILED)
    assert d.path[-2:] == [("ready", "exited", "stopping"), ("stopping", "unrunnable", "failed")]
    # another exit of the next run is an ordinary failure again: backoff, not failed
    d.inst.start()
    await d.until_state(State.READY)
    d.ops.current.exit(1)
    await d.until_state(State.BACKOFF)
    assert d.path[-1] == ("stopping", "cleaned_up", "backoff")


async def test_failures_after_starts_that_counted_never_make_a_crash_loop(driven):
    d = driven(load_time=0.5, restart={"max_failures": 3, "stable_after": 15.0})
    d.inst.start()
    for _ in range(6):
        await d.until(lambda: d.inst.state is State.READY, "ready")
        await d.clock.advance(20)  # each run lives 20 s: every start counted
        d.ops.current.exit(1)
        await d.until_state(State.BACKOFF)
    assert State.FAILED.value not in [to for _, _, to in d.path]


async def test_a_stable_run_resets_the_backoff_and_the_crash_count(driven):
    d = driven(load_time=0.5, restart={"stable_after": 100.0})
    d.inst.start()
    for _ in range(3):  # three quick failures: the delay grows to 4 s
        await d.until(lambda: d.inst.state is State.READY, "ready")
        d.ops.current.exit(1)
        await d.until_state(State.BACKOFF)
    assert d.inst.next_start_at - d.clock.now() == pytest.approx(4.0) and d.inst.policy.attempt == 3
    await d.until_state(State.READY)
    await d.clock.advance(99)  # not yet stable
    d.ops.current.exit(1)
    await d.until_state(State.BACKOFF)
    assert d.inst.next_start_at - d.clock.now() == pytest.approx(8.0) and d.inst.policy.attempt == 4
    await d.until_state(State.READY)
    await d.clock.advance(100)  # stable
    d.ops.current.exit(1)
    await d.until_state(State.BACKOFF)
    assert d.inst.next_start_at - d.clock.now() == pytest.approx(1.0) and d.inst.policy.attempt == 1


# ---- requests and races ----------------------------------------------------------------------------

async def test_restart_of_a_ready_instance_starts_it_again_at_once(driven):
    d = driven()
    await d.ready()
    old = d.ops.current
    waiter = await run_concurrently(d, d.inst.restart())
    await d.until(waiter.done, "restart done")
    assert waiter.result() is State.READY
    assert d.path[3:] == [("ready", "stop", "stopping"), ("stopping", "restart", "starting"),
                          ("starting", "healthy", "warming"), ("warming", "warmed", "ready")]
    assert d.inst.history[3].reason == "restart requested"
    assert d.ops.stopped == [old.pid] and d.ops.current is not old
    assert d.inst.last_exit == "stopped on request (killed by SIGTERM)"
    assert d.inst.policy.attempt == 0  # a requested restart is not a failure


async def test_restart_during_starting_stops_the_loading_process_and_starts_a_new_one(driven):
    d = driven(load_time=30)
    d.inst.start()
    await d.until_state(State.STARTING)
    loading = d.ops.current
    await d.clock.advance(10)
    waiter = await run_concurrently(d, d.inst.restart())
    await d.until(waiter.done, "restart done")
    assert waiter.result() is State.READY
    assert d.path[1:3] == [("starting", "stop", "stopping"), ("stopping", "restart", "starting")]
    assert d.ops.stopped == [loading.pid] and len(d.ops.processes) == 2 and d.inst.starts == 2


async def test_restart_during_backoff_skips_the_rest_of_the_delay(driven, monkeypatch):
    monkeypatch.setattr(backoff, "FIRST_DELAY", 50.0)
    d = driven(restart={"max_delay": 50.0})
    await d.ready()
    d.ops.current.exit(1)
    await d.until_state(State.BACKOFF)
    waiter = await run_concurrently(d, d.inst.restart())
    await d.until(waiter.done, "restart done", limit=20)
    assert d.path[5] == ("backoff", "start", "starting")
    assert d.inst.history[5].reason == "restart requested: skipping the rest of the backoff delay"


async def test_stop_during_backoff_stops_without_starting_again(driven):
    d = driven()
    await d.ready()
    d.ops.current.exit(1)
    await d.until_state(State.BACKOFF)
    stopper = await run_concurrently(d, d.inst.stop())
    await d.until(stopper.done, "stopped")
    assert d.path[-1] == ("backoff", "stop", "stopped")
    await d.clock.advance(1000)
    assert d.inst.state is State.STOPPED and len(d.ops.processes) == 1


@pytest.mark.parametrize("state", [State.STARTING, State.READY, State.FAILED, State.STOPPED])
async def test_stop_from_each_state_ends_stopped(driven, state):
    d = driven(load_time=5, restart={"max_failures": 1})
    if state is not State.STOPPED:
        d.inst.start()
        await d.until_state(State.STARTING)
        if state is State.FAILED:
            d.ops.current.exit(1)
        await d.until_state(state)
    stopper = await run_concurrently(d, d.inst.stop())
    await d.until(stopper.done, "stopped")
    assert d.inst.state is State.STOPPED and d.inst.intent is None and d.inst.pid is None
    if state in (State.STARTING, State.READY):
        assert d.path[-2:] == [(state.value, "stop", "stopping"), ("stopping", "halted", "stopped")]
        assert d.ops.stopped == [d.ops.current.pid]


async def test_halt_beats_a_restart_in_progress(driven):
    d = driven(stop_time=5.0)
    await d.ready()
    restarting = await run_concurrently(d, d.inst.restart())
    assert d.inst.state is State.STOPPING  # the tree stop of the restart is under way ...
    stopper = await run_concurrently(d, d.inst.stop())  # ... when the shutdown comes
    await d.until(lambda: stopper.done() and restarting.done(), "both answered")
    assert restarting.result() is State.STOPPED  # the restart's waiter is told, not left hanging
    assert d.path[-1] == ("stopping", "halted", "stopped") and len(d.ops.processes) == 1
    d.inst.ask(Intent.RESTART)  # after the halt a new request is honoured again
    await d.until_state(State.READY)


async def test_a_restart_cannot_undo_a_pending_halt(driven):
    d = driven(stop_time=5.0)
    await d.ready()
    stopper = await run_concurrently(d, d.inst.stop())
    restarting = await run_concurrently(d, d.inst.restart())
    await d.until(lambda: stopper.done() and restarting.done(), "both answered")
    assert d.inst.state is State.STOPPED and restarting.result() is State.STOPPED
    assert len(d.ops.processes) == 1


async def test_exit_during_the_stop_is_no_second_event(driven):
    d = driven(stop_time=8.0)
    await d.ready()
    stopper = await run_concurrently(d, d.inst.stop())
    await d.clock.advance(1)
    d.ops.current.exit(0)  # the process goes by itself while stop_tree waits for it
    await d.until(stopper.done, "stopped")
    assert d.path[-2:] == [("ready", "stop", "stopping"), ("stopping", "halted", "stopped")]
    assert d.inst.last_exit == "stopped on request (exited with code 0 (vLLM exits 0 when its engine dies))"


async def test_an_exit_and_a_restart_at_the_same_moment_the_exit_is_seen_first(driven):
    d = driven()
    await d.ready()
    d.ops.current.exit(-signal.SIGKILL)
    d.inst.ask(Intent.RESTART)
    await d.until(lambda: d.inst.state is State.READY and d.inst.starts == 2, "restarted")
    assert d.path[3:5] == [("ready", "exited", "stopping"), ("stopping", "restart", "starting")]
    assert d.inst.last_exit.startswith("killed by SIGKILL")  # the failure stays the reason
    assert State.BACKOFF.value not in [to for _, _, to in d.path]  # asked for: no backoff


@pytest.mark.parametrize("intent, ends", [(Intent.HALT, ("stopping", "halted", "stopped")),
                                         (Intent.RESTART, ("stopping", "restart", "starting"))])
async def test_an_intent_arriving_with_unhealthy_decides_how_the_stop_ends(driven, intent, ends):
    d = driven()
    await d.ready()
    d.inst.subscribe(lambda inst, t: t.new is State.UNHEALTHY and inst.ask(intent))
    d.ops.current.health = 500
    await d.until(lambda: len(d.path) >= 6, "the stop ended")
    assert d.path[3:6] == [("ready", "unhealthy", "unhealthy"), ("unhealthy", "stop", "stopping"), ends]
    assert d.inst.last_exit.startswith("unhealthy")  # it failed: that stays the reason


# ---- warm-up -----------------------------------------------------------------------------------------

async def test_the_warm_up_runs_after_health_and_before_the_rotation_with_the_configured_request(driven):
    d = driven(warmup_time=4.0, health={"warmup": {"prompt": "Hi there", "max_tokens": 2}})
    d.inst.start()
    await d.until_state(State.WARMING)
    process = d.ops.current
    await d.clock.advance(3.9)
    assert d.inst.state is State.WARMING  # not in the rotation while the warm-up runs
    await d.until_state(State.READY)
    assert d.ops.warmups == [(process.pid, {"model": "m", "prompt": "Hi there", "max_tokens": 2, "temperature": 0})]
    assert d.path[1:] == [("starting", "healthy", "warming"), ("warming", "warmed", "ready")]
    assert d.inst.history[-1].at - d.inst.history[-2].at == pytest.approx(4.0)


async def test_the_warm_up_uses_the_served_model_name():
    config = VsupConfig.model_validate({"model": "/srv/m", "served_model_name": "tiny", "health": HEALTH, "restart": RESTART})
    d = Driven(FakeOps(), config)
    try:
        await d.ready()
        assert d.ops.warmups[0][1]["model"] == "tiny"
    finally:
        await d.close()


async def test_warm_up_off_joins_the_rotation_at_once(driven):
    d = driven(health={"warmup": {"enabled": False}})
    await d.ready()
    assert d.ops.warmups == []
    warmed = d.inst.history[-1]
    assert (warmed.old, warmed.event) == (State.WARMING, Event.WARMED) and warmed.reason.startswith("warm-up off")
    assert warmed.at == d.inst.history[-2].at


@pytest.mark.parametrize("answer, detail", [(500, "HTTP 500"), ("hang", "timeout after 30s")])
async def test_a_failed_warm_up_is_a_failed_start_and_the_next_start_warms_up_again(driven, answer, detail):
    d = driven(health={"warmup": {"timeout": 30}})
    d.ops.spawn_error = None
    d.inst.start()
    await d.until_state(State.STARTING)
    cold = d.ops.current
    cold.warmup = answer
    await d.until_state(State.BACKOFF)
    assert d.path[1:] == [("starting", "healthy", "warming"), ("warming", "warmup_failed", "stopping"),
                          ("stopping", "cleaned_up", "backoff")]
    assert detail in d.inst.last_exit and d.inst.last_exit.startswith("warm-up failed")
    assert d.ops.stopped == [cold.pid] and d.inst.policy.attempt == 1 and d.inst.failures == 1
    await d.until(lambda: d.inst.state is State.READY, "ready after the backoff")
    assert [pid for pid, _ in d.ops.warmups] == [cold.pid, d.ops.current.pid]  # every start warms up


async def test_an_exit_during_the_warm_up_is_a_failure(driven):
    d = driven(warmup_time=10.0)
    d.inst.start()
    await d.until_state(State.WARMING)
    d.ops.current.exit(-signal.SIGKILL)
    await d.until_state(State.BACKOFF)
    assert ("warming", "exited", "stopping") in d.path and d.inst.last_exit.startswith("killed by SIGKILL")


async def test_a_start_asked_during_the_warm_up_sends_no_second_request(driven):
    d = driven(warmup_time=5.0)
    d.inst.start()
    await d.until_state(State.WARMING)
    d.inst.start()  # RUN changes nothing here
    await d.until_state(State.READY)
    assert len(d.ops.warmups) == 1


# ---- draining: recycle and retire -------------------------------------------------------------------

async def test_recycle_drains_until_nothing_is_in_flight_then_starts_again_warmed(driven):
    d = driven(drain_timeout=30)
    await d.ready()
    old = d.ops.current
    d.in_flight = 2
    waiter = await run_concurrently(d, d.inst.recycle("memory watchdog: RSS 7 GiB above 6 GiB for 60s"))
    assert d.inst.state is State.DRAINING and d.ops.stopped == []
    draining = d.inst.history[-1]
    assert draining.reason == ("memory watchdog: RSS 7 GiB above 6 GiB for 60s: out of the rotation, 2 request(s) in flight "
                               "may finish (up to proxy.drain_timeout 30s)")
    await d.clock.advance(12)
    assert d.inst.state is State.DRAINING and d.ops.stopped == []  # still serving what it has
    d.in_flight = 0
    await d.until(waiter.done, "recycled")
    assert waiter.result() is State.READY
    assert d.path[3:] == [("ready", "drain", "draining"), ("draining", "drained", "stopping"),
                          ("stopping", "restart", "starting"), ("starting", "healthy", "warming"),
                          ("warming", "warmed", "ready")]
    assert d.inst.history[4].reason.startswith("no request in flight after 12.")
    assert d.ops.stopped == [old.pid] and len(d.ops.warmups) == 2
    assert d.inst.last_exit == "memory watchdog: RSS 7 GiB above 6 GiB for 60s (killed by SIGTERM)"
    assert d.inst.policy.attempt == 0 and d.inst.failures == 0  # asked for: not a failure


async def test_a_drain_ends_at_the_drain_timeout(driven):
    d = driven(drain_timeout=10)
    await d.ready()
    d.in_flight = 3
    began = d.clock.now()
    d.inst.ask(Intent.RECYCLE)
    await d.until_state(State.STOPPING)
    drained = d.inst.history[-1]
    assert drained.event is Event.DRAINED and drained.at - began == pytest.approx(10)
    assert drained.reason == "proxy.drain_timeout of 10s passed with 3 request(s) still in flight; stopping cuts them off"


async def test_retire_drains_stops_and_stays_stopped(driven):
    d = driven()
    await d.ready()
    d.in_flight = 1
    retiring = await run_concurrently(d, d.inst.retire("replaced by a reload"))
    await d.clock.advance(2)
    assert d.inst.state is State.DRAINING
    d.in_flight = 0
    await d.until(retiring.done, "retired")
    assert d.path[-3:] == [("ready", "drain", "draining"), ("draining", "drained", "stopping"),
                           ("stopping", "halted", "stopped")]
    assert d.inst.history[-1].reason == "replaced by a reload"
    await d.clock.advance(1000)
    assert d.inst.state is State.STOPPED and len(d.ops.processes) == 1


@pytest.mark.parametrize("intent, ends", [(Intent.RESTART, ("stopping", "restart", "starting")),
                                         (Intent.HALT, ("stopping", "halted", "stopped"))])
async def test_a_restart_or_halt_during_a_drain_stops_at_once(driven, intent, ends):
    d = driven(drain_timeout=600)
    await d.ready()
    d.in_flight = 5
    d.inst.ask(Intent.RECYCLE)
    await d.until_state(State.DRAINING)
    await d.clock.advance(1)
    d.inst.ask(intent)
    await d.until(lambda: len(d.path) >= 6, "the stop ended")
    assert d.path[4:6] == [("draining", "stop", "stopping"), ends]
    assert d.clock.now() < 600  # it did not wait for the drain


async def test_a_retire_during_a_recycle_keeps_draining_and_ends_stopped(driven):
    d = driven(drain_timeout=600)
    await d.ready()
    d.in_flight = 1
    d.inst.ask(Intent.RECYCLE)
    await d.until_state(State.DRAINING)
    d.inst.ask(Intent.RETIRE)
    d.inst.ask(Intent.RECYCLE)  # weaker: changes nothing
    await d.clock.advance(5)
    assert d.inst.state is State.DRAINING and d.inst.intent is Intent.RETIRE
    d.in_flight = 0
    await d.until_state(State.STOPPED)
    assert d.path[-3:] == [("ready", "drain", "draining"), ("draining", "drained", "stopping"),
                           ("stopping", "halted", "stopped")]


async def test_an_exit_while_draining_is_a_failure_but_the_recycle_still_restarts_at_once(driven):
    d = driven()
    await d.ready()
    d.in_flight = 1
    d.inst.ask(Intent.RECYCLE)
    await d.until_state(State.DRAINING)
    d.ops.current.exit(-signal.SIGKILL)
    await d.until(lambda: d.inst.state is State.READY and d.inst.starts == 2, "ready again")
    assert d.path[4:6] == [("draining", "exited", "stopping"), ("stopping", "restart", "starting")]
    assert d.inst.last_exit.startswith("killed by SIGKILL")


@pytest.mark.parametrize("state", [State.STARTING, State.WARMING, State.BACKOFF, State.FAILED])
async def test_recycle_of_an_instance_out_of_the_rotation_has_nothing_to_drain(driven, state, monkeypatch):
    monkeypatch.setattr(backoff, "FIRST_DELAY", 100.0)
    d = driven(load_time=5, warmup_time=5, restart={"max_failures": 1 if state is State.FAILED else 50,
                                                      "max_delay": 100.0})
    d.in_flight = 4  # not the instance's: it is not in the rotation
    d.inst.start()
    await d.until_state(State.STARTING if state is not State.WARMING else State.WARMING)
    if state in (State.BACKOFF, State.FAILED):
        d.ops.current.exit(1)
        await d.until_state(state)
    recycled = await run_concurrently(d, d.inst.recycle())
    await d.until(recycled.done, "recycled", limit=50)
    assert recycled.result() is State.READY
    assert State.DRAINING.value not in [to for _, _, to in d.path]


async def test_relaunch_starts_the_next_run_with_the_new_command(driven):
    d = driven()
    await d.ready()
    d.inst.relaunch(["vllm", "serve", "m", "--dtype", "float32"], {"X": "1"})
    assert d.ops.current.argv == ["vllm", "serve", "m"]  # the running process is not touched
    waiter = await run_concurrently(d, d.inst.recycle("config reloaded"))
    await d.until(waiter.done, "recycled")
    assert d.ops.current.argv == ["vllm", "serve", "m", "--dtype", "float32"] and d.inst.env == {"X": "1"}
    assert d.inst.launch is None


async def test_recycle_waiter_is_told_when_the_new_run_fails(driven):
    d = driven()
    await d.ready()
    waiter = await run_concurrently(d, d.inst.recycle())
    await d.until_state(State.WARMING)
    d.ops.current.warmup = 500
    await d.until(waiter.done, "told")
    assert waiter.result() is State.BACKOFF and d.inst.failures == 1
