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

This module does step 1, the checks of the settings and the warnings about the whole plan, and
calls the others: vsup.topology.cores (steps 2-4), vsup.topology.memory (step 5) and
vsup.topology.env (each instance's environment and numactl/taskset prefix).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from vsup.topology.cores import cut, min_cores
from vsup.topology.cpulist import format_list
from vsup.topology.env import instance_plan
from vsup.topology.errors import PlanError
from vsup.topology.hybrid import MODES, kind_counts, share_out, split_kinds
from vsup.topology.memory import DoesNotFit, memory_nodes, plan_memory
from vsup.topology.model import EFFICIENCY, PERFORMANCE, Core, Machine
from vsup.topology.plan_model import InstancePlan, Plan, PlanSettings, format_ids, setting_error


def plan(machine: Machine, settings: PlanSettings) -> Plan:
    try:
        return _plan(machine, settings)
    except DoesNotFit as exc:
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
    per_instance = min_cores(settings)
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
    reserved, fast_chunks, fast_spare = cut(fast, on_fast, reserve - slow_reserve, settings, machine, warnings)
    slow_reserved, slow_chunks, slow_spare = cut(slow, on_slow, slow_reserve, settings, machine, warnings)
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

    instances_nodes = [memory_nodes(machine, chunk, warnings) for chunk in chunks]
    kv_bytes, memory, memory_limit = plan_memory(machine, settings, instances_nodes, warnings)

    instances = tuple(
        instance_plan(index, chunk, extra, kind, nodes, kv_bytes, settings, warnings)
        for index, (chunk, extra, kind, nodes) in enumerate(zip(chunks, extras, kinds, instances_nodes, strict=True))
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



def _mark(unused: dict[int, str], core: Core, reason: str) -> None:
    if reason:
        for cpu in core.cpus:
            unused[cpu] = reason



# --- checks -------------------------------------------------------------------------------------


def _check_settings(s: PlanSettings) -> None:
    if s.instances != "auto" and (isinstance(s.instances, bool) or not isinstance(s.instances, int) or s.instances < 1):
        raise setting_error("instances", repr(s.instances), "must be a whole number of at least 1, or auto")
    if not 1 <= s.base_port <= 65535:
        raise setting_error("base_port", s.base_port, "must be a TCP port, 1-65535")
    if s.model_size_bytes is not None and s.model_size_bytes <= 0:
        raise setting_error("model_size_bytes", None, f"{s.model_size_bytes} bytes is not a model size; give a positive number of GiB")
    if s.kvcache_gib is not None:
        if not s.kvcache_gib > 0:
            raise setting_error("kvcache_gib", f"{s.kvcache_gib:g}", "must be positive")
        if s.kvcache_gib >= 1 and s.kvcache_gib != int(s.kvcache_gib):
            lo = int(s.kvcache_gib)
            raise setting_error(
                "kvcache_gib", f"{s.kvcache_gib:g}",
                f"vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB; use {lo} or {lo + 1} (values below 1 go to --kv-cache-memory-bytes)",
            )
    if s.overhead_bytes < 0 or s.memory_reserve_bytes < 0:
        raise PlanError("memory overhead and reserve must not be negative")
    if s.reserve_cores != "auto" and (isinstance(s.reserve_cores, bool) or not isinstance(s.reserve_cores, int) or s.reserve_cores < 0):
        raise setting_error("reserve_cores", repr(s.reserve_cores), "must be a whole number, 0 or more, or auto")
    if s.cores_per_instance is not None and s.cores_per_instance < 1:
        raise setting_error("cores_per_instance", s.cores_per_instance, "must be at least 1")
    if s.omp_threads is not None and (isinstance(s.omp_threads, bool) or not isinstance(s.omp_threads, int) or s.omp_threads < 1):
        raise setting_error("omp_threads", repr(s.omp_threads), "must be a whole number of at least 1")
    if s.membind not in ("bind", "preferred"):
        raise setting_error("membind", repr(s.membind), "must be bind or preferred")
    if s.launcher not in ("numactl", "taskset", "none"):
        raise setting_error("launcher", repr(s.launcher), "must be numactl, taskset or none")
    if s.efficiency_cores not in MODES:
        raise setting_error("efficiency_cores", repr(s.efficiency_cores), f"must be {', '.join(MODES[:-1])} or {MODES[-1]}")


def _check_ports(s: PlanSettings, count: int) -> None:
    if s.base_port + count - 1 > 65535:
        raise setting_error("base_port", s.base_port, f"{count} instances need ports up to {s.base_port + count - 1}, past 65535")


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
                raise setting_error("nodes", None, f"unknown node {node}; this machine's nodes with usable CPUs are {format_ids(with_cpus)}")
            if node not in with_cpus:
                raise setting_error("nodes", None, f"node {node} has no usable CPUs; nodes with usable CPUs are {format_ids(with_cpus)}")
        chosen = set(s.nodes)
        for c in cores:
            if c.node not in chosen:
                for cpu in c.cpus:
                    unused[cpu] = f"node {c.node} is not in --nodes {format_ids(s.nodes)}"
        cores = [c for c in cores if c.node in chosen]
    return sorted(cores, key=_core_order)


def _core_order(c: Core) -> tuple:
    # By node, then L3 domain, then core: instances cut from consecutive cores share an L3.
    return (-1 if c.node is None else c.node, -1 if c.l3 is None else c.l3, c.id)


def _instance_count(s: PlanSettings, pool: Sequence[Core]) -> int:
    if s.instances == "auto":
        return len({c.node for c in pool})
    return int(s.instances)



# --- warnings about the whole plan --------------------------------------------------------------


def _general_warnings(machine: Machine, s: PlanSettings, instances: Iterable[InstancePlan], warnings: list[str]) -> None:
    instances = list(instances)
    memory_only = [n.id for n in machine.nodes if n.memory_only]
    if memory_only:
        warnings.append(
            f"memory-only node(s) {format_ids(memory_only)} (HBM/CXL/Optane, no CPUs): not used by this plan; "
            f"instances bind to their own node's memory"
        )
    for inst in instances:
        if len(inst.cpu_nodes) > 1:
            warnings.append(f"instance {inst.index} spans NUMA nodes {format_ids(inst.cpu_nodes)}")
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


