"""From a planned instance and the config to the argv and environment that are exec'd."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.machines import GiB, make_machine
from vsup.config.schema import parse_config
from vsup.errors import ConfigError
from vsup.supervisor.launch import access_log_args, build_command, child_environment, instance_url
from vsup.topology.plan_model import PlanSettings
from vsup.topology.planner import plan


def instance(kvcache_gib=2.0, **kw):
    machine = make_machine(sockets=2, cores_per_node=4, smt=2)
    settings = PlanSettings(instances=2, model_size_bytes=GiB, kvcache_gib=kvcache_gib, **kw)
    return plan(machine, settings).instances[1]


def config(extra: str = ""):
    return parse_config("model: /models/tiny\nvllm:\n  command: [vllm, serve]\n" + extra)


def test_argv_is_prefix_command_model_socket_then_args():
    cfg = parse_config(
        "model: /models/tiny\nserved_model_name: tiny\n"
        "vllm:\n  command: [vllm, serve]\n  args: [--dtype, float32]\n"
    )
    argv, _ = build_command(instance(), cfg, {"TMPDIR": "/scratch"})
    assert argv == [
        "numactl", "--physcpubind=4-7,12-15", "--membind=1",
        "vllm", "serve", "/models/tiny", "--uds", f"/scratch/vsup-{os.getuid()}/instances-8000/1.sock",
        "--served-model-name", "tiny", "--disable-access-log-for-endpoints", "/health,/metrics", "--dtype", "float32",
    ]


def test_listen_tcp_gives_host_and_port():
    cfg = config("  listen: tcp\n")
    argv, _ = build_command(instance(launcher="none"), cfg, {})
    assert argv[3:7] == ["--host", "127.0.0.1", "--port", "8101"]
    assert instance_url(instance(), cfg, {}) == "http://127.0.0.1:8101"


def test_each_slot_and_each_vsup_has_its_own_socket_under_the_runtime_directory():
    cfg = config()
    one = instance()
    assert instance_url(one, cfg, {"RUNTIME_DIRECTORY": "/run/vsup"}) == "unix:/run/vsup/instances-8000/1.sock"
    beside = dataclasses.replace(one, port=8201)  # spare_base_port (null: base_port + 100) + 1
    assert instance_url(beside, cfg, {"RUNTIME_DIRECTORY": "/run/vsup"}) == "unix:/run/vsup/instances-8000/1b.sock"
    other_vsup = parse_config("model: m\nproxy:\n  port: 9000\n")
    assert instance_url(one, other_vsup, {"RUNTIME_DIRECTORY": "/run/vsup"}) == "unix:/run/vsup/instances-9000/1.sock"


def test_a_socket_path_too_long_for_sun_path_names_tmpdir():
    with pytest.raises(ConfigError, match=r"longer than the 107 bytes .* point TMPDIR \(or RUNTIME_DIRECTORY\)"):
        build_command(instance(), config(), {"TMPDIR": "/" + "d" * 90})


def test_api_server_module_gets_the_model_as_an_option():
    cfg = parse_config("model: m\nvllm:\n  command: [python3, -m, vllm.entrypoints.openai.api_server]\n")
    argv, _ = build_command(instance(launcher="none"), cfg, {})
    assert argv[:6] == ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--uds"]


def test_sub_gib_kv_cache_goes_to_argv_and_a_stale_env_value_is_dropped():
    argv, env = build_command(instance(kvcache_gib=0.5), config(), {"VLLM_CPU_KVCACHE_SPACE": "40", "PATH": "/bin"})
    assert argv[-2:] == ["--kv-cache-memory-bytes", str(GiB // 2)]
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["PATH"] == "/bin"


def test_environment_is_the_plan_over_the_inherited_one_without_systemd_variables():
    base = {
        "PATH": "/usr/bin", "HOME": "/root", "OMP_NUM_THREADS": "64",
        "NOTIFY_SOCKET": "@/run/x", "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1",
        "LISTEN_FDS": "1", "LISTEN_PID": "1", "LISTEN_FDNAMES": "a", "LISTEN_OTHER": "z",
    }
    _, env = build_command(instance(), config("  env:\n    LD_PRELOAD: libtcmalloc.so\n"), base)
    assert env == {
        "PATH": "/usr/bin", "HOME": "/root",
        "OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "4-7", "CPU_VISIBLE_MEMORY_NODES": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2", "LD_PRELOAD": "libtcmalloc.so",
    }
    assert child_environment(base).keys() == {"PATH", "HOME", "OMP_NUM_THREADS"}


def test_user_env_may_repeat_a_placement_value():
    _, env = build_command(instance(), config("  env:\n    OMP_NUM_THREADS: '4'\n"), {})
    assert env["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("  env:\n    OMP_NUM_THREADS: '8'\n", r"^<config>:5: vllm.env.OMP_NUM_THREADS: '8' contradicts the placement of instance 1 \(the plan sets '4'\); remove it and set placement.cores_per_instance"),
        ("  env:\n    VLLM_CPU_OMP_THREADS_BIND: auto\n", r"^<config>:5: vllm.env.VLLM_CPU_OMP_THREADS_BIND: 'auto' contradicts"),
        ("  args: ['--port=9000']\n", r"^<config>:4: vllm\.args\[0\]: '--port=9000' is not allowed"),
        ("  args: [--host, 0.0.0.0]\n", r"^<config>:4: vllm\.args\[0\]: '--host' is not allowed: .*proxy.host"),
        ("  args: [--uds, /tmp/x.sock]\n", r"^<config>:4: vllm\.args\[0\]: '--uds' is not allowed: .*private runtime directory"),
    ],
)
def test_contradicting_the_plan_is_a_config_error(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_command(instance(), config(extra), {})


def test_kv_env_from_the_user_when_the_plan_uses_the_option_is_refused():
    with pytest.raises(ConfigError, match=r"VLLM_CPU_KVCACHE_SPACE: '1' contradicts .*leaves it unset"):
        build_command(instance(kvcache_gib=0.5), config("  env:\n    VLLM_CPU_KVCACHE_SPACE: '1'\n"), {})


def test_default_command_puts_the_model_right_after_it():
    cfg = parse_config("model: /models/tiny\n")
    argv, _ = build_command(instance(launcher="none"), cfg, {"PATH": "/nonexistent"})
    model_at = argv.index("/models/tiny")
    assert argv[model_at - 1] in ("serve", "--model")
    assert argv[model_at + 1] == "--uds" and argv[model_at + 2].endswith("/instances-8000/1.sock")


@pytest.mark.parametrize("extra, expected", [
    ("", ["--disable-access-log-for-endpoints", "/health,/metrics"]),  # default: clients
    ("  access_log: clients\n", ["--disable-access-log-for-endpoints", "/health,/metrics"]),
    ("  access_log: all\n", []),
    ("  access_log: off\n", ["--disable-uvicorn-access-log"]),
    ("  access_log: off\n  args: [--disable-access-log-for-endpoints, /ping]\n", []),  # the user's own wins
    ("  args: [--disable_uvicorn_access_log]\n", []),  # vLLM takes underscores too
    ("  args: ['--disable-access-log-for-endpoints=/health']\n", []),
])
def test_access_log_leaves_out_vsups_own_polls_unless_the_user_chose(extra, expected):
    cfg = config(extra)
    assert access_log_args(cfg) == expected
    argv, _ = build_command(instance(launcher="none"), cfg, {})
    assert argv[argv.index("--uds") + 2:][:len(expected)] == expected  # before the user's args


def test_a_bad_access_log_value_names_the_key():
    with pytest.raises(ConfigError, match="vllm.access_log"):
        config("  access_log: some\n")
