"""The placement rules on every real machine of the hwloc corpus (tests/data/hwloc),
read by vsup.topology.sysfs, for N in {1, 2, CPU nodes, cores/2, max}."""

from __future__ import annotations

import pytest

from tests.test_planner_properties import check_plan_rules
from tests.topology_fixtures import DUMP_NAMES
from vsup.topology.errors import PlanError
from vsup.topology.plan_model import GiB, PlanSettings
from vsup.topology.planner import plan
from vsup.topology.sysfs import read_machine

# Memory is not what these tests are about (the corpus has 256 MiB VM nodes): tiny instances.
SMALL = dict(model_size_bytes=32 * 1024**2, kvcache_gib=1 / 32, overhead_bytes=0, memory_reserve_bytes=0)


@pytest.fixture(scope="module")
def machines(corpus):
    return {name: read_machine(corpus.fsroot(name), live=False) for name in DUMP_NAMES}


def instance_counts(machine) -> list[int]:
    cores = len(machine.cores)
    return sorted({1, 2, len(machine.cpu_nodes), max(1, cores // 2), cores - 1})


@pytest.mark.parametrize("name", DUMP_NAMES)
@pytest.mark.parametrize(
    "options",
    [{}, {"housekeeping_core": True}, {"smt": True, "reserve_cores": 0}, {"cores_per_instance": 2}],
    ids=["default", "housekeeping", "smt", "two-cores-each"],
)
def test_rules_hold_on_every_dump(machines, name, options):
    machine = machines[name]
    planned = 0
    for count in instance_counts(machine):
        s = PlanSettings(instances=count, **SMALL, **options)
        try:
            p = plan(machine, s)
        except PlanError as exc:
            per_instance = (s.cores_per_instance or 1) + (1 if s.housekeeping_core else 0)
            # only too few cores may refuse these tiny instances
            reserve = 0 if s.reserve_cores == "auto" else s.reserve_cores
            assert len(machine.cores) < count * per_instance + reserve, str(exc)
            continue
        planned += 1
        check_plan_rules(machine, s, p)
        assert len(p.instances) == count
    assert planned >= 1


@pytest.mark.parametrize("name", DUMP_NAMES)
def test_auto_is_one_instance_per_cpu_node(machines, name):
    machine = machines[name]
    p = plan(machine, PlanSettings(instances="auto", **SMALL))
    assert len(p.instances) == len({c.node for c in machine.cores})
    check_plan_rules(machine, PlanSettings(instances="auto", **SMALL), p)
    if len(p.instances) >= 2 and all(c.node is not None for c in machine.cores):
        assert sorted(i.cpu_nodes[0] for i in p.instances) == [n.id for n in machine.cpu_nodes]


def test_two_socket_xeon_two_instances(machines):
    """2 × Xeon 8c/16t: one instance per socket, core 0 (CPUs 0 and 16) reserved."""
    p = plan(machines["32intel64-2p8co2t+8ve"], PlanSettings(instances=2, model_size_bytes=4 * GiB))
    a, b = p.instances
    assert p.reserved_cpus == (0, 16)
    assert (a.argv, b.argv) == (
        ("numactl", "--physcpubind=1-7,17-23", "--membind=0"),
        ("numactl", "--physcpubind=8-15,24-31", "--membind=1"),
    )
    assert a.env_dict()["VLLM_CPU_OMP_THREADS_BIND"] == "1-7"
    assert b.env_dict()["OMP_NUM_THREADS"] == "8"


def test_power7_smt4_keeps_one_thread_per_core(machines):
    p = plan(machines["256ppc-8n8s4t"], PlanSettings(instances="auto", **SMALL))
    assert [len(i.omp_cpus) for i in p.instances] == [7, 8, 8, 8, 8, 8, 8, 8]
    assert all(len(i.cpus) == 4 * len(i.omp_cpus) for i in p.instances)


def test_cpuset_restricted_memory_binds_to_allowed_nodes(machines):
    machine = machines["16amd64-8n2c-cpusets"]
    p = plan(machine, PlanSettings(instances="auto", **SMALL))
    allowed = set(machine.mems_allowed)
    assert all(set(i.nodes) <= allowed for i in p.instances)
    assert any("outside this cpuset" in w for w in p.warnings)
    assert dict(p.unused_cpus)[4] == "offline"
