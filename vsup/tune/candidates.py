"""Which layouts and settings `vsup tune` tries (pure: a Machine and PlanSettings in, candidates out).

Layouts come from the planner itself: for every combination of instances per NUMA node (1, 2, 4, …
while each instance keeps a core), SMT on/off (where cores have siblings), a housekeeping core
on/off and OpenMP threads per instance (all cores, about half of them, or given counts), the
planner places the instances; what it refuses is pruned with its own message, and two
combinations that end in the same placement are measured once. The tweaks are tried afterwards on
the best layout, one setting at a time: LD_PRELOAD of tcmalloc / Intel OpenMP, vLLM's
--max-num-seqs and --max-num-batched-tokens, the KV cache size, and last --enforce-eager (only
when asked: a compiled start takes minutes, so by default the config's own setting is kept).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from vsup.topology.errors import PlanError
from vsup.topology.model import Machine
from vsup.topology.plan_model import Plan, PlanSettings
from vsup.topology.planner import plan

PRELOAD_SETS = {"none": (), "tcmalloc": ("tcmalloc",), "iomp": ("iomp",), "tcmalloc+iomp": ("tcmalloc", "iomp")}
KV_MAX = "max"  # the largest KV cache that fits (the planner's own choice when kvcache_gib is unset)


@dataclass(frozen=True)
class Candidate:
    """One configuration to measure. None in a tweak field means: as in the user's configuration."""

    instances: int
    omp_threads: int | None = None  # per instance; None: one per core
    smt: bool = False
    housekeeping_core: bool = False
    preload: str = "none"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kvcache_gib: float | str | None = None  # a size, KV_MAX, or None
    enforce_eager: bool | None = None  # vLLM's --enforce-eager on (True) or off (False: torch.compile at start)

    @property
    def id(self) -> str:
        """Stable and file-name safe; the key of the results file (and of --resume)."""
        parts = [f"i{self.instances}"]
        if self.omp_threads is not None:
            parts.append(f"t{self.omp_threads}")
        if self.smt:
            parts.append("smt")
        if self.housekeeping_core:
            parts.append("hk")
        if self.preload != "none":
            parts.append(self.preload.replace("+", "-"))
        if self.max_num_seqs is not None:
            parts.append(f"seqs{self.max_num_seqs}")
        if self.max_num_batched_tokens is not None:
            parts.append(f"mbt{self.max_num_batched_tokens}")
        if self.kvcache_gib is not None:
            parts.append(f"kv{self.kvcache_gib:g}" if not isinstance(self.kvcache_gib, str) else f"kv{self.kvcache_gib}")
        if self.enforce_eager is not None:
            parts.append("eager" if self.enforce_eager else "compiled")
        return "-".join(parts)

    def settings(self, base: PlanSettings) -> PlanSettings:
        """The planner settings of this candidate: the user's, with the layout fields replaced."""
        kv = base.kvcache_gib
        if self.kvcache_gib == KV_MAX:
            kv = None
        elif self.kvcache_gib is not None:
            kv = float(self.kvcache_gib)
        return replace(base, instances=self.instances, omp_threads=self.omp_threads, smt=self.smt,
                       housekeeping_core=self.housekeeping_core, kvcache_gib=kv)


@dataclass(frozen=True)
class Planned:
    candidate: Candidate
    plan: Plan

    @property
    def id(self) -> str:
        return self.candidate.id

    def describe(self) -> str:
        """'2 × 1 core, 1 thread' style, from the plan."""
        return describe(self.plan)


@dataclass(frozen=True)
class Pruned:
    candidate: Candidate | None
    reason: str
    label: str | None = None  # for what is not one candidate (an LD_PRELOAD set)

    @property
    def id(self) -> str:
        if self.label:
            return self.label
        if self.candidate is None:
            raise ValueError("a Pruned without a candidate needs a label")
        return self.candidate.id


@dataclass(frozen=True)
class Space:
    """What may be tried; None: the default for this machine (see the module docstring)."""

    instances_per_node: tuple[int, ...] | None = None
    omp_threads: tuple[int | str, ...] | None = None  # "all", "half" or a count
    smt: tuple[bool, ...] | None = None
    housekeeping_core: tuple[bool, ...] | None = None
    preload: tuple[str, ...] | None = None
    max_num_seqs: tuple[int, ...] | None = None
    max_num_batched_tokens: tuple[int, ...] | None = None
    kvcache_gib: tuple[float, ...] | None = None
    enforce_eager: tuple[bool, ...] | None = None  # None: the config's own setting only


def describe(p: Plan) -> str:
    cores = sorted({len(i.cores) for i in p.instances})
    threads = sorted({len(i.omp_cpus) for i in p.instances})
    core_text = "/".join(map(str, cores))
    thread_text = "/".join(map(str, threads))
    return f"{len(p.instances)} × {core_text} core{'s' if cores[-1] > 1 else ''}, {thread_text} thread{'s' if threads[-1] > 1 else ''}"


def _signature(p: Plan) -> tuple:
    return tuple((i.cpus, i.omp_cpus, i.env, i.argv, i.vllm_args) for i in p.instances)


def _node_cores(machine: Machine, base: PlanSettings) -> dict[int | None, int]:
    counts: dict[int | None, int] = {}
    for core in machine.cores:
        if core.cpus and (base.nodes is None or core.node in base.nodes):
            counts[core.node] = counts.get(core.node, 0) + 1
    return counts


