"""The planner: Machine + PlanSettings -> Plan. Pure: no I/O, no clock, no environment.

How cores are chosen (docs/placement.md has the user's version):
1. The pool: physical cores with at least one usable CPU (Machine.cores), on the requested nodes.
   Hybrid CPUs give two pools, performance and efficiency cores, planned apart so that no OpenMP
   team mixes kinds (its threads advance in lock step: one slow core slows every step). Instances
   go on performance cores; those they cannot hold go on efficiency cores (vsup.topology.hybrid
   says what else the efficiency cores do).
2. Bins: normally one bin per NUMA node, and each instance inside one bin, so that it never
   straddles two nodes. Instances are spread over nodes in proportion to their cores (each node
   first gets one, the rest go where the next instance would be largest: D'Hondt), so uneven nodes
   (sub-NUMA clustering 43-43-42) are split proportionally instead of truncated. Only when that is
   impossible (fewer instances than nodes with "use all cores", or --cores-per-instance larger than
   the nodes) do instances span nodes, with a warning; they then join nodes that are close by the
   distance matrix (closest first), not merely neighbouring ids.
3. Reserved cores (for vsup, the proxy and the OS) come from where they hurt least: efficiency
   cores first, then cores no instance would get anyway, then the node whose shrinking instance
   stays largest (on equal nodes: node 0, whose CPU 0 also takes most interrupts and kernel work,
   so giving it away is the cheapest core of the machine).
4. Inside a bin the cores are ordered by L3 domain, and instances take consecutive runs. The start
   offset (how many non-instance cores go in front) is chosen to touch the fewest nodes and L3
   domains, so an instance of 8 cores on an AMD node with 8-core CCXs gets exactly one CCX.
5. Memory: per node, Σ (weights + KV cache + overhead) must fit MemTotal minus the reserve; under
   a cgroup memory limit (a container, a pod), Σ over all instances must fit the limit minus the
   reserve too, and the KV cache is sized from whichever is smaller.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from vsup.topology.cpulist import format_list
from vsup.topology.errors import PlanError, SettingError
from vsup.topology.hybrid import MODES, kind_counts, share_out, split_kinds
from vsup.topology.model import EFFICIENCY, PERFORMANCE, Core, Machine
from vsup.topology.plan_model import FLAGS, GiB, InstancePlan, LimitMemory, NodeMemory, Plan, PlanSettings, format_gib

# vLLM's own default for VLLM_CPU_KVCACHE_SPACE before it sized the cache from node memory: the
# figure used when a node's memory size is unknown (a dump without meminfo).
FALLBACK_KVCACHE_GIB = 4
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


class _DoesNotFit(PlanError):
    """Memory overcommitted on a node; plan() adds the instance count that would fit."""

    def __init__(self, text: str, hints: list[str]):
        super().__init__(text)
        self.text, self.hints = text, hints


def plan(machine: Machine, settings: PlanSettings) -> Plan:
    try:
        return _plan(machine, settings)
    except _DoesNotFit as exc:
        hints = list(exc.hints)
        fewer = _most_instances_that_fit(machine, settings)
        if fewer:
            hints.insert(0, f"--instances {fewer}")
        hint = f"; try {' or '.join(hints)}" if hints else "; the model does not fit this node"
        raise PlanError(exc.text + hint) from None


def _most_instances_that_fit(machine: Machine, settings: PlanSettings) -> int | None:
    """The largest smaller instance count whose plan fits (memory need only grows with the count)."""
    current = len({c.node for c in machine.cores if c.cpus}) if settings.instances == "auto" else int(settings.instances)
    lo, hi, found = 1, current - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            _plan(machine, replace(settings, instances=mid))
        except PlanError:
            hi = mid - 1
        else:
            found, lo = mid, mid + 1
    return found


def _plan(machine: Machine, settings: PlanSettings) -> Plan:
    _check_settings(settings)
    warnings: list[str] = []
    unused: dict[int, str] = dict(machine.unusable)

    pool = _pool(machine, settings, unused)
    count = _instance_count(settings, pool)
    _check_ports(settings, count)
    per_instance = _min_cores(settings)
    if count * per_instance > len(pool):  # raises, with the counts that would fit
        _check_enough(pool, count, per_instance, 0 if settings.reserve_cores == "auto" else int(settings.reserve_cores), settings)
    # Hybrid CPUs: the two kinds are planned as separate pools, so no OpenMP team mixes them.
    fast, slow = split_kinds(pool)
    on_fast, on_slow = kind_counts(fast, slow, count, per_instance, settings.efficiency_cores, warnings)
    total = on_fast + on_slow
    _check_ports(settings, total)  # efficiency_cores: instances adds some

    reserve = _reserve_count(settings, len(pool) - total * per_instance, warnings)
    _check_enough(pool, total, per_instance, reserve, settings)
    # Reserved cores: efficiency cores first (those no efficiency-core instance needs).
    slow_reserve = min(reserve, len(slow) - on_slow * per_instance)
    reserved, fast_chunks, fast_spare = _cut(fast, on_fast, reserve - slow_reserve, settings, machine, warnings)
    slow_reserved, slow_chunks, slow_spare = _cut(slow, on_slow, slow_reserve, settings, machine, warnings)
    reserved += slow_reserved
    for core, reason in fast_spare:
        _mark(unused, core, reason or f"performance core: too few of them for an instance of {per_instance} core(s)")

    chunks = fast_chunks + slow_chunks
    kinds = [PERFORMANCE if slow else ""] * len(fast_chunks) + [EFFICIENCY] * len(slow_chunks)
    extras: list[list[Core]] = [[] for _ in chunks]
    left = [core for core, _ in slow_spare]
    if left and settings.efficiency_cores == "housekeeping" and chunks:
        extras, unserved = share_out(left, chunks)
        for core in unserved:
            _mark(unused, core, f"efficiency core on node {core.node}: no instance there to run housekeeping for")
    elif on_slow:  # efficiency-core instances: what they leave is spare like in any bin
        for core, reason in slow_spare:
            _mark(unused, core, reason)
    elif left:
        for core in left:
            _mark(unused, core, f"efficiency core: too few on node {core.node} for an instance of its own"
                  if settings.efficiency_cores == "instances" else
                  "efficiency core: kept out of OpenMP, whose threads would wait for it (placement.efficiency_cores: unused)")
        if settings.efficiency_cores == "unused":
            warnings.append(
                f"hybrid CPU: efficiency cores {format_list(cpu for c in left for cpu in c.cpus)} stay idle "
                f"(efficiency_cores: unused); housekeeping or instances would use them"
            )

    instances_nodes = [_memory_nodes(machine, chunk, warnings) for chunk in chunks]
    kv_bytes, memory, memory_limit = _plan_memory(machine, settings, instances_nodes, warnings)

    instances = tuple(
        _instance(index, chunk, extra, kind, nodes, kv_bytes, settings, warnings)
        for index, (chunk, extra, kind, nodes) in enumerate(zip(chunks, extras, kinds, instances_nodes))
    )
    _general_warnings(machine, settings, instances, warnings)
    reserved_cpus = tuple(sorted(cpu for core in reserved for cpu in core.cpus))
    for cpu in reserved_cpus:
        unused.pop(cpu, None)
    return Plan(
        instances=instances,
        reserved_cpus=reserved_cpus,
        unused_cpus=tuple(sorted(unused.items())),
        warnings=tuple(dict.fromkeys(warnings)),
        memory=memory,
        settings=settings,
        memory_limit=memory_limit,
    )


def _cut(cores: list[Core], count: int, reserve: int, s: PlanSettings, machine: Machine, warnings: list[str]
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


def _mark(unused: dict[int, str], core: Core, reason: str) -> None:
    if reason:
        for cpu in core.cpus:
            unused[cpu] = reason


def _bad(setting: str, value: object, detail: str) -> SettingError:
    """An error about one setting, worded with its `vsup plan` flag (see SettingError)."""
    return SettingError(setting, FLAGS[setting], None if value is None else str(value), detail)


# --- checks -------------------------------------------------------------------------------------


def _check_settings(s: PlanSettings) -> None:
    if s.instances != "auto" and (isinstance(s.instances, bool) or not isinstance(s.instances, int) or s.instances < 1):
        raise _bad("instances", repr(s.instances), "must be a whole number of at least 1, or auto")
    if not 1 <= s.base_port <= 65535:
        raise _bad("base_port", s.base_port, "must be a TCP port, 1-65535")
    if s.model_size_bytes is not None and s.model_size_bytes <= 0:
        raise _bad("model_size_bytes", None, f"{s.model_size_bytes} bytes is not a model size; give a positive number of GiB")
    if s.kvcache_gib is not None:
        if not s.kvcache_gib > 0:
            raise _bad("kvcache_gib", f"{s.kvcache_gib:g}", "must be positive")
        if s.kvcache_gib >= 1 and s.kvcache_gib != int(s.kvcache_gib):
            lo = int(s.kvcache_gib)
            raise _bad(
                "kvcache_gib", f"{s.kvcache_gib:g}",
                f"vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB; use {lo} or {lo + 1} (values below 1 go to --kv-cache-memory-bytes)",
            )
    if s.overhead_bytes < 0 or s.memory_reserve_bytes < 0:
        raise PlanError("memory overhead and reserve must not be negative")
    if s.reserve_cores != "auto" and (isinstance(s.reserve_cores, bool) or not isinstance(s.reserve_cores, int) or s.reserve_cores < 0):
        raise _bad("reserve_cores", repr(s.reserve_cores), "must be a whole number, 0 or more, or auto")
    if s.cores_per_instance is not None and s.cores_per_instance < 1:
        raise _bad("cores_per_instance", s.cores_per_instance, "must be at least 1")
    if s.omp_threads is not None and (isinstance(s.omp_threads, bool) or not isinstance(s.omp_threads, int) or s.omp_threads < 1):
        raise _bad("omp_threads", repr(s.omp_threads), "must be a whole number of at least 1")
    if s.membind not in ("bind", "preferred"):
        raise _bad("membind", repr(s.membind), "must be bind or preferred")
    if s.launcher not in ("numactl", "taskset", "none"):
        raise _bad("launcher", repr(s.launcher), "must be numactl, taskset or none")
    if s.efficiency_cores not in MODES:
        raise _bad("efficiency_cores", repr(s.efficiency_cores), f"must be {', '.join(MODES[:-1])} or {MODES[-1]}")


def _check_ports(s: PlanSettings, count: int) -> None:
    if s.base_port + count - 1 > 65535:
        raise _bad("base_port", s.base_port, f"{count} instances need ports up to {s.base_port + count - 1}, past 65535")


def _reserve_count(s: PlanSettings, spare: int, warnings: list[str]) -> int:
    """reserve_cores "auto": one core when the instances leave one, else none (a 2-core box running
    2 instances), said in a warning. A number is a requirement."""
    if s.reserve_cores != "auto":
        return int(s.reserve_cores)
    if spare >= 1:
        return 1
    warnings.append(
        "no core reserved for vsup, the proxy and the OS: the instances take every usable core, so "
        "they share them with everything else (fewer instances or --cores-per-instance leave one free)"
    )
    return 0


def _min_cores(s: PlanSettings) -> int:
    """Physical cores one instance needs at least (exactly, with --cores-per-instance)."""
    return (s.cores_per_instance or 1) + (1 if s.housekeeping_core else 0)


def _check_enough(pool: Sequence[Core], count: int, per_instance: int, reserve: int, s: PlanSettings) -> None:
    need = count * per_instance + reserve
    if len(pool) >= need:
        return
    what = f"{count} × {per_instance}" + (f" + {reserve} reserved" if reserve else "")
    fit = (len(pool) - reserve) // per_instance
    hints = []
    if fit >= 1:
        hints.append(f"--instances {fit}")
    if reserve:
        hints.append("--reserve-cores 0")
    if s.cores_per_instance:
        k = (len(pool) - reserve) // count - (per_instance - s.cores_per_instance)
        if 1 <= k < s.cores_per_instance:
            hints.append(f"--cores-per-instance {k}")
    hint = f"; try {' or '.join(hints)}" if hints else ""
    raise PlanError(
        f"{count} instance(s) need {need} physical cores ({what}) but only {len(pool)} are usable{hint}"
    )


# --- the pool of cores --------------------------------------------------------------------------


def _pool(machine: Machine, s: PlanSettings, unused: dict[int, str]) -> list[Core]:
    cores = [c for c in machine.cores if c.cpus]
    if not cores:
        reasons = sorted({why for _, why in machine.unusable})
        detail = f" (CPUs are {', '.join(reasons)})" if reasons else ""
        raise PlanError(f"no usable CPUs: nothing to place instances on{detail}")
    if s.nodes is not None:
        with_cpus = sorted({c.node for c in cores if c.node is not None})
        known = {n.id for n in machine.nodes}
        for node in s.nodes:
            if node not in known:
                raise _bad("nodes", None, f"unknown node {node}; this machine's nodes with usable CPUs are {_ids(with_cpus)}")
            if node not in with_cpus:
                raise _bad("nodes", None, f"node {node} has no usable CPUs; nodes with usable CPUs are {_ids(with_cpus)}")
        chosen = set(s.nodes)
        for c in cores:
            if c.node not in chosen:
                for cpu in c.cpus:
                    unused[cpu] = f"node {c.node} is not in --nodes {_ids(s.nodes)}"
        cores = [c for c in cores if c.node in chosen]
    return sorted(cores, key=_core_order)


def _core_order(c: Core) -> tuple:
    # By node, then L3 domain, then core: instances cut from consecutive cores share an L3.
    return (-1 if c.node is None else c.node, -1 if c.l3 is None else c.l3, c.id)


def _instance_count(s: PlanSettings, pool: Sequence[Core]) -> int:
    if s.instances == "auto":
        return len({c.node for c in pool})
    return int(s.instances)


# --- splitting cores among instances ------------------------------------------------------------


def _make_bins(pool: list[Core], count: int, s: PlanSettings, reserve: int, machine: Machine, warnings: list[str]) -> list[_Bin]:
    by_node: dict[int | None, list[Core]] = defaultdict(list)
    for core in pool:
        by_node[core.node].append(core)
    nodes = [_Bin(cores) for cores in by_node.values()]  # pool is sorted, so bins are in node order
    # Where instances must span nodes, they join nodes that are close (the distance matrix).
    order = _closest_first(machine)
    chain = sorted(nodes, key=lambda b: order.index(b.cores[0].node) if b.cores[0].node in order else len(order))

    if s.cores_per_instance is None:
        min_size = _min_cores(s)
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
            b.spare_reason = f"node {_ids(b.node_ids)}: too small for another instance"
        return bins

    size = _min_cores(s)
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


def _group_nodes(bins: list[_Bin], count: int, min_size: int, spread) -> list[_Bin] | None:
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


def _spread(machine: Machine, bins: list[_Bin]):
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

    best_key, best_starts, best_front = None, [], 0
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
            best_key, best_starts, best_front = key, starts, front
    runs = [cores[start : start + size] for start, size in zip(best_starts, sizes)]
    taken = {id(c) for run in runs for c in run}
    outside = [c for c in cores if id(c) not in taken]
    return outside[:reserve], runs, outside[reserve:]


# --- one instance -------------------------------------------------------------------------------


def _memory_nodes(machine: Machine, cores: list[Core], warnings: list[str]) -> tuple[int, ...]:
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


def _instance(index: int, team: list[Core], extra: list[Core], kind: str, nodes: tuple[int, ...], kv_bytes: int,
              s: PlanSettings, warnings: list[str]) -> InstancePlan:
    """`team`: its run of cores of one kind (the last is the housekeeping core with --housekeeping-core);
    `extra`: efficiency cores for its API server and EngineCore, in its mask but outside OpenMP."""
    housekeeping = (team[-1:] if s.housekeeping_core else []) + extra
    omp_cores = team[: len(team) - (1 if s.housekeeping_core else 0)]
    cores = team + extra
    omp_cpus = tuple(sorted(cpu for c in omp_cores for cpu in (c.cpus if s.smt else c.cpus[:1])))
    cpus = tuple(sorted(cpu for c in cores for cpu in c.cpus))
    idle: tuple[int, ...] = ()
    if s.omp_threads is not None:
        omp_cpus, idle = _fewer_threads(index, omp_cores, omp_cpus, s)
    env = [("OMP_NUM_THREADS", str(len(omp_cpus))), ("VLLM_CPU_OMP_THREADS_BIND", format_list(omp_cpus))]
    if nodes:
        env.append(("CPU_VISIBLE_MEMORY_NODES", ",".join(map(str, nodes))))
    vllm_args: tuple[str, ...] = ()
    if kv_bytes >= GiB:
        env.append(("VLLM_CPU_KVCACHE_SPACE", str(kv_bytes // GiB)))
    else:
        vllm_args = ("--kv-cache-memory-bytes", str(kv_bytes))
    return InstancePlan(
        index=index,
        port=s.base_port + index,
        nodes=nodes,
        cpu_nodes=tuple(sorted({c.node for c in cores if c.node is not None})),
        cpus=cpus,
        omp_cpus=omp_cpus,
        housekeeping_cpus=tuple(sorted({cpu for c in housekeeping for cpu in c.cpus} | set(idle))),
        cores=tuple(c.id for c in cores),
        l3_domains=tuple(sorted({c.l3 for c in cores if c.l3 is not None})),
        env=tuple(env),
        argv=_launcher(cpus, nodes, s, warnings),
        vllm_args=vllm_args,
        weights_bytes=s.model_size_bytes,
        kvcache_bytes=kv_bytes,
        overhead_bytes=s.overhead_bytes,
        kind=kind,
    )


def _fewer_threads(index: int, omp_cores: list[Core], omp_cpus: tuple[int, ...], s: PlanSettings) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(OpenMP CPUs, idle CPUs) for --omp-threads T: the first hardware thread of each core before
    any second one, so T threads spread over T cores; the rest stay in the instance's mask for its
    API server and EngineCore."""
    threads = int(s.omp_threads or 0)
    if threads > len(omp_cpus):
        raise _bad("omp_threads", threads, f"instance {index} has only {len(omp_cpus)} OpenMP CPU(s); "
                   f"use at most {len(omp_cpus)}, or fewer instances")
    allowed = set(omp_cpus)
    order = []
    for depth in range(max(len(c.cpus) for c in omp_cores)):
        order += [c.cpus[depth] for c in omp_cores if depth < len(c.cpus) and c.cpus[depth] in allowed]
    chosen = set(order[:threads])
    # idle: every CPU of a core without a thread (like a housekeeping core), and unused OpenMP CPUs
    idle = {cpu for c in omp_cores if not chosen & set(c.cpus) for cpu in c.cpus} | (allowed - chosen)
    return tuple(sorted(chosen)), tuple(sorted(idle))


