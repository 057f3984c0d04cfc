"""`vsup topology` on the machine running the tests, in a real process, checked against what
Python and /sys say directly (os.sched_getaffinity, os.cpu_count, the cpulist files); plus the
CLI contract: --fsroot / VSUP_FSROOT, one-line errors with exit 2, --help, --version."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sysfs_builder import build_sysfs
from vsup import __version__
from vsup.topology.cpulist import parse_list

VSUP = str(Path(sys.executable).with_name("vsup"))
SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")


def vsup(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "VSUP_FSROOT"}
    full_env.update(env or {})
    return subprocess.run([VSUP, *args], capture_output=True, text=True, timeout=120, env=full_env)


@pytest.fixture(scope="module")
def live() -> dict:
    result = vsup("topology", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _sys_list(path: Path) -> set[int]:
    return set(parse_list(path.read_text()))


def test_online_cpus_match_os_cpu_count_and_sysfs(live):
    assert len(live["cpus_online"]) == os.cpu_count()
    assert set(live["cpus_online"]) == _sys_list(SYS_CPU / "online")


def test_usable_cpus_match_sched_getaffinity(live):
    isolated = _sys_list(SYS_CPU / "isolated") if (SYS_CPU / "isolated").exists() else set()
    assert set(live["cpus_usable"]) == set(os.sched_getaffinity(0)) - isolated
    assert set(live["cpus_usable"]) <= set(live["cpus_allowed"]) <= set(live["cpus_online"])


def test_nodes_match_sysfs(live):
    node_dirs = sorted(SYS_NODE.glob("node[0-9]*")) if SYS_NODE.is_dir() else []
    if not node_dirs:
        assert [n["id"] for n in live["nodes"]] == [0]
        return
    assert [n["id"] for n in live["nodes"]] == sorted(int(d.name[4:]) for d in node_dirs)
    usable = set(live["cpus_usable"])
    for node in live["nodes"]:
        d = SYS_NODE / f"node{node['id']}"
        online_cpus = _sys_list(d / "cpulist") & set(live["cpus_online"])  # live cpulist is exact
        assert set(node["cpus_online"]) == online_cpus
        assert set(node["cpus"]) == online_cpus & usable
        total_kb = int(re.search(r"MemTotal:\s+(\d+) kB", (d / "meminfo").read_text()).group(1))
        assert node["memory_total_bytes"] == total_kb * 1024
        assert 0 < node["memory_free_bytes"] <= node["memory_available_bytes"] <= node["memory_total_bytes"]


def test_cores_match_thread_siblings_lists(live):
    online = set(live["cpus_online"])
    for core in live["cores"]:
        for cpu in core["all_cpus"]:
            siblings = SYS_CPU / f"cpu{cpu}/topology/thread_siblings_list"
            assert _sys_list(siblings) & online == set(core["all_cpus"]), cpu
            package = int((SYS_CPU / f"cpu{cpu}/topology/physical_package_id").read_text())
            assert core["package"] == package
    assert sorted(c for core in live["cores"] for c in core["cpus"]) == live["cpus_usable"]


def test_isa_matches_proc_cpuinfo(live):
    text = Path("/proc/cpuinfo").read_text()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    if not match:
        pytest.fail("no flags line in /proc/cpuinfo on this (non-x86?) machine")
    flags = set(match.group(1).split())
    for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"):
        assert live["isa"][name] == (name in flags), name


def test_text_map_of_this_machine():
    result = vsup("topology")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^CPUs: \d+ online", result.stdout, re.MULTILINE)
    assert re.search(r"^node \d+: CPUs ", result.stdout, re.MULTILINE)
    assert "ISA: " in result.stdout


def test_fsroot_option_and_env_read_the_same_dump(tmp_path):
    root = build_sysfs(tmp_path, nodes=(3, 3), smt=2)
    by_option = vsup("topology", "--fsroot", str(root), "--format", "json")
    by_env = vsup("topology", "--format", "json", env={"VSUP_FSROOT": str(root)})
    assert by_option.returncode == 0 and by_env.returncode == 0, by_option.stderr + by_env.stderr
    data = json.loads(by_option.stdout)
    assert data == json.loads(by_env.stdout)
    assert data["cpus_online"] == list(range(12))
    assert [n["cpus"] for n in data["nodes"]] == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]


def test_fsroot_slash_is_this_machine(live):
    result = vsup("topology", "--fsroot", "/", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["cpus_usable"] == live["cpus_usable"] and data["isa"] == live["isa"]


@pytest.mark.parametrize("how", ["option", "env"])
def test_missing_fsroot_is_one_line_and_exit_2(how):
    if how == "option":
        result = vsup("topology", "--fsroot", "/nonexistent")
    else:
        result = vsup("topology", env={"VSUP_FSROOT": "/nonexistent"})
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vsup: error: ") and "/nonexistent" in lines[0]


def test_broken_dump_is_one_line_naming_the_file(tmp_path):
    root = build_sysfs(tmp_path, nodes=(2,))
    (root / "sys/devices/system/node/node0/cpumap").write_text("not-hex\n")
    result = vsup("topology", "--fsroot", str(root))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "node0/cpumap" in lines[0] and "Traceback" not in result.stderr


def test_help_and_version():
    help_result = vsup("--help")
    assert help_result.returncode == 0 and "topology" in help_result.stdout
    topo_help = vsup("topology", "--help")
    assert topo_help.returncode == 0 and "--fsroot" in topo_help.stdout and "--format" in topo_help.stdout
    version = vsup("--version")
    assert version.returncode == 0 and __version__ in version.stdout


def test_affinity_narrows_usable_cpus():
    """Started under a narrower affinity (as `taskset -c` does), vsup sees only that CPU and says
    why the others are unusable."""
    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        pytest.skip("needs two CPUs in this process's affinity")
    keep = online[0]
    code = (
        "import os, sys; os.sched_setaffinity(0, {%d}); "
        "os.execv(sys.argv[1], sys.argv[1:])" % keep
    )
    result = subprocess.run(
        [sys.executable, "-c", code, VSUP, "topology", "--format", "json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["cpus_usable"] == [keep]
    reasons = {item["cpu"]: item["reason"] for item in data["unusable"]}
    assert all(reasons[cpu] == "outside affinity" for cpu in online[1:])
