"""One instance's plan from its cores: the CPUs its OpenMP threads bind to, the environment vLLM
reads (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND, CPU_VISIBLE_MEMORY_NODES, the KV cache size) and
the numactl/taskset prefix that pins the whole command. Pure: cores and settings in, InstancePlan out.
"""

from __future__ import annotations

from vsup.topology.cpulist import format_list
from vsup.topology.model import Core
from vsup.topology.plan_model import GiB, InstancePlan, PlanSettings, format_ids, setting_error


def instance_plan(index: int, team: list[Core], extra: list[Core], kind: str, nodes: tuple[int, ...], kv_bytes: int,
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
        raise setting_error("omp_threads", threads, f"instance {index} has only {len(omp_cpus)} OpenMP CPU(s); "
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
                    f"instance spanning nodes {format_ids(nodes)} prefers node {nodes[0]} only; --membind bind binds it to all of them"
                )
            argv.append(f"--preferred={nodes[0]}")
    else:
        argv.append(f"--membind={','.join(map(str, nodes))}")
    return tuple(argv)

