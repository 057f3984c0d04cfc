"""Read a machine's CPU/NUMA layout from sysfs and procfs under a filesystem root.

`read_machine("/")` reads this machine; `read_machine(dump_dir)` reads an unpacked dump (hwloc's
HWLOC_FSROOT convention: the directory that stands for "/"). Nothing here runs a program.

What counts, and where it comes from:
- online CPUs: cpu/online; without it, each cpuN/online ("1"/"0"), and a cpuN without that file
  is online when it has a topology/ directory (offline CPUs lose it; CPUs that cannot be
  unplugged have no online file at all).
- physical cores: online CPUs grouped by their SMT sibling masks (core_cpus, else
  thread_siblings). (package, core_id) is not unique on many machines, so core_id is not used.
- NUMA nodes: nodeN/cpumap (the mask: hand-made dumps leave cpulist stale), nodeN/meminfo,
  nodeN/distance. No node directory means one node 0 holding every CPU and /proc/meminfo.
- usable CPUs: online ∩ cgroup cpuset (∩ sched_getaffinity when live) − kernel-isolated CPUs.
- memory limit: the cgroup's memory.max / memory.limit_in_bytes (vsup.topology.cgroup_memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vsup.topology.cgroup import Cpuset, read_cpuset
from vsup.topology.cgroup_memory import read_memory_limit
from vsup.topology.cpulist import parse_list
from vsup.topology.errors import TopologyError
from vsup.topology.fsroot import FsRoot
from vsup.topology.isa import read_isa
from vsup.topology.kinds import read_kinds
from vsup.topology.meminfo import Memory, memory_from_meminfo
from vsup.topology.model import UNIFORM, Core, Machine, Node

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"

OFFLINE = "offline"
OUTSIDE_CPUSET = "outside cpuset"
OUTSIDE_AFFINITY = "outside affinity"
ISOLATED = "isolated"


@dataclass(frozen=True)
class _RawNode:
    id: int
    cpus: frozenset[int]  # from the mask, before intersecting with the online CPUs
    memory: Memory
    distance_row: tuple[int, ...]


@dataclass(frozen=True)
class _CpuTopology:
    package: int
    siblings: frozenset[int]
    die: int | None
    cluster: int | None
    l3: frozenset[int] | None


def read_machine(fsroot: str | Path = "/", *, live: bool | None = None) -> Machine:
    """The machine under `fsroot`. `live` (default: fsroot is "/") adds what only the running
    process can know: its scheduler affinity and py-cpuinfo's ISA flags."""
    root = Path(fsroot)
    if not root.is_dir():
        raise TopologyError(
            f"fsroot {str(fsroot)!r}: no such directory; expected / or the root of a filesystem "
            "dump (the directory holding sys/ and proc/)"
        )
    if live is None:
        live = root.resolve() == Path("/")
    fs = FsRoot(root)
    if not fs.is_dir(CPU_DIR):
        raise TopologyError(
            f"{fs.path(CPU_DIR)}: missing; expected the sysfs CPU directory "
            f"(is {str(root)!r} the root of a Linux filesystem or of a sysfs dump?)"
        )
    sources: list[tuple[str, str]] = []

    cpu_dirs = frozenset(fs.numbered(CPU_DIR, "cpu"))
    online, online_source = _read_online(fs, cpu_dirs)
    sources.append(("cpus_online", online_source))
    present = (_optional_list(fs, f"{CPU_DIR}/present") or cpu_dirs) | online
    possible = (_optional_list(fs, f"{CPU_DIR}/possible") or present) | present
    isolated = _optional_list(fs, f"{CPU_DIR}/isolated") & possible

    cpuset = read_cpuset(fs)
    if cpuset.cpus_file:
        sources.append(("cpuset", cpuset.cpus_file + (f", {cpuset.note}" if cpuset.note else "")))
    elif cpuset.note:  # none found, or only cpuset.mems: say so rather than nothing
        sources.append(("cpuset", cpuset.note))
    allowed = online if cpuset.cpus is None else online & cpuset.cpus
    affinity: frozenset[int] | None = None
    if live:
        affinity = frozenset(os.sched_getaffinity(0))
        allowed &= affinity
        sources.append(("affinity", "sched_getaffinity(0)"))
    usable = allowed - isolated

    raw_nodes, nodes_source = _read_nodes(fs, online)
    sources.append(("nodes", nodes_source))
    node_of = _node_of_cpu(fs, raw_nodes)
    node_ids = [n.id for n in raw_nodes]
    mems_allowed = _mems_allowed(fs, cpuset, node_ids, live)
    if cpuset.mems_file:
        sources.append(("mems", cpuset.mems_file))

    topologies = {cpu: _read_cpu_topology(fs, cpu) for cpu in sorted(online)}
    kinds, kinds_source = read_kinds(fs, online)
    sources.append(("kind", kinds_source))
    all_cores = _build_cores(topologies, online, usable, node_of, kinds)

    isa, isa_source = read_isa(fs, live)
    sources.append(("isa", isa_source))
    memory_limit = read_memory_limit(fs)
    if memory_limit.file:
        sources.append(("memory_limit", memory_limit.file))

    # Read once for all nodes, and only when some node has a distance row to match.
    distance_columns = _distance_columns(fs, node_ids) if any(raw.distance_row for raw in raw_nodes) else ()
    nodes = tuple(
        Node(
            id=raw.id,
            cpus=tuple(sorted(raw.cpus & online)),
            usable_cpus=tuple(sorted(raw.cpus & usable)),
            memory_total_bytes=raw.memory.total_bytes,
            memory_free_bytes=raw.memory.free_bytes,
            memory_available_bytes=raw.memory.available_bytes,
            distances=_distances(raw.distance_row, node_ids, distance_columns),
            allowed=raw.id in mems_allowed,
        )
        for raw in raw_nodes
    )
    return Machine(
        cpus_possible=tuple(sorted(possible)),
        cpus_present=tuple(sorted(present)),
        cpus_online=tuple(sorted(online)),
        cpus_allowed=tuple(sorted(allowed)),
        cpus_isolated=tuple(sorted(isolated)),
        cpus_usable=tuple(sorted(usable)),
        nodes=nodes,
        cores=tuple(core for core in all_cores if core.cpus),
        all_cores=all_cores,
        packages=tuple(sorted({core.package for core in all_cores})),
        isa=isa,
        mems_allowed=tuple(sorted(mems_allowed)),
        unusable=_unusable(present | online, online, cpuset.cpus, affinity, isolated),
        sources=tuple(sources),
        memory_limit_bytes=memory_limit.bytes,
    )


