"""Hybrid CPUs in the planner: performance and efficiency cores are planned as two separate pools,
so that no instance's OpenMP team ever holds both kinds (OpenMP threads advance in lock step: a
team with one slow core runs every step at that core's pace). Pure functions; planner.py calls them.

What the efficiency cores do (PlanSettings.efficiency_cores, docs/placement.md):
- "housekeeping" (default): the reserved cores come from them first; the rest are shared out to
  the performance-core instances on their node, in each instance's CPU mask but outside its OpenMP
  team, where vLLM's API server and busy-polling EngineCore run instead of on a team core.
- "instances": after the reserve, the efficiency cores of each node form one instance of their own
  (a slower one; the proxy's least_outstanding policy sends it less).
- "unused": after the reserve they stay idle, listed as unused.
Whatever the choice, instances the performance cores cannot hold go to the efficiency cores.
"""

from __future__ import annotations

from collections import defaultdict

from vsup.topology.errors import PlanError
from vsup.topology.model import EFFICIENCY, PERFORMANCE, Core

MODES = ("housekeeping", "instances", "unused")


def split_kinds(pool: list[Core]) -> tuple[list[Core], list[Core]]:
    """(performance cores, efficiency cores) when the pool holds both kinds, else (pool, [])."""
    kinds = {c.kind for c in pool}
    if not (EFFICIENCY in kinds and PERFORMANCE in kinds):
        return pool, []
    return [c for c in pool if c.kind != EFFICIENCY], [c for c in pool if c.kind == EFFICIENCY]


def kind_counts(fast: list[Core], slow: list[Core], count: int, per_instance: int, mode: str, warnings: list[str]) -> tuple[int, int]:
    """(instances on performance cores, instances on efficiency cores) for `count` requested ones.
    The caller has checked that count × per_instance cores exist in all."""
    if not slow:
        return count, 0
    fast_fit, slow_fit = len(fast) // per_instance, len(slow) // per_instance
    on_fast = min(count, fast_fit)
    overflow = count - on_fast
    if overflow > slow_fit:
        raise PlanError(
            f"{count} instance(s) of {per_instance} core(s) do not fit when no OpenMP team mixes core kinds: "
            f"the {len(fast)} performance cores hold {fast_fit} and the {len(slow)} efficiency cores {slow_fit}; "
            f"try --instances {fast_fit + slow_fit}"
        )
    if overflow:
        first = on_fast
        which = f"instance {first}" if overflow == 1 else f"instances {first}-{count - 1}"
        warnings.append(
            f"hybrid CPU: the {len(fast)} performance cores hold {on_fast} of {count} instance(s), so {which} "
            f"run on efficiency cores (each OpenMP team on one kind of core) and answer more slowly"
        )
        return on_fast, overflow
    if mode == "instances":
        per_node: dict[int | None, int] = defaultdict(int)
        for core in slow:
            per_node[core.node] += 1
        return on_fast, sum(1 for n in per_node.values() if n >= per_instance)
    return on_fast, 0


def share_out(leftover: list[Core], chunks: list[list[Core]]) -> tuple[list[list[Core]], list[Core]]:
    """Efficiency cores no instance or reserve took, shared out per node among the instances (given
    as their performance cores) that have cores on that node: consecutive runs, near-equal, the
    first instances getting one more. Returns (extra cores per instance, cores nobody could take)."""
    extras: list[list[Core]] = [[] for _ in chunks]
    by_node: dict[int | None, list[Core]] = defaultdict(list)
    for core in leftover:
        by_node[core.node].append(core)
    unserved: list[Core] = []
    for node, cores in by_node.items():
        members = [i for i, chunk in enumerate(chunks) if any(c.node == node for c in chunk)]
        if not members:
            unserved.extend(cores)
            continue
        q, rem = divmod(len(cores), len(members))
        start = 0
        for position, index in enumerate(members):
            size = q + (1 if position < rem else 0)
            extras[index].extend(cores[start : start + size])
            start += size
    return extras, unserved
