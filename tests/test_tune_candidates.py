"""vsup tune's candidates (pure): layouts from the planner, pruning with its reasons, tweaks."""

from __future__ import annotations

from dataclasses import replace

from tests.machines import GiB, make_machine
from vsup.topology.plan_model import PlanSettings
from vsup.tune.candidates import (
    KV_MAX,
    Candidate,
    Space,
    default_instances_per_node,
    layouts,
    preload_sets,
    tweak_dimensions,
)

BASE = PlanSettings(instances=1, reserve_cores=0, model_size_bytes=GiB, kvcache_gib=1, launcher="numactl")


def ids(planned) -> list[str]:
    return [p.id for p in planned]


def test_two_cores_one_node_gives_the_issues_layouts_and_prunes_the_rest_with_reasons():
    machine = make_machine(cores_per_node=2)
    kept, pruned = layouts(machine, BASE)
    assert ids(kept) == ["i1", "i1-t1", "i2"]
    reasons = {p.id: p.reason for p in pruned}
    # one instance with a housekeeping core is the same placement as one thread on two cores
    assert reasons["i1-hk"] == "same placement as i1-t1"
    # two instances with a housekeeping core each need four cores: the planner's own message
    assert "2 instance(s) need 4 physical cores" in reasons["i2-hk"]
    one_thread = kept[1].plan.instances[0]
    assert one_thread.cpus == (0, 1) and one_thread.omp_cpus == (0,)


def test_instances_per_node_double_while_each_instance_keeps_a_core():
    machine = make_machine(sockets=2, cores_per_node=[6, 4])
    assert default_instances_per_node(machine, BASE) == (1, 2, 4)
    kept, _ = layouts(machine, BASE, Space(omp_threads=("all",), housekeeping_core=(False,)))
    assert [p.candidate.instances for p in kept] == [2, 4, 8]  # per node x 2 nodes
    for p in kept:  # the planner keeps every instance inside one node
        assert all(len(i.cpu_nodes) == 1 for i in p.plan.instances)


def test_smt_is_tried_only_where_cores_have_siblings():
    flat, _ = layouts(make_machine(cores_per_node=4), BASE, Space(omp_threads=("all",), housekeeping_core=(False,)))
    assert not any(p.candidate.smt for p in flat)
    smt, _ = layouts(make_machine(cores_per_node=4, smt=2), BASE, Space(omp_threads=("all",), housekeeping_core=(False,)))
    assert {p.candidate.smt for p in smt} == {False, True}
    with_smt = next(p for p in smt if p.candidate.smt and p.candidate.instances == 1)
    assert len(with_smt.plan.instances[0].omp_cpus) == 8


def test_memory_that_does_not_fit_prunes_with_the_planners_numbers():
    machine = make_machine(cores_per_node=8, node_memory=16 * GiB)
    big = replace(BASE, model_size_bytes=5 * GiB, kvcache_gib=2)
    kept, pruned = layouts(machine, big, Space(omp_threads=("all",), housekeeping_core=(False,)))
    assert ids(kept) == ["i1"]
    reasons = {p.id: p.reason for p in pruned}
    assert set(reasons) == {"i2", "i4", "i8"}
    assert "GiB" in reasons["i2"] and "try --instances 1" in reasons["i2"]


def test_the_space_restricts_and_impossible_thread_counts_are_pruned():
    machine = make_machine(cores_per_node=8)
    kept, pruned = layouts(machine, BASE, Space(instances_per_node=(2,), omp_threads=(2, 6), housekeeping_core=(False,)))
    assert ids(kept) == ["i2-t2"]
    assert "--omp-threads 6: instance 0 has only 4 OpenMP CPU(s)" in {p.id: p.reason for p in pruned}["i2-t6"]


def test_candidate_ids_are_stable_and_name_every_setting():
    c = Candidate(instances=4, omp_threads=2, smt=True, housekeeping_core=True, preload="tcmalloc+iomp",
                  max_num_seqs=16, max_num_batched_tokens=4096, kvcache_gib=KV_MAX)
    assert c.id == "i4-t2-smt-hk-tcmalloc-iomp-seqs16-mbt4096-kvmax"
    assert Candidate(instances=1, kvcache_gib=0.5).id == "i1-kv0.5"


def test_preload_sets_default_to_none_and_everything_installed_and_refuse_missing_ones():
    assert preload_sets({}, None) == (["none"], [])
    assert preload_sets({"tcmalloc": "/l/t.so", "iomp": "/l/i.so"}, None)[0] == ["none", "tcmalloc+iomp"]
    usable, refused = preload_sets({"tcmalloc": "/l/t.so"}, ["none", "iomp", "tcmalloc"])
    assert usable == ["none", "tcmalloc"]
    assert refused == [("iomp", "libiomp5.so not found (pip install intel-openmp in vLLM's venv)")]


def test_tweaks_skip_the_users_own_values_and_try_the_largest_kv_cache_when_one_is_set():
    dims = tweak_dimensions(Space(), preloads=["none", "tcmalloc"], base_max_num_seqs=None, base_kvcache_gib=2.0,
                            busiest_per_instance=32)
    assert dims == [("preload", ["tcmalloc"]), ("max_num_seqs", [16]), ("kvcache_gib", [KV_MAX])]
    dims = tweak_dimensions(Space(max_num_seqs=(16, 64), max_num_batched_tokens=(2048,)), preloads=["none"],
                            base_max_num_seqs=64, base_kvcache_gib=None, busiest_per_instance=32)
    assert dims == [("max_num_seqs", [16]), ("max_num_batched_tokens", [2048])]


def test_enforce_eager_is_tried_last_and_only_when_asked_besides_the_configs_own():
    asked = dict(preloads=["none"], base_max_num_seqs=None, base_kvcache_gib=None, busiest_per_instance=None)
    assert tweak_dimensions(Space(), **asked) == []  # by default: the config's own, no extra start
    dims = tweak_dimensions(Space(enforce_eager=(True, False), max_num_batched_tokens=(2048,)), **asked)
    assert dims == [("max_num_batched_tokens", [2048]), ("enforce_eager", [True])]  # the config's (off) is measured already
    assert tweak_dimensions(Space(enforce_eager=(True, False)), **asked, base_enforce_eager=True) == [("enforce_eager", [False])]
    assert Candidate(1, omp_threads=1, enforce_eager=True).id == "i1-t1-eager"
    assert Candidate(2, preload="tcmalloc", enforce_eager=False).id == "i2-tcmalloc-compiled"
