"""What the planner takes and what it returns, as immutable data.

`PlanSettings` mirrors the `placement` section of the YAML config (vsup/config/schema.py), in bytes
and plain values; `vsup.config.planning` converts one into the other. A `Plan` holds everything that
must agree for each instance: its CPUs, the subset its OpenMP threads are bound to, its memory
node(s), the environment vLLM reads and the numactl/taskset prefix that wraps the whole command.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from vsup.topology.cpulist import format_list
from vsup.topology.errors import SettingError

GiB = 1024**3


def format_gib(value: float | int | None) -> str:
    """Bytes as whole GiB when exact ("4 GiB"), else one decimal ("1.5 GiB"); None reads as 0."""
    gib = (value or 0) / GiB
    return f"{gib:.0f} GiB" if gib == int(gib) else f"{gib:.1f} GiB"


# The `vsup plan` flag of each PlanSettings field: what the planner's errors call a setting
# (vsup.config.planning names the config key and its line instead when the value came from a file).
FLAGS = {
    "instances": "--instances", "base_port": "--base-port", "model_size_bytes": "--model-size-gib",
    "kvcache_gib": "--kvcache-gib", "reserve_cores": "--reserve-cores", "housekeeping_core": "--housekeeping-core", "smt": "--smt",
    "cores_per_instance": "--cores-per-instance", "omp_threads": "--omp-threads", "membind": "--membind", "launcher": "--launcher",
    "nodes": "--nodes", "efficiency_cores": "--efficiency-cores",
}


def setting_error(setting: str, value: object, detail: str) -> SettingError:
    """An error about one setting, worded with its `vsup plan` flag (see SettingError)."""
    return SettingError(setting, FLAGS[setting], None if value is None else str(value), detail)


def format_ids(values: Iterable[int]) -> str:
    """Node (or other) ids as the planner's messages write them: "0,1,3"."""
    return ",".join(str(v) for v in values)


@dataclass(frozen=True)
class PlanSettings:
    instances: int | Literal["auto"] = "auto"
    base_port: int = 8100
    model_size_bytes: int | None = None  # weights per instance; None: unknown (see docs/placement.md)
    kvcache_gib: float | None = None  # None: the largest equal whole-GiB share that fits
    overhead_bytes: int = int(1.5 * GiB)  # per instance, besides weights and KV cache
    memory_reserve_bytes: int = 2 * GiB  # per node, left to the OS and page cache
    # physical cores kept for vsup, the proxy and the OS; auto: 1 when the instances leave one free
    reserve_cores: int | Literal["auto"] = "auto"
    housekeeping_core: bool = False  # one extra core per instance, in cpus but not in omp_cpus
    smt: bool = False  # OpenMP threads on every hardware thread instead of one per physical core
    cores_per_instance: int | None = None  # OpenMP cores per instance; None: split all usable cores
    # OpenMP threads per instance, fewer than its OpenMP CPUs: the CPUs left over stay in its mask,
    # idle for its API server/EngineCore (decode saturates memory bandwidth before the cores). None: all
    omp_threads: int | None = None
    membind: Literal["bind", "preferred"] = "bind"
    launcher: Literal["numactl", "taskset", "none"] = "numactl"
    nodes: tuple[int, ...] | None = None  # only place instances on these NUMA nodes
    # hybrid CPUs: what efficiency cores do besides the reserve (vsup.topology.hybrid)
    efficiency_cores: Literal["housekeeping", "instances", "unused"] = "housekeeping"
    # the installed numactl has --preferred-many (an instance spanning nodes prefers all of them)
    numactl_preferred_many: bool = False


@dataclass(frozen=True)
class InstancePlan:
    index: int
    port: int
    nodes: tuple[int, ...]  # memory nodes it binds to (empty: no NUMA information)
    cpu_nodes: tuple[int, ...]  # NUMA nodes its CPUs belong to
    cpus: tuple[int, ...]  # whole affinity mask (numactl --physcpubind / taskset -c)
    omp_cpus: tuple[int, ...]  # one per OpenMP thread, = VLLM_CPU_OMP_THREADS_BIND
    housekeeping_cpus: tuple[int, ...]  # in cpus, not in omp_cpus: API server / EngineCore
    cores: tuple[int, ...]  # physical core ids (Core.id) it owns
    l3_domains: tuple[int, ...]  # L3 domain ids its cores belong to
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]  # launcher prefix; the vLLM command goes after it
    vllm_args: tuple[str, ...]  # extra vLLM arguments the plan requires (--kv-cache-memory-bytes)
    weights_bytes: int | None
    kvcache_bytes: int
    overhead_bytes: int
    kind: str = ""  # hybrid CPUs: "performance" or "efficiency", the one kind of its OpenMP team
    model: str = ""  # the served model name (a fleet: vsup/topology/fleet.py)
    replica: int = 0  # its position among its model's instances

    @property
    def memory_bytes(self) -> int:
        """What the instance is expected to hold: weights (0 when unknown) + KV cache + overhead."""
        return (self.weights_bytes or 0) + self.kvcache_bytes + self.overhead_bytes

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "port": self.port,
            "nodes": list(self.nodes),
            "cpus": list(self.cpus),
            "omp_cpus": list(self.omp_cpus),
            "env": dict(self.env),
            "argv": list(self.argv),
            "vllm_args": list(self.vllm_args),
            "cpu_nodes": list(self.cpu_nodes),
            "cpus_list": format_list(self.cpus),
            "housekeeping_cpus": list(self.housekeeping_cpus),
            "physical_cores": len(self.cores),
            "l3_domains": list(self.l3_domains),
            "weights_bytes": self.weights_bytes,
            "kvcache_bytes": self.kvcache_bytes,
            "overhead_bytes": self.overhead_bytes,
            "memory_bytes": self.memory_bytes,
            "kind": self.kind,
            **({"model": self.model, "replica": self.replica} if self.model else {}),
        }


