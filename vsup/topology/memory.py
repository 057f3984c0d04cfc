"""Memory: which nodes an instance binds to, and the KV cache every instance gets (step 5 of
vsup.topology.planner's docstring). Per node, the instances' Σ (weights + KV cache + overhead) must
fit MemTotal minus the reserve; under a cgroup memory limit, Σ over all instances must fit the limit
minus the reserve too. Pure: Machine and settings in, sizes and summaries out.
"""

from __future__ import annotations

import math
from collections import defaultdict

from vsup.topology.errors import PlanError
from vsup.topology.model import Core, Machine
from vsup.topology.plan_model import GiB, LimitMemory, NodeMemory, PlanSettings, format_gib

# vLLM's own default for VLLM_CPU_KVCACHE_SPACE before it sized the cache from node memory: the
# figure used when a node's memory size is unknown (a dump without meminfo).
FALLBACK_KVCACHE_GIB = 4


class DoesNotFit(PlanError):
    """Memory overcommitted on a node; plan() adds the instance count that would fit."""

    def __init__(self, text: str, hints: list[str]):
        super().__init__(text)
        self.text, self.hints = text, hints


def memory_nodes(machine: Machine, cores: list[Core], warnings: list[str]) -> tuple[int, ...]:
    """The nodes an instance binds its memory to: its CPUs' nodes, or the nearest node whose memory
    this process may use when the cpuset forbids its own."""
    allowed = [n.id for n in machine.nodes if _mem_allowed(machine, n.id)]
    result: list[int] = []
    for node_id in sorted({c.node for c in cores if c.node is not None}):
        if node_id in allowed:
            result.append(node_id)
            continue
        if not allowed:
            warnings.append(f"no memory node is allowed by the cpuset; memory is not bound for node {node_id}'s CPUs")
            continue
        nearest = _nearest(machine, node_id, allowed)
        warnings.append(
            f"node {node_id}'s memory is outside this cpuset (cpuset.mems); its instance binds to node {nearest}, the nearest allowed"
        )
        result.append(nearest)
    return tuple(sorted(set(result)))


def _mem_allowed(machine: Machine, node_id: int) -> bool:
    node = machine.node(node_id)
    return node.allowed and (not machine.mems_allowed or node_id in machine.mems_allowed)


def _nearest(machine: Machine, node_id: int, allowed: list[int]) -> int:
    order = [n.id for n in machine.nodes]
    row = machine.node(node_id).distances
    if len(row) == len(order):
        return min(allowed, key=lambda a: (row[order.index(a)], a))
    return min(allowed, key=lambda a: (abs(a - node_id), a))