def _launcher(cpus: tuple[int, ...], nodes: tuple[int, ...], s: PlanSettings, warnings: list[str]) -> tuple[str, ...]:
    cpu_list = format_list(cpus)
    if s.launcher == "none":
        warnings.append("launcher none: only vLLM's worker is pinned; its API server and EngineCore roam over all CPUs and memory is not bound")
        return ()
    if s.launcher == "taskset":
        warnings.append("launcher taskset: CPUs are pinned but memory is not bound to the instance's node (install numactl)")
        return ("taskset", "-c", cpu_list)
    argv = ["numactl", f"--physcpubind={cpu_list}"]
    if not nodes:
        warnings.append(f"CPUs {cpu_list} belong to no known NUMA node: their instance's memory is not bound")
    elif s.membind == "preferred":
        if len(nodes) > 1 and s.numactl_preferred_many:
            argv.append(f"--preferred-many={','.join(map(str, nodes))}")
        else:
            if len(nodes) > 1:
                warnings.append(
                    f"--membind preferred: this numactl has no --preferred-many (numactl 2.0.16+, Linux 5.15+), so the "
                    f"instance spanning nodes {_ids(nodes)} prefers node {nodes[0]} only; --membind bind binds it to all of them"
                )
            argv.append(f"--preferred={nodes[0]}")
    else:
        argv.append(f"--membind={','.join(map(str, nodes))}")
    return tuple(argv)


