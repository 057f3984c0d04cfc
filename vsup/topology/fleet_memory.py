"""Several models on one machine: each model planned on its cores, with each node's memory shared
among the models on it (pure; vsup.topology.fleet decides the cores).

A node's budget is its MemTotal minus placement.memory_reserve_gib, once for the node, not once per
model. The models with an explicit KV cache (placement.kvcache_gib) take what they ask; the models
with an auto-sized one share what the others leave on each node, in proportion to their cores there,
and within that share the single-model planner sizes the largest equal whole-GiB KV cache. The
cgroup memory limit is shared the same way, over every model.

Two passes: the first plans each model with a token KV cache to learn which nodes its instances bind
to (and so what its weights and overhead put on each); the second plans the auto-KV models again on a
machine whose nodes hold only their share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from vsup.topology.errors import PlanError, SettingError
from vsup.topology.model import Machine
from vsup.topology.plan_model import FleetModel, LimitMemory, NodeMemory, Plan, format_gib
from vsup.topology.planner import plan

# The first pass's KV cache: small enough that it never decides whether a model fits.
_TOKEN_KV_GIB = 1 / 1024


class ModelPlanError(PlanError):
    """The planner refuses one model of a fleet; `key`: the key of its entry to name ("share",
    "placement.nodes"; None: the entry itself), so vsup.config.planning can say where it is written."""

    def __init__(self, model: str, key: str | None, text: str) -> None:
        super().__init__(f"model {model}: {text}")
        self.model, self.key, self.text = model, key, text


class ModelSettingError(PlanError):
    """The single-model planner's error about one model's setting (vsup.config.planning names
    that model's key)."""

    def __init__(self, model: str, error: SettingError) -> None:
        super().__init__(f"model {model}: {error}")
        self.model, self.error = model, error


def plan_models(machine: Machine, parts: Sequence[tuple[FleetModel, Machine]]) -> list[Plan]:
    """One plan per (model, the machine as its cores see it), the memory shared as the module says."""
    first = [_plan_one(model, _quiet(part), token=model.settings.kvcache_gib is None) for model, part in parts]
    reserve = parts[0][0].settings.memory_reserve_bytes
    auto = [i for i, (model, _) in enumerate(parts) if model.settings.kvcache_gib is None]
    if not auto:
        return first
    # what each node (and the cgroup) has left for the auto-sized KV caches
    left: dict[int, float] = {}
    for node in machine.nodes:
        if node.memory_total_bytes > 0:
            left[node.id] = max(0, node.memory_total_bytes - reserve)
    base: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))  # model -> node -> weights+overhead
    cores: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for i, one in enumerate(first):
        for inst in one.instances:
            for n in inst.nodes:
                if i in auto:
                    base[i][n] += ((inst.weights_bytes or 0) + inst.overhead_bytes) / len(inst.nodes)
                    cores[i][n] += len(inst.cores) / len(inst.nodes)
                if n in left:
                    left[n] -= (inst.memory_bytes if i not in auto else (inst.weights_bytes or 0) + inst.overhead_bytes) / len(inst.nodes)
    for n in sorted(left):
        if left[n] < 0:
            raise _overcommitted(machine, n, parts, first, reserve)
    limit = machine.memory_limit_bytes
    limit_left = 0.0
    if limit is not None:
        limit_left = max(0, limit - reserve) - sum(
            inst.memory_bytes if i not in auto else (inst.weights_bytes or 0) + inst.overhead_bytes
            for i, one in enumerate(first) for inst in one.instances)
    result = list(first)
    for i in auto:
        model, part = parts[i]
        nodes = []
        for node in part.nodes:
            if node.id in left and node.id in cores[i]:
                holders = sum(cores[j][node.id] for j in auto)
                share = base[i][node.id] + max(0.0, left[node.id]) * cores[i][node.id] / holders
                node = replace(node, memory_total_bytes=round(share) + reserve)
            nodes.append(replace(node, memory_available_bytes=0))
        own_limit = None
        if limit is not None:
            mine = sum(cores[i].values())
            total = sum(sum(cores[j].values()) for j in auto) or 1
            own_base = sum(base[i].values())
            own_limit = round(own_base + max(0.0, limit_left) * mine / total) + reserve
        try:
            result[i] = _plan_one(model, replace(part, nodes=tuple(nodes), memory_limit_bytes=own_limit), token=False)
        except ModelPlanError as exc:
            where = {n for inst in first[i].instances for n in inst.nodes}
            others = [parts[j][0].name for j, one in enumerate(first)
                      if j != i and any(set(inst.nodes) & where for inst in one.instances)]
            if not others:
                raise
            raise ModelPlanError(model.name, None, f"{exc.text} (its share of what {', '.join(others)} leave"
                                 f"{' there' if len(where) == 1 else ''})") from None
    return result


