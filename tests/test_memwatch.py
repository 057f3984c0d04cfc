"""The memory watchdog (vsup/supervisor/memwatch.py) in-process: instances over fake operations on
the virtual clock (tests/lifecycle_fakes.py), their tree's memory set by the test."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.lifecycle_fakes import FakeOps
from vsup.config.schema import VsupConfig
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.memwatch import MemoryWatchdog, may_drain
from vsup.supervisor.states import Event, Intent, State

pytestmark = pytest.mark.timeout(20)

MIB = 2**20
PLANNED = 1000 * MIB  # every instance's planned memory here


def make_config(max_rss, max_rss_for: float = 30.0) -> VsupConfig:
    return VsupConfig.model_validate({
        "model": "m",
        "health": {"interval": 5.0, "timeout": 2.0},
        "restart": {"max_delay": 1.0, "max_rss": max_rss, "max_rss_for": max_rss_for},
        "proxy": {"drain_timeout": 10.0},
    })


class Watched:
    """`count` instances on one FakeOps, their drivers and the watchdog running."""

    def __init__(self, count: int, config: VsupConfig) -> None:
        self.ops = FakeOps(load_time=2.0, warmup_time=0.5)
        self.clock = self.ops.clock
        self.config = config
        self.busy: str | None = None
        self.in_flight = {str(i): 0 for i in range(count)}
        self.instances = [
            Instance(i, ["vllm", "serve", "m", "--port", str(8100 + i)], {}, port=8100 + i, config=config, log=None,
                     ops=self.ops, in_flight=lambda i=i: self.in_flight[str(i)])
            for i in range(count)
        ]
        self.watchdog = MemoryWatchdog(self.ops, lambda: self.config, lambda: self.instances, lambda inst: PLANNED,
                                       lambda: self.busy)
        self.tasks = [asyncio.create_task(inst.run()) for inst in self.instances]
        self.tasks.append(asyncio.create_task(self.watchdog.run()))

    def process(self, index: int):
        return self.ops.process_at(self.instances[index].url)

    async def ready(self) -> None:
        for inst in self.instances:
            inst.start()
        await self.until(lambda: all(i.state is State.READY for i in self.instances), "all ready")

    async def until(self, predicate, what: str, limit: float = 10_000.0) -> None:
        for task in self.tasks:
            if task.done():
                task.result()
        await self.clock.run_until(predicate, limit, what)

    def drains(self, index: int) -> list[float]:
        return [t.at for t in self.instances[index].history if t.event is Event.DRAIN]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def watched():
    made: list[Watched] = []

    def make(count: int = 2, **config) -> Watched:
        w = Watched(count, make_config(**config))
        made.append(w)
        return w

    yield make
    for w in made:
        await w.close()


async def test_an_instance_above_its_limit_long_enough_is_drained_and_restarted_while_the_other_serves(watched, caplog):
    caplog.set_level(logging.INFO)
    w = watched(max_rss="600MiB", max_rss_for=30.0)
    await w.ready()
    leaking = w.process(0)
    leaking.rss = 700 * MIB
    w.in_flight["0"] = 2
    began = w.clock.now()
    await w.until(lambda: w.drains(0), "instance 0 drained")
    waited = w.drains(0)[0] - began
    assert 30.0 <= waited <= 30.0 + 2 * 5.0  # seen above at the next look, drained max_rss_for later
    assert w.instances[1].state is State.READY  # the other serves meanwhile
    drain = next(t for t in w.instances[0].history if t.event is Event.DRAIN)
    assert drain.reason.startswith("memory watchdog: RSS 0.7 GiB above restart.max_rss 600MiB (0.6 GiB) for 3")
    w.in_flight["0"] = 0
    await w.until(lambda: w.instances[0].state is State.READY and w.process(0) is not leaking, "restarted")
    assert leaking.returncode is not None and w.instances[0].restarts == 1
    assert w.instances[0].last_exit.startswith("memory watchdog: RSS 0.7 GiB")
    assert "instance 0: memory 0.7 GiB above restart.max_rss 600MiB" in caplog.text
    await w.clock.advance(200)  # the new process is under the limit: nothing more happens
    assert len(w.drains(0)) == 1 and w.drains(1) == []


async def test_a_short_peak_passes(watched):
    w = watched(max_rss=0.5, max_rss_for=30.0)  # half of the planned 1000 MiB
    await w.ready()
    w.process(0).rss = 600 * MIB
    await w.clock.advance(20)
    w.process(0).rss = 400 * MIB  # back under before 30 s
    await w.clock.advance(100)
    assert w.drains(0) == [] and w.watchdog.status(w.instances[0])["above_for"] is None
    assert w.watchdog.status(w.instances[0])["limit"] == 500 * MIB


async def test_never_two_at_once_and_never_the_last_ready_one_while_another_is_down(watched, caplog):
    w = watched(count=2, max_rss="600MiB", max_rss_for=10.0)
    await w.ready()
    w.process(0).rss = w.process(1).rss = 700 * MIB
    w.in_flight["0"] = 1  # instance 0 drains for a while
    await w.until(lambda: w.drains(0), "instance 0 drained first (it went above first, or has the lower index)")
    assert w.drains(1) == []
    await w.clock.advance(8)
    assert w.drains(1) == [] and w.instances[0].state is State.DRAINING  # not two at once
    w.ops.load_time = 20.0  # instance 0's restart takes a while
    w.in_flight["0"] = 0
    await w.until(lambda: w.instances[0].state is State.STARTING, "instance 0 restarting")
    await w.clock.advance(15)
    assert w.instances[0].state is State.STARTING
    assert w.drains(1) == []  # the last ready instance while instance 0 is not ready
    assert "its restart waits: it is the last ready instance while instance 0 is" in caplog.text
    await w.until(lambda: w.drains(1), "instance 1 drained once instance 0 was ready again")
    assert w.drains(1)[0] >= next(t.at for t in reversed(w.instances[0].history) if t.new is State.READY)


async def test_the_only_instance_is_restarted_all_the_same(watched):
    w = watched(count=1, max_rss="600MiB", max_rss_for=10.0)
    await w.ready()
    w.process(0).rss = 700 * MIB
    leaking = w.process(0)
    await w.until(lambda: w.drains(0), "drained: nothing else could serve meanwhile anyway")
    await w.until(lambda: w.instances[0].state is State.READY and w.process(0) is not leaking, "back")


async def test_it_waits_while_a_rollout_runs_and_is_off_without_a_limit(watched):
    w = watched(max_rss="600MiB", max_rss_for=10.0)
    await w.ready()
    w.busy = "a reload is running (0 of 2 steps done)"
    w.process(0).rss = 700 * MIB
    await w.clock.advance(60)
    assert w.drains(0) == [] and w.watchdog.status(w.instances[0])["waits_for"] == w.busy
    w.busy = None
    await w.until(lambda: w.drains(0), "drained once the rollout is over")
    w.config = make_config(max_rss=None)
    w.process(1).rss = 10_000 * MIB
    await w.clock.advance(300)
    assert w.drains(1) == [] and w.watchdog.status(w.instances[1]) is None


def test_may_drain_rules_by_state():
    config = make_config(max_rss=None)
    ops = FakeOps()
    a, b, c = (Instance(i, ["x"], {}, port=9000 + i, config=config, log=None, ops=ops) for i in range(3))
    a.state = b.state = c.state = State.READY
    assert may_drain(a, [a, b, c]) is None
    b.state = State.DRAINING
    assert may_drain(a, [a, b, c]) == "instance 1 is draining"
    b.state, c.state = State.BACKOFF, State.STARTING
    assert may_drain(a, [a, b, c]) == "it is the last ready instance while instance 1 is backoff"
    c.state = State.READY
    assert may_drain(a, [a, b, c]) is None  # instance 2 still serves
    assert Intent.RECYCLE < Intent.RESTART