def _optional_list(fs: FsRoot, rel: str) -> frozenset[int]:
    return fs.cpu_list(rel) or frozenset()


def _read_online(fs: FsRoot, cpu_dirs: frozenset[int]) -> tuple[frozenset[int], str]:
    online = fs.cpu_list(f"{CPU_DIR}/online")
    if online:
        return online, str(fs.path(f"{CPU_DIR}/online"))
    found: set[int] = set()
    for cpu in cpu_dirs:
        flag = fs.read_nonblank(f"{CPU_DIR}/cpu{cpu}/online")
        if flag is None:
            if fs.is_dir(f"{CPU_DIR}/cpu{cpu}/topology"):
                found.add(cpu)
        elif flag == "1":
            found.add(cpu)
        elif flag != "0":
            raise TopologyError(f"{fs.path(f'{CPU_DIR}/cpu{cpu}/online')}: {flag[:20]!r}; expected 1 or 0")
    if not found:
        raise TopologyError(
            f"{fs.path(f'{CPU_DIR}/online')}: missing, and no cpuN/online or cpuN/topology "
            "tells which CPUs are online; expected a CPU list like 0-15"
        )
    return frozenset(found), f"{fs.path(CPU_DIR)}/cpuN/online and cpuN/topology (no cpu/online)"


