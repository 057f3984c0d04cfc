"""How the instances start (`start.mode`): all at once when memory holds their load peaks together,
one after another otherwise; pure, from the plan.

Each instance loads on its own cores, so starting them together costs no instance any time: the
fleet serves in the time of its slowest load instead of the sum of them. What parallel starts can
overrun is memory at the load's peak. The estimate per instance (an estimate: docs/supervisor.md):

- while it loads it holds its weights once as its own memory — the tensors it fills — plus its
  overhead (measured with real vLLM 0.32 and the real-shape model of tests/test_vllm_realshape.py:
  the loading tree's anonymous memory peaked at its weights + the overhead, no more than once
  loaded; bench/start_bench.py records it as load_peak_bytes: docs/bench/start_bench-eager.json); its KV cache does not exist yet (vLLM allocates it after the load and the compile warm-up);
- the checkpoint it reads them from is mmap'd: its pages (page cache, on its own node under
  numactl --membind, and charged to a cgroup) are resident while it loads — a second copy of the
  weights, but one per model, shared by every instance of that model that loads from the same
  files (measured: file pages of the loading tree ≈ the weights, gone from it once loaded);
- once loaded, what the plan gives it: weights + KV cache + overhead.

Per holder of memory — each NUMA node's budget (MemTotal less the reserve; an instance spanning
nodes counts a share on each), the cgroup limit over all instances — all loading at once peak at
the larger of the sum of their loads (weights + overhead) plus every model's checkpoint pages, and
the plan's demand (weights + KV cache + overhead, once loaded); one at a time, at the plan's demand
less one instance's KV cache plus its model's pages, the largest such. `auto` picks parallel when every holder takes the parallel
peak, or when staggering would lower no peak that does not fit (one model: its pages come either
way); else staggered, saying which holder and by how much. Several models whose checkpoints would
not fit together are what staggering is for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from vsup.topology.plan_model import InstancePlan, Plan, format_gib

Mode = Literal["parallel", "staggered"]
LOAD_COPIES = 1  # the weights an instance holds as its own memory while it loads (measured, see above)
HOW = ("while instances load, each holds its weights and overhead, and every model's checkpoint pages are resident "
       "once, however many instances read them")


@dataclass(frozen=True)
class Holder:
    """One budget the instances' memory comes out of, and their peaks in it."""

    name: str  # "node 0", "the cgroup memory limit"
    budget: int
    parallel: int  # the peak with every instance loading at once
    staggered: int  # the peak one at a time

    @property
    def fits(self) -> bool:
        return self.parallel <= self.budget


@dataclass(frozen=True)
class StartChoice:
    mode: Mode
    asked: str  # start.mode as configured: auto, parallel, staggered
    reason: str
    holders: tuple[Holder, ...] = ()
    estimated: bool = False  # decided from the load peaks (the estimate above)

    def describe(self, *, estimate: bool = True) -> str:
        """One line for vsup's log ("parallel (start.mode auto): ... (the estimate)") and, without
        the estimate's words, `vsup plan`'s table (docs/supervisor.md explains it there)."""
        return f"{self.mode} (start.mode {self.asked}): {self.reason}" + (f" ({HOW})" if estimate and self.estimated else "")

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "asked": self.asked, "reason": self.reason, "estimate": HOW,
                "holders": [{"name": h.name, "budget_bytes": h.budget, "parallel_peak_bytes": h.parallel,
                             "staggered_peak_bytes": h.staggered} for h in self.holders]}


def _peaks(members: list[tuple[InstancePlan, float]]) -> tuple[int, int]:
    """(parallel peak, one-at-a-time peak) of these instances, each with its share of the holder."""
    loading = steady = 0.0
    pages: dict[str, float] = {}  # model -> its checkpoint's pages while it loads (once, shared by its instances)
    for inst, share in members:
        loading += share * (LOAD_COPIES * (inst.weights_bytes or 0) + inst.overhead_bytes)  # no KV cache yet
        steady += share * inst.memory_bytes
        pages[inst.model] = max(pages.get(inst.model, 0.0), share * (inst.weights_bytes or 0))
    # one at a time: the others loaded (their plan's memory) while this one loads beside its checkpoint's pages
    alone = max((share * (LOAD_COPIES * (inst.weights_bytes or 0) + inst.overhead_bytes - inst.memory_bytes) + pages[inst.model]
                 for inst, share in members), default=0.0)
    return round(max(loading + sum(pages.values()), steady)), round(max(steady, steady + alone))


def holders(plan: Plan) -> list[Holder]:
    """The plan's budgets whose size is known, with the instances' peaks in each."""
    found = []
    by_index = {inst.index: inst for inst in plan.instances}
    for node in plan.memory:
        if node.figure == "unknown" or node.budget_bytes <= 0:
            continue
        members = [(by_index[i], 1 / len(by_index[i].nodes)) for i in node.instances if i in by_index and by_index[i].nodes]
        found.append(Holder(f"node {node.node}", node.budget_bytes, *_peaks(members)))
    if plan.memory_limit is not None:
        found.append(Holder("the cgroup memory limit", plan.memory_limit.budget_bytes,
                            *_peaks([(inst, 1.0) for inst in plan.instances])))
    return found


def choose_start(plan: Plan, asked: str) -> StartChoice:
    """`asked`: start.mode (auto, parallel or staggered)."""
    count = len(plan.instances)
    found = tuple(holders(plan))
    if asked in ("parallel", "staggered"):
        over = [h for h in found if not h.fits]
        note = "" if asked == "staggered" or not over else (
            f"; all loading at once may peak at {format_gib(over[0].parallel)} on {over[0].name}, over its "
            f"{format_gib(over[0].budget)} budget")
        mode: Mode = "parallel" if asked == "parallel" else "staggered"
        return StartChoice(mode, asked, f"as configured{note}", found, bool(note))
    if count <= 1:
        return StartChoice("parallel", asked, "one instance", found)
    if any(inst.weights_bytes is None for inst in plan.instances):
        return StartChoice("staggered", asked, "the model size is unknown (placement.model_size_gib), so the load "
                                               "peaks cannot be checked: one instance at a time", found)
    if not found:
        return StartChoice("staggered", asked, "no node's memory size is known, so the load peaks cannot be checked: "
                                               "one instance at a time", found)
    worse = [h for h in found if not h.fits and h.staggered < h.parallel]
    if worse:
        h = max(worse, key=lambda h: h.parallel / h.budget)
        return StartChoice("staggered", asked, (
            f"loading all {count} instances at once could peak at {format_gib(h.parallel)} on {h.name}, over its "
            f"{format_gib(h.budget)} budget; one at a time it peaks at {format_gib(h.staggered)}"), found, True)
    tight = max(found, key=lambda h: h.parallel / h.budget)
    if tight.fits:
        return StartChoice("parallel", asked, (
            f"all {count} instances load at once: their peak, {format_gib(tight.parallel)} on {tight.name} (the fullest), "
            f"fits its {format_gib(tight.budget)} budget"), found, True)
    return StartChoice("parallel", asked, (
        f"a load could peak at {format_gib(tight.parallel)} on {tight.name}, over its {format_gib(tight.budget)} budget, "
        f"in any order (its model's checkpoint pages come with the first load: starting the others later would not lower "
        f"it)"), found, True)
