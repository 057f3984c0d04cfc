"""Every real machine of the hwloc corpus, read through vsup.topology.sysfs and held against
truth.json and against hwloc's own expected lstopo output for the same dump.

What the truth.json fields count (checked against the raw files of each dump):
- online_cpus / offline_cpus: cpu/online (or per-CPU online files); offline = present − online.
- allowed_cpus: online ∩ the dump's cpuset (legacy /dev/cpuset, cgroup v1 or v2).
- nodes[].usable_cpus: the node's cpumap ∩ online CPUs. It does NOT apply the cpuset (in the
  cgroup2 dump node 1 lists 4-7 while only 0-5 are allowed), so it is our Node.cpus, and our
  Node.usable_cpus is that ∩ allowed_cpus. nodes[].cpus is the raw cpumap (offline CPUs included).
- cores_hwloc_style: physical cores with at least one online CPU, cpuset or not (15 in the
  cpusets dump) = len(Machine.all_cores). lstopo_allowed_counts.Core counts cores with an allowed
  CPU = len(Machine.cores).
- lstopo_allowed_counts.Package counts packages holding an allowed CPU or an allowed memory node;
  on POWER7 (physical_package_id -1) hwloc invents 64 packages from core_siblings, while the
  kernel reports one unknown package id: that dump's package count is checked separately.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.topology_fixtures import DUMP_NAMES
from vsup.topology.cpulist import parse_list
from vsup.topology.model import EFFICIENCY, PERFORMANCE, UNIFORM
from vsup.topology.sysfs import read_machine

_machines: dict[str, object] = {}


@pytest.fixture
def dump(corpus, request):
    name = request.param
    if name not in _machines:
        _machines[name] = read_machine(corpus.fsroot(name), live=False)
    return name, _machines[name], corpus.facts(name)


def _cpus(text: str) -> set[int]:
    return set(parse_list(text))


pytestmark = pytest.mark.parametrize("dump", DUMP_NAMES, indirect=True)


def test_online_and_offline_cpus(dump):
    name, machine, facts = dump
    assert set(machine.cpus_online) == _cpus(facts["online_cpus"])
    offline = set(machine.cpus_present) - set(machine.cpus_online)
    assert offline == _cpus(facts["offline_cpus"])
    assert {cpu for cpu, reason in machine.unusable if reason == "offline"} == offline


def test_allowed_and_usable_cpus(dump):
    name, machine, facts = dump
    allowed = _cpus(facts["allowed_cpus"])
    assert set(machine.cpus_allowed) == allowed
    assert machine.cpus_isolated == ()  # no dump isolates CPUs, so usable == allowed
    assert set(machine.cpus_usable) == allowed
    outside = {cpu for cpu, reason in machine.unusable if reason == "outside cpuset"}
    assert outside == set(machine.cpus_online) - allowed


def test_memory_nodes_allowed(dump):
    name, machine, facts = dump
    allowed = _cpus(facts["allowed_nodes"])
    assert set(machine.mems_allowed) == allowed
    assert {node.id for node in machine.nodes if node.allowed} == allowed
    assert len(machine.mems_allowed) == facts["lstopo_allowed_counts"]["NUMANode"]


def test_nodes_cpus_memory_and_distances(dump):
    name, machine, facts = dump
    truth = facts["nodes"]
    allowed = _cpus(facts["allowed_cpus"])
    online = set(machine.cpus_online)
    assert [node.id for node in machine.nodes] == sorted(int(i) for i in truth)
    for node in machine.nodes:
        expected = truth[str(node.id)]
        assert _cpus(expected["cpus"]) & online == _cpus(expected["usable_cpus"])  # truth is coherent
        assert set(node.cpus) == _cpus(expected["usable_cpus"]), f"node {node.id}"
        assert set(node.usable_cpus) == _cpus(expected["usable_cpus"]) & allowed, f"node {node.id}"
        assert node.memory_total_bytes == expected["mem_total_kB"] * 1024
        assert node.memory_only == expected["memory_only"]
        assert 0 < node.memory_free_bytes <= node.memory_available_bytes <= node.memory_total_bytes
        assert len(node.distances) == len(machine.nodes)
        assert node.distances[machine.nodes.index(node)] == 10


def test_physical_cores_and_smt(dump):
    name, machine, facts = dump
    assert len(machine.all_cores) == facts["cores_hwloc_style"]
    assert len(machine.cores) == facts["lstopo_allowed_counts"]["Core"]
    assert sum(len(core.cpus) for core in machine.cores) == facts["lstopo_allowed_counts"]["PU"]
    # the cores partition the online CPUs, and their usable CPUs partition the usable ones
    every = [cpu for core in machine.all_cores for cpu in core.all_cpus]
    assert sorted(every) == list(machine.cpus_online)
    usable = [cpu for core in machine.cores for cpu in core.cpus]
    assert sorted(usable) == list(machine.cpus_usable)
    threads = sorted({len(core.all_cpus) for core in machine.all_cores})
    smt = facts["smt_threads_per_core"]
    assert threads == ([smt] if isinstance(smt, int) else json.loads(smt.removeprefix("mixed ")))
    for core in machine.all_cores:
        assert len({machine_node(machine, cpu) for cpu in core.all_cpus}) == 1, core


def machine_node(machine, cpu):
    for node in machine.nodes:
        if cpu in node.cpus:
            return node.id
    return None


def test_packages(dump):
    name, machine, facts = dump
    assert len(machine.packages) == facts["packages"]
    if machine.packages == (-1,):
        # POWER7: the kernel does not know the package; hwloc builds them from core_siblings
        assert name == "256ppc-8n8s4t"
        return
    allowed_nodes = set(machine.mems_allowed)
    holding = {core.package for core in machine.cores} | {
        core.package for core in machine.all_cores if core.node in allowed_nodes
    }
    assert len(holding) == facts["lstopo_allowed_counts"]["Package"]


def test_l3_domains(dump):
    name, machine, facts = dump
    groups: dict[int, list[int]] = {}
    for core in machine.all_cores:
        if core.l3 is not None:
            groups.setdefault(core.l3, []).extend(core.all_cpus)
    for l3, cpus in groups.items():
        assert l3 == min(cpus), "an L3 domain is named by its smallest CPU"
        assert len({c.package for c in machine.all_cores if c.l3 == l3}) == 1


def test_agrees_with_hwloc_expected_output(dump, corpus):
    """hwloc's expected lstopo output for the dump (.console or .xml) as a second witness."""
    name, machine, facts = dump
    counts = corpus.lstopo_counts(name)
    if counts is None:
        pytest.fail(f"no {name}.console or {name}.xml in the corpus")
    assert counts["PU"] == len(machine.cpus_usable)
    assert counts["Core"] == len(machine.cores)
    unrestricted = machine.cpus_allowed == machine.cpus_online and len(machine.mems_allowed) == len(machine.nodes)
    if unrestricted:
        assert counts.get("L3Cache", 0) == len({c.l3 for c in machine.cores if c.l3 is not None})
        assert counts["NUMANode"] == len(machine.nodes)
        if machine.packages != (-1,):
            assert counts["Package"] == len(machine.packages)
        if "Die" in counts:
            assert counts["Die"] == len({(c.package, c.die) for c in machine.cores})


