"""`vsup topology` output: a Machine as JSON-ready data and as a text map a person can hold
against `lscpu` and `numactl --hardware`. Pure functions: Machine in, data or text out."""

from __future__ import annotations

import textwrap
from collections import defaultdict

from vsup.topology.cpulist import format_list
from vsup.topology.model import EFFICIENCY, PERFORMANCE, UNIFORM, Core, Machine

GIB = 1024**3
WIDTH = 100


def machine_to_json(machine: Machine) -> dict:
    """The stable keys of the issue (cpus_online, cpus_usable, nodes, cores, isa) plus the rest
    of the model. nodes[].cpus are the node's usable CPUs; nodes[].cpus_online all of its online
    ones. cores lists cores with a usable CPU; cores[].cpus are its usable SMT siblings."""
    return {
        "cpus_possible": list(machine.cpus_possible),
        "cpus_present": list(machine.cpus_present),
        "cpus_online": list(machine.cpus_online),
        "cpus_allowed": list(machine.cpus_allowed),
        "cpus_isolated": list(machine.cpus_isolated),
        "cpus_usable": list(machine.cpus_usable),
        "packages": list(machine.packages),
        "mems_allowed": list(machine.mems_allowed),
        "nodes": [
            {
                "id": node.id,
                "cpus": list(node.usable_cpus),
                "cpus_online": list(node.cpus),
                "memory_total_bytes": node.memory_total_bytes,
                "memory_free_bytes": node.memory_free_bytes,
                "memory_available_bytes": node.memory_available_bytes,
                "memory_only": node.memory_only,
                "allowed": node.allowed,
                "distances": list(node.distances),
            }
            for node in machine.nodes
        ],
        "cores": [_core_json(core) for core in machine.cores],
        "cores_total": len(machine.all_cores),
        "isa": {
            "avx2": machine.isa.avx2,
            "avx512f": machine.isa.avx512f,
            "avx512_bf16": machine.isa.avx512_bf16,
            "amx_bf16": machine.isa.amx_bf16,
            "amx_tile": machine.isa.amx_tile,
            "arch": machine.isa.arch,
        },
        "unusable": [{"cpu": cpu, "reason": reason} for cpu, reason in machine.unusable],
        "sources": {fact: source for fact, source in machine.sources},
        "memory_limit_bytes": machine.memory_limit_bytes,
    }


def _core_json(core: Core) -> dict:
    return {
        "package": core.package,
        "node": core.node,
        "cpus": list(core.cpus),
        "all_cpus": list(core.all_cpus),
        "l3": core.l3,
        "die": core.die,
        "cluster": core.cluster,
        "kind": core.kind,
    }


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _cpus(cpus) -> str:
    return format_list(cpus) if cpus else "none"


def _core_token(core: Core, usable: set[int], hybrid: bool) -> str:
    token = "+".join(f"{cpu}" if cpu in usable else f"{cpu}*" for cpu in core.all_cpus)
    if hybrid:
        token = {PERFORMANCE: "P:", EFFICIENCY: "E:"}.get(core.kind, "") + token
    return token


def _wrap(prefix: str, tokens: list[str], indent: str) -> list[str]:
    return textwrap.wrap(
        " ".join(tokens), width=WIDTH, initial_indent=prefix, subsequent_indent=indent,
        break_on_hyphens=False,
    ) or [prefix.rstrip()]


