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

from vsup.supervisor.rundir import runtime_dir

VSUP = [sys.executable, "-m", "vsup.cli.main"] if not (Path(sys.executable).parent / "vsup").exists() else [str(Path(sys.executable).parent / "vsup")]
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
    row0 = next(line.split() for line in out.splitlines() if line.strip().startswith("0  0.sock"))
    assert row0[:6] == ["0", "0.sock", "0", "7", "7", "1-7"]


def test_the_table_names_each_instances_address_as_vllm_listen_has_it(xeon, tmp_path):
    """Under vllm.listen: unix (the default) an instance has a socket, not a port: the table says so."""
    unix = vsup("plan", "-n", "2", "--fsroot", xeon, "--model-size-gib", "4")
    assert unix.returncode == 0, unix.stderr
    header = next(line.split() for line in unix.stdout.splitlines() if line.strip().startswith("#"))
    assert header[:2] == ["#", "socket"] and "port" not in header
    assert [line.split()[1] for line in unix.stdout.splitlines() if line.strip()[:3] in ("0  ", "1  ")] == ["0.sock", "1.sock"]
    assert "sockets: <runtime dir>/instances-8000/<i>.sock (vllm.listen: unix; tcp: 127.0.0.1:<base_port + i>)" in unix.stdout
    config = tmp_path / "tcp.yaml"
    config.write_text("model: m\nvllm:\n  listen: tcp\n  base_port: 9100\nplacement:\n  model_size_gib: 4\n")
    tcp = vsup("plan", "-n", "2", "--fsroot", xeon, "--config", str(config))
    assert tcp.returncode == 0, tcp.stderr
    header = next(line.split() for line in tcp.stdout.splitlines() if line.strip().startswith("#"))
    assert header[:2] == ["#", "port"] and "sockets:" not in tcp.stdout
    assert [line.split()[1] for line in tcp.stdout.splitlines() if line.strip()[:3] in ("0  ", "1  ")] == ["9100", "9101"]


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
        "--uds", str(runtime_dir() / "instances-8000" / "1.sock"),  # vllm.listen: unix (the default)
        "--disable-access-log-for-endpoints", "/health,/metrics",  # vllm.access_log: clients (the default)
        "--kv-cache-memory-bytes", str(2**29), "--dtype", "float32",
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


def test_omp_threads_flag_overrides_the_config_and_keeps_the_mask(xeon, tmp_path):
    config = tmp_path / "vsup.yaml"
    config.write_text("model: m\ninstances: 2\nplacement:\n  model_size_gib: 1\n  omp_threads: 2\n")
    every = vsup("plan", "--fsroot", xeon, "-n", "2", "--model-size-gib", "1", "--format", "json")
    fewer = vsup("plan", "-c", str(config), "--fsroot", xeon, "--omp-threads", "3", "--format", "json")
    assert every.returncode == 0 and fewer.returncode == 0, every.stderr + fewer.stderr
    for whole, inst in zip(json.loads(every.stdout)["instances"], json.loads(fewer.stdout)["instances"], strict=True):
        assert inst["cpus"] == whole["cpus"] and inst["env"]["OMP_NUM_THREADS"] == "3"
        assert inst["omp_cpus"] == whole["omp_cpus"][:3]


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
        (["-n", "2", "--omp-threads", "0"], "vsup: error: --omp-threads '0': expected a whole number of at least 1"),
        (["-n", "2", "--omp-threads", "8"], "vsup: error: --omp-threads 8: instance 0 has only 7 OpenMP CPU(s); use at most 7, or fewer instances"),
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


@pytest.mark.parametrize(
    ("yaml_text", "args", "message"),
    [
        # a value from the file is named by its key and line, not by a flag it never came from
        ("placement:\n  model_size_gib: 1\n  kvcache_gib: 1.5\n", [],
         "{config}:5: placement.kvcache_gib: 1.5 is not valid: vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB; use 1 or 2"),
        ("vllm:\n  base_port: 65535\n", ["--model-size-gib", "1"],
         "{config}:4: vllm.base_port: 65535 is not valid: 2 instances need ports up to 65536, past 65535"),
        ("placement:\n  nodes: [7]\n", ["--model-size-gib", "1"],
         "{config}:4: placement.nodes: unknown node 7; this machine's nodes with usable CPUs are 0,1"),
        ("placement:\n  model_size_gib: 1\n  omp_threads: 8\n", [],
         "{config}:5: placement.omp_threads: 8 is not valid: instance 0 has only 7 OpenMP CPU(s); use at most 7, or fewer instances"),
        # the same key given as a flag: the flag is named
        ("placement:\n  omp_threads: 2\n", ["--model-size-gib", "1", "--omp-threads", "8"],
         "--omp-threads 8: instance 0 has only 7 OpenMP CPU(s)"),
        ("placement:\n  kvcache_gib: 1\n", ["--model-size-gib", "1", "--kvcache-gib", "2.5"],
         "--kvcache-gib 2.5: vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB; use 2 or 3"),
        # not in the file and not a flag: the key and that it is the default
        ("placement:\n  model_size_gib: 1\n", ["-n", "65436"],
         "{config}: vllm.base_port (default): 8100 is not valid: 65436 instances need ports"),
    ],
)
def test_plan_errors_name_where_the_value_came_from(xeon, tmp_path, yaml_text, args, message):
    config = tmp_path / "bad.yaml"
    config.write_text("model: m\ninstances: 2\n" + yaml_text)
    result = vsup("plan", "--config", str(config), "--fsroot", xeon, *args)
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.strip().startswith("vsup: error: " + message.format(config=config)), result.stderr


