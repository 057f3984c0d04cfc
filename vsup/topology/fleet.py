"""Several models on one machine: the partition of its cores and memory among them (pure).

PHASE-0 STUB (the planner engineer replaces `plan_fleet`'s partition): each model gets a
contiguous run of the usable physical cores in proportion to its instance count (auto: 1), is
planned by the single-model planner on that run alone, and its instances are numbered after the
previous model's. `renumber` is final.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from vsup.topology.errors import PlanError, SettingError
from vsup.topology.model import Machine
from vsup.topology.plan_model import FleetModel, InstancePlan, ModelShare, NodeMemory, Plan
from vsup.topology.planner import plan


class ModelSettingError(PlanError):
    """The single-model planner's error about one model's setting (vsup.config.planning names
    that model's key)."""

    def __init__(self, model: str, error: SettingError) -> None:
        super().__init__(f"model {model}: {error}")
        self.model, self.error = model, error


def restricted(machine: Machine, cpus: frozenset[int]) -> Machine:
    """`machine` as a process allowed only `cpus` would see it (as under a cpuset)."""
    cores = tuple(c for c in machine.cores if set(c.cpus) & cpus)
    cores = tuple(replace(c, cpus=tuple(x for x in c.cpus if x in cpus)) for c in cores)
    nodes = tuple(replace(n, usable_cpus=tuple(x for x in n.usable_cpus if x in cpus)) for n in machine.nodes)
    return replace(machine, cores=cores, nodes=nodes, cpus_usable=tuple(x for x in machine.cpus_usable if x in cpus))


def plan_fleet(machine: Machine, models: Sequence[FleetModel]) -> Plan:
    weights = [m.settings.instances if isinstance(m.settings.instances, int) else 1 for m in models]
    cores = list(machine.cores)
    total, start = sum(weights), 0
    plans: list[tuple[FleetModel, Plan]] = []
    for i, (model, weight) in enumerate(zip(models, weights, strict=True)):
        count = len(cores) - start if i == len(models) - 1 else max(1, len(cores) * weight // total)
        cpus = frozenset(x for core in cores[start:start + count] for x in core.cpus)
        start += count
        try:
            plans.append((model, plan(restricted(machine, cpus), replace(model.settings, reserve_cores=0))))
        except SettingError as exc:
            raise ModelSettingError(model.name, exc) from None
    return merge(plans)


def merge(plans: Sequence[tuple[FleetModel, Plan]]) -> Plan:
    """Per-model plans as one: instances numbered in order, their ports from the first model's
    base port, every node's memory summed."""
    instances: list[InstancePlan] = []
    shares: list[ModelShare] = []
    memory: dict[int, NodeMemory] = {}
    base_port = plans[0][0].settings.base_port
    for model, one in plans:
        first = len(instances)
        for replica, inst in enumerate(one.instances):
            index = first + replica
            instances.append(replace(inst, index=index, port=base_port + index, model=model.name, replica=replica))
        for node in one.memory:
            moved = tuple(first + i for i in node.instances)
            old = memory.get(node.node)
            memory[node.node] = node if old is None and not moved else replace(
                node, demand_bytes=(old.demand_bytes if old else 0) + node.demand_bytes,
                instances=(old.instances if old else ()) + moved)
        cpus = tuple(sorted(x for inst in one.instances for x in inst.cpus))
        nodes = tuple(sorted({n for inst in one.instances for n in inst.cpu_nodes}))
        shares.append(ModelShare(model.name, model.settings, cpus, nodes, tuple(range(first, len(instances))), "stub"))
    head = plans[0][1]
    return replace(head, instances=tuple(instances), memory=tuple(memory[n] for n in sorted(memory)),
                   warnings=tuple(w for _, p in plans for w in p.warnings), models=tuple(shares))


def renumber(fleet_plan: Plan, running: Mapping[tuple[str, int], int]) -> Plan:
    """`fleet_plan` with the indexes a running fleet already uses (a reload): an instance whose
    (model, replica) runs keeps its index (so its socket, port, log and name); the others take
    the lowest indexes nobody keeps. Ports follow the indexes."""
    kept = {key: index for key, index in running.items()
            if any((inst.model, inst.replica) == key for inst in fleet_plan.instances)}
    taken = set(kept.values())
    free = (i for i in range(len(fleet_plan.instances) + len(taken) + 1) if i not in taken)
    base = fleet_plan.settings.base_port
    mapping: dict[int, int] = {}
    for inst in fleet_plan.instances:
        key = (inst.model, inst.replica)
        mapping[inst.index] = kept[key] if key in kept else next(free)
    instances = tuple(sorted((replace(inst, index=mapping[inst.index], port=base + mapping[inst.index])
                              for inst in fleet_plan.instances), key=lambda inst: inst.index))
    memory = tuple(replace(node, instances=tuple(sorted(mapping[i] for i in node.instances))) for node in fleet_plan.memory)
    models = tuple(replace(m, instances=tuple(sorted(mapping[i] for i in m.instances))) for m in fleet_plan.models)
    return replace(fleet_plan, instances=instances, memory=memory, models=models)
