"""The planner's rules on hand-built machines whose right answer can be worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from tests.machines import GiB, make_machine
from tests.sysfs_builder import build_sysfs, gb10_layout
from vsup.topology.errors import PlanError, SettingError
from vsup.topology.model import EFFICIENCY, PERFORMANCE
from vsup.topology.plan_model import PlanSettings
from vsup.topology.planner import plan
from vsup.topology.sysfs import read_machine


def settings(**kw) -> PlanSettings:
    kw.setdefault("model_size_bytes", 4 * GiB)
    return PlanSettings(**kw)


def two_socket():
    # 2 sockets x 8 cores x SMT2: node 0 = CPUs 0-7 + 16-23, node 1 = 8-15 + 24-31
    return make_machine(sockets=2, cores_per_node=8, smt=2, node_memory=64 * GiB)


def test_two_socket_two_instances_one_per_node_with_core_zero_reserved():
    p = plan(two_socket(), settings(instances=2))
    a, b = p.instances
    assert p.reserved_cpus == (0, 16)  # core 0 and its sibling, on node 0 where the split is even
    assert a.nodes == (0,) and b.nodes == (1,)
    assert a.cpus == tuple(range(1, 8)) + tuple(range(17, 24))
    assert a.omp_cpus == tuple(range(1, 8))  # one OpenMP thread per physical core
    assert b.omp_cpus == tuple(range(8, 16))
    assert a.env_dict() == {
        "OMP_NUM_THREADS": "7",
        "VLLM_CPU_OMP_THREADS_BIND": "1-7",
        "CPU_VISIBLE_MEMORY_NODES": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(a.kvcache_bytes // GiB),
    }
    assert a.argv == ("numactl", "--physcpubind=1-7,17-23", "--membind=0")
    assert b.argv == ("numactl", "--physcpubind=8-15,24-31", "--membind=1")
    assert (a.port, b.port) == (8100, 8101)
    assert p.unused_cpus == ()


def test_kv_cache_default_is_the_largest_whole_gib_share_that_fits():
    p = plan(two_socket(), settings(instances=4))  # 2 per node: (64 - 2) / 2 - 4 - 1.5 = 25.5
    assert {i.kvcache_bytes for i in p.instances} == {25 * GiB}
    for node in p.memory:
        assert node.demand_bytes <= node.budget_bytes
        assert node.budget_bytes == 62 * GiB
        assert "MemTotal" in node.figure


def test_reserve_zero_uses_every_core():
    p = plan(two_socket(), settings(instances=2, reserve_cores=0))
    assert p.reserved_cpus == ()
    assert [len(i.omp_cpus) for i in p.instances] == [8, 8]


def test_uneven_sub_numa_nodes_are_split_proportionally():
    m = make_machine(sockets=1, nodes_per_socket=3, cores_per_node=[43, 43, 42])
    p = plan(m, settings(instances=3, reserve_cores=0))
    assert [len(i.omp_cpus) for i in p.instances] == [43, 43, 42]
    p6 = plan(m, settings(instances=6, reserve_cores=0))
    assert [len(i.omp_cpus) for i in p6.instances] == [22, 21, 22, 21, 21, 21]
    assert [i.nodes for i in p6.instances] == [(0,), (0,), (1,), (1,), (2,), (2,)]


def test_reserved_core_goes_where_the_split_is_uneven():
    m = make_machine(sockets=1, nodes_per_socket=3, cores_per_node=[42, 43, 42])
    p = plan(m, settings(instances=3, reserve_cores=1))
    # node 1 has the spare 43rd core: taking it costs nobody a thread that the others have
    assert [len(i.omp_cpus) for i in p.instances] == [42, 42, 42]
    assert len(p.reserved_cpus) == 1 and m.node(1).cpus.count(p.reserved_cpus[0]) == 1


def test_fewer_instances_than_nodes_spans_nodes_with_a_warning():
    m = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=4)
    p = plan(m, settings(instances=2, reserve_cores=0))
    assert [i.cpu_nodes for i in p.instances] == [(0, 1), (2, 3)]  # neighbours, one socket each
    assert p.instances[0].argv[-1] == "--membind=0,1"
    assert any("span" in w for w in p.warnings)


def test_fewer_instances_than_nodes_join_the_closest_nodes_not_the_neighbouring_ids():
    # Firmware that numbers the sockets' nodes alternately: nodes 0 and 2 share a socket, so do 1 and 3.
    m = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=4)
    def row(n):
        return tuple(10 if a == n else 12 if a % 2 == n % 2 else 32 for a in range(4))
    m = dataclasses.replace(m, nodes=tuple(dataclasses.replace(node, distances=row(node.id)) for node in m.nodes))
    p = plan(m, settings(instances=2, reserve_cores=0))
    assert [i.cpu_nodes for i in p.instances] == [(0, 2), (1, 3)]
    assert p.instances[0].argv[-1] == "--membind=0,2"
    # three groups: the one that spans joins two nodes of one socket
    p3 = plan(m, settings(instances=3, reserve_cores=0))
    (spanning,) = [i.cpu_nodes for i in p3.instances if len(i.cpu_nodes) > 1]
    assert spanning in ((0, 2), (1, 3))


@pytest.mark.parametrize("many, flag", [(True, "--preferred-many=0,1"), (False, "--preferred=0")])
def test_membind_preferred_on_an_instance_spanning_nodes(many, flag):
    m = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=4)
    p = plan(m, settings(instances=2, reserve_cores=0, membind="preferred", numactl_preferred_many=many))
    assert p.instances[0].argv[-1] == flag
    said = any("no --preferred-many" in w and "prefers node 0 only" in w for w in p.warnings)
    assert said == (not many)
    one_node = plan(m, settings(instances=4, reserve_cores=0, membind="preferred", numactl_preferred_many=many))
    assert one_node.instances[1].argv[-1] == "--preferred=1"  # one node: plain --preferred


def test_smt_without_smt_is_said_to_change_nothing():
    m = make_machine(sockets=1, cores_per_node=4, smt=1)
    with_smt, without = plan(m, settings(instances=2, smt=True)), plan(m, settings(instances=2))
    assert [i.omp_cpus for i in with_smt.instances] == [i.omp_cpus for i in without.instances]
    assert any("changes nothing here" in w for w in with_smt.warnings)
    assert not any("changes nothing" in w for w in plan(two_socket(), settings(instances=2, smt=True)).warnings)


def test_cores_per_instance_keeps_instances_on_separate_nodes_and_lists_spare_cpus():
    m = make_machine(sockets=2, cores_per_node=8)
    p = plan(m, settings(instances=2, cores_per_instance=4))
    assert [i.nodes for i in p.instances] == [(0,), (1,)]
    assert [len(i.omp_cpus) for i in p.instances] == [4, 4]
    assert len(p.reserved_cpus) == 1
    assert len(p.unused_cpus) == 16 - 8 - 1
    assert all(reason.startswith("spare") for _, reason in p.unused_cpus)
    assert not any("span" in w for w in p.warnings)


def test_cores_per_instance_larger_than_a_node_spans_with_a_warning():
    m = make_machine(sockets=2, cores_per_node=4)
    p = plan(m, settings(instances=1, cores_per_instance=6, reserve_cores=0))
    assert p.instances[0].cpu_nodes == (0, 1)
    assert any("do not fit inside NUMA nodes" in w for w in p.warnings)


def test_instances_stay_inside_l3_domains():
    # AMD-like: 4 nodes x 32 cores, 8-core CCX (4 L3 per node), SMT2
    m = make_machine(sockets=1, nodes_per_socket=4, cores_per_node=32, smt=2, l3_per_node=4)
    p = plan(m, settings(instances=16, cores_per_instance=7))
    for inst in p.instances:
        assert len(inst.l3_domains) == 1, inst
    p = plan(m, settings(instances=4, cores_per_instance=8, reserve_cores=0))
    assert all(len(i.l3_domains) == 1 for i in p.instances)


def test_grouped_nodes_leave_every_instance_room_for_its_housekeeping_core():
    # Found by hypothesis: nodes of 1, 1, 1 and 3 cores, 3 instances with a housekeeping core each.
    # The smallest-largest grouping ([1+1], [1], [3]) gave one instance a single core, which the
    # housekeeping core took, leaving OpenMP no thread at all.
    m = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=[1, 1, 1, 3])
    p = plan(m, settings(instances=3, housekeeping_core=True, reserve_cores=0))
    for inst in p.instances:
        assert inst.omp_cpus and inst.env_dict()["OMP_NUM_THREADS"] == str(len(inst.omp_cpus))
        assert len(inst.cpus) >= 2


def test_housekeeping_core_is_in_cpus_but_not_in_omp_cpus():
    p = plan(two_socket(), settings(instances=2, housekeeping_core=True))
    a = p.instances[0]
    assert a.housekeeping_cpus == (7, 23)
    assert set(a.housekeeping_cpus) <= set(a.cpus)
    assert not set(a.housekeeping_cpus) & set(a.omp_cpus)
    assert a.env_dict()["OMP_NUM_THREADS"] == "6"


def test_smt_puts_openmp_on_every_hardware_thread():
    p = plan(two_socket(), settings(instances=2, smt=True))
    a = p.instances[0]
    assert a.omp_cpus == a.cpus
    assert a.env_dict()["OMP_NUM_THREADS"] == str(len(a.cpus))
    assert a.env_dict()["VLLM_CPU_OMP_THREADS_BIND"] == "1-7,17-23"


def test_unusable_cpus_are_listed_with_their_reason():
    m = make_machine(sockets=1, cores_per_node=8, offline=[7], cpuset=range(0, 6), isolated=[5])
    p = plan(m, settings(instances=2))
    reasons = dict(p.unused_cpus)
    assert reasons == {5: "isolated", 6: "outside cpuset", 7: "offline"}
    cpus = [c for i in p.instances for c in i.cpus]
    assert sorted(cpus + list(p.reserved_cpus)) == [0, 1, 2, 3, 4]


def test_partly_usable_core_is_never_shared():
    # cpuset keeps only the first sibling of core 1 (CPU 1, not 9)
    m = make_machine(sockets=1, cores_per_node=8, smt=2, cpuset=[c for c in range(16) if c != 9])
    p = plan(m, settings(instances=7))
    owners = {}
    for inst in p.instances:
        for cpu in inst.cpus:
            core = cpu % 8
            assert owners.setdefault(core, inst.index) == inst.index


def test_auto_is_one_instance_per_node_with_usable_cpus():
    m = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=4, cpuset=range(0, 12))
    p = plan(m, settings(instances="auto"))
    assert [i.nodes for i in p.instances] == [(0,), (1,), (2,)]


def test_memory_that_does_not_fit_names_the_numbers():
    m = make_machine(sockets=2, cores_per_node=8, node_memory=47 * GiB)
    with pytest.raises(PlanError) as err:
        plan(m, settings(instances=4, model_size_bytes=int(14.2 * GiB), kvcache_gib=8))
    assert str(err.value) == (
        "node 0: 2 × (14.2 GiB weights + 8 GiB KV + 1.5 GiB) = 47.4 GiB > 45 GiB available "
        "(MemTotal - 2 GiB reserve); try --instances 2 or --kvcache-gib 6"
    )


def test_model_too_big_for_any_kv_cache():
    m = make_machine(sockets=1, cores_per_node=8, node_memory=16 * GiB)
    with pytest.raises(PlanError, match=r"node 0: 1 × \(20 GiB weights \+ 1.5 GiB\) = 21.5 GiB .* 14 GiB available.*does not fit"):
        plan(m, settings(instances=1, model_size_bytes=20 * GiB))


def test_kv_cache_below_one_gib_goes_to_the_command_line():
    p = plan(two_socket(), settings(instances=2, kvcache_gib=0.5))
    a = p.instances[0]
    assert "VLLM_CPU_KVCACHE_SPACE" not in a.env_dict()
    assert a.vllm_args == ("--kv-cache-memory-bytes", str(GiB // 2))


def test_whole_gib_kv_cache_goes_to_the_environment():
    p = plan(two_socket(), settings(instances=2, kvcache_gib=3))
    assert p.instances[0].env_dict()["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert p.instances[0].vllm_args == ()


def test_fractional_kv_cache_above_one_gib_is_refused():
    with pytest.raises(PlanError, match=r"--kvcache-gib 2.5: .*whole GiB; use 2 or 3"):
        plan(two_socket(), settings(instances=2, kvcache_gib=2.5))


def test_unknown_model_size_still_sets_an_explicit_kv_cache_and_warns():
    p = plan(two_socket(), PlanSettings(instances=2))
    assert all(i.env_dict()["VLLM_CPU_KVCACHE_SPACE"] == "30" for i in p.instances)  # (62 - 1.5) / 2
    assert any("model size unknown" in w for w in p.warnings)


def test_unknown_node_memory_falls_back_with_a_warning():
    m = make_machine(sockets=1, cores_per_node=4, node_memory=0)
    p = plan(m, settings(instances=1))
    assert p.instances[0].env_dict()["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert any("memory size unknown" in w for w in p.warnings)


def test_less_available_than_needed_is_a_warning_not_a_refusal():
    m = make_machine(sockets=1, cores_per_node=4, node_memory=64 * GiB, node_available=10 * GiB)
    p = plan(m, settings(instances=1, kvcache_gib=16))
    assert any("only 10 GiB is available now" in w for w in p.warnings)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"instances": 9, "reserve_cores": 1}, r"9 instance\(s\) need 10 physical cores \(9 × 1 \+ 1 reserved\) but only 8 are usable; try --instances 7 or --reserve-cores 0"),
        ({"instances": 0}, r"--instances 0: must be a whole number"),
        ({"instances": 9}, r"9 instance\(s\) need 9 physical cores \(9 × 1\) but only 8 are usable; try --instances 8$"),
        ({"instances": 2, "cores_per_instance": 4, "reserve_cores": 1}, r"need 9 physical cores.*try --instances 1 or --reserve-cores 0 or --cores-per-instance 3"),
        ({"instances": 2, "nodes": (5,)}, r"--nodes: unknown node 5; this machine's nodes with usable CPUs are 0"),
        ({"instances": 2, "base_port": 65535}, r"--base-port 65535: 2 instances need ports up to 65536"),
        ({"instances": 1, "reserve_cores": -1}, r"--reserve-cores -1"),
    ],
)
def test_infeasible_requests_say_why_and_what_would_work(kw, message):
    m = make_machine(sockets=1, cores_per_node=8)
    with pytest.raises(PlanError, match=message):
        plan(m, settings(**kw))


def test_auto_reserve_yields_when_the_instances_need_every_core():
    m = make_machine(sockets=1, cores_per_node=2)  # like the 2-CPU box of DESIGN.md's measurements
    p = plan(m, settings(instances=2))
    assert p.reserved_cpus == ()
    assert [i.omp_cpus for i in p.instances] == [(0,), (1,)]
    assert any("no core reserved" in w for w in p.warnings)
    assert plan(m, settings(instances=1)).reserved_cpus == (0,)


def test_no_usable_cpus():
    m = make_machine(sockets=1, cores_per_node=4, cpuset=[])
    with pytest.raises(PlanError, match=r"no usable CPUs.*outside cpuset"):
        plan(m, settings(instances=1))


def test_node_without_usable_cpus_is_refused_in_nodes():
    m = make_machine(sockets=1, cores_per_node=4, memory_only_nodes=1)
    with pytest.raises(PlanError, match=r"--nodes: node 1 has no usable CPUs"):
        plan(m, settings(instances=1, nodes=(1,)))


def test_nodes_restricts_placement():
    m = make_machine(sockets=2, cores_per_node=4)
    p = plan(m, settings(instances=1, nodes=(1,)))
    assert p.instances[0].nodes == (1,)
    assert dict(p.unused_cpus)[0] == "node 0 is not in --nodes 1"


def test_memory_only_nodes_are_not_cpu_nodes_and_are_mentioned():
    m = make_machine(sockets=2, cores_per_node=4, memory_only_nodes=2)
    p = plan(m, settings(instances="auto"))
    assert len(p.instances) == 2
    assert any("memory-only node(s) 2,3" in w for w in p.warnings)


def kinds_of(machine, cpus):
    kind = {cpu: core.kind for core in machine.cores for cpu in core.cpus}
    return {kind[cpu] for cpu in cpus}


def test_hybrid_efficiency_cores_reserve_first_then_run_housekeeping():
    m = make_machine(sockets=1, cores_per_node=6, efficiency_cores=[4, 5])
    p = plan(m, settings(instances=2))
    assert p.reserved_cpus == (4,)  # an efficiency core is the cheapest one to give away
    assert [i.omp_cpus for i in p.instances] == [(0, 1), (2, 3)]
    a, b = p.instances
    # the other efficiency core runs instance 0's API server and EngineCore: in its mask, not in OpenMP
    assert a.housekeeping_cpus == (5,) and a.cpus == (0, 1, 5) and a.argv[1] == "--physcpubind=0-1,5"
    assert b.housekeeping_cpus == () and b.cpus == (2, 3)
    assert [i.kind for i in p.instances] == [PERFORMANCE, PERFORMANCE]
    assert p.unused_cpus == ()


def test_hybrid_efficiency_cores_unused_are_listed_and_said():
    m = make_machine(sockets=1, cores_per_node=6, efficiency_cores=[4, 5])
    p = plan(m, settings(instances=2, efficiency_cores="unused"))
    assert p.reserved_cpus == (4,)
    assert [i.cpus for i in p.instances] == [(0, 1), (2, 3)]
    assert dict(p.unused_cpus)[5].startswith("efficiency core")
    assert any("efficiency cores 5 stay idle" in w for w in p.warnings)


def test_hybrid_efficiency_cores_as_instances_of_their_own():
    m = make_machine(sockets=1, cores_per_node=8, efficiency_cores=[4, 5, 6, 7])
    p = plan(m, settings(instances=2, efficiency_cores="instances"))
    assert [(i.port, i.kind, i.omp_cpus) for i in p.instances] == [
        (8100, PERFORMANCE, (0, 1)), (8101, PERFORMANCE, (2, 3)), (8102, EFFICIENCY, (5, 6, 7)),
    ]
    assert p.reserved_cpus == (4,)


def test_hybrid_intel_6p_8e_seven_instances_reserve_an_e_core_and_never_mix(tmp_path):
    # The shape: 6 P-cores with SMT (CPUs 0-11, siblings adjacent) and 8 E-cores (12-19),
    # one L3. Seven instances used to reserve P-core 0 while one OpenMP team mixed P and E cores.
    machine = read_machine(build_sysfs(tmp_path, hybrid=(6, 8)), live=False)
    p = plan(machine, settings(instances=7, model_size_bytes=GiB // 2, kvcache_gib=0.5, overhead_bytes=0))
    assert len(p.instances) == 7
    assert kinds_of(machine, p.reserved_cpus) == {EFFICIENCY}
    for inst in p.instances:
        assert len(kinds_of(machine, inst.omp_cpus)) == 1, inst
    assert [i.omp_cpus for i in p.instances[:6]] == [(0,), (2,), (4,), (6,), (8,), (10,)]
    assert p.instances[6].kind == EFFICIENCY and len(p.instances[6].omp_cpus) == 7
    assert any("instance 6 run on efficiency cores" in w for w in p.warnings)


def test_hybrid_cpu_with_too_few_performance_cores_puts_the_rest_on_efficiency_cores():
    m = make_machine(sockets=1, cores_per_node=5, efficiency_cores=[1, 2, 3, 4])  # Lakefield
    p = plan(m, settings(instances=2))
    assert [(i.kind, i.omp_cpus) for i in p.instances] == [(PERFORMANCE, (0,)), (EFFICIENCY, (2, 3, 4))]
    assert p.reserved_cpus == (1,)
    assert any("instance 1 run on efficiency cores" in w for w in p.warnings)


def test_hybrid_kinds_that_cannot_hold_the_instances_unmixed_are_refused():
    # 6 cores hold three 2-core instances only if one team mixed a P and an E core
    m = make_machine(sockets=1, cores_per_node=6, efficiency_cores=[3, 4, 5])
    with pytest.raises(PlanError, match=r"^3 instance\(s\) of 2 core\(s\) do not fit when no OpenMP team mixes core kinds: "
                                        r"the 3 performance cores hold 1 and the 3 efficiency cores 1; try --instances 2$"):
        plan(m, settings(instances=3, cores_per_instance=2, reserve_cores=0))


def test_gb10_one_instance_uses_every_big_core(tmp_path):
    machine = read_machine(build_sysfs(tmp_path, cores=gb10_layout(), hybrid_source="none"), live=False)
    p = plan(machine, settings(instances=1))
    (inst,) = p.instances
    assert inst.omp_cpus == (5, 6, 7, 8, 9, 15, 16, 17, 18, 19)  # all ten Cortex-X925
    assert p.reserved_cpus == (0,)  # a Cortex-A725
    assert inst.housekeeping_cpus == (1, 2, 3, 4, 10, 11, 12, 13, 14)


def test_efficiency_cores_go_to_the_instances_of_their_own_node():
    # two nodes, each 3 P + 2 E cores; E cores of node 1 serve node 1's instance only
    m = make_machine(sockets=2, cores_per_node=5, efficiency_cores=[3, 4, 8, 9])
    p = plan(m, settings(instances=2, reserve_cores=0))
    assert [i.housekeeping_cpus for i in p.instances] == [(3, 4), (8, 9)]
    assert [i.nodes for i in p.instances] == [(0,), (1,)]


def test_node_memory_outside_the_cpuset_binds_to_the_nearest_allowed():
    m = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=2, mems_allowed=[1, 2, 3])
    p = plan(m, settings(instances=4, reserve_cores=0, model_size_bytes=GiB))
    assert p.instances[0].cpu_nodes == (0,) and p.instances[0].nodes == (1,)
    assert any("node 0's memory is outside this cpuset" in w for w in p.warnings)
    shared = next(n for n in p.memory if n.node == 1)
    assert shared.instances == (0, 1)


@pytest.mark.parametrize(
    ("launcher", "membind", "argv", "warning"),
    [
        ("numactl", "preferred", ("numactl", "--physcpubind=1-3", "--preferred=0"), None),
        ("taskset", "bind", ("taskset", "-c", "1-3"), "memory is not bound"),
        ("none", "bind", (), "roam"),
    ],
)
def test_launchers(launcher, membind, argv, warning):
    p = plan(make_machine(sockets=1, cores_per_node=4), settings(instances=1, launcher=launcher, membind=membind))
    assert p.instances[0].argv == argv
    if warning:
        assert any(warning in w for w in p.warnings)


def test_same_input_same_plan():
    m = make_machine(sockets=2, nodes_per_socket=2, cores_per_node=[7, 9, 8, 5], smt=2, l3_per_node=2)
    s = settings(instances=5, housekeeping_core=True)
    assert plan(m, s) == plan(m, dataclasses.replace(s))


def test_to_json_has_the_documented_keys():
    data = plan(two_socket(), settings(instances=2)).to_json()
    assert set(data) >= {"instances", "reserved_cpus", "unused_cpus", "warnings"}
    assert set(data["instances"][0]) >= {"index", "port", "nodes", "cpus", "omp_cpus", "env", "argv"}
    assert data["instances"][0]["env"]["OMP_NUM_THREADS"] == "7"


# ---- omp_threads: fewer OpenMP threads than cores ----------------------------------------------

def test_omp_threads_leaves_the_other_cores_in_the_mask_for_the_api_server():
    from tests.machines import make_machine
    from vsup.topology.plan_model import PlanSettings
    from vsup.topology.planner import plan

    machine = make_machine(cores_per_node=8, smt=2)
    full = plan(machine, PlanSettings(instances=1, reserve_cores=0, model_size_bytes=GiB, launcher="numactl"))
    half = plan(machine, PlanSettings(instances=1, reserve_cores=0, model_size_bytes=GiB, launcher="numactl", omp_threads=4))
    inst, whole = half.instances[0], full.instances[0]
    assert inst.cpus == whole.cpus  # the mask keeps every core
    assert inst.omp_cpus == (0, 1, 2, 3)
    assert dict(inst.env)["OMP_NUM_THREADS"] == "4" and dict(inst.env)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    # the cores without a thread, with their SMT siblings, are what the API server/EngineCore get
    assert inst.housekeeping_cpus == (4, 5, 6, 7, 12, 13, 14, 15)


def test_omp_threads_with_smt_spreads_over_cores_before_siblings():
    from tests.machines import make_machine
    from vsup.topology.plan_model import PlanSettings
    from vsup.topology.planner import plan

    machine = make_machine(cores_per_node=4, smt=2)  # siblings 0+4, 1+5, ...
    inst = plan(machine, PlanSettings(instances=1, reserve_cores=0, smt=True, omp_threads=6)).instances[0]
    assert inst.omp_cpus == (0, 1, 2, 3, 4, 5)


def test_omp_threads_above_the_cpus_is_a_plan_error_naming_the_limit():
    from tests.machines import make_machine
    from vsup.topology.errors import PlanError
    from vsup.topology.plan_model import PlanSettings
    from vsup.topology.planner import plan

    with pytest.raises(PlanError, match=r"--omp-threads 5: instance 0 has only 4 OpenMP CPU\(s\); use at most 4") as info:
        plan(make_machine(cores_per_node=8), PlanSettings(instances=2, reserve_cores=0, omp_threads=5))
    # a SettingError, so vsup.config.planning can name placement.omp_threads and its line instead
    assert isinstance(info.value, SettingError) and info.value.setting == "omp_threads"


@pytest.mark.parametrize("bad", [0, True, "2"])
def test_omp_threads_that_is_no_count_is_a_setting_error(bad):
    with pytest.raises(SettingError, match=r"^--omp-threads .*: must be a whole number of at least 1$") as info:
        plan(make_machine(cores_per_node=8), settings(instances=1, omp_threads=bad))
    assert info.value.setting == "omp_threads"


def test_omp_threads_on_a_hybrid_cpu_idles_performance_cores_beside_the_efficiency_housekeeping():
    m = make_machine(sockets=1, cores_per_node=6, efficiency_cores=[4, 5])
    p = plan(m, settings(instances=1, reserve_cores=0, omp_threads=2))
    inst = p.instances[0]
    assert inst.omp_cpus == (0, 1) and kinds_of(m, inst.omp_cpus) == {PERFORMANCE}
    # the performance cores without a thread and the efficiency cores: API server and EngineCore
    assert inst.housekeeping_cpus == (2, 3, 4, 5) and inst.cpus == (0, 1, 2, 3, 4, 5)
