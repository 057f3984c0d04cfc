"""The fleet planner (vsup/topology/fleet.py): several models partitioned over the machines of the
hwloc corpus, as properties (hypothesis) and on the 2-socket Xeon the README shows."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.topology_fixtures import DUMP_NAMES
from vsup.config.planning import plan_from_config
from vsup.config.schema import parse_config
from vsup.errors import VsupError
from vsup.topology.errors import PlanError
from vsup.topology.fleet import ModelPlanError, ModelSettingError, kept_of, plan_fleet
from vsup.topology.model import Machine
from vsup.topology.plan_model import FleetModel, GiB, Plan, PlanSettings
from vsup.topology.planner import plan
from vsup.topology.sysfs import read_machine

MiB = 1024**2
XEON = "32intel64-2p8co2t+8ve"  # 2 × Xeon 8 cores / 16 threads, nodes 0 and 1 of ~46 GiB


@pytest.fixture(scope="module")
def machines(corpus) -> dict[str, Machine]:
    return {name: read_machine(corpus.fsroot(name), live=False) for name in DUMP_NAMES}


def check_fleet_rules(machine: Machine, models: list[FleetModel], p: Plan) -> None:
    core_of = {cpu: core.id for core in machine.cores for cpu in core.cpus}
    owner: dict[int, int] = {}
    for inst in p.instances:
        for cpu in inst.cpus:  # no physical core in two instances, of one model or two
            assert owner.setdefault(core_of[cpu], inst.index) == inst.index, f"core {core_of[cpu]} in two instances"
        assert not set(inst.cpus) & set(p.reserved_cpus)
        assert inst.port == models[0].settings.base_port + inst.index
    assert [i.index for i in p.instances] == list(range(len(p.instances)))
    # every model placed, in order, with its instances and a reason in words
    assert [m.name for m in p.models] == [m.name for m in models]
    for model, share in zip(models, p.models, strict=True):
        mine = p.of_model(model.name)
        assert mine and share.instances == tuple(i.index for i in mine) and share.reason
        assert [i.replica for i in mine] == list(range(len(mine)))
        if isinstance(model.settings.instances, int):
            assert len(mine) == model.settings.instances
        # an instance that fits in one of its model's nodes is inside one node
        per = (model.settings.cores_per_instance or 1) + (1 if model.settings.housekeeping_core else 0)
        if model.settings.cores_per_instance:
            nodes = defaultdict(int)
            for cpu in share.cpus:
                nodes[next(c.node for c in machine.cores if cpu in c.cpus)] += 1
            cores_of = {n: len({core_of[c] for c in share.cpus if next(k.node for k in machine.cores if c in k.cpus) == n}) for n in nodes}
            if sum(k // per for k in cores_of.values()) >= len(mine):
                assert all(len(i.cpu_nodes) <= 1 for i in mine), [i.cpu_nodes for i in mine]
    # every node's demand, summed over all models, within its one budget (the reserve taken once)
    reserve = models[0].settings.memory_reserve_bytes
    for node in p.memory:
        expected = sum(i.memory_bytes / len(i.nodes) for i in p.instances if node.node in i.nodes)
        assert abs(node.demand_bytes - expected) <= 1
        if node.figure != "unknown":
            assert node.budget_bytes == max(0, machine.node(node.node).memory_total_bytes - reserve)
            assert node.demand_bytes <= node.budget_bytes + len(node.instances)
    usable = set(machine.cpus_usable)
    unused = dict(p.unused_cpus)
    busy = {c for i in p.instances for c in i.cpus}
    assert usable <= busy | set(p.reserved_cpus) | set(unused) and all(unused.values())


@st.composite
def fleets(draw):
    count = draw(st.integers(2, 4))
    models = []
    for i in range(count):
        cpi = draw(st.sampled_from([None, None, 1, 2]))
        models.append(FleetModel(f"m{i}", PlanSettings(
            instances=draw(st.one_of(st.just("auto"), st.integers(1, 3))),
            cores_per_instance=cpi,
            housekeeping_core=draw(st.booleans()) if cpi else False,
            model_size_bytes=draw(st.sampled_from([16 * MiB, 64 * MiB, 8 * GiB])),
            kvcache_gib=draw(st.sampled_from([None, None, 1 / 64, 1])),
            overhead_bytes=16 * MiB, memory_reserve_bytes=draw(st.sampled_from([0, 64 * MiB])),
            reserve_cores=0,
        ), share=draw(st.sampled_from([None, None, None, 0.25]))))
    reserve = draw(st.sampled_from(["auto", 0, 1]))
    return [FleetModel(m.name, PlanSettings(**{**m.settings.__dict__, "reserve_cores": reserve}), m.share) for m in models]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(DUMP_NAMES), models=fleets())
def test_fleets_keep_the_rules_or_are_refused_naming_a_model(machines, name, models):
    machine = machines[name]
    try:
        p = plan_fleet(machine, models)
    except (ModelPlanError, ModelSettingError) as exc:
        event("refused")
        assert exc.model in {m.name for m in models} and str(exc).startswith(f"model {exc.model}: ")
        assert "\n" not in str(exc)
        return
    event("planned")
    check_fleet_rules(machine, models, p)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(DUMP_NAMES), instances=st.one_of(st.just("auto"), st.integers(1, 4)),
       cpi=st.sampled_from([None, 1, 2]), kv=st.sampled_from([None, 1 / 64]), one_node=st.booleans())
def test_a_fleet_of_one_is_the_single_model_plan(machines, name, instances, cpi, kv, one_node):
    machine = machines[name]
    nodes = (machine.cpu_nodes[-1].id,) if one_node and machine.cpu_nodes else None
    s = PlanSettings(instances=instances, cores_per_instance=cpi, kvcache_gib=kv, model_size_bytes=16 * MiB,
                     overhead_bytes=16 * MiB, memory_reserve_bytes=0, nodes=nodes)
    try:
        single = plan(machine, s)
    except PlanError as exc:
        with pytest.raises(ModelPlanError) as info:
            plan_fleet(machine, [FleetModel("m", s)])
        assert info.value.text == str(exc)
        return
    fleet = plan_fleet(machine, [FleetModel("m", s)])
    as_json = [json.dumps({**i.to_json(), "model": "m", "replica": i.index}) for i in single.instances]
    assert [json.dumps(i.to_json()) for i in fleet.instances] == as_json
    assert fleet.memory == single.memory and fleet.reserved_cpus == single.reserved_cpus


def test_a_models_file_of_one_entry_plans_like_the_single_model_file(corpus, tmp_path):
    root = corpus.fsroot(XEON)
    single = parse_config("model: /m\nserved_model_name: chat\ninstances: 2\nplacement: {model_size_gib: 4, launcher: taskset}\n", "a.yaml")
    fleet = parse_config("placement: {launcher: taskset}\nmodels:\n  - model: /m\n    served_model_name: chat\n"
                         "    instances: 2\n    placement: {model_size_gib: 4}\n", "b.yaml")
    one = plan_from_config(single, root)[1]
    other = plan_from_config(fleet, root)[1]
    assert [i.to_json() for i in other.instances] == [i.to_json() for i in one.instances]


# --- the README's 2-socket example ----------------------------------------------------------

README_FLEET = """\
placement: {memory_reserve_gib: 2, launcher: numactl}
models:
  - model: /srv/chat
    served_model_name: chat
    instances: 1
    placement: {nodes: [0], model_size_gib: 16}
  - model: /srv/embed
    served_model_name: embed
    instances: 1
    placement: {cores_per_instance: 2, model_size_gib: 1, kvcache_gib: 2}
  - model: /srv/rerank
    served_model_name: rerank
    instances: 1
    placement: {cores_per_instance: 2, model_size_gib: 1}