def test_run_names_the_config_key_and_line_too(xeon, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model: m\ninstances: 2\nplacement:\n  model_size_gib: 1\n  kvcache_gib: 2.5\n")
    result = vsup("run", "--config", str(config), "--fsroot", xeon)
    assert result.returncode == 2
    assert f"vsup: error: {config}:5: placement.kvcache_gib: 2.5 is not valid" in result.stderr
    assert "--kvcache-gib" not in result.stderr


@pytest.fixture
def gb10(tmp_path) -> str:
    from tests.sysfs_builder import build_sysfs, gb10_layout

    return str(build_sysfs(tmp_path / "gb10", cores=gb10_layout(), hybrid_source="none"))


def test_gb10_one_instance_takes_every_big_core_and_shows_the_efficiency_choice(gb10):
    result = vsup("plan", "--instances", "1", "--fsroot", gb10, "--model-size-gib", "1", "--kvcache-gib", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "efficiency cores: housekeeping (the reserve, then each instance's API server and EngineCore, outside OpenMP)" in out
    assert "[R E:0] [i0 E:1h E:2h E:3h E:4h P:5 P:6 P:7 P:8 P:9]" in out
    row0 = next(line.split() for line in out.splitlines() if line.strip().startswith("0  0.sock"))
    assert row0[4:6] == ["10", "5-9,15-19"] and row0[-1] == "performance"
    data = json.loads(vsup("plan", "-n", "1", "--fsroot", gb10, "--model-size-gib", "1", "--format", "json").stdout)
    assert data["instances"][0]["omp_cpus"] == [5, 6, 7, 8, 9, 15, 16, 17, 18, 19]
    assert data["efficiency_cores"] == "housekeeping"


@pytest.mark.parametrize("source", ["flag", "config"])
def test_efficiency_cores_as_instances(gb10, tmp_path, source):
    config = tmp_path / "vsup.yaml"
    config.write_text("model: m\nplacement:\n  model_size_gib: 1\n  kvcache_gib: 1\n"
                      + ("  efficiency_cores: instances\n" if source == "config" else ""))
    args = ["--efficiency-cores", "instances"] if source == "flag" else []
    result = vsup("plan", "-c", str(config), "-n", "1", "--fsroot", gb10, "--format", "json", *args)
    assert result.returncode == 0, result.stderr
    instances = json.loads(result.stdout)["instances"]
    assert [(i["kind"], i["omp_cpus"]) for i in instances] == [
        ("performance", [5, 6, 7, 8, 9, 15, 16, 17, 18, 19]), ("efficiency", [1, 2, 3, 4, 10, 11, 12, 13, 14]),
    ]


def test_bad_efficiency_cores_flag_is_one_line(gb10):
    result = vsup("plan", "-n", "1", "--fsroot", gb10, "--efficiency-cores", "idle")
    assert result.returncode == 2
    assert result.stderr.strip() == "vsup: error: --efficiency-cores 'idle': expected housekeeping or instances or unused"


def test_smt_on_a_machine_without_smt_says_it_changes_nothing(gb10):
    result = vsup("plan", "-n", "1", "--fsroot", gb10, "--model-size-gib", "1", "--smt")
    assert result.returncode == 0, result.stderr
    assert "warning: --smt (placement.smt) changes nothing here" in result.stdout


def fake_numactl(directory: Path, many: bool) -> dict:
    """A `numactl` whose usage text (on stderr, exit 1, like the real one) lists --preferred-many or not."""
    directory.mkdir()
    usage = "usage: numactl [--preferred= | -p <node>]" + (" [--preferred-many= | -P <nodes>]" if many else "")
    script = directory / "numactl"
    script.write_text(f"#!/bin/sh\necho \"numactl: unrecognized option '$1'\" >&2\necho '{usage}' >&2\nexit 1\n")
    script.chmod(0o755)
    return {"PATH": f"{directory}:{os.environ['PATH']}"}


@pytest.mark.parametrize("many", [True, False])
def test_membind_preferred_on_a_spanning_instance_prefers_all_its_nodes_when_numactl_can(xeon, tmp_path, many):
    env = fake_numactl(tmp_path / "bin", many)
    result = vsup("plan", "-n", "1", "--fsroot", xeon, "--model-size-gib", "1", "--membind", "preferred",
                  "--launcher", "numactl", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["instances"][0]["argv"][-1] == ("--preferred-many=0,1" if many else "--preferred=0")
    assert any("no --preferred-many" in w for w in data["warnings"]) == (not many)


def test_callers_that_name_no_flags_get_the_config_key(xeon, tmp_path):
    # vsup doctor plans a loaded config and names no flags: the key and its line, never a flag
    from vsup.config.planning import plan_from_config
    from vsup.config.schema import parse_config
    from vsup.topology.errors import PlanError

    cfg = parse_config("model: m\ninstances: 2\nplacement:\n  model_size_gib: 1\n  kvcache_gib: 1.5\n")
    with pytest.raises(PlanError) as info:
        plan_from_config(cfg, xeon)
    assert str(info.value).startswith("<config>:5: placement.kvcache_gib: 1.5 is not valid: vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB")
    assert "--kvcache-gib" not in str(info.value)