def _core_lines(cores: list[Core], usable: set[int], hybrid: bool, indent: str) -> list[str]:
    """One line (wrapped) per (package, L3 domain): its usable cores, SMT siblings joined by '+'
    ('*' marks a sibling that cannot be used); cores with no usable CPU are only counted."""
    groups: dict[tuple, list[Core]] = defaultdict(list)
    l3_sizes: dict[int | None, int] = defaultdict(int)
    for core in cores:
        l3_sizes[core.l3] += 1
    # POWER-style per-core L3s would give one line per core: group those by package instead.
    per_core_l3 = all(l3 is not None and n == 1 for l3, n in l3_sizes.items()) and len(cores) > 1
    for core in cores:
        groups[(core.package, "per core" if per_core_l3 else core.l3)].append(core)
    lines = []
    for (package, l3), members in groups.items():
        package_name = "?" if package < 0 else str(package)
        l3_name = "no L3" if l3 is None else "L3 per core" if l3 == "per core" else f"L3 {l3}"
        shown = [core for core in members if core.cpus]
        prefix = f"{indent}package {package_name}, {l3_name}: {_n(len(members), 'core')}"
        if not shown:
            lines.append(f"{prefix}, none usable")
            continue
        tokens = [_core_token(core, usable, hybrid) for core in shown]
        if len(shown) < len(members):
            tokens.append(f"(+{len(members) - len(shown)} with no usable CPU)")
        lines += _wrap(prefix + ": ", tokens, indent + "    ")
    return lines


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def render_text(machine: Machine) -> str:
    usable = set(machine.cpus_usable)
    cores = machine.all_cores or machine.cores
    hybrid = any(core.kind != UNIFORM for core in cores)
    threads = sorted({len(core.all_cpus) for core in cores})
    threads_text = "-".join(str(t) for t in (threads[0], threads[-1])) if len(threads) > 1 else str(threads[0] if threads else 0)
    packages = "unknown package ids (physical_package_id -1)" if machine.packages == (-1,) else _n(len(machine.packages), "package")
    cpu_nodes = [n for n in machine.nodes if n.cpus]
    memory_only = [n for n in machine.nodes if n.memory_only]

    lines = [
        f"CPUs: {len(machine.cpus_online)} online ({_cpus(machine.cpus_online)}), "
        f"{len(machine.cpus_usable)} usable ({_cpus(machine.cpus_usable)})",
        f"Layout: {packages}, {_n(len(machine.nodes), 'NUMA node')}"
        + (f" ({len(memory_only)} memory-only)" if memory_only else "")
        + f", {_n(len(cores), 'physical core')}, {threads_text} thread{'' if threads_text == '1' else 's'} per core",
    ]
    if hybrid:
        p = sum(1 for c in cores if c.kind == PERFORMANCE)
        e = sum(1 for c in cores if c.kind == EFFICIENCY)
        lines.append(f"Hybrid: {_n(p, 'performance core')} (P:), {_n(e, 'efficiency core')} (E:)")
    sources = dict(machine.sources)
    if "kind" in sources:  # which source decided the kinds (vsup.topology.kinds)
        lines.append(f"Core kinds: {sources['kind']}")
    if "cpuset" in sources:
        lines.append(f"Cpuset: {sources['cpuset']}")
    isa = machine.isa
    flags = " ".join(
        f"{name} {'yes' if getattr(isa, name) else 'no'}"
        for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    )
    lines.append(f"ISA: {isa.arch or 'unknown arch'}: {flags}" + ("" if isa.avx2 or isa.arch not in ("x86_64", "") else "  (vLLM's x86 build needs avx2)"))
    if machine.memory_limit_bytes is not None:
        lines.append(f"Memory limit: {_gib(machine.memory_limit_bytes)} for this process's cgroup "
                     f"({dict(machine.sources).get('memory_limit', 'cgroup')}): plans budget within it")
    lines.append("")

    by_node: dict[int | None, list[Core]] = defaultdict(list)
    for core in cores:
        by_node[core.node].append(core)
    ids = [n.id for n in machine.nodes]
    if len(ids) > 1:
        lines.append("(distances are listed in node order: " + " ".join(str(i) for i in ids) + ")")
    for node in cpu_nodes:
        memory = f"memory {_gib(node.memory_total_bytes)} total, {_gib(node.memory_available_bytes)} available"
        flags = "" if node.allowed else ", memory outside cpuset.mems"
        distances = f", distances {' '.join(map(str, node.distances))}" if node.distances and len(ids) > 1 else ""
        lines.append(
            f"node {node.id}: CPUs {_cpus(node.cpus)} ({len(node.usable_cpus)} of {len(node.cpus)} usable), "
            f"{memory}{flags}{distances}"
        )
        lines += _core_lines(by_node.get(node.id, []), usable, hybrid, "  ")
    orphans = by_node.get(None, [])
    if orphans:
        lines.append(f"CPUs in no listed NUMA node (their node is offline or missing): "
                     f"{_cpus([c for core in orphans for c in core.all_cpus])}")
        lines += _core_lines(orphans, usable, hybrid, "  ")
    for node in memory_only:
        lines.append(
            f"node {node.id}: memory-only, {_gib(node.memory_total_bytes)} total, "
            f"{_gib(node.memory_available_bytes)} available"
            + ("" if node.allowed else ", outside cpuset.mems")
            + (f", distances {' '.join(map(str, node.distances))}" if node.distances else "")
        )
    empty = [n for n in machine.nodes if not n.cpus and not n.memory_only]
    for node in empty:
        lines.append(f"node {node.id}: no online CPUs and no memory")

    lines.append("")
    if machine.unusable:
        by_reason: dict[str, list[int]] = defaultdict(list)
        for cpu, reason in machine.unusable:
            by_reason[reason].append(cpu)
        detail = "; ".join(f"{_cpus(cpus)} {reason}" for reason, cpus in by_reason.items())
        starred = any(c not in usable for core in cores if core.cpus for c in core.all_cpus)
        lines.append(f"Unusable CPUs: {detail}" + ("  (marked * in the map above)" if starred else ""))
    else:
        lines.append("Unusable CPUs: none")
    outside = [n.id for n in machine.nodes if not n.allowed]
    if outside:
        lines.append(f"Memory nodes outside cpuset.mems: {format_list(outside)}")
    return "\n".join(lines) + "\n"