# --- memory -------------------------------------------------------------------------------------


def _plan_memory(
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
    "cgroup memory limit"), its budget, the instances it holds, where the budget comes from)."""
    best = None
    for where, budget, share, figure in holders:
        per_instance = budget / share
        if s.model_size_bytes is None:
            room = (per_instance - s.overhead_bytes) / 2
        else:
            room = per_instance - s.model_size_bytes - s.overhead_bytes
        gib = math.floor(room / GiB) if room > 0 else 0
        if gib < 1:
            raise _no_room_for_kv(where, share, s, budget, room, figure)
        best = gib if best is None else min(best, gib)
    return best * GiB


def _no_room_for_kv(where: str, share: float, s: PlanSettings, budget: int, room: float, figure: str) -> _DoesNotFit:
    weights = f"{format_gib(s.model_size_bytes)} weights + " if s.model_size_bytes else ""
    each = (s.model_size_bytes or 0) + s.overhead_bytes
    hints = []
    if room >= GiB / 4:
        hints.append(f"--kvcache-gib {math.floor(room / GiB * 10) / 10:g}")
    return _DoesNotFit(
        f"{where}: {share:g} × ({weights}{format_gib(s.overhead_bytes)}) = {format_gib(share * each)} leaves "
        f"less than 1 GiB of KV cache per instance in {format_gib(budget)} available ({figure})",
        hints,
    )


def _does_not_fit(where: str, share: float, s: PlanSettings, kv: int, budget: int, figure: str) -> _DoesNotFit:
    weights = f"{format_gib(s.model_size_bytes)} weights + " if s.model_size_bytes else ""
    each = (s.model_size_bytes or 0) + kv + s.overhead_bytes
    hints = []
    room = budget / share - (s.model_size_bytes or 0) - s.overhead_bytes
    if room >= GiB:
        hints.append(f"--kvcache-gib {math.floor(room / GiB)}")
    elif room >= GiB / 4:
        hints.append(f"--kvcache-gib {math.floor(room / GiB * 10) / 10:g}")
    return _DoesNotFit(
        f"{where}: {share:g} × ({weights}{format_gib(kv)} KV + {format_gib(s.overhead_bytes)}) = {format_gib(share * each)} "
        f"> {format_gib(budget)} available ({figure})",
        hints,
    )


# --- warnings about the whole plan --------------------------------------------------------------


def _general_warnings(machine: Machine, s: PlanSettings, instances: Iterable[InstancePlan], warnings: list[str]) -> None:
    instances = list(instances)
    memory_only = [n.id for n in machine.nodes if n.memory_only]
    if memory_only:
        warnings.append(
            f"memory-only node(s) {_ids(memory_only)} (HBM/CXL/Optane, no CPUs): not used by this plan; "
            f"instances bind to their own node's memory"
        )
    for inst in instances:
        if len(inst.cpu_nodes) > 1:
            warnings.append(f"instance {inst.index} spans NUMA nodes {_ids(inst.cpu_nodes)}")
    threads = [len(i.omp_cpus) for i in instances]
    if threads and max(threads) >= 1.25 * min(threads) and max(threads) - min(threads) > 1:
        warnings.append(
            f"instances differ in size ({min(threads)} to {max(threads)} OpenMP threads): the proxy spreads "
            f"requests evenly, so the small ones answer more slowly; --cores-per-instance K makes them equal"
        )
    if s.smt and any(len(i.omp_cpus) > len(i.cores) - len(_cores_of(i.housekeeping_cpus, machine)) for i in instances):
        warnings.append("--smt: OpenMP threads on both hardware threads of a core; vLLM usually runs faster with one per core")
    elif s.smt and instances:
        warnings.append(
            "--smt (placement.smt) changes nothing here: no core of the plan has a second usable hardware thread "
            "(no SMT, or the siblings are offline, isolated or outside the cpuset)"
        )


def _cores_of(cpus: Iterable[int], machine: Machine) -> set[int]:
    wanted = set(cpus)
    return {core.id for core in machine.cores if wanted & set(core.cpus)}


def _ids(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)