@dataclass(frozen=True)
class NodeMemory:
    """One memory node's budget against what the plan puts on it."""

    node: int
    figure: str  # which figure the budget comes from, for humans ("MemTotal - 2.0 GiB reserve")
    total_bytes: int  # MemTotal (0: unknown)
    available_bytes: int  # MemFree + file cache + SReclaimable when the plan was made (0: unknown)
    budget_bytes: int  # what the plan may use
    demand_bytes: int  # Σ over its instances (split evenly when an instance spans nodes)
    instances: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "figure": self.figure,
            "total_bytes": self.total_bytes,
            "available_bytes": self.available_bytes,
            "budget_bytes": self.budget_bytes,
            "demand_bytes": self.demand_bytes,
            "instances": list(self.instances),
        }


@dataclass(frozen=True)
class LimitMemory:
    """The cgroup memory limit (a container's or pod's) against every instance of the plan: they
    all run in that cgroup, whatever their nodes."""

    limit_bytes: int  # memory.max / memory.limit_in_bytes
    figure: str  # "cgroup memory limit 16 GiB - 2 GiB reserve"
    budget_bytes: int  # what the plan may use: the limit less the reserve
    demand_bytes: int  # Σ over all instances (weights + KV cache + overhead)

    def to_json(self) -> dict[str, Any]:
        return {
            "limit_bytes": self.limit_bytes,
            "figure": self.figure,
            "budget_bytes": self.budget_bytes,
            "demand_bytes": self.demand_bytes,
        }


@dataclass(frozen=True)
class FleetModel:
    """What the fleet planner takes for one model (vsup/topology/fleet.py)."""

    name: str  # the served model name
    settings: PlanSettings
    share: float | None = None  # fraction of the usable physical cores; None: the planner decides


@dataclass(frozen=True)
class Kept:
    """What a reload keeps of a model that runs unchanged (vsup/topology/fleet.py): its CPUs and
    the KV cache per instance it was planned with, so that its instances' launch stays the same
    whatever the models around it do."""

    cpus: frozenset[int]
    kvcache_bytes: int
    instances: tuple[InstancePlan, ...] = ()  # its instances as they run (by replica), reused as they are


@dataclass(frozen=True)
class ModelShare:
    """One model's part of a fleet plan: its CPUs and nodes, its instances, why it got them."""

    name: str
    settings: PlanSettings
    cpus: tuple[int, ...]
    nodes: tuple[int, ...]  # NUMA nodes its CPUs are on
    instances: tuple[int, ...]  # instance indexes
    reason: str  # how the planner chose its share, in words
    share: float | None = None  # models[i].share it was planned with

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "cpus": list(self.cpus), "cpus_list": format_list(self.cpus),
                "nodes": list(self.nodes), "instances": list(self.instances), "reason": self.reason}


@dataclass(frozen=True)
class Plan:
    instances: tuple[InstancePlan, ...]
    reserved_cpus: tuple[int, ...]
    unused_cpus: tuple[tuple[int, str], ...]  # (cpu, why no instance gets it), sorted by cpu
    warnings: tuple[str, ...]
    memory: tuple[NodeMemory, ...]
    settings: PlanSettings  # a fleet's: its first model's (the machine-wide keys are the same in all)
    memory_limit: LimitMemory | None = None  # None: no cgroup memory limit
    models: tuple[ModelShare, ...] = ()  # a fleet's models; () for a single-model plan

    def of_model(self, name: str) -> tuple[InstancePlan, ...]:
        return tuple(inst for inst in self.instances if inst.model == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "instances": [inst.to_json() for inst in self.instances],
            "reserved_cpus": list(self.reserved_cpus),
            "unused_cpus": [{"cpu": cpu, "reason": reason} for cpu, reason in self.unused_cpus],
            "warnings": list(self.warnings),
            "memory": [node.to_json() for node in self.memory],
            "memory_limit": self.memory_limit.to_json() if self.memory_limit else None,
            "efficiency_cores": self.settings.efficiency_cores,
            **({"models": [m.to_json() for m in self.models]} if self.models else {}),
        }
