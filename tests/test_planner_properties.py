"""The placement rules as properties over generated machines (hypothesis): whatever the shape,
a plan either is refused with a reason, or keeps every rule. The same checks run on the hwloc
corpus in test_planner_corpus.py."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from tests.machines import GiB, make_machine
from vsup.topology.cpulist import format_list
from vsup.topology.errors import PlanError
from vsup.topology.model import EFFICIENCY, PERFORMANCE, Machine
from vsup.topology.plan_model import Plan, PlanSettings
from vsup.topology.planner import plan


def check_plan_rules(machine: Machine, s: PlanSettings, p: Plan) -> None:
    """Every rule a plan must keep, whatever the machine. Shared with the corpus tests."""
    usable = set(machine.cpus_usable)
    core_of = {cpu: core.id for core in machine.cores for cpu in core.cpus}
    kind_of = {core.id: core.kind for core in machine.cores}
    owner: dict[int, int] = {}
    seen_cpus: set[int] = set()
    team_size: dict[int, int] = {}
    for inst in p.instances:
        env = inst.env_dict()
        # one kind of core per OpenMP team (hybrid CPUs): a slow core would pace every step
        team_kinds = {kind_of[core_of[c]] for c in inst.omp_cpus}
        assert len(team_kinds) == 1, f"instance {inst.index} mixes {team_kinds}"
        # its OpenMP cores and its housekeeping core (efficiency cores lent for housekeeping aside)
        team_size[inst.index] = len({core_of[c] for c in inst.omp_cpus}) + (1 if s.housekeeping_core else 0)
        assert set(inst.housekeeping_cpus) <= set(inst.cpus) and not set(inst.housekeeping_cpus) & set(inst.omp_cpus)
        assert set(inst.omp_cpus) <= set(inst.cpus) <= usable
        assert env["OMP_NUM_THREADS"] == str(len(inst.omp_cpus)) and inst.omp_cpus
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == format_list(inst.omp_cpus)
        assert not set(inst.cpus) & seen_cpus, "two instances share a CPU"
        seen_cpus |= set(inst.cpus)
        for cpu in inst.cpus:  # no physical core is shared between instances
            assert owner.setdefault(core_of[cpu], inst.index) == inst.index
        # whole cores: every usable sibling of an instance's core is in its mask
        for core in machine.cores:
            if core.id in inst.cores:
                assert set(core.cpus) <= set(inst.cpus)
        if not s.smt:  # one OpenMP thread per physical core
            assert len({core_of[c] for c in inst.omp_cpus}) == len(inst.omp_cpus)
        if s.housekeeping_core:
            assert len(inst.housekeeping_cpus) >= 1 and not set(inst.housekeeping_cpus) & set(inst.omp_cpus)
        if s.cores_per_instance:
            assert team_size[inst.index] == s.cores_per_instance + (1 if s.housekeeping_core else 0)
        if inst.nodes:
            assert env["CPU_VISIBLE_MEMORY_NODES"] == ",".join(map(str, inst.nodes))
        assert ("VLLM_CPU_KVCACHE_SPACE" in env) != bool(inst.vllm_args)
        assert inst.port == s.base_port + inst.index
    assert not set(p.reserved_cpus) & seen_cpus
    unused = dict(p.unused_cpus)
    assert not set(unused) & (seen_cpus | set(p.reserved_cpus))
    assert all(reason for reason in unused.values())
    assert usable <= seen_cpus | set(p.reserved_cpus) | set(unused), "a usable CPU is unaccounted for"

    # sizes within a node (and kind) differ by at most one core
    per_node: dict[tuple, list[int]] = defaultdict(list)
    for inst in p.instances:
        if len(inst.cpu_nodes) == 1:
            per_node[(inst.cpu_nodes[0], inst.kind)].append(team_size[inst.index])
    for sizes in per_node.values():
        assert max(sizes) - min(sizes) <= 1, sizes

    # single node whenever avoidable
    pool: dict[int | None, int] = defaultdict(int)
    for core in machine.cores:
        if core.cpus and (s.nodes is None or core.node in s.nodes):
            pool[core.node] += 1
    per_instance = (s.cores_per_instance or 1) + (1 if s.housekeeping_core else 0)
    fits_in_nodes = sum(n // per_instance for n in pool.values()) >= len(p.instances)
    if fits_in_nodes and (s.cores_per_instance or len(p.instances) >= len(pool)) and not any(k.kind == "efficiency" for k in machine.cores):
        assert all(len(inst.cpu_nodes) <= 1 for inst in p.instances), [i.cpu_nodes for i in p.instances]

    # reserved cores come from efficiency cores first: a reserved performance core means every
    # efficiency core of the pool is reserved too or belongs to an efficiency-core instance
    in_pool = [core for core in machine.cores if s.nodes is None or core.node in s.nodes]
    if any(kind_of[core_of[c]] != EFFICIENCY for c in p.reserved_cpus) and any(c.kind == EFFICIENCY for c in in_pool):
        taken = {core_of[c] for c in p.reserved_cpus} | {c for inst in p.instances if inst.kind == EFFICIENCY for c in inst.cores}
        assert all(core.id in taken for core in in_pool if core.kind == EFFICIENCY), "P core reserved before an E core"

    # memory sums fit the per-node budget
    for node in p.memory:
        expected = sum(i.memory_bytes / len(i.nodes) for i in p.instances if node.node in i.nodes)
        assert abs(node.demand_bytes - expected) <= len(node.instances) + 1
        if node.figure != "unknown":
            assert node.demand_bytes <= node.budget_bytes


@st.composite
def machines(draw):
    sockets = draw(st.integers(1, 2))
    nodes_per_socket = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 12), min_size=sockets * nodes_per_socket, max_size=sockets * nodes_per_socket))
    smt = draw(st.sampled_from([1, 2, 4]))
    total = sum(sizes) * smt
    offline = draw(st.sets(st.integers(0, total - 1), max_size=total // 4))
    restricted = draw(st.booleans())
    cpuset = draw(st.sets(st.integers(0, total - 1), min_size=1)) if restricted else None
    l3 = draw(st.integers(1, 3))
    memory = draw(st.sampled_from([8 * GiB, 64 * GiB, 512 * GiB]))
    return make_machine(
        sockets, nodes_per_socket, sizes, smt, offline=offline, cpuset=cpuset, l3_per_node=l3, node_memory=memory
    )


@st.composite
def plan_settings(draw):
    return PlanSettings(
        instances=draw(st.one_of(st.just("auto"), st.integers(1, 24))),
        reserve_cores=draw(st.sampled_from(["auto", 0, 1, 2])),
        housekeeping_core=draw(st.booleans()),
        smt=draw(st.booleans()),
        cores_per_instance=draw(st.one_of(st.none(), st.integers(1, 6))),
        model_size_bytes=draw(st.sampled_from([None, GiB // 2, 2 * GiB])),
        kvcache_gib=draw(st.sampled_from([None, None, 0.5, 1, 2])),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines(), plan_settings())
def test_plans_keep_the_rules_or_are_refused_with_a_reason(machine, s):
    try:
        p = plan(machine, s)
    except PlanError as exc:
        message = str(exc)
        event("refused")
        assert message and "\n" not in message
        pool = len(machine.cores)
        count = len(machine.cpu_nodes) if s.instances == "auto" else s.instances
        per_instance = (s.cores_per_instance or 1) + (1 if s.housekeeping_core else 0)
        enough_cores = pool >= count * per_instance + (0 if s.reserve_cores == "auto" else s.reserve_cores)
        # cores enough: only memory can refuse the plan (the machines have small nodes too)
        assert not enough_cores or "node" in message or "no usable" in message, message
        return
    event("planned")
    check_plan_rules(machine, s, p)
    assert len(p.instances) == (len(machine.cpu_nodes) if s.instances == "auto" else s.instances)


@settings(max_examples=100, deadline=None)
@given(machines(), plan_settings())
def test_enough_cores_and_memory_always_gives_a_plan(machine, s):
    count = len(machine.cpu_nodes) if s.instances == "auto" else s.instances
    per_instance = (s.cores_per_instance or 1) + (1 if s.housekeeping_core else 0)
    assume(machine.cores and len(machine.cores) >= count * per_instance + (0 if s.reserve_cores == "auto" else s.reserve_cores))
    roomy = PlanSettings(**{**s.__dict__, "model_size_bytes": GiB // 4, "kvcache_gib": 0.25, "overhead_bytes": 0, "memory_reserve_bytes": 0})
    machine_with_memory = machine  # 8 GiB+ per node: 24 instances × 0.5 GiB always fit
    p = plan(machine_with_memory, roomy)
    check_plan_rules(machine, roomy, p)


@settings(max_examples=50, deadline=None)
@given(machines(), plan_settings())
def test_plans_are_deterministic(machine, s):
    try:
        first = plan(machine, s)
    except PlanError as exc:
        try:
            plan(machine, s)
        except PlanError as again:
            assert str(again) == str(exc)
        return
    assert plan(machine, s) == first


@st.composite
def hybrid_machines(draw):
    """Hybrid parts: performance and efficiency cores on one or several nodes, any proportion."""
    sockets = draw(st.integers(1, 2))
    nodes_per_socket = draw(st.integers(1, 2))
    sizes = draw(st.lists(st.integers(2, 12), min_size=sockets * nodes_per_socket, max_size=sockets * nodes_per_socket))
    total = sum(sizes)
    e_cores = draw(st.sets(st.integers(0, total - 1), min_size=1, max_size=total - 1))
    smt = draw(st.sampled_from([1, 2]))
    offline = draw(st.sets(st.integers(0, total * smt - 1), max_size=total // 4))
    return make_machine(sockets, nodes_per_socket, sizes, smt, offline=offline, efficiency_cores=e_cores,
                        l3_per_node=draw(st.integers(1, 2)), node_memory=64 * GiB)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_machines(), plan_settings(), st.sampled_from(["housekeeping", "instances", "unused"]))
# found by hypothesis: every performance core offline leaves a pool of efficiency cores only
@example(make_machine(1, 1, [8], 1, offline={0, 4}, efficiency_cores={1, 2, 3, 5, 6, 7}, l3_per_node=2, node_memory=64 * GiB),
         PlanSettings(cores_per_instance=1), "housekeeping")
def test_hybrid_plans_never_mix_kinds_and_reserve_efficiency_cores_first(machine, s, mode):
    s = PlanSettings(**{**s.__dict__, "efficiency_cores": mode})
    try:
        p = plan(machine, s)
    except PlanError as exc:
        event("refused")
        assert str(exc) and "\n" not in str(exc)
        return
    event(f"planned {mode}")
    check_plan_rules(machine, s, p)
    requested = len(machine.cpu_nodes) if s.instances == "auto" else s.instances
    if mode == "instances":
        assert len(p.instances) >= requested
    else:
        assert len(p.instances) == requested
    # no efficiency core idles while an instance runs on its node; only where the usable cores hold
    # both kinds: with every performance core offline the pool is one kind, planned like any
    # uniform machine (spare cores stay spare), as hybrid.split_kinds says
    if mode == "housekeeping" and {c.kind for c in machine.cores if c.cpus} >= {PERFORMANCE, EFFICIENCY}:
        busy = set(p.reserved_cpus) | {c for i in p.instances for c in i.cpus}
        nodes_with_instances = {n for i in p.instances for n in i.cpu_nodes}
        for core in machine.cores:
            if core.kind == EFFICIENCY and core.node in nodes_with_instances:
                assert set(core.cpus) & busy, f"efficiency core {core.id} idle"
