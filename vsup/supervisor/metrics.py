"""The metrics collector's life inside `vsup run`: started with the proxy when `metrics.interval`
is above 0, given a new interval or timeout by a reload, started or stopped by a reload that turns
it on or off; and what it looks at each round (`targets`). The starting instances' phases are
read when /metrics is (`starting`: vsup_instance_start_*, whatever the interval). The collecting itself is
vsup/observe/collector.py; the proxy appends its cached text to /metrics and serves /status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from vsup.config.schema import VsupConfig
from vsup.observe.collector import Collector, Target
from vsup.observe.families import start_families
from vsup.observe.page import status_page
from vsup.proxy import ProxyServer
from vsup.proxy.address import Sessions
from vsup.supervisor import proctree
from vsup.supervisor.fleet import Fleet
from vsup.supervisor.processes import Child
from vsup.supervisor.states import State
from vsup.supervisor.status import model_of


def tree_pids(target: Target) -> list[int]:
    """The live processes of the target's tree (proctree's four marks); the collector's `pids`."""
    if target.leader is None:
        return []
    return sorted(proctree.find_tree(target.leader, token=target.token, known=target.known))


class Metrics:
    def __init__(self, fleet: Fleet, status: Callable[[], Mapping[str, Any]]) -> None:
        self.fleet = fleet
        self.status = status  # what /status shows
        self.collector: Collector | None = None  # None: metrics.interval 0
        self._task: asyncio.Task[None] | None = None
        self._ended: list[asyncio.Task[None]] = []  # cancelled by a reload; `close` gathers them
        self._proxy: ProxyServer | None = None
        self._session: Sessions | None = None

    def start(self, config: VsupConfig, proxy: ProxyServer, session: Sessions) -> None:
        """At `vsup run`: the /status page, the start phases in /metrics, and the collection when
        the interval is above 0."""
        self._proxy, self._session = proxy, session
        proxy.metrics.families.append(lambda: start_families(self.starting()))
        self.apply(config)

    def starting(self) -> list[dict[str, Any]]:
        """Each starting or warming instance's name, model and phase (read at scrape time)."""
        fleet = self.fleet
        return [{"name": inst.name, "model": model_of(fleet, inst), "phase": inst.watch.to_json(inst.ops.now())}
                for inst in [*fleet.instances, *fleet.outside()]
                if inst.watch is not None and inst.state in (State.STARTING, State.WARMING)]

    def apply(self, config: VsupConfig) -> None:
        """`metrics:` as in `config`: a new interval, timeout or series cap applies from the next round; 0 stops
        the collection (the proxy's /metrics keeps only its own), > 0 from 0 starts it."""
        interval, timeout = config.metrics.interval, config.metrics.timeout
        proxy = self._proxy
        if proxy is not None:
            proxy.add_page("/status", status_page(self.status, interval))  # its refresh follows the interval
        if interval > 0 and self.collector is not None:
            self.collector.interval, self.collector.timeout = interval, timeout
            self.collector.max_series = config.metrics.max_series_per_instance
        elif interval > 0 and self._session is not None:
            collector = Collector(self.targets, self._session, interval=interval, timeout=timeout, pids=tree_pids,
                                  max_series=config.metrics.max_series_per_instance)
            self.collector = collector
            self._task = asyncio.create_task(collector.run(), name="metrics")
            if proxy is not None:
                proxy.extra_metrics = collector.text
        elif interval == 0 and self.collector is not None:
            if self._task is not None:
                self._task.cancel()
                self._ended.append(self._task)
            self.collector = self._task = None
            if proxy is not None:
                proxy.extra_metrics = None

    def figures(self, name: str) -> dict[str, Any] | None:
        """The last collection of instance `name`; None when off or not yet done."""
        return self.collector.figures(name) if self.collector is not None else None

    async def close(self) -> None:
        tasks = [*self._ended, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def targets(self) -> list[Target]:
        """What the collector looks at this round: a serving instance's /metrics, and the process
        tree of every instance that has one (a model load's memory shows too); during a rollout
        also the instances outside the fleet (a replacement starting, a replaced one draining)."""
        fleet = self.fleet
        targets = []
        for inst in [*fleet.instances, *fleet.outside()]:
            child = inst.child if isinstance(inst.child, Child) else None
            serving = inst.state in (State.READY, State.UNHEALTHY)
            targets.append(Target(
                name=inst.name,
                address=inst.url if serving else None,
                nodes=tuple(fleet.plans[inst.name].nodes) if inst.name in fleet.plans else (),
                leader=child.pid if child else None,
                token=child.token if child else None,
                known=dict(child.seen) if child else {},
                model=model_of(fleet, inst),
            ))
        return targets