"""


def test_chat_takes_node_0_whole_and_the_small_models_share_node_1(corpus):
    machine, p = plan_from_config(parse_config(README_FLEET, "f.yaml"), corpus.fsroot(XEON), numactl_available=True)
    chat, embed, rerank = p.models
    assert p.reserved_cpus == (0, 16)  # where the single-model planner reserves: node 0's first core
    assert chat.nodes == (0,) and chat.cpus == (*range(1, 8), *range(17, 24))
    assert chat.reason.startswith("node 0 whole (placement.nodes 0")
    assert embed.cpus == (8, 9, 24, 25) and rerank.cpus == (10, 11, 26, 27)  # beside each other, no core shared
    assert embed.reason == "2 cores of node 1 beside rerank (1 instance(s) × 2 core(s))"
    assert rerank.reason == "2 cores of node 1 beside embed (1 instance(s) × 2 core(s))"
    assert [(i.index, i.model, i.port) for i in p.instances] == [(0, "chat", 8100), (1, "embed", 8101), (2, "rerank", 8102)]
    # node 1: one budget (the reserve taken once), embed's explicit 2 GiB KV cache, rerank's auto one
    # sized from what is left: 1 GiB weights + 1.5 GiB overhead + whole GiB of KV
    node1 = next(n for n in p.memory if n.node == 1)
    budget = machine.node(1).memory_total_bytes - 2 * GiB
    assert node1.budget_bytes == budget and node1.instances == (1, 2)
    embed_i, rerank_i = p.instances[1], p.instances[2]
    assert embed_i.kvcache_bytes == 2 * GiB
    left = budget - embed_i.memory_bytes - (GiB + int(1.5 * GiB))
    assert rerank_i.kvcache_bytes == (left // GiB) * GiB
    assert node1.demand_bytes == embed_i.memory_bytes + rerank_i.memory_bytes <= budget
    assert any(cpu == 12 and "no model's share" in why for cpu, why in p.unused_cpus)


def test_two_auto_kv_models_on_a_node_split_what_is_left_by_their_cores(corpus):
    text = README_FLEET.replace("cores_per_instance: 2, model_size_gib: 1, kvcache_gib: 2", "cores_per_instance: 4, model_size_gib: 1")
    _, p = plan_from_config(parse_config(text, "f.yaml"), corpus.fsroot(XEON), numactl_available=True)
    embed, rerank = p.instances[1], p.instances[2]
    assert len(embed.cores) == 4 and len(rerank.cores) == 2
    assert embed.kvcache_bytes > rerank.kvcache_bytes >= GiB
    assert abs(embed.kvcache_bytes / (embed.kvcache_bytes + rerank.kvcache_bytes) - 4 / 6) < 0.05
    # together they fill node 1's one budget: each loses less than a GiB to whole-GiB rounding
    node1 = next(n for n in p.memory if n.node == 1)
    assert embed.nodes == rerank.nodes == (1,) and node1.instances == (1, 2)
    assert 0 <= node1.budget_bytes - node1.demand_bytes < 2 * GiB


def test_the_equal_split_gives_a_big_model_whole_nodes(corpus):
    text = ("placement: {launcher: taskset}\nmodels:\n  - model: /a\n    instances: 2\n    placement: {model_size_gib: 1}\n"
            "  - model: /b\n    instances: 2\n    placement: {model_size_gib: 1}\n")
    _, p = plan_from_config(parse_config(text, "f.yaml"), corpus.fsroot("40intel64-2g2n4c+pcilocality"))
    a, b = p.models
    assert a.reason.startswith("nodes 0-1 whole") or a.reason.startswith("node")
    assert set(a.nodes).isdisjoint(b.nodes) and len(a.nodes) == len(b.nodes) == 2


@pytest.mark.parametrize(("text", "message"), [
    (README_FLEET.replace("cores_per_instance: 2, model_size_gib: 1, kvcache_gib: 2", "nodes: [0], model_size_gib: 1"),
     "f.yaml:10: models[1].placement.nodes: node 0 is all taken by chat (7 cores); embed needs 1 core(s) there"),
    (README_FLEET.replace("nodes: [0], model_size_gib: 16", "nodes: [3], model_size_gib: 16"),
     "f.yaml:6: models[0].placement.nodes: unknown node 3; this machine's nodes with usable CPUs are 0,1"),
    (README_FLEET.replace("    instances: 1\n    placement: {cores_per_instance: 2, model_size_gib: 1}\n",
                          "    share: 0.01\n    instances: 2\n    placement: {model_size_gib: 1}\n"),
     "f.yaml:13: models[2].share: 0.01 of the 15 usable physical cores is 0, but 2 instance(s) need at least 2"),
    (README_FLEET.replace("cores_per_instance: 2, model_size_gib: 1}", "cores_per_instance: 20, model_size_gib: 1}"),
     "f.yaml:14: models[2].placement.cores_per_instance: needs 20 physical cores but only 14 of the 16 usable are left after embed (2)"),
    (README_FLEET.replace("kvcache_gib: 2", "kvcache_gib: 2.5"),
     "f.yaml:10: models[1].placement.kvcache_gib: 2.5 is not valid: vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB; use 2 or 3"),
    (README_FLEET.replace("launcher: numactl}", "launcher: numactl, reserve_cores: 16}"),
     "f.yaml:1: placement.reserve_cores: 16 is not valid: the machine has 16 usable physical cores: none is left for the models"),
    (README_FLEET.replace("model_size_gib: 1, kvcache_gib: 2", "model_size_gib: 1, kvcache_gib: 40"),
     "f.yaml:11: models[2].model: node 1: 1 × (1 GiB weights + 1.5 GiB) = 2.5 GiB leaves less than 1 GiB of KV cache"),
])
def test_refusals_name_the_models_key(corpus, text, message):
    with pytest.raises((PlanError, VsupError)) as info:
        plan_from_config(parse_config(text, "f.yaml"), corpus.fsroot(XEON), numactl_available=True)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("chat", "cores"), [("cores_per_instance: 10", 10), ("cores_per_instance: 7", 7)])
def test_an_instance_bigger_than_a_node_spans_nodes_and_one_that_fits_does_not(corpus, chat, cores):
    text = README_FLEET.replace("nodes: [0], model_size_gib: 16", f"{chat}, model_size_gib: 4")
    _, p = plan_from_config(parse_config(text, "f.yaml"), corpus.fsroot(XEON), numactl_available=True)
    first = p.instances[0]
    assert len(first.cores) == cores
    assert len(first.cpu_nodes) == (2 if cores > 8 else 1)
    assert (cores > 8) == any(w.startswith("chat: --cores-per-instance 10") for w in p.warnings)
    assert not {c for i in p.instances[1:] for c in i.cores} & set(first.cores)


def test_a_share_is_met_even_when_its_instance_must_span_nodes(corpus):
    text = README_FLEET.replace("    placement: {nodes: [0], model_size_gib: 16}", "    share: 0.75\n    placement: {model_size_gib: 4}")
    _, p = plan_from_config(parse_config(text, "f.yaml"), corpus.fsroot(XEON), numactl_available=True)
    chat = p.models[0]
    assert len(p.instances[0].cores) == round(0.75 * 15) == 11 and chat.reason.endswith("(share 0.75 of 15 usable cores)")
    # its whole node is the larger one: node 0 keeps the reserve and the small models
    assert chat.reason == "node 1 whole + 3 cores of node 0 beside embed, rerank (share 0.75 of 15 usable cores)"


def test_an_auto_count_share_gets_no_instance_of_a_few_leftover_cores(machines):
    small = dict(model_size_bytes=64 * MiB, overhead_bytes=64 * MiB, memory_reserve_bytes=0)
    p = plan_fleet(machines["96em64t-4no4pa3ca2co"], [  # 4 nodes of 24 cores
        FleetModel("a", PlanSettings(**small), share=0.5), FleetModel("b", PlanSettings(**small)),
        FleetModel("c", PlanSettings(instances=1, cores_per_instance=4, **small))])
    assert [len(i.cores) for i in p.of_model("a")] == [24, 24]  # 0.5 × 95 = 48: two whole nodes, not 47 + 1
    assert p.models[0].reason == "nodes 1-2 whole (share 0.5 of 95 usable cores)"
    assert p.models[2].reason == "4 cores of node 0 beside b (1 instance(s) × 4 core(s))"


def test_whole_nodes_go_largest_first_and_an_idle_node_is_a_warning(machines):
    small = dict(model_size_bytes=64 * MiB, overhead_bytes=64 * MiB, memory_reserve_bytes=0)
    p = plan_fleet(machines["16amd64-8n2c"], [  # 8 nodes of 2 cores; the reserve takes one of node 0
        FleetModel("chat", PlanSettings(instances=2, **small)),
        FleetModel("embed", PlanSettings(instances=1, cores_per_instance=1, **small))])
    assert [len(i.cores) for i in p.of_model("chat")] == [2, 2] and p.models[1].nodes == (0,)
    assert "node(s) 3,4,5,6,7 idle: no model's demand reaches them" in " ".join(p.warnings)


def test_a_model_whose_equal_split_is_below_its_minimum_gets_the_minimum(machines):
    small = dict(model_size_bytes=64 * MiB, overhead_bytes=64 * MiB, memory_reserve_bytes=0)
    p = plan_fleet(machines[XEON], [  # 15 usable cores split 2:6:4 would give a 2.5 cores for 2 × (1 + housekeeping)
        FleetModel("a", PlanSettings(instances=2, housekeeping_core=True, **small)),
        FleetModel("b", PlanSettings(instances=6, **small)), FleetModel("c", PlanSettings(instances=4, **small))])
    assert [len(i.cores) for i in p.of_model("a")] == [2, 2]
    assert p.models[0].reason.endswith("(its 2 instance(s)' minimum of the 15 cores the others leave)")
    assert sum(len(i.cores) for i in p.of_model("b")) + sum(len(i.cores) for i in p.of_model("c")) == 11


# ---- a reload: the models it does not change keep their CPUs and KV cache (kept_of) ------------

def _launch(p: Plan, name: str) -> list[tuple]:
    return [(i.replica, i.cpus, i.omp_cpus, i.env, i.vllm_args, i.nodes, i.kvcache_bytes) for i in p.of_model(name)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(DUMP_NAMES), before=fleets(), change=st.sampled_from(["add", "remove", "resize"]), data=st.data())
def test_a_reload_moves_no_model_it_does_not_change(machines, name, before, change, data):
    machine = machines[name]
    try:
        old = plan_fleet(machine, before)
    except (ModelPlanError, ModelSettingError):
        return
    after = list(before)
    if change == "add":
        after.append(FleetModel("new", replace(before[0].settings, instances=1, cores_per_instance=1)))
    elif change == "remove":
        after.pop(data.draw(st.integers(0, len(after) - 1)))
    else:
        i = data.draw(st.integers(0, len(after) - 1))
        count = after[i].settings.instances
        after[i] = replace(after[i], settings=replace(after[i].settings, instances=(count + 1 if isinstance(count, int) else 1)))
    keep = kept_of(old, after)
    try:
        new = plan_fleet(machine, after, keep)
    except (ModelPlanError, ModelSettingError):
        event("refused")
        return
    event("planned")
    check_fleet_rules(machine, after, new)
    for model, share in zip(after, new.models, strict=True):
        if "kept where it runs" in share.reason:  # the same CPUs, threads, environment, memory nodes, KV cache
            assert model.name in keep and _launch(new, model.name) == _launch(old, model.name), model.name
        elif change == "remove":  # a model leaving needs no room: every other one stays where it runs
            raise AssertionError(f"{model.name} moved when another model left")


def test_adding_a_model_beside_a_running_fleet_moves_nothing_that_runs(corpus):
    machine = read_machine(corpus.fsroot(XEON), live=False)
    s = PlanSettings(model_size_bytes=GiB, overhead_bytes=GiB)
    chat = FleetModel("chat", replace(s, instances=2, cores_per_instance=4))
    before = [chat, FleetModel("embed", replace(s, instances=1, cores_per_instance=2))]
    old = plan_fleet(machine, before)
    after = [FleetModel("rerank", replace(s, instances=1, cores_per_instance=2)), *before]  # first in the file
    fresh = plan_fleet(machine, after)  # planned from scratch, the newcomer takes cores the others run on
    assert _launch(fresh, "chat") != _launch(old, "chat") or _launch(fresh, "embed") != _launch(old, "embed")
    kept = plan_fleet(machine, after, kept_of(old, after))
    assert _launch(kept, "chat") == _launch(old, "chat") and _launch(kept, "embed") == _launch(old, "embed")
    assert kept.of_model("rerank") and "kept where it runs" in kept.models[1].reason
    check_fleet_rules(machine, after, kept)


def test_a_model_sized_by_what_the_others_leave_makes_room_for_a_newcomer(corpus):
    """chat takes every core the others leave: a new model can only come from its cores, so chat
    is planned anew (the reload replaces its instances one by one) while embed stays."""
    machine = read_machine(corpus.fsroot(XEON), live=False)
    s = PlanSettings(model_size_bytes=GiB, overhead_bytes=GiB)
    before = [FleetModel("chat", replace(s, instances=2)), FleetModel("embed", replace(s, instances=1, cores_per_instance=2))]
    old = plan_fleet(machine, before)
    after = [*before, FleetModel("rerank", replace(s, instances=1, cores_per_instance=2))]
    kept = plan_fleet(machine, after, kept_of(old, after))
    assert _launch(kept, "embed") == _launch(old, "embed") and _launch(kept, "chat") != _launch(old, "chat")
    check_fleet_rules(machine, after, kept)