def test_core_kinds(dump, corpus):
    """Agree with hwloc's cpukinds: Lakefield is hybrid (its console lists the kinds), every other
    dump is uniform. hwloc ranks kinds by efficiency (0 = the slowest); vsup's efficiency cores
    are the slowest kind, every faster kind is performance."""
    name, machine, facts = dump
    kinds = corpus.cpu_kinds(name)
    source = dict(machine.sources)["kind"]
    if kinds is None:
        assert {core.kind for core in machine.all_cores} == {UNIFORM}
        assert source.startswith("uniform")
        return
    slowest = min(rank for rank, _ in kinds)
    for rank, cpus in kinds:
        want = EFFICIENCY if rank == slowest else PERFORMANCE
        assert {core.kind for core in machine.all_cores if set(core.all_cpus) & cpus} == {want}
    assert not source.startswith("uniform")


def test_isa_from_the_dumps_cpuinfo(dump, corpus):
    name, machine, facts = dump
    text = (corpus.fsroot(name) / "proc" / "cpuinfo").read_text()
    match = re.search(r"^(?:flags|features)\s*:(.*)$", text, re.MULTILINE | re.IGNORECASE)
    flags = set(match.group(1).split()) if match else set()
    assert machine.isa.avx2 == ("avx2" in flags)
    assert machine.isa.avx512f == ("avx512f" in flags)
    assert machine.isa.avx512_bf16 == ("avx512_bf16" in flags)
    assert machine.isa.amx_bf16 == ("amx_bf16" in flags)
    if name == "memorysidecaches":  # Cascade Lake: AVX-512, no BF16
        assert machine.isa.avx512f and not machine.isa.avx512_bf16


def test_cli_json_and_text(dump, corpus):
    """`vsup topology --fsroot DUMP` in a real process: the JSON keys of the issue, and a text
    map that names every node with CPUs."""
    name, machine, facts = dump
    vsup = [str(Path(sys.executable).with_name("vsup")), "topology", "--fsroot", str(corpus.fsroot(name))]
    result = subprocess.run([*vsup, "--format", "json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["cpus_online"] == sorted(_cpus(facts["online_cpus"]))
    assert data["cpus_usable"] == sorted(_cpus(facts["allowed_cpus"]))
    assert [n["id"] for n in data["nodes"]] == sorted(int(i) for i in facts["nodes"])
    for node in data["nodes"]:
        expected = facts["nodes"][str(node["id"])]
        assert node["cpus"] == sorted(_cpus(expected["usable_cpus"]) & _cpus(facts["allowed_cpus"]))
        assert node["memory_total_bytes"] == expected["mem_total_kB"] * 1024
        assert isinstance(node["memory_free_bytes"], int) and isinstance(node["distances"], list)
    assert len(data["cores"]) == facts["lstopo_allowed_counts"]["Core"]
    assert sorted(cpu for core in data["cores"] for cpu in core["cpus"]) == data["cpus_usable"]
    for core in data["cores"]:
        assert set(core) >= {"package", "node", "cpus", "l3", "kind"} and core["cpus"]
    assert set(data["isa"]) >= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}

    text = subprocess.run(vsup, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    for node in machine.nodes:
        if node.cpus:
            assert re.search(rf"^node {node.id}: CPUs ", text.stdout, re.MULTILINE)
    assert f"{len(machine.cpus_online)} online" in text.stdout
