"""`vsup plan` output: the plan as a per-node core map (table) and as launch lines (shell)."""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Mapping

from vsup.config.fleet import is_fleet, models_of
from vsup.config.schema import VsupConfig
from vsup.supervisor.launch import PLACEMENT_VARIABLES, build_command
from vsup.supervisor.preload import Preload
from vsup.topology.cpulist import format_list
from vsup.topology.model import EFFICIENCY, PERFORMANCE, UNIFORM, Core, Machine
from vsup.topology.plan_model import Plan, format_gib
from vsup.topology.startmode import StartChoice

# Owner marks in the core map.
RESERVED, UNUSED = "reserved", "unused"
# What placement.efficiency_cores does, for the header of a hybrid machine's plan.
EFFICIENCY_CHOICE = {
    "housekeeping": "efficiency cores: housekeeping (the reserve, then each instance's API server and EngineCore, outside OpenMP)",
    "instances": "efficiency cores: instances of their own",
    "unused": "efficiency cores: unused (the reserve only)",
}


def render_table(machine: Machine, plan: Plan, *, fleet: bool = False, listen: str = "unix", proxy_port: int = 8000,
                 preloads: Mapping[int, Preload] | None = None, start: StartChoice | None = None) -> str:
    """`fleet`: the plan of a file with `models:` (a MODEL column, a line per model). `listen`
    (vllm.listen): unix shows each instance's socket, tcp its port; `proxy_port` names the
    sockets' folder. `preloads`: what each instance preloads, by index (launch.instance_preload).
    `start`: how `vsup run` would start the instances (start.mode), one line after the memory."""
    lines: list[str] = []
    s = plan.settings
    launcher = s.launcher + (f" (--membind {s.membind})" if s.launcher == "numactl" else "")
    hybrid = _hybrid(machine)
    lines.append(
        f"{len(plan.instances)} instance(s) · launcher {launcher} · "
        f"{'all hardware threads' if s.smt else 'one OpenMP thread per physical core'}"
        f"{' · housekeeping core per instance' if s.housekeeping_core else ''}"
        f"{' · ' + EFFICIENCY_CHOICE[s.efficiency_cores] if hybrid else ''}"
    )
    lines.append("")
    if fleet:
        lines.extend(_model_lines(plan))
        lines.append("")
    lines.extend(_core_map(machine, plan))
    lines.append("")
    lines.extend(_instance_table(plan, fleet, listen, proxy_port))
    lines.extend(_preload_lines(preloads or {}))
    lines.append("")
    reserved = plan.reserved_cpus
    lines.append(f"reserved for vsup, the proxy and the OS: {format_list(reserved) if reserved else 'none'}")
    limit = plan.memory_limit
    if limit is not None:
        lines.append(f"cgroup memory limit {format_gib(limit.limit_bytes)}: planned {format_gib(limit.demand_bytes)} "
                     f"of {format_gib(limit.budget_bytes)} ({limit.figure})")
    if start is not None:
        lines.append(f"start: {start.describe(estimate=False)}")
    by_reason: dict[str, list[int]] = defaultdict(list)
    for cpu, reason in plan.unused_cpus:
        by_reason[reason].append(cpu)
    if by_reason:
        lines.append("unused CPUs:")
        lines.extend(f"  {format_list(cpus)}: {reason}" for reason, cpus in by_reason.items())
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    return "\n".join(lines) + "\n"


def _core_map(machine: Machine, plan: Plan) -> list[str]:
    """Per node and L3 domain, the physical cores (SMT siblings joined by +) grouped by owner:
    `[i0 1+17 2+18]` = instance 0 owns cores 1 and 2; `h` marks a housekeeping core, `*` a CPU
    that cannot be used (offline, outside the cpuset, isolated)."""
    owner: dict[int, str] = {}
    housekeeping: set[int] = set()
    for inst in plan.instances:
        for cpu in inst.cpus:
            owner[cpu] = f"i{inst.index}"
        housekeeping.update(inst.housekeeping_cpus)
    for cpu in plan.reserved_cpus:
        owner[cpu] = "R"
    usable = set(machine.cpus_usable)
    memory = {m.node: m for m in plan.memory}
    cores = machine.all_cores or machine.cores
    by_node: dict[int | None, list[Core]] = defaultdict(list)
    for core in cores:
        by_node[core.node].append(core)
    hybrid = _hybrid(machine)
    lines = ["core map: [owner cores] — iN instance N, R reserved, - unused; 1+17 = SMT siblings, h housekeeping, * unusable CPU"
             + ("; P: performance, E: efficiency core" if hybrid else "")]
    for node_id in sorted(by_node, key=lambda n: -1 if n is None else n):
        lines.append(_node_header(machine, node_id, by_node[node_id], memory.get(node_id) if node_id is not None else None))
        by_l3: dict[int | None, list[Core]] = defaultdict(list)
        for core in by_node[node_id]:
            by_l3[core.l3].append(core)
        for number, (l3, l3_cores) in enumerate(sorted(by_l3.items(), key=lambda kv: -1 if kv[0] is None else kv[0])):
            label = f"L3 #{number} ({len(l3_cores)} cores)" if l3 is not None else f"no L3 ({len(l3_cores)} cores)"
            groups: list[tuple[str, list[str]]] = []
            for core in sorted(l3_cores, key=lambda c: c.id):
                cpus = core.all_cpus or core.cpus
                who = next((owner[c] for c in cpus if c in owner), "-")
                token = "+".join(f"{c}{'h' if c in housekeeping else ''}{'' if c in usable else '*'}" for c in cpus)
                if hybrid:
                    token = {PERFORMANCE: "P:", EFFICIENCY: "E:"}.get(core.kind, "") + token
                if groups and groups[-1][0] == who:
                    groups[-1][1].append(token)
                else:
                    groups.append((who, [token]))
            cells = " ".join(f"[{who} {' '.join(tokens)}]" for who, tokens in groups)
            lines.append(f"    {label}: {cells}")
    for node in machine.nodes:
        if node.memory_only:
            lines.append(f"  node {node.id}: memory only ({format_gib(node.memory_total_bytes)}), no CPUs")
    return lines