def default_instances_per_node(machine: Machine, base: PlanSettings) -> tuple[int, ...]:
    """1, 2, 4, … while every instance of the smallest node keeps a physical core."""
    counts = _node_cores(machine, base)
    smallest = min(counts.values(), default=1)
    return tuple(2**e for e in range(int(math.log2(smallest)) + 1))


def layouts(machine: Machine, base: PlanSettings, space: Space = Space()) -> tuple[list[Planned], list[Pruned]]:
    nodes = max(1, len(_node_cores(machine, base)))
    has_smt = any(len(c.cpus) > 1 for c in machine.cores)
    per_node = space.instances_per_node or default_instances_per_node(machine, base)
    smt_values = space.smt or ((False, True) if has_smt else (False,))
    hk_values = space.housekeeping_core or (False, True)
    thread_values = space.omp_threads or ("all", "half")

    kept: list[Planned] = []
    pruned: list[Pruned] = []
    seen: dict[tuple, str] = {}
    for k in dict.fromkeys(per_node):
        for smt in dict.fromkeys(smt_values):
            for hk in dict.fromkeys(hk_values):
                whole = Candidate(instances=k * nodes, smt=smt, housekeeping_core=hk)
                try:
                    whole_plan = plan(machine, whole.settings(base))
                except PlanError as exc:
                    pruned.append(Pruned(whole, str(exc)))
                    continue
                fewest = min(len(i.omp_cpus) for i in whole_plan.instances)
                for threads in dict.fromkeys(_thread_counts(thread_values, fewest)):
                    cand = whole if threads is None else replace(whole, omp_threads=threads)
                    try:
                        cand_plan = whole_plan if threads is None else plan(machine, cand.settings(base))
                    except PlanError as exc:
                        pruned.append(Pruned(cand, str(exc)))
                        continue
                    signature = _signature(cand_plan)
                    if signature in seen:
                        pruned.append(Pruned(cand, f"same placement as {seen[signature]}"))
                        continue
                    seen[signature] = cand.id
                    kept.append(Planned(cand, cand_plan))
    return kept, pruned


def _thread_counts(values: Iterable[int | str], fewest: int) -> list[int | None]:
    """OpenMP thread counts for instances whose smallest has `fewest` OpenMP CPUs; None = all.
    "half" applies where it leaves a core idle; a count equal to all is all (the planner refuses
    counts above it, which prunes them with its reason)."""
    out: list[int | None] = []
    for value in values:
        if value == "all":
            out.append(None)
        elif value == "half":
            if fewest >= 2:
                out.append(fewest // 2)
        else:
            out.append(None if int(value) == fewest else int(value))
    return out


# ---- tweaks on the best layout ---------------------------------------------------------------------

def preload_sets(found: Mapping[str, str], wanted: Iterable[str] | None) -> tuple[list[str], list[tuple[str, str]]]:
    """(LD_PRELOAD sets to try, [(set, why not)]). `found`: library key -> path of those installed."""
    hints = {"tcmalloc": "libtcmalloc_minimal.so.4 not found (apt-get install libtcmalloc-minimal4)",
             "iomp": "libiomp5.so not found (pip install intel-openmp in vLLM's venv)"}
    if wanted is None:
        installed = [key for key in ("tcmalloc", "iomp") if key in found]
        wanted = ["none"] + (["+".join(installed)] if installed else [])
    usable, refused = [], []
    for name in dict.fromkeys(wanted):
        missing = [lib for lib in PRELOAD_SETS[name] if lib not in found]
        if missing:
            refused.append((name, "; ".join(hints[lib] for lib in missing)))
        else:
            usable.append(name)
    return usable, refused


def tweak_dimensions(
    space: Space,
    *,
    preloads: list[str],
    base_max_num_seqs: int | None,
    base_kvcache_gib: float | None,
    busiest_per_instance: int | None,
    base_enforce_eager: bool = False,
) -> list[tuple[str, list]]:
    """[(field of Candidate, values to try)], in the order they are tried; each list holds only the
    alternatives to the user's configuration ("none" preload, its own vLLM flags and KV cache).
    --enforce-eager comes last: it is then measured against the best of everything else, the
    same configuration with and without it."""
    dims: list[tuple[str, list]] = []
    dims.append(("preload", [p for p in preloads if p != "none"]))
    if space.max_num_seqs is not None:
        seqs = list(space.max_num_seqs)
    elif busiest_per_instance and busiest_per_instance >= 2:
        # fewer sequences per step: shorter steps (ITL) against longer queues (TTFT)
        seqs = [busiest_per_instance // 2]
    else:
        seqs = []
    dims.append(("max_num_seqs", [v for v in dict.fromkeys(seqs) if v != base_max_num_seqs]))
    dims.append(("max_num_batched_tokens", list(dict.fromkeys(space.max_num_batched_tokens or ()))))
    if space.kvcache_gib is not None:
        kv: list = [v for v in dict.fromkeys(space.kvcache_gib) if v != base_kvcache_gib]
    else:
        kv = [KV_MAX] if base_kvcache_gib is not None else []
    dims.append(("kvcache_gib", kv))
    dims.append(("enforce_eager", [v for v in dict.fromkeys(space.enforce_eager or ()) if v != base_enforce_eager]))
    return [(name, values) for name, values in dims if values]


def plan_tweak(machine: Machine, base: PlanSettings, candidate: Candidate) -> Planned | Pruned:
    try:
        return Planned(candidate, plan(machine, candidate.settings(base)))
    except PlanError as exc:
        return Pruned(candidate, str(exc))
