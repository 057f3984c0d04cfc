"""The running instances and what happens to them as a whole: create one (its log, its backend in
the proxy, its driver task), adopt a new plan, swap it into an index of the fleet, forget it.

`instances` is the fleet by index (what `vsup status`, `vsup restart N` and the plan's indexes
mean): a `Members`, which may have holes once a reload removed a model (the other models keep
their indexes, so their sockets, ports and logs). Each instance runs under its model's view of
the configuration (vsup.config.fleet; launch.model_config), and its backend carries the model's
name for the proxy's routing. During a rollout a new instance may run beside it, and a replaced one drains outside it.
Every instance with a driver task, inside the fleet or not, is in `drivers`, and the shutdown
stops them all. `Fleet` is what rollout.py's steps act on (its `Fleet` protocol); what it needs of
the running vsup (configuration, operations, the proxy's in-flight counts, and where to report
transitions, a crashed driver or a change of members) is the `Owner`, the Supervisor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator
from typing import Protocol

from vsup.config.schema import VsupConfig, spare_base_port
from vsup.ownfiles import group_id
from vsup.proxy.backends import Backend, BackendPool
from vsup.supervisor.control import describe_indexes
from vsup.supervisor.launch import build_command, instance_url, kv_events_endpoint, model_config
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.operations import Operations
from vsup.supervisor.rundir import default_log_dir
from vsup.supervisor.states import State, Transition
from vsup.topology.plan_model import InstancePlan, Plan

logger = logging.getLogger("vsup.supervisor")


class Members:
    """The fleet by instance index, in index order; an index may be missing (a removed model's)."""

    def __init__(self) -> None:
        self._by_index: dict[int, Instance] = {}

    def __getitem__(self, index: int) -> Instance:
        return self._by_index[index]

    def __setitem__(self, index: int, inst: Instance) -> None:
        self._by_index[index] = inst

    def __delitem__(self, index: int) -> None:
        del self._by_index[index]

    def __len__(self) -> int:
        return len(self._by_index)

    def __iter__(self) -> Iterator[Instance]:
        return iter([self._by_index[i] for i in sorted(self._by_index)])

    def __contains__(self, item: object) -> bool:
        """An index (int) of the fleet, or an instance in it."""
        if isinstance(item, int):
            return item in self._by_index
        return any(inst is item for inst in self._by_index.values())

    def indexes(self) -> list[int]:
        return sorted(self._by_index)

    def get(self, index: int) -> Instance | None:
        return self._by_index.get(index)

    def describe(self) -> str:
        return describe_indexes(self.indexes())


class Owner(Protocol):
    """What the fleet needs of the running vsup (the Supervisor)."""

    config: VsupConfig
    plan: Plan
    environ: dict[str, str]

    @property
    def ops(self) -> Operations: ...

    def in_flight(self, name: str) -> int:
        """Requests the proxy has in flight to the backend `name`."""

    def on_transition(self, inst: Instance, transition: Transition) -> None: ...

    def on_driver_crash(self, task: asyncio.Task[None]) -> None:
        """An instance's driver task raised: a bug; vsup stops."""

    def on_members_changed(self) -> None:
        """An instance was created or left (the state file lists their ports)."""

    def on_fleet_changed(self) -> None:
        """The fleet's order changed (status, sd_notify)."""


class Fleet:
    def __init__(self, owner: Owner, pool: BackendPool) -> None:
        self.owner = owner
        self.pool = pool
        self.instances = Members()  # the fleet, by index
        self.plans: dict[str, InstancePlan] = {}  # instance name -> its plan
        self.placement: dict[str, list[str] | None] = {}  # name -> drift lines ([] ok, None not checked)
        self.drivers: dict[Instance, asyncio.Task[None]] = {}  # every instance with a driver task
        self.logs: dict[Instance, InstanceLog] = {}

    @property
    def plan(self) -> Plan:
        """The plan in force (the new one, during a reload)."""
        return self.owner.plan

    def outside(self) -> list[Instance]:
        """Instances with a driver that are not in the fleet: a rollout's new one before it joins,
        a replaced one while it drains."""
        return [inst for inst in self.drivers if inst not in self.instances]

    def build(self) -> None:
        """The plan's instances on their ports, not started."""
        for plan in self.owner.plan.instances:
            self.instances[plan.index] = self._new_instance(plan, plan.port)

    def _new_instance(self, plan: InstancePlan, port: int) -> Instance:
        """An instance of `plan` listening on `port`, its backend known to the proxy (not in the
        rotation). On its spare port (a replacement beside the old one) it is named `<i>b`, with
        its own log i<i>b.log, so the two never share a name, a backend or a log file."""
        owner = self.owner
        name = f"{plan.index}b" if port == self.spare_port(plan.index) else str(plan.index)
        argv, env = self.launch(plan, port)
        url = self.address(plan, port)
        config = model_config(owner.config, plan)
        log_config = owner.config.log
        directory = log_config.dir if log_config.dir is not None else default_log_dir(owner.environ)
        log = InstanceLog(
            f"i{name}", directory, max_bytes=log_config.max_bytes, backups=log_config.backups,
            echo=log_config.echo, logger=logging.getLogger("vsup.instance"), group=group_id(log_config.group, "log.group"),
        )
        instance = Instance(plan.index, argv, env, port=port, url=url, config=config, log=log, ops=owner.ops,
                            on_transition=owner.on_transition, name=name, in_flight=lambda: owner.in_flight(name),
                            model=plan.model, weights_bytes=plan.weights_bytes)
        self.logs[instance] = log
        self.plans[name] = plan
        self.placement[name] = None
        self.pool.add(Backend(name, instance.url, model=plan.model, kv_events=kv_events_endpoint(
            dataclasses.replace(plan, port=port), config, owner.environ)))
        return instance

    def launch_driver(self, inst: Instance) -> None:
        """Start the instance's driver task; one that crashes is reported to the owner."""
        task = asyncio.create_task(inst.run(), name=f"instance-{inst.name}")
        self.drivers[inst] = task

        def ended(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                self.owner.on_driver_crash(task)

        task.add_done_callback(ended)

    # ---- rollout.Fleet -----------------------------------------------------------------------------

    def plan_of(self, inst: Instance) -> InstancePlan:
        return self.plans[inst.name]

    def live_plans(self) -> list[InstancePlan]:
        return [self.plans[inst.name] for inst in self.drivers if inst.state is not State.STOPPED or inst.intent]

    def launch(self, plan: InstancePlan, port: int) -> tuple[list[str], dict[str, str]]:
        return build_command(dataclasses.replace(plan, port=port), model_config(self.owner.config, plan), self.owner.environ)

    def address(self, plan: InstancePlan, port: int) -> str:
        return instance_url(dataclasses.replace(plan, port=port), model_config(self.owner.config, plan), self.owner.environ)

    def spare_port(self, index: int) -> int:
        return spare_base_port(self.owner.config) + index

    def create(self, plan: InstancePlan, port: int) -> Instance:
        inst = self._new_instance(plan, port)
        self.launch_driver(inst)
        self.owner.on_members_changed()
        return inst

    def adopt(self, inst: Instance, plan: InstancePlan) -> None:
        self.plans[inst.name] = plan
        inst.weights_bytes = plan.weights_bytes

    def swap(self, index: int, inst: Instance | None) -> None:
        if inst is None:
            del self.instances[index]  # a hole: the other instances keep their indexes
        else:
            self.instances[index] = inst
        self.owner.on_fleet_changed()

    def forget(self, inst: Instance) -> None:
        task = self.drivers.pop(inst, None)
        if task is not None:
            task.cancel()
        self.pool.remove(inst.name)
        if inst not in self.instances:  # the same name may be back in the fleet (an in-place reuse)
            self.plans.pop(inst.name, None)
            self.placement.pop(inst.name, None)
        log = self.logs.pop(inst, None)
        if log is not None:
            try:
                log.close()
            except Exception:
                logger.exception("closing the log %s failed", log.name)
