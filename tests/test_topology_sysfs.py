"""Machine shapes the hwloc corpus lacks, written by tests/sysfs_builder.py and read back through
vsup.topology.sysfs: EPYC NPS4 with 8-core L3s, Xeon Max HBM nodes, Raptor Lake hybrid, isolcpus,
cgroup cpusets, old/odd sysfs files, and the errors a broken dump must give."""

from __future__ import annotations

import pytest

from tests.sysfs_builder import GIB, CoreSpec, build_sysfs, expected_available, gb10_layout, hybrid_layout, layout
from vsup.topology.errors import TopologyError
from vsup.topology.model import EFFICIENCY, PERFORMANCE, UNIFORM
from vsup.topology.render import machine_to_json, render_text
from vsup.topology.sysfs import read_machine


def read(root):
    return read_machine(root, live=False)


def test_epyc_nps4_eight_core_l3_groups(tmp_path):
    # EPYC 9654: 96 cores, 12 CCDs of 8 cores, NPS4 -> 4 nodes of 24 cores, SMT2, 192 CPUs.
    root = build_sysfs(tmp_path, nodes=(24, 24, 24, 24), smt=2, l3_cores=8)
    mask = (root / "sys/devices/system/node/node1/cpumap").read_text()
    assert mask.count(",") == 5  # 192 CPUs: six 32-bit groups, the wide-mask case
    machine = read(root)
    assert len(machine.cpus_usable) == 192
    assert [n.id for n in machine.nodes] == [0, 1, 2, 3]
    assert machine.node(1).cpus == tuple(range(24, 48)) + tuple(range(120, 144))
    assert len(machine.cores) == 96
    assert all(len(core.cpus) == 2 and core.cpus[1] == core.cpus[0] + 96 for core in machine.cores)
    l3s: dict[int, list] = {}
    for core in machine.cores:
        l3s.setdefault(core.l3, []).append(core)
    assert sorted(l3s) == list(range(0, 96, 8))  # named by their smallest CPU
    for l3, cores in l3s.items():
        assert len(cores) == 8
        assert {core.node for core in cores} == {l3 // 24}
    assert machine.packages == (0,)
    assert machine.node(0).distances == (10, 21, 21, 21)


def test_xeon_max_hbm_memory_only_nodes(tmp_path):
    # Xeon Max 9480 x2, flat mode, no SNC: DDR nodes 0-1 with the CPUs, HBM nodes 2-3 without.
    root = build_sysfs(tmp_path, nodes=(56, 56), packages=2, smt=2,
                       memory_only_nodes={2: 64 * GIB, 3: 64 * GIB}, node_memory=256 * GIB)
    machine = read(root)
    assert [n.id for n in machine.nodes] == [0, 1, 2, 3]
    hbm = [n for n in machine.nodes if n.memory_only]
    assert [n.id for n in hbm] == [2, 3]
    assert all(n.cpus == () and n.memory_total_bytes == 64 * GIB for n in hbm)
    assert [n.id for n in machine.cpu_nodes] == [0, 1]
    assert machine.packages == (0, 1)
    assert machine.node(2).distances == (17, 17, 10, 17)
    assert machine.node(0).memory_available_bytes == expected_available(256 * GIB)
    text = render_text(machine)
    assert "node 2: memory-only, 64.0 GiB total" in text
    assert "2 memory-only" in text


def test_raptor_lake_hybrid_from_cpu_core_and_cpu_atom(tmp_path):
    root = build_sysfs(tmp_path, hybrid=(8, 16))
    machine = read(root)
    assert len(machine.cores) == 24
    p_cores = [c for c in machine.cores if c.kind == PERFORMANCE]
    e_cores = [c for c in machine.cores if c.kind == EFFICIENCY]
    assert [c.cpus for c in p_cores] == [(2 * i, 2 * i + 1) for i in range(8)]
    assert [c.cpus for c in e_cores] == [(16 + i,) for i in range(16)]
    text = render_text(machine)
    assert "P:0+1" in text and "E:31" in text and "Hybrid: 8 performance cores" in text


def test_big_little_from_cpu_capacity(tmp_path):
    cores = [c for c in hybrid_layout(p_cores=4, e_cores=4, p_smt=1)]
    root = build_sysfs(tmp_path, cores=cores, hybrid_source="capacity")
    machine = read(root)
    assert [c.kind for c in machine.cores] == [PERFORMANCE] * 4 + [EFFICIENCY] * 4


@pytest.mark.parametrize("midr", [True, False], ids=["midr", "capacity-only"])
def test_gb10_two_big_core_bins_are_one_tier(tmp_path, midr):
    # NVIDIA GB10: X925 cores at capacity 997/1017/1024, A725 cores at 718/731. The single highest
    # value (1024, one CPU) must not be "the" performance core: every X925 is.
    root = build_sysfs(tmp_path, cores=gb10_layout(midr=midr), hybrid_source="none")
    machine = read(root)
    kinds = {c.id: c.kind for c in machine.cores}
    assert [cpu for cpu, kind in kinds.items() if kind == PERFORMANCE] == [5, 6, 7, 8, 9, 15, 16, 17, 18, 19]
    assert [cpu for cpu, kind in kinds.items() if kind == EFFICIENCY] == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    source = dict(machine.sources)["kind"]
    text = render_text(machine)
    assert "Hybrid: 10 performance cores (P:), 10 efficiency cores (E:)" in text
    assert f"Core kinds: {source}" in text
    if midr:
        assert "regs/identification/midr_el1" in source
        assert "0xd85 Cortex-X925 (CPUs 5-9,15-19, cpu_capacity 997) > 0xd87 Cortex-A725 (CPUs 0-4,10-14, cpu_capacity 718)" in source
    else:
        assert "cpu_capacity" in source and "997-1024 (CPUs 5-9,15-19) > 718-731 (CPUs 0-4,10-14)" in source


def test_midr_ranks_core_types_by_max_frequency_without_capacity(tmp_path):
    cores = [CoreSpec((cpu,), kind="x", core_id=cpu, midr=0x410FD851 if cpu < 2 else 0x410FD871) for cpu in range(4)]
    root = build_sysfs(tmp_path, cores=cores, hybrid_source="none")
    for cpu in range(4):
        (root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq").mkdir(parents=True)
        (root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq/cpuinfo_max_freq").write_text("3900000\n" if cpu < 2 else "2800000\n")
    machine = read(root)
    assert [c.kind for c in machine.cores] == [PERFORMANCE, PERFORMANCE, EFFICIENCY, EFFICIENCY]
    assert "ranked" not in dict(machine.sources)["kind"] and "cpuinfo_max_freq 3900000" in dict(machine.sources)["kind"]


def test_one_midr_part_is_uniform_whatever_the_capacities(tmp_path):
    # one core type whose clusters boost differently (Snapdragon X): not big.LITTLE
    cores = [CoreSpec((cpu,), core_id=cpu, capacity=1024 if cpu < 4 else 700, midr=0x511F0011) for cpu in range(8)]
    machine = read(build_sysfs(tmp_path, cores=cores, hybrid_source="none"))
    assert {c.kind for c in machine.cores} == {UNIFORM}
    assert dict(machine.sources)["kind"].startswith("uniform: one core type, 0x51/0x001 on every CPU")
    assert "Hybrid" not in render_text(machine)


def test_core_types_that_nothing_ranks_are_planned_alike(tmp_path):
    cores = [CoreSpec((cpu,), core_id=cpu, midr=0x410FD851 if cpu < 2 else 0x410FD871) for cpu in range(4)]
    machine = read(build_sysfs(tmp_path, cores=cores, hybrid_source="none"))
    assert {c.kind for c in machine.cores} == {UNIFORM}
    assert "neither cpu_capacity nor cpuinfo_max_freq says which is faster" in dict(machine.sources)["kind"]


def test_three_capacity_tiers_only_the_slowest_is_efficiency(tmp_path):
    # phone-style prime + big + little: one prime core alone must not be "the" performance cores
    values = [1024] + [870] * 3 + [300] * 4
    cores = [CoreSpec((cpu,), core_id=cpu, capacity=v) for cpu, v in enumerate(values)]
    machine = read(build_sysfs(tmp_path, cores=cores, hybrid_source="none"))
    assert [c.kind for c in machine.cores] == [PERFORMANCE] * 4 + [EFFICIENCY] * 4
    assert "1024 (CPUs 0) > 870 (CPUs 1-3) > 300 (CPUs 4-7)" in dict(machine.sources)["kind"]


def test_capacities_within_a_few_percent_are_uniform(tmp_path):
    cores = [CoreSpec((cpu,), core_id=cpu, capacity=1024 - 9 * cpu) for cpu in range(8)]  # 961-1024
    machine = read(build_sysfs(tmp_path, cores=cores, hybrid_source="none"))
    assert {c.kind for c in machine.cores} == {UNIFORM}
    assert "uniform: cpu_capacity 961-1024, within 15%" in dict(machine.sources)["kind"]


def test_malformed_midr_is_an_error_naming_it(tmp_path):
    root = build_sysfs(tmp_path, cores=gb10_layout(), hybrid_source="none")
    (root / "sys/devices/system/cpu/cpu3/regs/identification/midr_el1").write_text("X925\n")
    with pytest.raises(TopologyError, match=r"cpu3/regs/identification/midr_el1: 'X925'; expected a hex"):
        read(root)


def test_uniform_machine_has_uniform_cores(tmp_path):
    machine = read(build_sysfs(tmp_path, nodes=(4,), smt=2))
    assert {c.kind for c in machine.cores} == {UNIFORM}
    assert "Hybrid" not in render_text(machine)


def test_isolcpus_are_not_usable(tmp_path):
    root = build_sysfs(tmp_path, nodes=(4,), smt=2, isolated=[2, 6, 3])  # core 2 = CPUs 2+6
    machine = read(root)
    assert machine.cpus_isolated == (2, 3, 6)
    assert machine.cpus_usable == (0, 1, 4, 5, 7)
    assert (3, "isolated") in machine.unusable and (6, "isolated") in machine.unusable
    assert [c.cpus for c in machine.cores] == [(0, 4), (1, 5), (7,)]
    assert len(machine.all_cores) == 4  # the fully isolated core is still a core of the machine
    assert machine.node(0).usable_cpus == (0, 1, 4, 5, 7)
    assert "2-3,6 isolated" in render_text(machine)


@pytest.mark.parametrize("in_parent", [False, True])
def test_cgroup_v2_cpuset(tmp_path, in_parent):
    root = build_sysfs(tmp_path, nodes=(4, 4), smt=2, cpuset="0-5", cpuset_mems="0",
                       cgroup="v2", cpuset_in_parent=in_parent)
    machine = read(root)
    assert machine.cpus_allowed == (0, 1, 2, 3, 4, 5)
    assert machine.cpus_usable == (0, 1, 2, 3, 4, 5)
    assert machine.mems_allowed == (0,)
    assert [n.allowed for n in machine.nodes] == [True, False]
    assert {cpu for cpu, why in machine.unusable if why == "outside cpuset"} == set(range(6, 16))
    assert machine.node(1).usable_cpus == (4, 5)
    assert [c.cpus for c in machine.cores] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    holder = "vsup.slice" if in_parent else "vsup.slice/test.scope"
    assert dict(machine.sources)["cpuset"].endswith(f"{holder}/cpuset.cpus.effective")


def test_cgroup_v1_cpuset_beats_the_cpusetless_v2_hierarchy(tmp_path):
    root = build_sysfs(tmp_path, nodes=(4, 4), cpuset="1,3,5", cpuset_mems="1", cgroup="v1")
    machine = read(root)
    assert machine.cpus_usable == (1, 3, 5)
    assert machine.mems_allowed == (1,)
    assert dict(machine.sources)["cpuset"].endswith("test.scope/cpuset.effective_cpus")


def test_cgroup_namespace_root_from_mountinfo(tmp_path):
    # In a container the mount shows the host's cgroup as its root and /proc/self/cgroup says "/".
    root = build_sysfs(tmp_path, nodes=(8,))
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text("0::/\n")
    (root / "proc/self/mountinfo").write_text(
        "30 24 0:26 /kubepods/pod1/ctr /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw\n")
    cg = root / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (cg / "cpuset.cpus.effective").write_text("2-3\n")
    (cg / "cpuset.mems.effective").write_text("0\n")
    assert read(root).cpus_usable == (2, 3)


@pytest.mark.parametrize("version, file", [("v2", "cpuset.cpus.effective"), ("v1", "cpuset.effective_cpus")])
def test_cgroup_without_a_mount_table_is_found_at_its_standard_place(tmp_path, version, file):
    # a 96-CPU dump restricted to 16 CPUs, with neither proc/self/mountinfo nor proc/mounts
    root = build_sysfs(tmp_path, nodes=(48, 48), cpuset="0-15", cpuset_mems="0", cgroup=version, mount_table=False)
    assert not (root / "proc/self/mountinfo").exists() and not (root / "proc/mounts").exists()
    machine = read(root)
    assert machine.cpus_usable == tuple(range(16))
    assert machine.mems_allowed == (0,)
    source = dict(machine.sources)["cpuset"]
    assert source.endswith(f"test.scope/{file}, found at its standard place: no proc/self/mountinfo or proc/mounts")
    assert f"Cpuset: {source}" in render_text(machine)


def test_legacy_dev_cpuset_without_a_mount_table(tmp_path):
    root = build_sysfs(tmp_path, nodes=(8,))
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cpuset").write_text("/job7\n")  # Slurm/Torque-style dumps carry this
    (root / "dev/cpuset/job7").mkdir(parents=True)
    (root / "dev/cpuset/cpus").write_text("0-7\n")
    (root / "dev/cpuset/job7/cpus").write_text("2-5\n")
    machine = read(root)
    assert machine.cpus_usable == (2, 3, 4, 5)
    assert dict(machine.sources)["cpuset"].startswith(str(root / "dev/cpuset/job7/cpus"))


def test_standard_place_without_a_process_path_reads_the_mounts_own_cgroup(tmp_path):
    # a container's view: the cgroup namespace root is the container's cgroup, and no proc/self
    root = build_sysfs(tmp_path, nodes=(8,))
    (root / "sys/fs/cgroup").mkdir(parents=True)
    (root / "sys/fs/cgroup/cpuset.cpus.effective").write_text("4-7\n")
    assert read(root).cpus_usable == (4, 5, 6, 7)


def test_no_cpuset_anywhere_is_said_not_silent(tmp_path):
    machine = read(build_sysfs(tmp_path, nodes=(4,)))
    assert machine.cpus_usable == (0, 1, 2, 3)
    text = render_text(machine)
    assert (
        "Cpuset: none found (no proc/self/mountinfo or proc/mounts, and none of /sys/fs/cgroup/cpuset.cpus.effective, "
        "/sys/fs/cgroup/cpuset/cpuset.cpus, /dev/cpuset/cpus): every online CPU counts as allowed"
    ) in text


def test_offline_cpus_and_missing_cpu_online_file(tmp_path):
    root = build_sysfs(tmp_path, nodes=(4,), smt=2, offline=[5, 6], online_file=False)
    assert not (root / "sys/devices/system/cpu/online").exists()
    machine = read(root)
    assert machine.cpus_online == (0, 1, 2, 3, 4, 7)
    assert {cpu for cpu, why in machine.unusable if why == "offline"} == {5, 6}
    assert [c.all_cpus for c in machine.all_cores] == [(0, 4), (1,), (2,), (3, 7)]
    assert machine.node(0).cpus == (0, 1, 2, 3, 4, 7)


def test_no_way_to_tell_online_cpus_is_an_error_naming_the_file(tmp_path):
    cpu = tmp_path / "sys/devices/system/cpu"
    for n in range(2):
        (cpu / f"cpu{n}").mkdir(parents=True)
    with pytest.raises(TopologyError, match=r"sys/devices/system/cpu/online: missing.*expected a CPU list"):
        read(tmp_path)


def test_nul_padded_and_blank_files_read_like_clean_ones(tmp_path):
    clean = read(build_sysfs(tmp_path / "clean", nodes=(6, 6), smt=2, l3_cores=3, isolated=[1]))
    padded_root = build_sysfs(tmp_path / "padded", nodes=(6, 6), smt=2, l3_cores=3, isolated=[1],
                              nul_padding=True)
    assert (padded_root / "sys/devices/system/node/node0/cpumap").read_bytes().endswith(b"\x00")
    # blank optional files: kernel_max-style extras, an empty isolated list, an empty cpulist
    (padded_root / "sys/devices/system/cpu/nohz_full").write_text("\n")
    (padded_root / "sys/devices/system/node/node1/cpulist").write_text("\x00\n")
    padded = read(padded_root)
    assert machine_to_json(padded) | {"sources": None} == machine_to_json(clean) | {"sources": None}


def test_cpumap_is_authoritative_over_a_stale_cpulist(tmp_path):
    machine = read(build_sysfs(tmp_path, nodes=(4, 4), stale_cpulist=True))
    assert machine.node(1).cpus == (4, 5, 6, 7)


def test_sparse_node_ids_and_their_distances(tmp_path):
    machine = read(build_sysfs(tmp_path, nodes=(2, 2, 2), node_ids=(0, 4, 9)))
    assert [n.id for n in machine.nodes] == [0, 4, 9]
    assert machine.node(9).cpus == (4, 5)
    assert machine.node(4).distances == (21, 10, 21)
    assert [c.node for c in machine.cores] == [0, 0, 4, 4, 9, 9]


def test_machine_without_numa_is_one_node_with_proc_meminfo(tmp_path):
    machine = read(build_sysfs(tmp_path, nodes=(4,), numa=False, node_memory=8 * GIB))
    assert [n.id for n in machine.nodes] == [0]
    assert machine.node(0).cpus == (0, 1, 2, 3)
    assert machine.node(0).memory_total_bytes == 8 * GIB
    assert {c.node for c in machine.cores} == {0}


def test_isa_from_proc_cpuinfo_flags(tmp_path):
    root = build_sysfs(tmp_path, flags="fpu lm avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile")
    isa = read(root).isa
    assert (isa.avx2, isa.avx512f, isa.avx512_bf16, isa.amx_bf16, isa.amx_tile) == (True,) * 5
    assert isa.arch == "x86_64"
    (root / "proc/cpuinfo").unlink()
    isa = read(root).isa
    assert not (isa.avx2 or isa.avx512f or isa.amx_bf16)


@pytest.mark.parametrize(
    "rel, content, message",
    [
        ("sys/devices/system/node/node0/cpumap", "zz,00000003", r"node0/cpumap: .*expected a hex CPU mask"),
        ("sys/devices/system/cpu/online", "0-x", r"cpu/online: .*expected a CPU list"),
        ("sys/devices/system/cpu/cpu1/online", "yes", r"cpu1/online: 'yes'; expected 1 or 0"),
        ("sys/devices/system/cpu/cpu2/topology/physical_package_id", "two", r"cpu2/topology/physical_package_id: 'two' is not an integer"),
        ("sys/devices/system/node/node1/meminfo", "Node 1 MemFree: 10 kB", r"node1/meminfo: no MemTotal line"),
        ("sys/devices/system/node/node1/distance", "21 ten", r"node1/distance: .*expected distances"),
        ("sys/devices/system/cpu/cpu3/cache/index3/shared_cpu_map", "0x0f", r"index3/shared_cpu_map: .*hex"),
    ],
)
def test_malformed_file_is_an_error_naming_it(tmp_path, rel, content, message):
    # without cpu/online the per-CPU online files are what counts
    root = build_sysfs(tmp_path, nodes=(2, 2), online_file=not rel.endswith("cpu1/online"))
    (root / rel).write_text(content + "\n")
    with pytest.raises(TopologyError, match=message) as info:
        read(root)
    assert str(root) in str(info.value)


def test_missing_sibling_mask_is_an_error_naming_the_file(tmp_path):
    root = build_sysfs(tmp_path, nodes=(2,), smt=2)
    for name in ("thread_siblings", "thread_siblings_list", "core_cpus", "core_cpus_list"):
        (root / f"sys/devices/system/cpu/cpu1/topology/{name}").unlink()
    with pytest.raises(TopologyError, match=r"cpu1/topology/thread_siblings: missing.*SMT sibling"):
        read(root)


def test_cpu_in_two_nodes_is_an_error(tmp_path):
    root = build_sysfs(tmp_path, nodes=(2, 2))
    (root / "sys/devices/system/node/node1/cpumap").write_text("0000000d\n")
    with pytest.raises(TopologyError, match=r"CPU 0 is in both node0/cpumap and node1/cpumap"):
        read(root)


def test_fsroot_that_is_not_a_directory(tmp_path):
    with pytest.raises(TopologyError, match=r"no such directory"):
        read_machine(tmp_path / "nope")
    with pytest.raises(TopologyError, match=r"sys/devices/system/cpu: missing"):
        read_machine(tmp_path)


def test_layout_helper_numbering():
    # the builder's own contract, which the planner's tests rely on too
    assert [c.cpus for c in layout((2, 2), smt=2)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [c.cpus for c in layout((2,), smt=2, smt_siblings="adjacent")] == [(0, 1), (2, 3)]
    assert [c.package for c in layout((1, 1, 1, 1), packages=2)] == [0, 0, 1, 1]
