"""Write a fake sysfs/procfs tree, shaped like the kernel's, from a compact description of a machine.

    root = build_sysfs(tmp_path, nodes=(24, 24, 24, 24), smt=2, l3_cores=8)   # EPYC 9654 NPS4
    machine = read_machine(root)

The layout follows Linux numbering on servers: the first thread of every core gets CPUs 0..C-1
(node by node), the second threads C..2C-1 and so on (smt_siblings="split"); client parts number
siblings next to each other (smt_siblings="adjacent"). `layout()` / `hybrid_layout()` return the
cores as CoreSpec so tests can state expectations, or pass `cores=` for any other shape.

Files written (only what the reader and the kernel agree on): sys/devices/system/cpu/{online,
possible,present,isolated}, cpuN/{online,topology/*,cache/index*/*,cpu_capacity},
sys/devices/cpu_core|cpu_atom/cpus, sys/devices/system/node/{online,possible,nodeN/{cpumap,cpulist,
meminfo,distance}}, proc/{meminfo,cpuinfo}, and for a cpuset: proc/self/{cgroup,mountinfo} plus
the cgroup files (v2 cpuset.cpus.effective or v1 cpuset.cpus/cpuset.effective_cpus)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vsup.topology.cpulist import format_list, format_mask

GIB = 1024**3
CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"


@dataclass(frozen=True)
class CoreSpec:
    cpus: tuple[int, ...]  # SMT siblings
    package: int = 0
    node: int | None = 0  # None: the CPU belongs to no node directory
    l3: object = 0  # cores with equal keys share an L3; None: no L3
    kind: str = "uniform"  # "performance" / "efficiency" on hybrid parts
    core_id: int = 0
    die: int | None = None
    capacity: int | None = None  # cpuN/cpu_capacity, written when set
    midr: int | None = None  # cpuN/regs/identification/midr_el1 (Arm), written when set


def layout(
    nodes: Sequence[int] = (4,),
    *,
    smt: int = 1,
    packages: int = 1,
    l3_cores: int | None = None,
    smt_siblings: str = "split",
    node_ids: Sequence[int] | None = None,
) -> list[CoreSpec]:
    """Cores for `nodes[i]` physical cores on node node_ids[i]; nodes are split evenly over
    `packages`. One L3 per package unless `l3_cores` groups that many cores of a node per L3."""
    if len(nodes) % packages:
        raise ValueError(f"{len(nodes)} nodes do not split evenly over {packages} packages")
    ids = list(node_ids) if node_ids is not None else list(range(len(nodes)))
    per_package = len(nodes) // packages
    total = sum(nodes)
    cores: list[CoreSpec] = []
    index = 0
    for position, count in enumerate(nodes):
        package = position // per_package
        for k in range(count):
            if smt_siblings == "split":
                cpus = tuple(index + t * total for t in range(smt))
            else:
                cpus = tuple(index * smt + t for t in range(smt))
            l3 = (position, k // l3_cores) if l3_cores else package
            cores.append(CoreSpec(cpus, package=package, node=ids[position], l3=l3, core_id=k))
            index += 1
    return cores


def hybrid_layout(p_cores: int = 8, e_cores: int = 16, p_smt: int = 2) -> list[CoreSpec]:
    """Raptor Lake style: P-cores first with adjacent SMT siblings, then single-thread E-cores,
    one package, one node, one L3."""
    cores = [
        CoreSpec(tuple(range(i * p_smt, (i + 1) * p_smt)), kind="performance", core_id=i * 4)
        for i in range(p_cores)
    ]
    first_e = p_cores * p_smt
    cores += [
        CoreSpec((first_e + i,), kind="efficiency", core_id=p_cores * 4 + i) for i in range(e_cores)
    ]
    return cores


# NVIDIA GB10 (DGX Spark) MIDR values: Arm Ltd, r0p1, part 0xd85 (Cortex-X925) / 0xd87 (Cortex-A725)
X925_MIDR = 0x410FD851
A725_MIDR = 0x410FD871


def gb10_layout(midr: bool = True) -> list[CoreSpec]:
    """NVIDIA GB10: two clusters, each with its own L3, of 5 Cortex-A725 then 5 Cortex-X925 cores
    (CPUs 0-4 A725, 5-9 X925, 10-14 A725, 15-19 X925), no SMT. The X925s report cpu_capacity
    997, 1017 or 1024 and the A725s 718 or 731: two big-core bins and two little-core bins."""
    capacities = {
        "x925": [997] * 5 + [1017] * 4 + [1024],
        "a725": [718] * 5 + [731] * 5,
    }
    cores, taken = [], {"x925": 0, "a725": 0}
    for cluster in range(2):
        for kind, midr_value, kind_name in (("a725", A725_MIDR, "efficiency"), ("x925", X925_MIDR, "performance")):
            for _ in range(5):
                cpu = len(cores)
                cores.append(CoreSpec((cpu,), l3=cluster, kind=kind_name, core_id=cpu,
                                      capacity=capacities[kind][taken[kind]], midr=midr_value if midr else None))
                taken[kind] += 1
    return cores


class _Writer:
    def __init__(self, root: Path, nul_padding: bool):
        self.root = root
        self.nul_padding = nul_padding

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = text if text.endswith("\n") or text == "" else text + "\n"
        if self.nul_padding and data:
            data += "\x00" * 7  # what some dump tools and hand-edited trees leave behind
        path.write_text(data)


def build_sysfs(
    root: str | Path,
    *,
    nodes: Sequence[int] = (4,),
    smt: int = 1,
    packages: int = 1,
    l3_cores: int | None = None,
    smt_siblings: str = "split",
    node_ids: Sequence[int] | None = None,
    cores: Sequence[CoreSpec] | None = None,
    hybrid: tuple[int, int] | None = None,
    hybrid_source: str = "pmu",
    memory_only_nodes: Mapping[int, int] | None = None,
    node_memory: int = 16 * GIB,
    offline: Iterable[int] = (),
    isolated: Iterable[int] = (),
    cpuset: str | None = None,
    cpuset_mems: str | None = None,
    cgroup: str = "v2",
    cpuset_in_parent: bool = False,
    mount_table: bool = True,
    online_file: bool = True,
    numa: bool = True,
    stale_cpulist: bool = False,
    nul_padding: bool = False,
    flags: str = "fpu sse sse2 lm avx avx2 avx512f",
) -> Path:
    """Write the tree under `root` and return it (pass it to read_machine as the fsroot).

    hybrid=(P, E) replaces nodes/smt with hybrid_layout(P, E); hybrid_source "pmu" writes
    cpu_core/cpu_atom, "capacity" writes cpuN/cpu_capacity (1024 for P, 512 for E), "none" neither
    (an Arm machine described by CoreSpec.capacity / .midr alone).
    memory_only_nodes maps extra node ids to their MemTotal in bytes (no CPUs: HBM, CXL).
    cpuset/cpuset_mems restrict the process through a cgroup ("v2" or "v1"); mount_table=False
    leaves out proc/self/mountinfo, so the reader must find the cgroup at its standard place.
    CoreSpec.capacity / .midr write cpuN/cpu_capacity / regs/identification/midr_el1.
    online_file=False leaves out cpu/online so the reader must use cpuN/online.
    stale_cpulist writes a wrong nodeN/cpulist (as hand-made dumps do) next to the right cpumap.
    nul_padding appends NUL bytes to every file."""
    root = Path(root)
    w = _Writer(root, nul_padding)
    if cores is None:
        if hybrid is not None:
            cores = hybrid_layout(*hybrid)
        else:
            cores = layout(nodes, smt=smt, packages=packages, l3_cores=l3_cores,
                           smt_siblings=smt_siblings, node_ids=node_ids)
    cores = list(cores)
    memory_only_nodes = dict(memory_only_nodes or {})
    all_cpus = sorted(cpu for core in cores for cpu in core.cpus)
    offline_set = set(offline)
    online = [cpu for cpu in all_cpus if cpu not in offline_set]
    width = max(1, (max(all_cpus) // 32) + 1)

    def mask(cpus) -> str:
        return format_mask(cpus, min_groups=width)

    # CPUs
    if online_file:
        w.write(f"{CPU_DIR}/online", format_list(online))
    w.write(f"{CPU_DIR}/possible", format_list(all_cpus))
    w.write(f"{CPU_DIR}/present", format_list(all_cpus))
    w.write(f"{CPU_DIR}/offline", format_list(offline_set))
    w.write(f"{CPU_DIR}/isolated", format_list(isolated))
    l3_groups: dict[object, list[int]] = {}
    for core in cores:
        if core.l3 is not None:
            l3_groups.setdefault(core.l3, []).extend(core.cpus)
    for core in cores:
        siblings = [cpu for cpu in core.cpus if cpu not in offline_set]
        package_cpus = [c for other in cores if other.package == core.package for c in other.cpus
                        if c not in offline_set]
        for cpu in core.cpus:
            d = f"{CPU_DIR}/cpu{cpu}"
            if cpu != 0:  # like x86: the boot CPU cannot be unplugged and has no online file
                w.write(f"{d}/online", "0" if cpu in offline_set else "1")
            if cpu in offline_set:
                (root / d).mkdir(parents=True, exist_ok=True)
                continue  # offline CPUs have no topology/ or cache/
            t = f"{d}/topology"
            w.write(f"{t}/physical_package_id", str(core.package))
            w.write(f"{t}/core_id", str(core.core_id))
            if core.die is not None:
                w.write(f"{t}/die_id", str(core.die))
            for name in ("thread_siblings", "core_cpus"):
                w.write(f"{t}/{name}", mask(siblings))
                w.write(f"{t}/{name}_list", format_list(siblings))
            for name in ("core_siblings", "package_cpus"):
                w.write(f"{t}/{name}", mask(package_cpus))
                w.write(f"{t}/{name}_list", format_list(package_cpus))
            caches = [(1, "Data", siblings), (1, "Instruction", siblings), (2, "Unified", siblings)]
            if core.l3 is not None:
                l3 = [c for c in l3_groups[core.l3] if c not in offline_set]
                caches.append((3, "Unified", l3))
            for index, (level, kind, shared) in enumerate(caches):
                c = f"{d}/cache/index{index}"
                w.write(f"{c}/level", str(level))
                w.write(f"{c}/type", kind)
                w.write(f"{c}/shared_cpu_map", mask(shared))
                w.write(f"{c}/shared_cpu_list", format_list(shared))
            if core.capacity is not None:
                w.write(f"{d}/cpu_capacity", str(core.capacity))
            elif hybrid_source == "capacity" and core.kind != "uniform":
                w.write(f"{d}/cpu_capacity", "1024" if core.kind == "performance" else "512")
            if core.midr is not None:
                w.write(f"{d}/regs/identification/midr_el1", f"0x{core.midr:016x}")
    if hybrid_source == "pmu":
        p = [c for core in cores if core.kind == "performance" for c in core.cpus if c not in offline_set]
        e = [c for core in cores if core.kind == "efficiency" for c in core.cpus if c not in offline_set]
        if p or e:
            w.write("sys/devices/cpu_core/cpus", format_list(p))
            w.write("sys/devices/cpu_atom/cpus", format_list(e))

    # NUMA nodes
    cpu_nodes: dict[int, list[int]] = {}
    for core in cores:
        if core.node is not None:
            cpu_nodes.setdefault(core.node, []).extend(core.cpus)
    memory = {node: node_memory for node in cpu_nodes}
    memory.update(memory_only_nodes)
    node_list = sorted(memory)
    if numa:
        w.write(f"{NODE_DIR}/online", format_list(node_list))
        w.write(f"{NODE_DIR}/possible", format_list(node_list))
        for node in node_list:
            d = f"{NODE_DIR}/node{node}"
            cpus = sorted(cpu_nodes.get(node, []))
            w.write(f"{d}/cpumap", mask(cpus))
            w.write(f"{d}/cpulist", format_list(cpus[:1] if stale_cpulist else cpus))
            w.write(f"{d}/meminfo", _node_meminfo(node, memory[node]))
            w.write(f"{d}/distance", " ".join(str(_distance(node, other, memory_only_nodes))
                                              for other in node_list))
    total = sum(memory.values())
    w.write("proc/meminfo", _meminfo(total))
    w.write("proc/cpuinfo", "".join(
        f"processor\t: {cpu}\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n" for cpu in online))

    if cpuset is not None or cpuset_mems is not None:
        _write_cgroup(w, cgroup, cpuset or format_list(online), cpuset_mems or format_list(node_list),
                      format_list(online), format_list(node_list), cpuset_in_parent)
        if not mount_table:
            (root / "proc/self/mountinfo").unlink()
    return root


def _distance(a: int, b: int, memory_only: Mapping[int, int]) -> int:
    if a == b:
        return 10
    return 17 if a in memory_only or b in memory_only else 21


def _node_meminfo(node: int, total: int) -> str:
    kb = total // 1024
    free, active_file, inactive_file, reclaimable = kb // 2, kb // 8, kb // 16, kb // 32
    lines = [
        ("MemTotal", kb), ("MemFree", free), ("MemUsed", kb - free),
        ("Active(file)", active_file), ("Inactive(file)", inactive_file),
        ("FilePages", active_file + inactive_file), ("SReclaimable", reclaimable),
    ]
    return "".join(f"Node {node} {name + ':':<16}{value:>12} kB\n" for name, value in lines) + (
        f"Node {node} HugePages_Total:     0\n"
    )


def _meminfo(total: int) -> str:
    kb = total // 1024
    return f"MemTotal:       {kb} kB\nMemFree:        {kb // 2} kB\nMemAvailable:   {kb * 3 // 4} kB\n"


def expected_available(total: int) -> int:
    """What the reader must compute from _node_meminfo: MemFree + file pages + SReclaimable."""
    kb = total // 1024
    return (kb // 2 + kb // 8 + kb // 16 + kb // 32) * 1024


def _write_cgroup(w: _Writer, version: str, cpus: str, mems: str, all_cpus: str, all_mems: str,
                  in_parent: bool) -> None:
    leaf = "vsup.slice/test.scope"
    holder = "vsup.slice" if in_parent else leaf
    if version == "v2":
        w.write("proc/self/cgroup", f"0::/{leaf}\n")
        w.write("proc/self/mountinfo",
                "24 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n"
                "30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev shared:9 - cgroup2 cgroup2 rw,nsdelegate\n")
        base = "sys/fs/cgroup"
        w.write(f"{base}/cgroup.controllers", "cpuset cpu io memory pids")
        w.write(f"{base}/cpuset.cpus.effective", all_cpus)
        w.write(f"{base}/cpuset.mems.effective", all_mems)
        (w.root / base / leaf).mkdir(parents=True, exist_ok=True)
        w.write(f"{base}/{holder}/cpuset.cpus.effective", cpus)
        w.write(f"{base}/{holder}/cpuset.mems.effective", mems)
    elif version == "v1":
        w.write("proc/self/cgroup", f"5:cpuset:/{leaf}\n4:memory:/{leaf}\n0::/{leaf}\n")
        w.write("proc/self/mountinfo",
                "30 24 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
                "34 30 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
                "35 30 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                "41 30 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
        base = "sys/fs/cgroup/cpuset"
        w.write(f"{base}/cpuset.cpus", all_cpus)
        w.write(f"{base}/cpuset.mems", all_mems)
        (w.root / base / leaf).mkdir(parents=True, exist_ok=True)
        for name, value in (("cpuset.cpus", cpus), ("cpuset.effective_cpus", cpus),
                            ("cpuset.mems", mems), ("cpuset.effective_mems", mems)):
            w.write(f"{base}/{holder}/{name}", value)
        # the v2 hierarchy of a hybrid set-up has no cpuset controller: it must be ignored
        w.write("sys/fs/cgroup/unified/cgroup.controllers", "")
    else:
        raise ValueError(f"cgroup must be 'v1' or 'v2', not {version!r}")


def add_memory_limit(root: str | Path, limit: int | None, *, cgroup: str = "v2", parent_limit: int | None = None) -> Path:
    """Put the process of a tree from build_sysfs under a cgroup memory limit (None: "max", no
    limit) and its parent cgroup under `parent_limit`: v2 memory.max, or v1
    memory.limit_in_bytes (no limit there is the kernel's 9223372036854771712). Works beside a
    cpuset written by build_sysfs (same cgroup, same mounts) or alone."""
    root = Path(root)
    w = _Writer(root, nul_padding=False)
    leaf, parent = "vsup.slice/test.scope", "vsup.slice"
    no_limit = "max" if cgroup == "v2" else "9223372036854771712"

    def ensure_lines(rel: str, lines: list[str]) -> None:
        path = root / rel
        old = path.read_text().splitlines() if path.exists() else []
        w.write(rel, "\n".join(old + [line for line in lines if line not in old]) + "\n")

    if cgroup == "v2":
        ensure_lines("proc/self/cgroup", [f"0::/{leaf}"])
        ensure_lines("proc/self/mountinfo",
                     ["30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev shared:9 - cgroup2 cgroup2 rw,nsdelegate"])
        base = "sys/fs/cgroup"
        if not (root / base / "cgroup.controllers").exists():
            w.write(f"{base}/cgroup.controllers", "cpu io memory pids")
        w.write(f"{base}/{leaf}/memory.max", str(limit) if limit is not None else no_limit)
        w.write(f"{base}/{parent}/memory.max", str(parent_limit) if parent_limit is not None else no_limit)
    elif cgroup == "v1":
        ensure_lines("proc/self/cgroup", [f"4:memory:/{leaf}", f"0::/{leaf}"])
        ensure_lines("proc/self/mountinfo",
                     ["35 30 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory",
                      "41 30 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"])
        if not (root / "sys/fs/cgroup/unified/cgroup.controllers").exists():
            w.write("sys/fs/cgroup/unified/cgroup.controllers", "")
        base = "sys/fs/cgroup/memory"
        w.write(f"{base}/memory.limit_in_bytes", no_limit)
        w.write(f"{base}/{leaf}/memory.limit_in_bytes", str(limit) if limit is not None else no_limit)
        w.write(f"{base}/{parent}/memory.limit_in_bytes", str(parent_limit) if parent_limit is not None else no_limit)
    else:
        raise ValueError(f"cgroup must be 'v1' or 'v2', not {cgroup!r}")
    return root