def _read_nodes(fs: FsRoot, online: frozenset[int]) -> tuple[list[_RawNode], str]:
    ids = fs.numbered(NODE_DIR, "node")
    if not ids:
        # No NUMA support compiled in (or not exposed): one node with everything.
        rel = "proc/meminfo"
        text = fs.require(rel, "lines like 'MemTotal: 16384 kB' (there is no sys/devices/system/node)")
        memory = memory_from_meminfo(text, str(fs.path(rel)))
        return [_RawNode(0, online, memory, (10,))], f"{fs.path(rel)} (no NUMA nodes in sysfs)"
    nodes = []
    for node_id in ids:
        d = f"{NODE_DIR}/node{node_id}"
        cpus = fs.cpu_mask(f"{d}/cpumap")
        if cpus is None:
            cpus = fs.cpu_list(f"{d}/cpulist")
        if cpus is None:
            cpus = frozenset(fs.numbered(d, "cpu"))
        text = fs.require(f"{d}/meminfo", f"lines like 'Node {node_id} MemTotal: 16384 kB'")
        memory = memory_from_meminfo(text, str(fs.path(f"{d}/meminfo")))
        nodes.append(_RawNode(node_id, cpus, memory, _distance_row(fs, f"{d}/distance")))
    return nodes, f"{fs.path(NODE_DIR)}/nodeN/cpumap, meminfo, distance"


def _distance_row(fs: FsRoot, rel: str) -> tuple[int, ...]:
    text = fs.read_nonblank(rel)
    if text is None:
        return ()
    try:
        return tuple(int(v) for v in text.split())
    except ValueError:
        raise TopologyError(f"{fs.path(rel)}: {text[:60]!r}; expected distances like '10 21'") from None


def _distance_columns(fs: FsRoot, node_ids: list[int]) -> tuple[list[int], ...]:
    """The node lists a distance row may be printed for: the kernel prints one entry per online
    node, in id order; dumps with an offline node keep entries for every possible node."""
    return (
        node_ids,
        sorted(_optional_list(fs, f"{NODE_DIR}/online")),
        sorted(_optional_list(fs, f"{NODE_DIR}/possible")),
    )


def _distances(row: tuple[int, ...], node_ids: list[int], candidates: tuple[list[int], ...]) -> tuple[int, ...]:
    """This node's row, one entry per node of Machine.nodes, or () when the row cannot be matched:
    taken from the first of the candidate node lists whose length matches the row."""
    if not row:
        return ()
    for columns in candidates:
        if len(columns) == len(row) and set(node_ids) <= set(columns):
            return tuple(row[columns.index(node_id)] for node_id in node_ids)
    return ()


def _node_of_cpu(fs: FsRoot, nodes: list[_RawNode]) -> dict[int, int]:
    node_of: dict[int, int] = {}
    for node in nodes:
        for cpu in node.cpus:
            if cpu in node_of:
                raise TopologyError(
                    f"{fs.path(NODE_DIR)}: CPU {cpu} is in both node{node_of[cpu]}/cpumap and "
                    f"node{node.id}/cpumap; expected each CPU in one node"
                )
            node_of[cpu] = node.id
    return node_of


def _mems_allowed(fs: FsRoot, cpuset: Cpuset, node_ids: list[int], live: bool) -> frozenset[int]:
    allowed = frozenset(node_ids)
    if cpuset.mems is not None:
        allowed &= cpuset.mems
    if live:
        # The kernel's own view of this process's memory nodes, whatever the cgroup set-up.
        for line in (fs.read("proc/self/status") or "").splitlines():
            if line.startswith("Mems_allowed_list:"):
                try:
                    mems = parse_list(line.partition(":")[2])
                except ValueError:
                    continue
                if mems:
                    allowed &= mems
    return allowed


