"""The memory watchdog: restart an instance whose memory keeps growing, without going dark.

Every `health.interval` the resident memory of each ready instance's whole tree (API server,
EngineCore, Worker) is read (`Operations.tree_rss`). An instance above `restart.max_rss` (bytes,
or a multiple of its planned memory) for `restart.max_rss_for` seconds gets a RECYCLE intent:
it leaves the rotation, its requests in flight finish (up to `proxy.drain_timeout`), it is
restarted and warmed up, and the reason is logged and kept in its history.

Two rules keep the fleet serving (`may_drain`): never two instances draining at once, and never
the last ready instance while another is not ready (an instance that is the only one of its vsup
is restarted all the same: nothing else could serve meanwhile). The watchdog also waits while a
reload or rolling restart runs; an instance held back stays watched and goes when the rule allows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vsup.config.schema import VsupConfig
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.operations import Operations
from vsup.supervisor.states import Intent, State
from vsup.topology.plan_model import format_gib

logger = logging.getLogger("vsup.memwatch")


def may_drain(inst: Instance, fleet: Sequence[Instance]) -> str | None:
    """None when `inst` may be drained now, else why not (pure)."""
    draining = [other.name for other in fleet if other.state is State.DRAINING]
    if draining:
        return f"instance {draining[0]} is draining"
    ready = [other for other in fleet if other.state is State.READY]
    waiting = [other for other in fleet if other is not inst and other.state is not State.READY]
    if ready == [inst] and waiting:
        return f"it is the last ready instance while instance {waiting[0].name} is {waiting[0].state.value}"
    return None


@dataclass
class Reading:
    rss: int | None = None  # bytes at the last look
    limit: int | None = None
    above_since: float | None = None  # when it went above the limit (None: not above)
    held: str | None = None  # why it was not drained yet (logged once)


class MemoryWatchdog:
    def __init__(self, ops: Operations, config: Callable[[], VsupConfig], fleet: Callable[[], Sequence[Instance]],
                 planned_bytes: Callable[[Instance], int], busy: Callable[[], str | None]) -> None:
        self.ops = ops
        self.config = config
        self.fleet = fleet
        self.planned_bytes = planned_bytes  # the instance's planned memory (for max_rss as a multiple)
        self.busy = busy  # why every drain waits now (a rollout runs, vsup stops), or None
        self.readings: dict[Instance, Reading] = {}

    async def run(self) -> None:
        while True:
            await self.ops.sleep(self.config().health.interval)
            await self.check()

    def describe_limit(self, inst: Instance) -> str:
        restart = self.config().restart
        limit = restart.rss_limit(self.planned_bytes(inst))
        if isinstance(restart.max_rss, float):
            return f"restart.max_rss {restart.max_rss:g} x planned {format_gib(self.planned_bytes(inst))} = {format_gib(limit)}"
        return f"restart.max_rss {restart.max_rss} ({format_gib(limit)})"

    async def check(self) -> Instance | None:
        """One look at every ready instance; drains at most one. Returns the one it drained."""
        cfg = self.config()
        fleet = list(self.fleet())
        for gone in [inst for inst in self.readings if inst not in fleet]:
            del self.readings[gone]
        if cfg.restart.max_rss is None:
            self.readings.clear()
            return None
        now = self.ops.now()
        for inst in fleet:
            reading = self.readings.setdefault(inst, Reading())
            if inst.state is not State.READY or inst.child is None:
                reading.above_since, reading.held = None, None
                continue
            reading.limit = cfg.restart.rss_limit(self.planned_bytes(inst))
            reading.rss = await self.ops.tree_rss(inst.child)
            if reading.rss is None or reading.limit is None or reading.rss <= reading.limit:
                if reading.above_since is not None:
                    logger.info("instance %s: memory back under its limit (%s of %s)", inst.name,
                                format_gib(reading.rss), format_gib(reading.limit))
                reading.above_since, reading.held = None, None
            elif reading.above_since is None:
                reading.above_since = now
                logger.warning("instance %s: memory %s above %s; restarting it if it stays above for %gs",
                               inst.name, format_gib(reading.rss), self.describe_limit(inst), cfg.restart.max_rss_for)
        due = sorted((r.above_since, inst.index, inst) for inst, r in self.readings.items()
                     if r.above_since is not None and now - r.above_since >= cfg.restart.max_rss_for
                     and inst.state is State.READY)
        for since, _, inst in due:
            reading = self.readings[inst]
            held = self.busy() or may_drain(inst, fleet)
            if held is not None:
                if held != reading.held:
                    logger.warning("instance %s: memory above its limit for %.0fs, but its restart waits: %s",
                                   inst.name, now - since, held)
                reading.held = held
                continue
            why = (f"memory watchdog: RSS {format_gib(reading.rss)} above {self.describe_limit(inst)} "
                   f"for {now - since:.0f}s")
            logger.warning("instance %s: %s: draining and restarting it", inst.name, why)
            reading.above_since, reading.held = None, None
            inst.ask(Intent.RECYCLE, why)
            return inst
        return None

    def status(self, inst: Instance) -> dict | None:
        """The instance's last reading for `vsup status` (None: the watchdog is off)."""
        if self.config().restart.max_rss is None:
            return None
        reading = self.readings.get(inst)
        limit = self.config().restart.rss_limit(self.planned_bytes(inst))
        if reading is None:
            return {"rss": None, "limit": limit, "above_for": None}
        above = round(self.ops.now() - reading.above_since, 3) if reading.above_since is not None else None
        return {"rss": reading.rss, "limit": limit, "above_for": above, "waits_for": reading.held}
