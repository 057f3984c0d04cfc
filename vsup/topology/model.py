"""What a machine looks like, as immutable data. Built by ``vsup.topology.sysfs`` (or by tests),
consumed by ``vsup.topology.planner`` and the CLI. CPU sets are sorted tuples so that equal machines
compare equal and plans are deterministic."""

from __future__ import annotations

from dataclasses import dataclass, field

# Core.kind values: hybrid parts have "performance" and "efficiency" cores, everything else "uniform".
UNIFORM = "uniform"
PERFORMANCE = "performance"
EFFICIENCY = "efficiency"


@dataclass(frozen=True)
class Core:
    """One physical core: the SMT siblings that share its execution units."""

    package: int  # physical_package_id
    node: int | None  # NUMA node of its CPUs (None when no listed node holds them: an offline node)
    cpus: tuple[int, ...]  # usable SMT siblings (online, allowed, not isolated), sorted
    all_cpus: tuple[int, ...] = ()  # every online sibling, usable or not
    l3: int | None = None  # L3 domain id: the smallest online CPU sharing that L3; None if no L3
    die: int | None = None
    cluster: int | None = None
    kind: str = UNIFORM

    @property
    def id(self) -> int:
        """A stable identity for the core: its smallest online CPU."""
        return min(self.all_cpus or self.cpus)


@dataclass(frozen=True)
class Node:
    """One NUMA node. A node with memory and no CPUs is memory-only (HBM, CXL, Optane)."""

    id: int
    cpus: tuple[int, ...]  # online CPUs of the node (from cpumap)
    usable_cpus: tuple[int, ...]  # cpus ∩ the CPUs this process may use
    memory_total_bytes: int
    memory_free_bytes: int
    # MemFree + Active(file) + Inactive(file) + SReclaimable: raw MemFree excludes page cache and
    # would refuse plans on a healthy box.
    memory_available_bytes: int = 0
    distances: tuple[int, ...] = ()  # row of the distance matrix, in the order of Machine.nodes
    allowed: bool = True  # inside cpuset.mems (memory may be bound here)

    @property
    def memory_only(self) -> bool:
        return not self.cpus and self.memory_total_bytes > 0


@dataclass(frozen=True)
class Isa:
    """Instruction-set facts vLLM CPU cares about."""

    avx2: bool = False  # required by vLLM's x86 build: without it, "illegal instruction"
    avx512f: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    amx_tile: bool = False
    arch: str = ""  # uname machine: x86_64, aarch64, ppc64le...
    avx512_vnni: bool = False
    flags_known: bool = False  # a flags line was read; False: every flag above is unknown, not absent


@dataclass(frozen=True)
class Machine:
    """Everything the planner needs to know, and what `vsup topology` shows."""

    cpus_possible: tuple[int, ...]
    cpus_present: tuple[int, ...]
    cpus_online: tuple[int, ...]
    cpus_allowed: tuple[int, ...]  # cgroup cpuset (∩ sched_getaffinity when live)
    cpus_isolated: tuple[int, ...]  # kernel isolcpus
    cpus_usable: tuple[int, ...]  # online ∩ allowed − isolated
    nodes: tuple[Node, ...]  # sorted by id; sparse ids are kept as they are
    cores: tuple[Core, ...]  # cores with at least one usable CPU, sorted by (node, package, id)
    packages: tuple[int, ...]
    isa: Isa = field(default_factory=Isa)
    mems_allowed: tuple[int, ...] = ()
    # CPU -> why it cannot be used: "offline", "outside cpuset", "outside affinity" (live only),
    # "isolated"; present CPUs only, the first reason that applies
    unusable: tuple[tuple[int, str], ...] = ()
    sources: tuple[tuple[str, str], ...] = ()  # which file each fact came from, for humans
    # every physical core with an online CPU, usable or not (Core.cpus may be empty), same order
    # as `cores`: what the text map shows and what "cores on this machine" counts
    all_cores: tuple[Core, ...] = ()
    # the cgroup memory limit this process runs under (a container's or pod's memory.max); None:
    # no limit. The planner budgets the instances of this process within it.
    memory_limit_bytes: int | None = None

    def node(self, node_id: int) -> Node:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @property
    def cpu_nodes(self) -> tuple[Node, ...]:
        """Nodes that have at least one usable CPU."""
        return tuple(n for n in self.nodes if n.usable_cpus)