def _read_cpu_topology(fs: FsRoot, cpu: int) -> _CpuTopology:
    t = f"{CPU_DIR}/cpu{cpu}/topology"
    siblings = (
        fs.cpu_mask(f"{t}/core_cpus")
        or fs.cpu_mask(f"{t}/thread_siblings")
        or fs.cpu_list(f"{t}/core_cpus_list")
        or fs.cpu_list(f"{t}/thread_siblings_list")
    )
    if not siblings:
        raise TopologyError(
            f"{fs.path(f'{t}/thread_siblings')}: missing; expected the SMT sibling mask of online "
            f"CPU {cpu} (core_cpus or thread_siblings): without it every thread would count as a core"
        )
    package = fs.integer(f"{t}/physical_package_id")
    if package is None:
        raise TopologyError(
            f"{fs.path(f'{t}/physical_package_id')}: missing; expected the package (socket) id of online CPU {cpu}"
        )
    return _CpuTopology(
        package=package,
        siblings=siblings | {cpu},
        die=fs.integer(f"{t}/die_id"),
        cluster=fs.integer(f"{t}/cluster_id"),
        l3=_read_l3(fs, cpu),
    )


def _read_l3(fs: FsRoot, cpu: int) -> frozenset[int] | None:
    cache = f"{CPU_DIR}/cpu{cpu}/cache"
    for index in fs.numbered(cache, "index"):
        d = f"{cache}/index{index}"
        if fs.integer(f"{d}/level") != 3 or fs.read_nonblank(f"{d}/type") == "Instruction":
            continue
        shared = fs.cpu_mask(f"{d}/shared_cpu_map")
        if shared is None:
            shared = fs.cpu_list(f"{d}/shared_cpu_list")
        if shared:
            return shared | {cpu}
    return None


class _Groups:
    """Union-find: CPUs that any file says belong together end up in one group, so a dump whose
    masks disagree with each other still yields a partition."""

    def __init__(self, members):
        self.parent = {m: m for m in members}

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def groups(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for m in sorted(self.parent):
            out.setdefault(self.find(m), []).append(m)
        return out


def _build_cores(
    topologies: dict[int, _CpuTopology],
    online: frozenset[int],
    usable: frozenset[int],
    node_of: dict[int, int],
    kinds: dict[int, str],
) -> tuple[Core, ...]:
    cores = _Groups(online)
    l3s = _Groups(online)
    for cpu, topo in topologies.items():
        for other in topo.siblings & online:
            cores.union(cpu, other)
        for other in (topo.l3 or frozenset()) & online:
            l3s.union(cpu, other)
    result = []
    for first, members in cores.groups().items():
        topo = topologies[first]
        result.append(
            Core(
                package=topo.package,
                node=node_of.get(first),
                cpus=tuple(cpu for cpu in members if cpu in usable),
                all_cpus=tuple(members),
                l3=l3s.find(first) if topo.l3 is not None else None,
                die=topo.die,
                cluster=topo.cluster,
                kind=kinds.get(first, UNIFORM),
            )
        )
    result.sort(key=lambda c: (c.node is None, c.node or 0, c.package, c.id))
    return tuple(result)


def _unusable(
    cpus: frozenset[int],
    online: frozenset[int],
    cpuset_cpus: frozenset[int] | None,
    affinity: frozenset[int] | None,
    isolated: frozenset[int],
) -> tuple[tuple[int, str], ...]:
    reasons = []
    for cpu in sorted(cpus):
        if cpu not in online:
            reasons.append((cpu, OFFLINE))
        elif cpuset_cpus is not None and cpu not in cpuset_cpus:
            reasons.append((cpu, OUTSIDE_CPUSET))
        elif affinity is not None and cpu not in affinity:
            reasons.append((cpu, OUTSIDE_AFFINITY))
        elif cpu in isolated:
            reasons.append((cpu, ISOLATED))
    return tuple(reasons)