def _hybrid(machine: Machine) -> bool:
    return any(core.kind != UNIFORM for core in machine.all_cores or machine.cores)


def _node_header(machine: Machine, node_id: int | None, cores: list[Core], mem) -> str:
    if node_id is None:
        return "  CPUs without a NUMA node"
    node = machine.node(node_id)
    parts = [f"  node {node_id}: {len(cores)} cores, CPUs {format_list(node.cpus) or 'none'}"]
    if node.memory_total_bytes:
        parts.append(f"MemTotal {format_gib(node.memory_total_bytes)}")
    if node.memory_available_bytes:
        parts.append(f"available now {format_gib(node.memory_available_bytes)}")
    if mem is not None and mem.figure != "unknown":
        parts.append(f"planned {format_gib(mem.demand_bytes)} of {format_gib(mem.budget_bytes)} ({mem.figure})")
    return " · ".join(parts)


def _model_lines(plan: Plan) -> list[str]:
    """One line per model: its instances, cores, nodes and why it got them."""
    rows = [("model", "instances", "cores", "nodes", "why")]
    for share in plan.models:
        cores = len({c for inst in plan.instances if inst.index in share.instances for c in inst.cores})
        rows.append((share.name, format_list(share.instances) or "-", str(cores), format_list(share.nodes) or "-", share.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["models:"] + ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows]


def _instance_table(plan: Plan, fleet: bool = False, listen: str = "unix", proxy_port: int = 8000) -> list[str]:
    kinds = any(inst.kind for inst in plan.instances)
    unix = listen == "unix"
    header = ("#",) + (("model",) if fleet else ()) + ("socket" if unix else "port", "nodes", "cores", "threads", "OpenMP CPUs", "affinity mask", "weights", "KV", "memory") + (("kind",) if kinds else ())
    rows = [header]
    for inst in plan.instances:
        rows.append(
            (str(inst.index),) + ((inst.model,) if fleet else ()) + (
                f"{inst.index}.sock" if unix else str(inst.port),
                ",".join(map(str, inst.nodes)) or "-",
                str(len(inst.cores)),
                str(len(inst.omp_cpus)),
                format_list(inst.omp_cpus),
                format_list(inst.cpus),
                format_gib(inst.weights_bytes) if inst.weights_bytes else "?",
                format_gib(inst.kvcache_bytes),
                format_gib(inst.memory_bytes),
            ) + ((inst.kind,) if kinds else ())
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["instances:"]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if unix:
        lines.append(f"sockets: <runtime dir>/instances-{proxy_port}/<i>.sock (vllm.listen: unix; tcp: 127.0.0.1:<base_port + i>)")
    prefixes = [(inst.index, " ".join(inst.argv)) for inst in plan.instances if inst.argv]
    if prefixes:
        lines.append("launch prefixes:")
        lines.extend(f"  #{index}: {prefix}" for index, prefix in prefixes)
    return lines


def _preload_lines(preloads: Mapping[int, Preload]) -> list[str]:
    """LD_PRELOAD per instance; instances that preload the same for the same reason share a line.
    No line when nothing is preloaded because vLLM's environment is unknown (a wrapper command, a
    plan for another machine without vLLM here; the JSON still says so)."""
    groups: dict[Preload, list[int]] = defaultdict(list)
    for index, preload in sorted(preloads.items()):
        groups[preload].append(index)
    if all(preload.unknown for preload in groups):
        return []
    lines = []
    for preload, indexes in groups.items():
        who = "every instance" if len(groups) == 1 else "#" + format_list(indexes)
        what = " ".join(preload.libraries) if preload.libraries else "nothing"
        lines.append(f"preload (LD_PRELOAD) of {who}: {what}  ({preload.why})")
    return lines


def render_shell(plan: Plan, cfg: VsupConfig, environ: Mapping[str, str]) -> str:
    """One runnable line per instance: `env [-u VAR] K=V … numactl … vllm serve MODEL …`. Only the
    variables vsup sets are written out; placement variables the plan leaves unset are removed. A
    fleet: each model's lines after a `# <model>` comment, from that model's view of the file."""
    lines = []
    fleet = is_fleet(cfg)
    for view in models_of(cfg):
        if fleet:
            lines.append(f"# {view.name}")
        for inst in plan.of_model(view.name) if fleet else plan.instances:
            argv, env = build_command(inst, view.config, environ)
            shown = {**inst.env_dict(), **view.config.vllm.env}
            if "LD_PRELOAD" in env and env["LD_PRELOAD"] != environ.get("LD_PRELOAD"):  # vllm.preload's libraries
                shown["LD_PRELOAD"] = env["LD_PRELOAD"]
            unset = [key for key in PLACEMENT_VARIABLES if key not in shown]
            words = ["env", *(w for key in unset for w in ("-u", key)), *(f"{k}={v}" for k, v in shown.items() if env.get(k) == v), *argv]
            lines.append(shlex.join(words))
    return "\n".join(lines) + "\n"