def plan_memory(
    machine: Machine, s: PlanSettings, instances_nodes: list[tuple[int, ...]], warnings: list[str]
) -> tuple[int, tuple[NodeMemory, ...], LimitMemory | None]:
    """(KV cache bytes per instance, per-node summary, cgroup limit summary). Raises PlanError when
    a node or the cgroup memory limit is overcommitted."""
    shares: dict[int, float] = defaultdict(float)
    members: dict[int, list[int]] = defaultdict(list)
    for index, nodes in enumerate(instances_nodes):
        for node_id in nodes:
            shares[node_id] += 1 / len(nodes)
            members[node_id].append(index)
    figure = f"MemTotal - {format_gib(s.memory_reserve_bytes)} reserve"
    budgets = {
        node_id: max(0, machine.node(node_id).memory_total_bytes - s.memory_reserve_bytes)
        for node_id in shares
        if machine.node(node_id).memory_total_bytes > 0
    }
    for node_id in sorted(set(shares) - set(budgets)):
        warnings.append(f"node {node_id}: memory size unknown (no meminfo), so memory was not checked there")
    # Every instance lives in this process's cgroup: one budget for all of them, once the reserve
    # (vsup, the proxy, the page cache charged to the cgroup) is taken off.
    count, limit = len(instances_nodes), machine.memory_limit_bytes
    limit_budget = max(0, limit - s.memory_reserve_bytes) if limit is not None else 0
    limit_figure = f"cgroup memory limit {format_gib(limit)} - {format_gib(s.memory_reserve_bytes)} reserve"
    weights, overhead = s.model_size_bytes, s.overhead_bytes
    if weights is None:
        warnings.append("model size unknown: memory checked without weights; give --model-size-gib (placement.model_size_gib) or a local model directory")

    if s.kvcache_gib is not None:
        kv = round(s.kvcache_gib * GiB)
    elif not budgets and limit is None:
        kv = FALLBACK_KVCACHE_GIB * GiB
        warnings.append(f"KV cache set to {FALLBACK_KVCACHE_GIB} GiB per instance because no node's memory size is known; give --kvcache-gib")
    else:
        holders = [(f"node {n}", budgets[n], shares[n], figure) for n in sorted(budgets)]
        if limit is not None:
            holders.append(("cgroup memory limit", limit_budget, count, limit_figure))
        kv = _largest_kv_share(s, holders)
        if weights is None:
            warnings.append(f"KV cache: {kv // GiB} GiB per instance, half of what is left once weights are assumed to take the other half")

    summary = []
    for node_id in sorted(shares):
        node = machine.node(node_id)
        demand = round(shares[node_id] * ((weights or 0) + kv + overhead))
        budget = budgets.get(node_id, 0)
        if node_id in budgets and demand > budget:
            raise _does_not_fit(f"node {node_id}", shares[node_id], s, kv, budget, figure)
        if node.memory_available_bytes and demand > node.memory_available_bytes:
            warnings.append(
                f"node {node_id}: the plan needs {format_gib(demand)} but only {format_gib(node.memory_available_bytes)} is available now "
                f"(MemFree + file cache + SReclaimable); other processes hold the rest"
            )
        summary.append(
            NodeMemory(
                node=node_id,
                figure=figure if node_id in budgets else "unknown",
                total_bytes=node.memory_total_bytes,
                available_bytes=node.memory_available_bytes,
                budget_bytes=budget,
                demand_bytes=demand,
                instances=tuple(members[node_id]),
            )
        )
    memory_limit = None
    if limit is not None:
        demand = count * ((weights or 0) + kv + overhead)
        if demand > limit_budget:
            raise _does_not_fit("cgroup memory limit", count, s, kv, limit_budget, limit_figure)
        memory_limit = LimitMemory(limit_bytes=limit, figure=limit_figure, budget_bytes=limit_budget, demand_bytes=demand)
    return kv, tuple(summary), memory_limit


def _largest_kv_share(s: PlanSettings, holders: list[tuple[str, int, float, str]]) -> int:
    """The largest whole-GiB KV cache every instance can have: the same for all, so that the proxy's
    even spread of requests meets even capacity. `holders`: (what holds the memory ("node 0",
    "cgroup memory limit"), its budget, the instances it holds, where the budget comes from); never
    empty (plan_memory only asks when some node's size or the cgroup limit is known)."""
    fits: list[int] = []
    for where, budget, share, figure in holders:
        per_instance = budget / share
        if s.model_size_bytes is None:
            room = (per_instance - s.overhead_bytes) / 2
        else:
            room = per_instance - s.model_size_bytes - s.overhead_bytes
        gib = math.floor(room / GiB) if room > 0 else 0
        if gib < 1:
            raise _no_room_for_kv(where, share, s, budget, room, figure)
        fits.append(gib)
    return min(fits) * GiB


def _no_room_for_kv(where: str, share: float, s: PlanSettings, budget: int, room: float, figure: str) -> DoesNotFit:
    weights = f"{format_gib(s.model_size_bytes)} weights + " if s.model_size_bytes else ""
    each = (s.model_size_bytes or 0) + s.overhead_bytes
    hints = []
    if room >= GiB / 4:
        hints.append(f"--kvcache-gib {math.floor(room / GiB * 10) / 10:g}")
    return DoesNotFit(
        f"{where}: {share:g} × ({weights}{format_gib(s.overhead_bytes)}) = {format_gib(share * each)} leaves "
        f"less than 1 GiB of KV cache per instance in {format_gib(budget)} available ({figure})",
        hints,
    )


def _does_not_fit(where: str, share: float, s: PlanSettings, kv: int, budget: int, figure: str) -> DoesNotFit:
    weights = f"{format_gib(s.model_size_bytes)} weights + " if s.model_size_bytes else ""
    each = (s.model_size_bytes or 0) + kv + s.overhead_bytes
    hints = []
    room = budget / share - (s.model_size_bytes or 0) - s.overhead_bytes
    if room >= GiB:
        hints.append(f"--kvcache-gib {math.floor(room / GiB)}")
    elif room >= GiB / 4:
        hints.append(f"--kvcache-gib {math.floor(room / GiB * 10) / 10:g}")
    return DoesNotFit(
        f"{where}: {share:g} × ({weights}{format_gib(kv)} KV + {format_gib(s.overhead_bytes)}) = {format_gib(share * each)} "
        f"> {format_gib(budget)} available ({figure})",
        hints,
    )

