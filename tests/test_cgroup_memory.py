"""vsup in a container or pod: the cgroup memory limit (v2 memory.max, v1 memory.limit_in_bytes),
read from hand-made trees (tests/sysfs_builder.py), and the plan that sizes the KV cache from it."""

from __future__ import annotations

import json

import pytest

from tests.sysfs_builder import GIB, add_memory_limit, build_sysfs
from tests.test_plan_cli import vsup
from vsup.topology.errors import PlanError, TopologyError
from vsup.topology.plan_model import PlanSettings
from vsup.topology.planner import plan
from vsup.topology.render import machine_to_json, render_text
from vsup.topology.sysfs import read_machine


def read(root):
    return read_machine(root, live=False)


def settings(**overrides) -> PlanSettings:
    values = dict(instances=2, model_size_bytes=4 * GIB, overhead_bytes=int(1.5 * GIB), memory_reserve_bytes=2 * GIB,
                  launcher="numactl")
    values.update(overrides)
    return PlanSettings(**values)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_limit_of_the_process_cgroup(tmp_path, version):
    root = add_memory_limit(build_sysfs(tmp_path, nodes=(4, 4)), 20 * GIB, cgroup=version)
    machine = read(root)
    assert machine.memory_limit_bytes == 20 * GIB
    name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    assert dict(machine.sources)["memory_limit"].endswith(f"vsup.slice/test.scope/{name}")
    assert machine_to_json(machine)["memory_limit_bytes"] == 20 * GIB
    assert "Memory limit: 20.0 GiB for this process's cgroup" in render_text(machine)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_smaller_limit_on_the_parent_holds_for_the_child(tmp_path, version):
    # a pod's limit sits on the pod's cgroup, above the container's own (or unlimited) one
    root = add_memory_limit(build_sysfs(tmp_path, nodes=(4,)), None, cgroup=version, parent_limit=6 * GIB)
    machine = read(root)
    assert machine.memory_limit_bytes == 6 * GIB
    name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    assert dict(machine.sources)["memory_limit"].endswith(f"vsup.slice/{name}")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_no_limit_written_as_max_or_the_v1_huge_number(tmp_path, version):
    machine = read(add_memory_limit(build_sysfs(tmp_path, nodes=(4,)), None, cgroup=version))
    assert machine.memory_limit_bytes is None
    assert "memory_limit" not in dict(machine.sources)
    assert "Memory limit" not in render_text(machine)


def test_no_cgroup_files_at_all_is_no_limit(tmp_path):
    assert read(build_sysfs(tmp_path, nodes=(4,))).memory_limit_bytes is None


def test_limit_beside_a_cpuset_in_the_same_cgroup(tmp_path):
    for version in ("v2", "v1"):
        root = build_sysfs(tmp_path / version, nodes=(4, 4), smt=2, cpuset="4-7,12-15", cpuset_mems="1", cgroup=version)
        machine = read(add_memory_limit(root, 9 * GIB, cgroup=version))
        assert machine.cpus_usable == (4, 5, 6, 7, 12, 13, 14, 15)
        assert machine.memory_limit_bytes == 9 * GIB


def test_container_with_a_cgroup_namespace(tmp_path):
    # Inside a container /proc/self/cgroup says "/" and the mount shows the pod's container cgroup.
    root = build_sysfs(tmp_path, nodes=(8,))
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text("0::/\n")
    (root / "proc/self/mountinfo").write_text(
        "30 24 0:26 /kubepods/pod1/ctr /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw\n")
    cg = root / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (cg / "memory.max").write_text(f"{12 * GIB}\n")
    assert read(root).memory_limit_bytes == 12 * GIB


