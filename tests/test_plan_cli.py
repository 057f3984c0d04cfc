"""`vsup plan` as a user runs it: a real subprocess on a real dump (the 2-socket Xeon of the corpus)
and on this machine."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.topology_fixtures import corpus  # noqa: F401  (fixture)

VSUP = [sys.executable, "-m", "vsup.supervisor.cli"] if not (Path(sys.executable).parent / "vsup").exists() else [str(Path(sys.executable).parent / "vsup")]
XEON = "32intel64-2p8co2t+8ve"  # 2 × Xeon 8 cores / 16 threads, 2 NUMA nodes of ~47 GiB


def vsup(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def xeon(corpus) -> str:
    return str(corpus.fsroot(XEON))


def test_table_shows_the_core_map_instances_reserve_and_memory(xeon):
    result = vsup("plan", "--instances", "2", "--fsroot", xeon, "--model-size-gib", "4", "--kvcache-gib", "8", "--launcher", "numactl")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "[R 0+16] [i0 1+17 2+18 3+19 4+20 5+21 6+22 7+23]" in out
    assert "[i1 8+24 9+25 10+26 11+27 12+28 13+29 14+30 15+31]" in out
    assert "reserved for vsup, the proxy and the OS: 0,16" in out
    assert "numactl --physcpubind=1-7,17-23 --membind=0" in out
    assert "planned 13.5 GiB of" in out and "(MemTotal - 2 GiB reserve)" in out
    row0 = next(line.split() for line in out.splitlines() if line.strip().startswith("0  8100"))
    assert row0[:6] == ["0", "8100", "0", "7", "7", "1-7"]


def test_json_is_the_plan(xeon):
    result = vsup("plan", "-n", "2", "--fsroot", xeon, "--model-size-gib", "4", "--format", "json", "--launcher", "taskset")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    first = data["instances"][0]
    assert first["argv"] == ["taskset", "-c", "1-7,17-23"]
    assert first["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "1-7"
    assert first["nodes"] == [0] and first["port"] == 8100
    assert data["reserved_cpus"] == [0, 16]
    assert any("memory is not bound" in w for w in data["warnings"])


def test_shell_lines_are_runnable_commands(xeon, tmp_path):
    config = tmp_path / "vsup.yaml"
    config.write_text(
        "model: /models/my model\ninstances: 2\nvllm:\n  command: [vllm, serve]\n  args: [--dtype, float32]\n"
        "  env:\n    LD_PRELOAD: libtcmalloc.so\nplacement:\n  model_size_gib: 2\n  kvcache_gib: 0.5\n  launcher: numactl\n"
    )
    result = vsup("plan", "--config", str(config), "--fsroot", xeon, "--format", "shell")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    words = shlex.split(lines[1])
    assert words[:3] == ["env", "-u", "VLLM_CPU_KVCACHE_SPACE"]
    assert "OMP_NUM_THREADS=8" in words and "VLLM_CPU_OMP_THREADS_BIND=8-15" in words and "LD_PRELOAD=libtcmalloc.so" in words
    start = words.index("numactl")
    assert words[start:] == [
        "numactl", "--physcpubind=8-15,24-31", "--membind=1", "vllm", "serve", "/models/my model",
        "--host", "127.0.0.1", "--port", "8101", "--kv-cache-memory-bytes", str(2**29), "--dtype", "float32",
    ]


def test_cli_flags_override_the_config(xeon, tmp_path):
    config = tmp_path / "vsup.yaml"
    config.write_text("model: m\ninstances: 1\nplacement:\n  model_size_gib: 2\n  reserve_cores: 0\n")
    result = vsup("plan", "-c", str(config), "--fsroot", xeon, "-n", "4", "--cores-per-instance", "3", "--base-port", "9000", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [i["port"] for i in data["instances"]] == [9000, 9001, 9002, 9003]
    assert all(len(i["omp_cpus"]) == 3 for i in data["instances"])
    assert data["reserved_cpus"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--instances", "two"], "vsup: error: --instances 'two': expected a whole number of at least 1, or auto"),
        (["--instances", "0"], "vsup: error: --instances '0': expected a whole number of at least 1, or auto"),
        (["-n", "2", "--kvcache-gib", "-1"], "vsup: error: --kvcache-gib '-1': expected a positive number of GiB"),
        (["-n", "2", "--format", "yaml"], "vsup: error: --format 'yaml': expected table or json or shell"),
        (["-n", "2", "--kvcache-gib", "2.5"], "vsup: error: --kvcache-gib 2.5: vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB; use 2 or 3"),
        (["-n", "40"], "vsup: error: 40 instance(s) need 40 physical cores (40 × 1) but only 16 are usable; try --instances 16"),
        (["-n", "2", "--nodes", "7"], "vsup: error: --nodes: unknown node 7; this machine's nodes with usable CPUs are 0,1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(xeon, args, message):
    result = vsup("plan", "--fsroot", xeon, "--model-size-gib", "1", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.strip().startswith(message), result.stderr


def test_memory_that_does_not_fit_exits_2_with_the_numbers(xeon):
    result = vsup("plan", "--fsroot", xeon, "-n", "4", "--model-size-gib", "14.2", "--kvcache-gib", "8")
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.startswith("vsup: error: node 0: 2 × (14.2 GiB weights + 8 GiB KV + 1.5 GiB) = 47.4 GiB > 43.7 GiB available (MemTotal - 2 GiB reserve); try --instances 2 or --kvcache-gib 6"), line


def test_model_size_comes_from_a_local_model_directory(xeon, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * (3 * 1024**2))
    (model / "config.json").write_text("{}" * 10_000)
    result = vsup("plan", "--fsroot", xeon, "-n", "2", "--model", str(model), "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["instances"][0]["weights_bytes"] == 3 * 1024**2


def test_this_machine_two_instances():
    cpus = len(os.sched_getaffinity(0))
    result = vsup("plan", "--instances", "2", "--model-size-gib", "0.1", "--kvcache-gib", "0.5", "--format", "json")
    if cpus < 2:
        assert result.returncode == 2 and "usable" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    used = [set(i["cpus"]) for i in data["instances"]]
    assert not used[0] & used[1] and used[0] | used[1] <= os.sched_getaffinity(0)
    table = vsup("plan", "--instances", "2", "--model-size-gib", "0.1", "--kvcache-gib", "0.5")
    assert table.returncode == 0 and "[i0 " in table.stdout and "[i1 " in table.stdout
