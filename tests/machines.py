"""Synthetic Machines for planner tests: the shapes the corpus lacks, built directly as data.

CPU numbering follows Linux on x86: the first hardware thread of every core first (0..C-1), then
the second siblings (C..2C-1), and so on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vsup.topology.model import EFFICIENCY, PERFORMANCE, UNIFORM, Core, Machine, Node

GiB = 1024**3


def make_machine(
    sockets: int = 1,
    nodes_per_socket: int = 1,
    cores_per_node: int | Sequence[int] = 4,
    smt: int = 1,
    *,
    offline: Iterable[int] = (),
    cpuset: Iterable[int] | None = None,
    isolated: Iterable[int] = (),
    l3_per_node: int = 1,
    node_memory: int | Sequence[int] = 64 * GiB,
    node_available: int | Sequence[int] | None = None,
    memory_only_nodes: int = 0,
    mems_allowed: Iterable[int] | None = None,
    efficiency_cores: Iterable[int] = (),
) -> Machine:
    """`cores_per_node`: one number for all nodes or one per node (e.g. [43, 43, 42] for SNC).
    `efficiency_cores`: physical core indexes (0-based, in CPU order) that are hybrid E-cores; the
    others are then P-cores. `l3_per_node` splits each node's cores into that many L3 domains."""
    node_count = sockets * nodes_per_socket
    sizes = [cores_per_node] * node_count if isinstance(cores_per_node, int) else list(cores_per_node)
    assert len(sizes) == node_count
    memory = [node_memory] * (node_count + memory_only_nodes) if isinstance(node_memory, int) else list(node_memory)
    if node_available is None:
        available = memory
    elif isinstance(node_available, int):
        available = [node_available] * len(memory)
    else:
        available = list(node_available)
    total_cores = sum(sizes)
    offline, isolated = set(offline), set(isolated)
    cpus_all = tuple(range(total_cores * smt))
    allowed = set(cpus_all if cpuset is None else cpuset)
    online = [c for c in cpus_all if c not in offline]
    usable = set(online) & allowed - isolated
    e_cores = set(efficiency_cores)

    cores: list[Core] = []
    node_cpus: dict[int, list[int]] = {n: [] for n in range(node_count)}
    core_index = 0
    for node, size in enumerate(sizes):
        l3_size = -(-size // l3_per_node)
        for local in range(size):
            siblings = [core_index + t * total_cores for t in range(smt)]
            online_siblings = tuple(c for c in siblings if c not in offline)
            node_cpus[node].extend(online_siblings)
            first_of_l3 = core_index - local + (local // l3_size) * l3_size
            l3_cpus = [first_of_l3 + k + t * total_cores for k in range(min(l3_size, size - (local // l3_size) * l3_size)) for t in range(smt)]
            l3_online = [c for c in l3_cpus if c not in offline]
            kind = UNIFORM
            if e_cores:
                kind = EFFICIENCY if core_index in e_cores else PERFORMANCE
            if online_siblings:
                cores.append(
                    Core(
                        package=node // nodes_per_socket,
                        node=node,
                        cpus=tuple(c for c in online_siblings if c in usable),
                        all_cpus=online_siblings,
                        l3=min(l3_online) if l3_online else None,
                        kind=kind,
                    )
                )
            core_index += 1
    node_ids = list(range(node_count + memory_only_nodes))
    allowed_mems = tuple(node_ids if mems_allowed is None else sorted(mems_allowed))
    nodes = tuple(
        Node(
            id=n,
            cpus=tuple(sorted(node_cpus.get(n, []))),
            usable_cpus=tuple(sorted(c for c in node_cpus.get(n, []) if c in usable)),
            memory_total_bytes=memory[n],
            memory_free_bytes=available[n],
            memory_available_bytes=available[n],
            distances=tuple(10 if a == n else (20 if a // nodes_per_socket == n // nodes_per_socket else 32) for a in node_ids),
            allowed=n in allowed_mems,
        )
        for n in node_ids
    )
    unusable = []
    for cpu in cpus_all:
        if cpu in offline:
            unusable.append((cpu, "offline"))
        elif cpu not in allowed:
            unusable.append((cpu, "outside cpuset"))
        elif cpu in isolated:
            unusable.append((cpu, "isolated"))
    usable_cores = tuple(sorted((c for c in cores if c.cpus), key=lambda c: (c.node, c.package, c.id)))
    return Machine(
        cpus_possible=cpus_all,
        cpus_present=cpus_all,
        cpus_online=tuple(online),
        cpus_allowed=tuple(sorted(allowed)),
        cpus_isolated=tuple(sorted(isolated)),
        cpus_usable=tuple(sorted(usable)),
        nodes=nodes,
        cores=usable_cores,
        packages=tuple(range(sockets)),
        mems_allowed=allowed_mems,
        unusable=tuple(unusable),
    )
