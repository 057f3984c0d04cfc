"""start.mode auto (vsup/topology/startmode.py): parallel when each budget holds the load peaks of
its instances together, staggered only when that lowers a peak that does not fit; the plan's own
numbers (from the planner on synthetic machines, and hand-made plans)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.machines import GiB, make_machine
from tests.vsup_harness import VSUP
from vsup.topology.plan_model import InstancePlan, LimitMemory, NodeMemory, Plan, PlanSettings
from vsup.topology.planner import plan
from vsup.topology.startmode import choose_start


def instance(index: int, *, model: str = "", weights: float | None = 4, kv: float = 4, overhead: float = 1,
             nodes: tuple[int, ...] = (0,)) -> InstancePlan:
    return InstancePlan(index=index, port=8100 + index, nodes=nodes, cpu_nodes=nodes, cpus=(index,), omp_cpus=(index,),
                        housekeeping_cpus=(), cores=(index,), l3_domains=(0,), env=(), argv=(), vllm_args=(),
                        weights_bytes=None if weights is None else int(weights * GiB), kvcache_bytes=int(kv * GiB),
                        overhead_bytes=int(overhead * GiB), model=model)


def hand_plan(instances: list[InstancePlan], budgets: dict[int, float], limit: float | None = None) -> Plan:
    memory = tuple(NodeMemory(node=n, figure="MemTotal - 2 GiB reserve", total_bytes=int((b + 2) * GiB), available_bytes=0,
                              budget_bytes=int(b * GiB), demand_bytes=0,
                              instances=tuple(i.index for i in instances if n in i.nodes)) for n, b in budgets.items())
    cap = LimitMemory(limit_bytes=int((limit + 2) * GiB), figure="cgroup", budget_bytes=int(limit * GiB), demand_bytes=0) \
        if limit is not None else None
    return Plan(instances=tuple(instances), reserved_cpus=(), unused_cpus=(), warnings=(), memory=memory,
                settings=PlanSettings(), memory_limit=cap)


HOW = ("while instances load, each holds its weights and overhead, and every model's checkpoint pages are resident "
       "once, however many instances read them")


def test_instances_whose_kv_cache_is_larger_than_their_weights_start_at_once_when_the_plan_fits():
    # each: 4 weights + 8 KV + 1 = 13 once loaded, 4 + 1 = 5 while loading beside their model's
    # checkpoint pages (4, once): 14 while loading, the plan's 26 GiB is the peak
    choice = choose_start(hand_plan([instance(0, kv=8), instance(1, kv=8)], {0: 26}), "auto")
    assert choice.mode == "parallel"
    assert choice.reason == "all 2 instances load at once: their peak, 26 GiB on node 0 (the fullest), fits its 26 GiB budget"
    assert choice.describe() == f"parallel (start.mode auto): {choice.reason} ({HOW})"  # vsup's log: the estimate too
    assert choice.describe(estimate=False) == f"parallel (start.mode auto): {choice.reason}"  # `vsup plan`'s table
    assert choice.holders[0].parallel == choice.holders[0].staggered == 26 * GiB


def test_instances_of_one_model_share_its_checkpoint_pages_so_they_load_at_once():
    # each 8 weights + 2 KV + 1 = 11 planned, 8 + 1 = 9 while loading; the checkpoint's 8 GiB of pages
    # once: 18 + 8 = 26 (measured: bench/start_bench.py; the estimate before counted 2 × 8 + 1 per
    # instance, 34, and staggered)
    choice = choose_start(hand_plan([instance(0, weights=8, kv=2), instance(1, weights=8, kv=2)], {0: 26}), "auto")
    assert choice.mode == "parallel" and choice.holders[0].parallel == 26 * GiB
    assert choice.reason.startswith("all 2 instances load at once: their peak, 26 GiB on node 0")


def test_a_tight_node_whose_models_would_not_load_together_starts_one_at_a_time():
    # two models of 8 GiB, 11 planned, 9 while loading: 18 + both checkpoints' pages (16) = 34 at once;
    # one at a time 11 + 9 + 8 = 28
    two = [instance(0, model="a", weights=8, kv=2), instance(1, model="b", weights=8, kv=2)]
    choice = choose_start(hand_plan(two, {0: 30}), "auto")
    assert choice.mode == "staggered"
    assert choice.reason == ("loading all 2 instances at once could peak at 34 GiB on node 0, over its 30 GiB budget; "
                             "one at a time it peaks at 28 GiB")
    assert choose_start(hand_plan(two, {0: 34}), "auto").mode == "parallel"


def test_one_instance_per_node_loads_at_once_even_over_budget_since_staggering_lowers_nothing():
    spread = [instance(0, weights=8, kv=2, nodes=(0,)), instance(1, weights=8, kv=2, nodes=(1,))]
    choice = choose_start(hand_plan(spread, {0: 12, 1: 12}), "auto")  # 9 + its checkpoint's 8 on each node
    assert choice.mode == "parallel"
    assert choice.reason.startswith("a load could peak at 17 GiB on node 0, over its 12 GiB budget, in any order")


def test_each_node_and_the_cgroup_limit_are_budgets_and_a_spanning_instance_counts_a_share_on_each():
    # 12 planned (6 on each node), 10 loading (5 each), checkpoint 8 (4 each)
    spanning = instance(0, nodes=(0, 1), weights=8, kv=2, overhead=2)
    other = instance(1, model="embed", nodes=(1,), weights=3, kv=1, overhead=1)  # 5 planned, 4 loading, checkpoint 3
    choice = choose_start(hand_plan([spanning, other], {0: 17, 1: 30}), "auto")
    peaks = {h.name: (h.parallel / GiB, h.staggered / GiB) for h in choice.holders}
    assert peaks == {"node 0": (9, 9), "node 1": (16, 14)}  # node 1: 5 + 4 + 4 + 3 at once; 5 + 5 + 4 one at a time
    assert choice.mode == "parallel"
    limited = choose_start(hand_plan([spanning, other], {0: 17, 1: 30}, limit=24), "auto")  # 14 + 11 = 25 at once; 5 + 10 + 8
    assert limited.mode == "staggered" and "25 GiB on the cgroup memory limit, over its 24 GiB budget" in limited.reason
    assert limited.reason.endswith("one at a time it peaks at 23 GiB")


def test_unknown_sizes_and_single_instances():
    single = choose_start(hand_plan([instance(0)], {0: 1}), "auto")
    assert single.reason == "one instance" and single.describe() == "parallel (start.mode auto): one instance"
    unknown = choose_start(hand_plan([instance(0, weights=None), instance(1, weights=None)], {0: 30}), "auto")
    assert unknown.mode == "staggered" and unknown.reason.startswith("the model size is unknown (placement.model_size_gib)")
    assert choose_start(hand_plan([instance(0), instance(1)], {}), "auto").reason.startswith("no node's memory size is known")


@pytest.mark.parametrize("asked", ["parallel", "staggered"])
def test_an_explicit_mode_is_kept_and_parallel_says_when_it_may_not_fit(asked):
    plan_ = hand_plan([instance(0, weights=8, kv=2), instance(1, weights=8, kv=2)], {0: 25})  # 18 + 8 at once
    choice = choose_start(plan_, asked)
    assert choice.mode == asked and choice.asked == asked
    if asked == "parallel":
        assert choice.reason == "as configured; all loading at once may peak at 26 GiB on node 0, over its 25 GiB budget"
    assert choice.describe().startswith(f"{asked} (start.mode {asked}): as configured")


def test_a_plan_from_the_planner_two_nodes_one_instance_each():
    machine = make_machine(sockets=2, cores_per_node=8, node_memory=64 * GiB)
    settings = PlanSettings(instances=2, model_size_bytes=14 * GiB, launcher="taskset")
    choice = choose_start(plan(machine, settings), "auto")  # the KV cache takes what is left: far more than 14 GiB
    assert choice.mode == "parallel" and [h.name for h in choice.holders] == ["node 0", "node 1"]
    assert all(h.fits for h in choice.holders)
    two_on_one = choose_start(plan(make_machine(cores_per_node=8, node_memory=40 * GiB),
                                   PlanSettings(instances=2, model_size_bytes=14 * GiB, launcher="taskset")), "auto")
    # 2 × (14 + 3 KV + 1.5) = 37 planned in 38 GiB; 2 × 15.5 + the checkpoint's 14 = 45 while loading at
    # once, 18.5 + 15.5 + 14 = 48 one at a time: over in either order (the pages are page cache: reclaimable)
    assert two_on_one.mode == "parallel" and two_on_one.reason.startswith("a load could peak at 45 GiB on node 0")


def test_vsup_plan_says_how_the_instances_would_start(tmp_path):
    config = tmp_path / "vsup.yaml"
    config.write_text("model: m\ninstances: 1\nplacement: {model_size_gib: 0.5, kvcache_gib: 0.5, launcher: taskset}\n")
    table = subprocess.run([*VSUP, "plan", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "start: parallel (start.mode auto): one instance" in table.stdout.splitlines()
    out = subprocess.run([*VSUP, "plan", "--config", str(config), "--format", "json"], capture_output=True, text=True, timeout=60)
    start = json.loads(out.stdout)["start"]
    assert start["mode"] == "parallel" and start["asked"] == "auto" and start["holders"][0]["budget_bytes"] > 0