def _quiet(machine: Machine) -> Machine:
    """The machine without the memory available now: the fleet warns about the sum over all models."""
    return replace(machine, nodes=tuple(replace(n, memory_available_bytes=0) for n in machine.nodes))


def _plan_one(model: FleetModel, machine: Machine, *, token: bool) -> Plan:
    settings = replace(model.settings, reserve_cores=0, nodes=None)
    try:
        if not token:
            return plan(machine, settings)
        try:
            return plan(machine, replace(settings, kvcache_gib=_TOKEN_KV_GIB))
        except PlanError:
            plan(machine, settings)  # the planner's own words about the real KV cache
            raise
    except SettingError as exc:
        raise ModelSettingError(model.name, exc) from None
    except PlanError as exc:
        raise ModelPlanError(model.name, None, str(exc)) from None


def _overcommitted(machine: Machine, node: int, parts: Sequence[tuple[FleetModel, Machine]], plans: Sequence[Plan],
                   reserve: int) -> ModelPlanError:
    terms = []
    for (model, _), one in zip(parts, plans, strict=True):
        on = [inst for inst in one.instances if node in inst.nodes]
        if on:
            each = on[0].memory_bytes if model.settings.kvcache_gib is not None else (on[0].weights_bytes or 0) + on[0].overhead_bytes
            terms.append((model.name, f"{model.name} {len(on)} × {format_gib(each)}"))
    budget = max(0, machine.node(node).memory_total_bytes - reserve)
    culprit = terms[-1][0] if terms else parts[-1][0].name
    return ModelPlanError(culprit, None, f"node {node}: {' + '.join(t for _, t in terms)} (weights, overhead and explicit KV "
                          f"caches) > {format_gib(budget)} available (MemTotal - {format_gib(reserve)} reserve); give the "
                          "models fewer instances, smaller KV caches or other nodes (placement.nodes)")


def summed_memory(machine: Machine, fleet: Plan, reserve: int, warnings: list[str]) -> tuple[tuple[NodeMemory, ...], LimitMemory | None]:
    """Every node's budget against what all the fleet's instances put on it, and the cgroup limit's."""
    demand: dict[int, float] = defaultdict(float)
    members: dict[int, list[int]] = defaultdict(list)
    for inst in fleet.instances:
        for n in inst.nodes:
            demand[n] += inst.memory_bytes / len(inst.nodes)
            members[n].append(inst.index)
    figure = f"MemTotal - {format_gib(reserve)} reserve"
    summary = []
    for n in sorted(demand):
        node = machine.node(n)
        known = node.memory_total_bytes > 0
        budget = max(0, node.memory_total_bytes - reserve) if known else 0
        if known and demand[n] > budget + len(members[n]):
            raise ModelPlanError(fleet.instances[members[n][-1]].model if members[n] else "", None,
                                 f"node {n}: the models on it need {format_gib(demand[n])} > {format_gib(budget)} available ({figure})")
        if node.memory_available_bytes and demand[n] > node.memory_available_bytes:
            warnings.append(f"node {n}: the plan needs {format_gib(demand[n])} but only {format_gib(node.memory_available_bytes)} "
                            "is available now (MemFree + file cache + SReclaimable); other processes hold the rest")
        summary.append(NodeMemory(node=n, figure=figure if known else "unknown", total_bytes=node.memory_total_bytes,
                                  available_bytes=node.memory_available_bytes, budget_bytes=budget,
                                  demand_bytes=round(demand[n]), instances=tuple(members[n])))
    limit = machine.memory_limit_bytes
    if limit is None:
        return tuple(summary), None
    limit_figure = f"cgroup memory limit {format_gib(limit)} - {format_gib(reserve)} reserve"
    total = sum(inst.memory_bytes for inst in fleet.instances)
    budget = max(0, limit - reserve)
    if total > budget:
        raise ModelPlanError(fleet.instances[-1].model, None,
                             f"cgroup memory limit: the models need {format_gib(total)} > {format_gib(budget)} available ({limit_figure})")
    return tuple(summary), LimitMemory(limit_bytes=limit, figure=limit_figure, budget_bytes=budget, demand_bytes=total)
