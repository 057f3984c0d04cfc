"""A start judged by its progress (lifecycle.Instance's `starting`, phases.StartWatch) on the
virtual clock: a start that shows no progress for health.startup_stall is stopped as stalled in
its phase; one that keeps moving (CPU, reads, output, phases) runs on, up to the startup_timeout
ceiling. The fakes' trees use CPU and read bytes at the rates a test sets (tests/lifecycle_fakes.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.lifecycle_fakes import FakeOps, FakeProcess
from tests.test_driver import Driven, make_config
from vsup.supervisor.lifecycle import PROGRESS_POLL
from vsup.supervisor.phases import Phase
from vsup.supervisor.states import State

pytestmark = pytest.mark.timeout(10)

LOADING = "(Worker pid=7) INFO 12-01 10:00:41 [cpu_model_runner.py:68] Starting to load model /srv/m..."
COMPILING = "(Worker pid=7) INFO 12-01 10:01:11 [cpu_model_runner.py:87] Warming up model for the compilation..."
SHM_WAIT = ("(EngineCore pid=6) INFO 12-01 10:02:11 [shm_broadcast.py:466] No available shared memory broadcast block found "
            "in 60 seconds. This typically happens when some processes are hanging or doing some time-consuming work "
            "(e.g. compilation, weight/kv cache quantization).")
STALL, CEILING = 120.0, 3600.0


@pytest.fixture
async def started():
    made: list[Driven] = []
    tasks: list[asyncio.Task] = []

    async def make(*, load_time: float, health=None, weights: int | None = None) -> tuple[Driven, FakeProcess]:
        d = Driven(FakeOps(load_time=load_time), make_config(health={"startup_stall": STALL, "startup_timeout": CEILING,
                                                                      **(health or {})}))
        d.inst.weights_bytes = weights
        made.append(d)
        d.inst.start()
        await d.until(lambda: d.ops.current is not None, "the spawn")
        return d, d.ops.current

    def every(d: Driven, period: float, action) -> None:
        """`action()` every `period` virtual seconds, beside the driver."""
        async def loop() -> None:
            while True:
                await d.clock.sleep(period)
                action()
        tasks.append(asyncio.create_task(loop()))

    make.every = every  # type: ignore[attr-defined]
    yield make
    for task in tasks:
        task.cancel()
    for d in made:
        await d.close()


async def test_a_start_without_progress_is_stopped_as_stalled_in_its_phase(started):
    d, process = await started(load_time=1e9)
    await d.clock.advance(5)
    process.say(LOADING)  # then nothing: no output, no CPU, no reads
    await d.until_state(State.BACKOFF)
    assert d.events() == ["start", "stalled", "cleaned_up"]
    stalled = d.inst.history[1]
    # the line came at 5 s, the next reading (every PROGRESS_POLL) saw it: stalled that reading + the stall time later
    assert 5 + STALL <= stalled.at <= 5 + PROGRESS_POLL + STALL + 0.5
    assert stalled.reason.startswith(f"stalled in loading for {STALL:.0f} s: no new phase, output, CPU time or reads")
    assert "health.startup_stall 120s" in stalled.reason and "connection refused" in stalled.reason
    assert d.inst.last_exit == stalled.reason and d.ops.stopped == [process.pid]


async def test_a_slow_start_that_keeps_using_cpu_runs_long_past_the_stall_time_and_serves(started):
    d, process = await started(load_time=900.0)  # 15 minutes, like a big model's compile on few cores
    process.cpu_rate = 0.9
    process.say(LOADING, COMPILING)
    started.every(d, 60.0, lambda: process.say(SHM_WAIT))  # vLLM's alarming line, every minute of the compile
    await d.until_state(State.READY)
    assert d.events() == ["start", "healthy", "warmed"]
    healthy = d.inst.history[1]
    assert healthy.at >= 900.0 and "(booting 2s, compiling 14m58s)" in healthy.reason  # seen at the first reading after the spawn


@pytest.mark.parametrize("moving", ["reads", "output"])
async def test_reads_alone_or_output_alone_are_progress(started, moving):
    d, process = await started(load_time=600.0)
    if moving == "reads":
        process.read_rate = 50 * 2**20  # a load from a slow disk: reads, little CPU
    else:
        started.every(d, STALL / 2, lambda: process.say("INFO something new"))
    await d.until_state(State.READY)
    assert d.events() == ["start", "healthy", "warmed"]


async def test_vllms_waiting_lines_alone_are_not_progress(started):
    d, process = await started(load_time=1e9)
    process.say(COMPILING)
    started.every(d, 10.0, lambda: process.say(SHM_WAIT))  # a hung engine keeps saying it waits
    await d.until_state(State.BACKOFF)
    assert d.events() == ["start", "stalled", "cleaned_up"]
    assert d.inst.history[1].reason.startswith("stalled in compiling for 120 s")


async def test_a_start_that_keeps_progressing_ends_at_the_ceiling(started):
    d, process = await started(load_time=1e9, health={"startup_timeout": 1000.0})
    process.cpu_rate = 1.0
    await d.until_state(State.BACKOFF)
    assert d.events() == ["start", "startup_timeout", "cleaned_up"]
    ended = d.inst.history[1]
    assert ended.at == pytest.approx(1000.0)
    assert ended.reason.startswith("not healthy after the startup timeout of 1000s (health.startup_timeout; in booting for")
    assert "last progress 0 s ago" in ended.reason


async def test_a_tree_whose_counters_cannot_be_read_is_never_called_stalled(started):
    d, process = await started(load_time=1e9, health={"startup_timeout": 1000.0})
    process.counters_readable = False
    await d.until_state(State.BACKOFF)
    assert d.events() == ["start", "startup_timeout", "cleaned_up"]


async def test_the_stall_time_counts_from_the_last_progress_not_from_the_start(started):
    d, process = await started(load_time=1e9)
    process.cpu_rate = 1.0
    await d.clock.advance(500.0)  # busy well past the stall time: still starting
    assert d.inst.state is State.STARTING and d.inst.watch is not None and d.inst.watch.phase is Phase.BOOTING
    process.cpu_rate = 0.0  # hangs from here
    process.say(LOADING)  # (one more line: the last progress)
    await d.until_state(State.BACKOFF)
    stalled = d.inst.history[1]
    assert stalled.event.value == "stalled"
    assert 500.0 + STALL <= stalled.at <= 500.0 + PROGRESS_POLL + STALL + 0.5


async def test_the_watch_shows_the_phase_the_load_and_warming(started):
    gib = 2**30
    d, process = await started(load_time=100.0, weights=4 * gib)
    process.cpu_rate, process.read_rate = 1.0, gib // 10  # 0.1 GiB/s
    await d.clock.advance(3.0)
    process.say(LOADING, "Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:14<00:14, 14.51s/it]")
    await d.clock.advance(20.0)
    shown = d.inst.watch.to_json(d.clock.now())
    assert shown["name"] == "loading" and shown["shards"] == [1, 2] and shown["percent"] == 50
    assert shown["weights_bytes"] == 4 * gib and 1.5 * gib <= shown["read_bytes"] <= 2.5 * gib
    assert shown["judged"] and shown["idle"] <= PROGRESS_POLL
    await d.until_state(State.WARMING)
    assert d.inst.watch.phase is Phase.WARMING
    await d.until_state(State.READY)


def test_systemds_status_line_names_each_starts_phase():
    from types import SimpleNamespace

    from vsup.supervisor.phases import StartWatch
    from vsup.supervisor.status import status_line

    def inst(name: str, state: State, phase: Phase | None):
        watch = None
        if phase is not None:
            watch = StartWatch(0.0)
            watch.enter(phase, 1.0)
        return SimpleNamespace(name=name, state=state, watch=watch, index=int(name), model="m")

    sup = SimpleNamespace(instances=[inst("0", State.STARTING, Phase.COMPILING), inst("1", State.WARMING, Phase.WARMING),
                                     inst("2", State.READY, None)],
                          proxy=None, fleet=SimpleNamespace(plans={}, owner=SimpleNamespace(config=make_config())),
                          config=make_config(), changes=SimpleNamespace(record=None), stopping=False)
    assert status_line(sup) == "1/3 instances ready, 0 in flight; starting: 0 (compiling), 1 (warming)"