def test_memory_controller_not_in_the_v2_hierarchy_is_ignored(tmp_path):
    root = add_memory_limit(build_sysfs(tmp_path, nodes=(4,)), 3 * GIB)
    (root / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu\n")
    assert read(root).memory_limit_bytes is None


def test_malformed_limit_is_an_error_naming_the_file(tmp_path):
    root = add_memory_limit(build_sysfs(tmp_path, nodes=(4,)), 3 * GIB)
    (root / "sys/fs/cgroup/vsup.slice/test.scope/memory.max").write_text("lots\n")
    with pytest.raises(TopologyError, match=r"test.scope/memory.max: 'lots'; expected a number of bytes or max"):
        read(root)


def test_kv_cache_is_sized_from_the_limit_not_the_nodes(tmp_path):
    # Two 16 GiB nodes would give each instance 16 - 2 - 4 - 1.5 -> 8 GiB of KV cache; the 20 GiB
    # limit holds both: (20 - 2) / 2 - 4 - 1.5 = 3.5 -> 3 GiB.
    unlimited = plan(read(build_sysfs(tmp_path / "host", nodes=(4, 4))), settings())
    assert unlimited.instances[0].kvcache_bytes == 8 * GIB and unlimited.memory_limit is None
    machine = read(add_memory_limit(build_sysfs(tmp_path / "pod", nodes=(4, 4)), 20 * GIB))
    result = plan(machine, settings())
    assert [inst.kvcache_bytes for inst in result.instances] == [3 * GIB, 3 * GIB]
    assert result.instances[0].env_dict()["VLLM_CPU_KVCACHE_SPACE"] == "3"
    limit = result.memory_limit
    assert (limit.limit_bytes, limit.budget_bytes, limit.demand_bytes) == (20 * GIB, 18 * GIB, int(2 * 8.5 * GIB))
    assert limit.figure == "cgroup memory limit 20 GiB - 2 GiB reserve"
    assert result.to_json()["memory_limit"]["demand_bytes"] == int(17 * GIB)


def test_a_limit_larger_than_the_nodes_changes_nothing(tmp_path):
    machine = read(add_memory_limit(build_sysfs(tmp_path, nodes=(4, 4)), 200 * GIB))
    assert plan(machine, settings()).instances[0].kvcache_bytes == 8 * GIB


def test_overcommitted_limit_is_one_line_with_what_would_fit(tmp_path):
    machine = read(add_memory_limit(build_sysfs(tmp_path, nodes=(4, 4)), 20 * GIB))
    with pytest.raises(PlanError) as info:
        plan(machine, settings(kvcache_gib=6))
    message = str(info.value)
    assert message.startswith("cgroup memory limit: 2 × (4 GiB weights + 6 GiB KV + 1.5 GiB) = 23 GiB > 18 GiB available "
                              "(cgroup memory limit 20 GiB - 2 GiB reserve)")
    assert "try --instances 1 or --kvcache-gib 3" in message
    with pytest.raises(PlanError, match=r"cgroup memory limit: 2 × \(4 GiB weights \+ 1.5 GiB\) = 11 GiB leaves less than 1 GiB"):
        plan(read(add_memory_limit(build_sysfs(tmp_path / "small", nodes=(4, 4)), 12 * GIB)), settings())


def test_topology_and_plan_commands_show_the_limit(tmp_path):
    root = add_memory_limit(build_sysfs(tmp_path, nodes=(4, 4)), 20 * GIB)
    result = vsup("topology", "--fsroot", str(root))
    assert result.returncode == 0, result.stderr
    assert "Memory limit: 20.0 GiB for this process's cgroup" in result.stdout
    assert json.loads(vsup("topology", "--fsroot", str(root), "--format", "json").stdout)["memory_limit_bytes"] == 20 * GIB
    result = vsup("plan", "--fsroot", str(root), "-n", "2", "--model-size-gib", "4", "--launcher", "numactl")
    assert result.returncode == 0, result.stderr
    assert "cgroup memory limit 20 GiB: planned 17 GiB of 18 GiB (cgroup memory limit 20 GiB - 2 GiB reserve)" in result.stdout
    result = vsup("plan", "--fsroot", str(root), "-n", "2", "--model-size-gib", "4", "--kvcache-gib", "6")
    assert result.returncode == 2 and result.stderr.startswith("vsup: error: cgroup memory limit: 2 × (4 GiB weights")
    assert len(result.stderr.strip().splitlines()) == 1
