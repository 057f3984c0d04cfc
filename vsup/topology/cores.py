"""Cutting one pool of cores (one kind of core, in node/L3 order) into runs, one per instance.

Steps 2-4 of vsup.topology.planner's docstring: bins (one per NUMA node, or groups of close nodes
when instances must span nodes), the reserved cores taken where they hurt least, and inside each bin
consecutive runs aligned to L3 domains. Pure: Core lists in, Core lists out.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from vsup.topology.errors import PlanError
from vsup.topology.model import Core, Machine
from vsup.topology.plan_model import PlanSettings, format_ids

# How far the L3-alignment search shifts the instances inside a bin (bounds the planning time).
_MAX_OFFSET = 64


@dataclass
class _Bin:
    """A run of cores that instances are cut from: one NUMA node, or several when unavoidable."""

    cores: list[Core]
    instances: int = 0
    reserve: int = 0
    sizes: list[int] = field(default_factory=list)
    spare_reason: str = ""

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(sorted({c.node for c in self.cores if c.node is not None}))


def min_cores(s: PlanSettings) -> int:
    """Physical cores one instance needs at least (exactly, with --cores-per-instance)."""
    return (s.cores_per_instance or 1) + (1 if s.housekeeping_core else 0)


def cut(cores: list[Core], count: int, reserve: int, s: PlanSettings, machine: Machine, warnings: list[str]
        ) -> tuple[list[Core], list[list[Core]], list[tuple[Core, str]]]:
    """(reserved, one run of cores per instance, (core, why unused) for the rest) for one pool;
    without instances the reason is "" (the caller decides what the cores do)."""
    if not count:
        return cores[:reserve], [], [(core, "") for core in cores[reserve:]]
    reserved: list[Core] = []
    chunks: list[list[Core]] = []
    spare: list[tuple[Core, str]] = []
    for b in _make_bins(cores, count, s, reserve, machine, warnings):
        bin_reserved, bin_chunks, bin_spare = _lay_out(b.cores, b.sizes, b.reserve)
        reserved.extend(bin_reserved)
        chunks.extend(bin_chunks)
        spare.extend((core, b.spare_reason) for core in bin_spare)
    return reserved, chunks, spare


def _make_bins(pool: list[Core], count: int, s: PlanSettings, reserve: int, machine: Machine, warnings: list[str]) -> list[_Bin]:
    by_node: dict[int | None, list[Core]] = defaultdict(list)
    for core in pool:
        by_node[core.node].append(core)
    nodes = [_Bin(cores) for cores in by_node.values()]  # pool is sorted, so bins are in node order
    # Where instances must span nodes, they join nodes that are close (the distance matrix).
    order = _closest_first(machine)
    chain = sorted(nodes, key=lambda b: order.index(b.cores[0].node) if b.cores[0].node in order else len(order))

    if s.cores_per_instance is None:
        min_size = min_cores(s)
        grouped = _group_nodes(chain, count, min_size, _spread(machine, chain)) if count < len(nodes) else None
        if count >= len(nodes) and sum(len(b.cores) // min_size for b in nodes) >= count:
            bins = _split_proportionally(nodes, count, min_size)
        elif grouped is None:
            # --housekeeping-core on nodes too small for two cores each: cut across nodes.
            bins = [_Bin([c for b in chain for c in b.cores], instances=count)]
            warnings.append(
                f"{count} instances of at least {min_size} cores do not fit inside NUMA nodes of at most "
                f"{max(len(b.cores) for b in nodes)} usable cores, so some span nodes"
            )
        else:
            bins = grouped
            warnings.append(
                f"{count} instance(s) for {len(nodes)} NUMA nodes: each instance spans several nodes and "
                f"pays for cross-node memory traffic; --instances {len(nodes)} (one per node) or "
                f"--cores-per-instance K keeps every instance inside one node"
            )
        _reserve_where_least_harmful(bins, reserve, min_size)
        for b in bins:
            q, rem = divmod(len(b.cores) - b.reserve, b.instances) if b.instances else (0, 0)
            b.sizes = [q + 1] * rem + [q] * (b.instances - rem)
            b.spare_reason = f"node {format_ids(b.node_ids)}: too small for another instance"
        return bins

    size = min_cores(s)
    if sum(len(b.cores) // size for b in nodes) >= count:
        _spread_fixed(nodes, count, size)
        bins = nodes
    else:
        # Some instance has to span nodes: cut consecutive runs over all cores, closest node after node.
        bins = [_Bin([c for b in chain for c in b.cores], instances=count)]
        biggest = max(len(b.cores) for b in nodes)
        warnings.append(
            f"--cores-per-instance {s.cores_per_instance}: {count} instance(s) of {size} cores do not fit "
            f"inside NUMA nodes of at most {biggest} usable cores, so some span nodes"
        )
    for b in bins:
        b.sizes = [size] * b.instances
        b.spare_reason = f"spare: {count} instance(s) × {s.cores_per_instance} core(s) leave it free"
    # Spare cores cost nothing: reserve from the bin with the most of them.
    for _ in range(reserve):
        b = max(bins, key=lambda b: len(b.cores) - b.instances * size - b.reserve)
        b.reserve += 1
    return bins


def _split_proportionally(bins: list[_Bin], count: int, min_size: int) -> list[_Bin]:
    """Every node that can hold one instance gets one; the rest go, one at a time, to the node where
    the next instance would be largest (D'Hondt), so node sizes 43-43-42 split into 22+21, 22+21,
    21+21 for six instances."""
    for b in bins:
        b.instances = 1 if len(b.cores) >= min_size else 0
    placed = sum(b.instances for b in bins)  # <= count: fewer instances than nodes go to _group_nodes
    for _ in range(count - placed):
        candidates = [b for b in bins if (b.instances + 1) * min_size <= len(b.cores)]
        best = max(candidates, key=lambda b: len(b.cores) / (b.instances + 1))  # first max: lowest node
        best.instances += 1
    return bins


def _group_nodes(bins: list[_Bin], count: int, min_size: int, spread: Callable[[int, int], int]) -> list[_Bin] | None:
    """Fewer instances than nodes, all cores wanted: join runs of nodes (in the closest-first order
    of `bins`) into `count` groups of at least `min_size` cores whose largest group is as small as
    possible (linear partition); of those groupings, the one whose groups' node distances add up
    least (spread(j, i): the largest distance inside bins[j:i]). None when no grouping exists."""
    sizes = [len(b.cores) for b in bins]
    m = len(sizes)
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    inf = float("inf")

    def partition(cost, limit) -> tuple[float, list[list[int]]]:
        # best[g][i]: least cost when the first i nodes form g groups of min_size..limit cores
        best = [[inf] * (m + 1) for _ in range(count + 1)]
        cut = [[0] * (m + 1) for _ in range(count + 1)]
        best[0][0] = 0
        for g in range(1, count + 1):
            for i in range(g, m - (count - g) + 1):
                for j in range(g - 1, i):
                    size = prefix[i] - prefix[j]
                    if size < min_size or size > limit:
                        continue  # an instance needs min_size cores (its housekeeping core included)
                    value = cost(best[g - 1][j], j, i)
                    if value < best[g][i]:
                        best[g][i], cut[g][i] = value, j
        return best[count][m], cut

    largest, _ = partition(lambda before, j, i: max(before, prefix[i] - prefix[j]), inf)
    if largest == inf:
        return None
    _, cut = partition(lambda before, j, i: before + spread(j, i), largest)
    groups: list[_Bin] = []
    i = m
    for g in range(count, 0, -1):
        j = cut[g][i]
        groups.append(_Bin([c for b in bins[j:i] for c in b.cores], instances=1))
        i = j
    return groups[::-1]


def _closest_first(machine: Machine) -> list[int]:
    """Node ids (with CPUs) ordered so that neighbours are close: from the lowest id, each next node
    is the nearest one not taken yet (ties: the lowest id). Two nodes of one socket thus stay
    neighbours even when the firmware numbers the sockets' nodes alternately. Id order when the
    distance matrix is missing."""
    ids = [n.id for n in machine.nodes if n.cpus]
    if not ids or any(len(machine.node(i).distances) != len(machine.nodes) for i in ids):
        return ids
    column = {n.id: position for position, n in enumerate(machine.nodes)}
    chain, rest = [ids[0]], ids[1:]
    while rest:
        row = machine.node(chain[-1]).distances
        nearest = min(rest, key=lambda n: (row[column[n]], n))
        chain.append(nearest)
        rest.remove(nearest)
    return chain


def _spread(machine: Machine, bins: list[_Bin]) -> Callable[[int, int], int]:
    """spread(j, i): the largest node distance inside bins[j:i] (0 without a distance matrix)."""
    column = {n.id: position for position, n in enumerate(machine.nodes)}
    node_of = [b.cores[0].node for b in bins]

    def distance(a: int | None, b: int | None) -> int:
        if a is None or b is None or a == b:
            return 0
        row = machine.node(a).distances
        return row[column[b]] if len(row) == len(column) else 0

    @functools.lru_cache(maxsize=None)
    def spread(j: int, i: int) -> int:
        if i - j <= 1:
            return 0
        newest = node_of[i - 1]  # the group bins[j:i-1] plus one more node
        return max(spread(j, i - 1), max(distance(node_of[k], newest) for k in range(j, i - 1)))

    return spread


def _spread_fixed(bins: list[_Bin], count: int, size: int) -> None:
    """--cores-per-instance: one instance at a time to the node with the most cores left, so that
    instances get their own memory controllers before any node gets a second one."""
    for _ in range(count):
        fits = [b for b in bins if len(b.cores) - b.instances * size >= size]
        best = max(fits, key=lambda b: len(b.cores) - b.instances * size)
        best.instances += 1


def _reserve_where_least_harmful(bins: list[_Bin], reserve: int, min_size: int) -> None:
    """Take each reserved core from the bin whose instance that loses it stays the largest: a bin with
    no instance first, then one where the split is uneven (its largest instance just evens out), then
    the largest instances. Ties go to the lowest node: there CPU 0 takes the interrupts anyway."""

    def loser_size(b: _Bin) -> float:
        if b.instances == 0:
            return math.inf
        return math.ceil((len(b.cores) - b.reserve) / b.instances) - 1

    for _ in range(reserve):
        candidates = [b for b in bins if len(b.cores) - b.reserve - 1 >= b.instances * min_size]
        if not candidates:
            raise PlanError("no core left to reserve: every core is needed by an instance; try --reserve-cores 0")
        max(candidates, key=loser_size).reserve += 1


def _lay_out(cores: list[Core], sizes: list[int], reserve: int) -> tuple[list[Core], list[list[Core]], list[Core]]:
    """(reserved, one run of cores per instance, spare). Instances take consecutive cores in L3
    order; the cores no instance gets go partly in front, partly into the gaps that keep a run
    inside one L3 domain (7-core instances on 8-core CCXs), the rest behind. Of the front offsets
    tried, the one touching the fewest nodes and L3 domains wins, then the one with exactly the
    reserved cores in front (CPU 0's end of the node: see _reserve_where_least_harmful)."""
    free = len(cores) - sum(sizes)
    domain = [(c.node, c.l3) for c in cores]
    # end_of_domain[i]: index just past the L3 domain that core i belongs to
    end_of_domain = [0] * len(cores)
    for i in range(len(cores) - 1, -1, -1):
        end_of_domain[i] = i + 1 if i + 1 == len(cores) or domain[i + 1] != domain[i] else end_of_domain[i + 1]

    def touched(start: int, size: int) -> tuple[int, int]:
        run = range(start, start + size)
        return len({cores[i].node for i in run}), len({domain[i] for i in run})

    best_key, best_starts = None, []
    for front in range(min(free, _MAX_OFFSET) + 1):
        starts, position, left = [], front, free - front
        cost_nodes = cost_l3 = 0
        for size in sizes:
            cost = touched(position, size)
            gap = end_of_domain[position] - position
            if cost[1] > 1 and gap <= left and position + gap + size <= len(cores):
                shifted = touched(position + gap, size)
                if shifted < cost:  # skipping the rest of this L3 domain keeps the run in fewer
                    position, left, cost = position + gap, left - gap, shifted
            starts.append(position)
            cost_nodes, cost_l3 = cost_nodes + cost[0], cost_l3 + cost[1]
            position += size
        key = (cost_nodes, cost_l3, abs(front - reserve), front)
        if best_key is None or key < best_key:
            best_key, best_starts = key, starts
    runs = [cores[start : start + size] for start, size in zip(best_starts, sizes, strict=True)]
    taken = {id(c) for run in runs for c in run}
    outside = [c for c in cores if id(c) not in taken]
    return outside[:reserve], runs, outside[reserve:]

