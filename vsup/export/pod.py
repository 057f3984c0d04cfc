"""One Kubernetes pod of vsup: one NUMA node's share of a machine, as vsup inside the pod sees it.

With the kubelet's CPU manager `static` (+ `full-pcpus-only`), topology manager
`single-numa-node` (scope `pod`) and memory manager `Static`, a Guaranteed pod gets whole cores
and the memory of one NUMA node; vsup inside it plans within that cpuset and the pod's memory
limit (vsup/topology/cgroup_memory.py). So the pod is shaped by running the planner on that view
of the machine — the same planner, on what the pod will see:

- one core per NUMA node stays with the kubelet and the system (`reservedSystemCPUs`): the
  node's first core, or an efficiency core on hybrid parts;
- a pod's CPUs: the rest of the smallest node, whole cores, a multiple of the SMT width
  (`full-pcpus-only` admits nothing else); every pod of the StatefulSet is the same;
- its memory: the node's MemTotal less `placement.memory_reserve_gib` (the memory manager's
  `reservedMemory`) bounds it; the planner sizes the KV cache within that bound less /dev/shm
  and vsup's own reserve, and the pod asks for exactly what its plan holds: instances ×
  (weights + KV cache + overhead) + /dev/shm + the reserve.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import yaml

from vsup.config.schema import VsupConfig, parse_config
from vsup.errors import VsupError
from vsup.export import keys
from vsup.topology.errors import PlanError
from vsup.topology.model import EFFICIENCY, Core, Machine
from vsup.topology.plan_model import GiB, Plan, PlanSettings, format_gib
from vsup.topology.planner import plan
from vsup.topology.sysfs import OUTSIDE_CPUSET

MiB = 1024**2
# Where the pod's config is mounted and where vLLM's processes share memory.
CONFIG_DIR = "/etc/vsup"
CONFIG_FILE = "vsup.yaml"


@dataclass(frozen=True)
class PodShape:
    nodes: tuple[int, ...]  # NUMA nodes whose share makes a pod (at most this many pods per host)
    instances: int  # vLLM instances per pod (= per node of the host plan)
    system_cpus: tuple[int, ...]  # reservedSystemCPUs: one whole core per node with CPUs
    reserved_memory: tuple[tuple[int, int], ...]  # (node, bytes): the memory manager's reservedMemory
    cpus: int  # requests == limits
    memory_bytes: int  # requests == limits, whole MiB
    shm_bytes: int  # the /dev/shm emptyDir's sizeLimit
    machine: Machine  # what vsup inside a pod sees
    plan: Plan  # vsup's plan inside a pod
    config: dict  # the pod's vsup configuration
    warnings: tuple[str, ...]


def node_type(machine: Machine) -> Machine:
    """A machine read here as the type of the hosts an export is for: what is free on it now and the
    memory limit of the process doing the export say nothing about those hosts, so both go."""
    nodes = tuple(replace(n, memory_available_bytes=0, memory_free_bytes=0) for n in machine.nodes)
    return replace(machine, nodes=nodes, memory_limit_bytes=None)


def instances_per_node(host_plan: Plan) -> tuple[tuple[int, ...], int]:
    """(the NUMA nodes holding instances, instances on each): every node must hold as many, and no
    instance may span nodes, since every pod is one node's share and all pods are the same."""
    counts: Counter[int] = Counter()
    for inst in host_plan.instances:
        if len(inst.cpu_nodes) != 1:
            nodes = ",".join(map(str, inst.cpu_nodes)) or "none"
            raise VsupError(
                f"instances: instance {inst.index} spans NUMA nodes {nodes}, but a pod takes one node's share; "
                "use instances: auto (one per node) or a multiple of the nodes"
            )
        counts[inst.cpu_nodes[0]] += 1
    if len(set(counts.values())) > 1:
        split = ", ".join(f"node {node}: {count}" for node, count in sorted(counts.items()))
        raise VsupError(
            f"instances: {len(host_plan.instances)} do not split evenly over NUMA nodes ({split}), but every pod "
            f"is the same; use instances: auto or a multiple of {len(counts)}"
        )
    return tuple(sorted(counts)), next(iter(counts.values()))


def system_cores(machine: Machine) -> dict[int, Core]:
    """Per node with usable CPUs, the core left to the kubelet and the OS: an efficiency core when
    the node has one (the instances want the fast ones), else its first core (CPU 0's on node 0,
    which takes most interrupts anyway)."""
    chosen: dict[int, Core] = {}
    for node in machine.cpu_nodes:
        cores = [c for c in machine.cores if c.node == node.id]
        slow = [c for c in cores if c.kind == EFFICIENCY]
        chosen[node.id] = (slow or cores)[0]
    return chosen


def shape_pod(machine: Machine, host_plan: Plan, cfg: VsupConfig, settings: PlanSettings, *, shm_bytes: int,
              share: frozenset[int] | None = None, memory_share: float = 1.0) -> PodShape:
    """A model of a fleet: `host_plan` holds its instances; `share` the CPUs the fleet plan gave it
    (its pods take its whole cores of a node, less the system core, not the whole node) and
    `memory_share` its part of the memory of a node it shares with other models."""
    nodes, per_pod = instances_per_node(host_plan)
    if settings.model_size_bytes is None:
        raise VsupError(
            f"placement.model_size_gib: the model's size is unknown ({cfg.model} is not a local directory with weight "
            "files here) and the pod's memory limit is sized from it; set placement.model_size_gib"
        )
    reserve = settings.memory_reserve_bytes
    for node_id in nodes:
        if machine.node(node_id).memory_total_bytes <= 0:
            raise VsupError(f"node {node_id}: memory size unknown (no meminfo): the pod's memory limit cannot be sized from it")
    if reserve * len(machine.cpu_nodes) <= 100 * MiB:
        raise VsupError(
            f"placement.memory_reserve_gib: {reserve / GiB:g} per node leaves the kubelet nothing to reserve besides its "
            "100 MiB eviction threshold (the memory manager needs both); use 1 or more"
        )

    system = system_cores(machine)
    smt = max(len(c.cpus) for c in machine.cores)

    def ours(core: Core) -> bool:  # a core a pod may take: not the system one, in the model's share
        return core not in system.values() and (share is None or bool(set(core.cpus) & share))

    # CPUs a pod may take on each node: whole cores, in multiples of the SMT width
    room = {n: sum(len(c.cpus) for c in machine.cores if c.node == n and ours(c)) // smt * smt for n in nodes}
    smallest = min(nodes, key=lambda n: (room[n], n))
    allocatable = min(machine.node(n).memory_total_bytes - reserve for n in nodes)
    if memory_share < 1:
        allocatable = math.floor(allocatable * memory_share)
    if allocatable <= shm_bytes:
        raise VsupError(
            f"--shm-gib {shm_bytes / GiB:g}: the pod's /dev/shm would take all of the {format_gib(allocatable)} a node "
            "leaves after its reserve; give less"
        )
    view = _pod_view(machine, smallest, ours, room[smallest], allocatable - shm_bytes)
    pod_settings = replace(settings, instances=per_pod, nodes=None, launcher="numactl")
    try:
        pod_plan = plan(view, pod_settings)
    except PlanError as exc:
        cpus = len(view.cpus_usable)
        raise VsupError(
            f"a pod (node {smallest}'s share: {cpus} CPUs, {format_gib(allocatable)} less {format_gib(shm_bytes)} of /dev/shm) "
            f"cannot hold {per_pod} instance(s): {exc}"
        ) from None
    assert pod_plan.memory_limit is not None  # the view has a limit
    memory = _whole_mib(pod_plan.memory_limit.demand_bytes + shm_bytes + reserve)
    kv = pod_plan.instances[0].kvcache_bytes
    warnings = list(pod_plan.warnings)
    if any(c.kind == EFFICIENCY for c in machine.cores):
        warnings.append(
            "hybrid CPU: the kubelet's CPU manager does not tell performance from efficiency cores, so a pod may get "
            "efficiency cores where vsup planned performance ones; vsup inside plans on what it gets"
        )
    return PodShape(
        nodes=nodes,
        instances=per_pod,
        system_cpus=tuple(sorted(cpu for core in system.values() for cpu in (core.all_cpus or core.cpus))),
        reserved_memory=tuple((node.id, reserve) for node in machine.cpu_nodes),
        cpus=len(view.cpus_usable),
        memory_bytes=memory,
        shm_bytes=shm_bytes,
        machine=view,
        plan=pod_plan,
        config=pod_config(cfg, per_pod, settings.model_size_bytes, kv),
        warnings=tuple(dict.fromkeys(warnings)),
    )


def _whole_mib(value: int) -> int:
    return math.ceil(value / MiB) * MiB


def _pod_view(machine: Machine, node_id: int, ours: Callable[[Core], bool], cpus: int, limit: int) -> Machine:
    """The machine as vsup inside a pod on `node_id` sees it: a cpuset of `cpus` CPUs of that node
    (whole cores that are `ours`, performance cores first; the system core is not among them),
    memory bound to that node, and the pod's memory limit."""
    chosen: list[Core] = []
    count = 0
    for core in sorted((c for c in machine.cores if c.node == node_id and ours(c)), key=lambda c: (c.kind == EFFICIENCY, c.id)):
        if count + len(core.cpus) <= cpus:
            chosen.append(core)
            count += len(core.cpus)
    inside = frozenset(cpu for core in chosen for cpu in core.cpus)
    unusable = dict(machine.unusable)
    unusable.update({cpu: OUTSIDE_CPUSET for cpu in machine.cpus_usable if cpu not in inside})
    return replace(
        machine,
        cpus_allowed=tuple(sorted(inside)),
        cpus_usable=tuple(sorted(inside)),
        nodes=tuple(replace(n, usable_cpus=tuple(c for c in n.usable_cpus if c in inside), allowed=n.id == node_id) for n in machine.nodes),
        cores=tuple(c for c in machine.cores if c in chosen),
        mems_allowed=(node_id,),
        unusable=tuple(sorted(unusable.items())),
        memory_limit_bytes=limit,
    )


def pod_config(cfg: VsupConfig, instances: int, weights_bytes: int, kv_bytes: int) -> dict:
    """The vsup configuration of every pod: one node's share (share_config), numactl (the image has
    it), the host paths of the user's machine left out (vLLM's venv: the image's vsup lives in it;
    log dir and control socket: their defaults)."""
    # batch off: clients reach a pod through the front, and a pod's state folder does not outlive it
    data = share_config(cfg, instances, weights_bytes, kv_bytes, {"placement": {"launcher": "numactl"}, "batch": {"enabled": False}})
    for section, key in (("vllm", "venv"), ("log", "dir"), ("control", "socket")):
        data.get(section, {}).pop(key, None)
    data = {key: value for key, value in data.items() if value != {}}
    parse_config(yaml.safe_dump(data), "the pod's vsup.yaml")  # it must load as it is written
    return data


def share_config(cfg: VsupConfig, instances: int, weights_bytes: int | None, kv_bytes: int, overrides: dict) -> dict:
    """The user's configuration for a vsup that runs one NUMA node's share of the plan (a pod, a
    Slurm step): its instance count, the sizes the export was computed from written out (so the
    vsup there plans exactly that), no node list (it plans within the CPUs it is given), its proxy
    listening beyond loopback (for a Service or a front proxy), its keys by environment only
    (export/keys.py: the file is shared); then `overrides`, section by section."""
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    if "proxy" in data:
        data["proxy"] = keys.without_secrets(data["proxy"], keys.key_vars(cfg.proxy))
    data["instances"] = instances
    placement = data.setdefault("placement", {})
    placement.pop("nodes", None)
    if weights_bytes is not None:
        placement["model_size_gib"] = weights_bytes / GiB
    placement["kvcache_gib"] = kv_bytes // GiB if kv_bytes % GiB == 0 else kv_bytes / GiB
    data.setdefault("proxy", {})["host"] = "0.0.0.0"
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
    return data
