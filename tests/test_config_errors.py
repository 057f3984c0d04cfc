"""Bad configurations as users hit them: `vsup plan --config`, `vsup run --config` and `vsup proxy
--config` as real processes. Each must end with one line `vsup: error: FILE:LINE: key: ...` and
exit code 2 before anything starts: no traceback, no hang, no silent coercion."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sysfs_builder import build_sysfs

VSUP = [str(Path(sys.executable).parent / "vsup")]
# instances that fit any machine; `false` only runs if a check below failed to stop vsup run
SMALL = ("placement:\n  launcher: taskset\n  reserve_cores: 0\n  model_size_gib: 0.01\n  kvcache_gib: 0.01\n"
         "  overhead_gib: 0.01\n  memory_reserve_gib: 0.1\n")
MEMORY_LIMIT = 1024**3  # an alias bomb used to grow past 1.2 GB


@pytest.fixture(scope="module")
def fsroot(tmp_path_factory) -> str:
    return str(build_sysfs(tmp_path_factory.mktemp("sysfs") / "root", nodes=(4, 4)))


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def vsup(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limit_memory, stdin=subprocess.DEVNULL)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single `vsup: error:` line, after checking exit 2, no traceback and no other output."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vsup: error: "), result.stderr[-2000:]
    assert result.stdout == ""
    return lines[0].removeprefix("vsup: error: ")


def write(tmp_path: Path, text: str | bytes, name: str = "vsup.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def line(config: str, text: str) -> int:
    """The 1-based line of the first line of the file `config` that starts with `text` (indent aside)."""
    lines = Path(config).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.strip().startswith(text))


def plan(config: str, fsroot: str, *extra: str) -> subprocess.CompletedProcess:
    return vsup("plan", "--config", config, "--fsroot", fsroot, "--format", "json", *extra)


def run(config: str, fsroot: str) -> subprocess.CompletedProcess:
    return vsup("run", "--config", config, "--fsroot", fsroot)


def proxy(config: str) -> subprocess.CompletedProcess:
    return vsup("proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--config", config)


# --- 7.1: the proxy on an instance's port -------------------------------------------------------


@pytest.mark.parametrize("instances", ["2", "auto"])
def test_proxy_port_on_an_instance_port_is_refused_by_plan_and_run(tmp_path, fsroot, instances):
    config = write(tmp_path, f"model: fake-model\ninstances: {instances}\n{SMALL}vllm:\n  listen: tcp\n  command: ['false']\n"
                             "  base_port: 8100\nproxy:\n  port: 8101\n")
    for result in (plan(config, fsroot), run(config, fsroot)):
        assert one_error_line(result) == (
            f"{config}:{line(config, 'port:')}: proxy.port: 8101 is the port of instance 1 "
            f"(from {config}:{line(config, 'base_port:')}: vllm.base_port 8100); "
            "choose a proxy.port outside 8100-8101 or move vllm.base_port")


def test_proxy_port_default_against_a_base_port_flag(tmp_path, fsroot):
    config = write(tmp_path, f"model: fake-model\ninstances: 1\n{SMALL}vllm:\n  listen: tcp\n")
    message = one_error_line(plan(config, fsroot, "--base-port", "8000"))
    assert message == (f"{config}: proxy.port (default): 8000 is the port of instance 0 (from --base-port 8000); "
                       "choose a proxy.port outside 8000 or move vllm.base_port")
    # just past the instances, or an ephemeral proxy port, is fine
    assert plan(config, fsroot, "--base-port", "8001").returncode == 0
    assert plan(write(tmp_path, f"model: fake-model\ninstances: 2\n{SMALL}proxy:\n  port: 0\nvllm:\n  base_port: 1\n",
                      "zero.yaml"), fsroot).returncode == 0



def test_without_instance_ports_the_proxy_may_take_any_port(tmp_path, fsroot):
    # vllm.listen: unix (the default): the instances have sockets, base_port is not bound
    config = write(tmp_path, f"model: fake-model\ninstances: 2\n{SMALL}vllm:\n  base_port: 8100\nproxy:\n  port: 8101\n")
    result = plan(config, fsroot)
    assert result.returncode == 0, result.stderr

# --- 7.9: the base port overflow names its source -----------------------------------------------


@pytest.mark.parametrize("instances", ["2", "auto"])
def test_base_port_overflow_from_the_config_names_the_key(tmp_path, fsroot, instances):
    config = write(tmp_path, f"model: fake-model\ninstances: {instances}\n{SMALL}vllm:\n  base_port: 65535\n")
    for result in (plan(config, fsroot), run(config, fsroot)):
        message = one_error_line(result)
        assert message.startswith(f"{config}:{line(config, 'base_port:')}: vllm.base_port: 65535 is not valid: 2 instances need ports up to 65536"), message
        assert "--base-port" not in message


def test_base_port_overflow_from_the_flag_names_the_flag(tmp_path, fsroot):
    config = write(tmp_path, f"model: fake-model\ninstances: 2\n{SMALL}")
    assert one_error_line(plan(config, fsroot, "--base-port", "65535")).startswith("--base-port 65535: 2 instances need ports")


# --- 7.2: non-finite numbers --------------------------------------------------------------------


@pytest.mark.parametrize(("section", "key", "value"), [
    ("stop", "timeout", ".inf"),
    ("proxy", "drain_timeout", ".inf"),
    ("proxy", "idle_timeout", ".nan"),
    ("health", "startup_timeout", "+.inf"),
    ("restart", "max_delay", ".inf"),
    ("placement", "overhead_gib", ".nan"),
])
def test_non_finite_numbers_are_refused(tmp_path, fsroot, section, key, value):
    text = f"model: fake-model\ninstances: 1\n{SMALL}" if section != "placement" else "model: fake-model\n"
    config = write(tmp_path, f"{text}{section}:\n  {key}: {value}\n" if section != "placement" else
                   f"{text}placement:\n  {key}: {value}\n")
    results = [plan(config, fsroot), run(config, fsroot)] + ([proxy(config)] if section in ("proxy", "health") else [])
    for result in results:
        message = one_error_line(result)
        assert message.startswith(f"{config}:{line(config, key + ':')}: {section}.{key}: ") and "Input should be a finite number" in message


# --- 7.3: alias bombs and other oversized YAML --------------------------------------------------

BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10) if i else ', '.join(['lol'] * 10)}]\n" for i in range(9))


@pytest.mark.parametrize("target", [
    "model: *l8\n",
    "vllm:\n  args: *l8\n",
    "vllm:\n  env: {A: *l8}\n",
    "proxy:\n  port: *l8\n",
])
def test_an_alias_bomb_is_refused_quickly_in_bounded_memory(tmp_path, fsroot, target):
    config = write(tmp_path, BOMB + target)
    for command in (lambda: plan(config, fsroot), lambda: run(config, fsroot), lambda: proxy(config)):
        began = time.monotonic()
        message = one_error_line(command())
        assert time.monotonic() - began < 30
        assert message == (f"{config}:4: expands to more than 10000 values (through YAML aliases and merges); "
                           "a vsup configuration needs a few hundred")


def test_recursive_alias_and_deep_nesting_are_refused(tmp_path, fsroot):
    assert one_error_line(plan(write(tmp_path, "model: m\nvllm:\n  args: &a [x, *a]\n"), fsroot)) == (
        f"{tmp_path}/vsup.yaml:3: alias *a refers to a node that contains it")
    deep = write(tmp_path, "model: " + "[" * 50_000 + "]" * 50_000 + "\n", "deep.yaml")
    assert one_error_line(plan(deep, fsroot)) == f"{deep}:1: nested deeper than 32 levels; a vsup configuration needs 4"


def test_error_lines_quote_a_short_excerpt_of_a_huge_value(tmp_path, fsroot):
    config = write(tmp_path, "model: m\nproxy:\n  port: '" + "9" * 900_000 + "'\n")
    message = one_error_line(plan(config, fsroot))
    assert message.startswith(f"{config}:3: proxy.port: '999") and message.endswith("is not valid: Input should be a valid integer")
    assert len(message) < 300
    many = write(tmp_path, "model: m\nvllm:\n  args: [" + ", ".join(["1"] * 5000) + "]\n", "many.yaml")
    message = one_error_line(plan(many, fsroot))
    assert message.count("vllm.args[") == 5 and message.endswith("; and 4995 more") and len(message) < 1000
    huge = write(tmp_path, "model: m\n# " + "x" * (2 * 1024**2) + "\n", "huge.yaml")
    assert one_error_line(plan(huge, fsroot)) == (
        f"{huge}: larger than 1 MiB; a vsup configuration is a few KiB (`vsup config --example --all` lists every key)")


# --- 7.6: not UTF-8 -----------------------------------------------------------------------------


def test_a_latin1_byte_in_a_comment_is_one_line_naming_file_and_offset(tmp_path, fsroot):
    config = write(tmp_path, b"model: fake-model\n# caf\xe9\ninstances: 1\n")
    expected = f"{config}:2: not UTF-8: byte 0xe9 at offset 23 (line 2, column 6); save the file as UTF-8"
    for result in (plan(config, fsroot), run(config, fsroot), proxy(config)):
        assert one_error_line(result) == expected


def test_a_control_character_is_one_line(tmp_path, fsroot):
    config = write(tmp_path, b"model: fake\x01model\n")
    assert one_error_line(plan(config, fsroot)) == (
        f"{config}:1: not valid YAML: character U+0001 at offset 11 is not allowed (special characters are not allowed)")


# --- 7.8: what used to be accepted silently ------------------------------------------------------


def test_a_duplicate_key_names_the_key_and_both_lines(tmp_path, fsroot):
    config = write(tmp_path, f"model: fake-model\n{SMALL}proxy:\n  port: 9000\n  host: 127.0.0.1\n  port: 9001\n")
    first = line(config, "port: 9000")
    for result in (plan(config, fsroot), run(config, fsroot), proxy(config)):
        assert one_error_line(result) == (
            f"{config}:{first + 2}: proxy.port: given twice (lines {first} and {first + 2}); "
            "YAML would keep only the last: remove one")


def test_keys_merged_in_may_be_overridden(tmp_path, fsroot):
    config = write(tmp_path, f"model: fake-model\ninstances: 1\n{SMALL}"
                             "proxy:\n  <<: {port: 9000, host: 127.0.0.1}\n  port: 9001\n")
    assert plan(config, fsroot).returncode == 0


@pytest.mark.parametrize(("setting", "expected"), [
    ("instances: true", "instances: true is not valid: Input should be a valid integer or 'auto'"),
    ("instances: 2.0", "instances: 2.0 is not valid: Input should be a valid integer or 'auto'"),
    ("placement: {smt: 1}", "placement.smt: 1 is not valid: Input should be a valid boolean"),
    ("proxy: {port: '8000'}", "proxy.port: '8000' is not valid: Input should be a valid integer"),
    ("stop: {timeout: true}", "stop.timeout: true is not valid: Input should be a valid number"),
    ("vllm: {env: {HF_HUB_OFFLINE: 1}}",
     "vllm.env.HF_HUB_OFFLINE: 1 is not valid: Input should be a valid string (quote it: YAML reads it as a number or a boolean)"),
])
def test_values_are_not_coerced_from_another_type(tmp_path, fsroot, setting, expected):
    config = write(tmp_path, f"model: fake-model\n{setting}\n")
    assert one_error_line(plan(config, fsroot)) == f"{config}:2: {expected}"


@pytest.mark.parametrize("model", ["/nonexistent/model-dir", "./models/missing", "~/no-such-model-dir"])
def test_a_local_model_path_that_does_not_exist_is_refused(tmp_path, fsroot, model):
    config = write(tmp_path, f"model: {model}\ninstances: 1\n{SMALL}")
    shown = os.path.expanduser(model)
    expected = (f"{config}:1: model: {shown!r}: no such file or directory; "
                "give the model's local directory, or a hub name like org/name")
    assert one_error_line(run(config, fsroot)) == expected
    # plan on this machine checks it too; a plan for a dumped machine (--fsroot) does not look here
    here = vsup("plan", "--config", config, "--format", "json")
    assert one_error_line(here) == expected
    assert plan(config, fsroot).returncode == 0
    flag = vsup("plan", "--model", "/nonexistent/model-dir", "-n", "1", "--model-size-gib", "0.01")
    assert one_error_line(flag) == ("--model '/nonexistent/model-dir': no such file or directory; "
                                    "give the model's local directory, or a hub name like org/name")


def test_a_hub_name_or_an_existing_directory_is_accepted(tmp_path):
    (tmp_path / "weights").mkdir()
    for model in ("org/name", str(tmp_path / "weights")):
        result = vsup("plan", "--model", model, "-n", "1", "--model-size-gib", "0.01", "--kvcache-gib", "0.01", "--format", "json")
        assert result.returncode == 0, result.stderr


# --- 7.9: plan runs the launch checks that run does ----------------------------------------------


@pytest.mark.parametrize(("vllm", "expected"), [
    ("  command: ['false']\n  args: [--port, '9000']\n",
     "{config}:{line[args:]}: vllm.args[0]: '--port' is not allowed: vsup sets every instance's address "
     "(vllm.listen: tcp gives instance i the port vllm.base_port + i)"),
    ("  command: ['false']\n  env:\n    OMP_NUM_THREADS: '64'\n",
     "{config}:{line[OMP_NUM_THREADS:]}: vllm.env.OMP_NUM_THREADS: '64' contradicts the placement of instance 0 "
     "(the plan sets '4'); remove it and set placement.cores_per_instance / placement.omp_threads / placement.smt / placement.housekeeping_core instead"),
    ("  venv: /nonexistent/venv\n", "vllm.venv: '/nonexistent/venv' has no bin/python; give the directory of a virtual "
     "environment with vLLM installed (scripts/vllm-env creates one and prints its path)"),
])
def test_plan_in_every_format_refuses_what_run_refuses(tmp_path, fsroot, vllm, expected):
    config = write(tmp_path, f"model: fake-model\ninstances: 2\n{SMALL}vllm:\n{vllm}")
    lines = {text: line(config, text) for text in ("args:", "OMP_NUM_THREADS:") if text in vllm}
    expected = expected.format(config=config, line=lines)
    for output in ("json", "table", "shell"):
        assert one_error_line(vsup("plan", "--config", config, "--fsroot", fsroot, "--format", output)) == expected
    assert one_error_line(run(config, fsroot)) == expected


# --- issue 13: spare ports (reload) and the memory watchdog's limit -----------------------------


def test_proxy_port_on_a_spare_port_is_refused_by_plan_and_run(tmp_path, fsroot):
    config = write(tmp_path, f"model: fake-model\ninstances: 2\n{SMALL}vllm:\n  listen: tcp\n  command: ['false']\n  base_port: 8100\n"
                             "proxy:\n  port: 8201\n")
    for result in (plan(config, fsroot), run(config, fsroot)):
        assert one_error_line(result) == (
            f"{config}:{line(config, 'port: 8201')}: proxy.port: 8201 is the spare port of instance 1 (from {config}: "
            "vllm.spare_base_port (default) (null: vllm.base_port + 100)), where its replacement listens during a reload; "
            "choose a proxy.port outside 8200-8201 or set vllm.spare_base_port")


@pytest.mark.parametrize(("spare", "expected"), [
    (8101, "the spare ports 8101-8102 meet the instances' ports 8100-8101 (from {config}:{base}: vllm.base_port 8100); "
           "set vllm.spare_base_port to 8102 or higher"),
    (65535, "the spare ports of 2 instance(s) would end at 65536, above 65535; set vllm.spare_base_port lower"),
])
def test_spare_ports_must_fit_and_stay_clear_of_the_instances(tmp_path, fsroot, spare, expected):
    config = write(tmp_path, f"model: fake-model\ninstances: 2\n{SMALL}vllm:\n  listen: tcp\n  base_port: 8100\n  spare_base_port: {spare}\n")
    assert one_error_line(plan(config, fsroot)) == (
        f"{config}:{line(config, 'spare_base_port:')}: vllm.spare_base_port: "
        + expected.format(config=config, base=line(config, "base_port:")))
    fine = write(tmp_path, f"model: fake-model\ninstances: 2\n{SMALL}vllm:\n  base_port: 8100\n  spare_base_port: 8102\n",
                 "fine.yaml")
    assert plan(fine, fsroot).returncode == 0


@pytest.mark.parametrize(("value", "expected"), [
    ("'6 GiBs'", "restart.max_rss: '6 GiBs' is not valid: not a size in bytes: write a number and a unit, e.g. \"6GiB\", \"500MB\""),
    ("60", "restart.max_rss: 60 is not valid: a number is a multiple of the instance's planned memory: more than 0, "
           "at most 10 (write bytes with a unit, e.g. \"6GiB\")"),
    ("0", "restart.max_rss: 0 is not valid: a number is a multiple of the instance's planned memory"),
])
def test_a_bad_memory_limit_is_refused(tmp_path, fsroot, value, expected):
    config = write(tmp_path, f"model: fake-model\ninstances: 1\n{SMALL}restart:\n  max_rss: {value}\n")
    message = one_error_line(plan(config, fsroot))
    assert message.startswith(f"{config}:{line(config, 'max_rss:')}: {expected}"), message


def test_a_memory_limit_as_a_multiple_needs_the_models_size(tmp_path, fsroot):
    unsized = SMALL.replace("  model_size_gib: 0.01\n", "")
    config = write(tmp_path, f"model: org/some-model\ninstances: 1\n{unsized}restart:\n  max_rss: 1.2\n")
    for result in (plan(config, fsroot), run(config, fsroot)):
        assert one_error_line(result) == (
            f"{config}:{line(config, 'max_rss:')}: restart.max_rss: 1.2 is a multiple of the planned memory, but the plan "
            "does not know the model's size (a hub name, or no weight files found); set placement.model_size_gib, or give "
            "restart.max_rss in bytes, e.g. \"6GiB\"")
    in_bytes = write(tmp_path, f"model: org/some-model\ninstances: 1\n{unsized}restart:\n  max_rss: '6GiB'\n", "bytes.yaml")
    sized = write(tmp_path, f"model: org/some-model\ninstances: 1\n{SMALL}restart:\n  max_rss: 1.2\n", "sized.yaml")
    assert plan(in_bytes, fsroot).returncode == 0 and plan(sized, fsroot).returncode == 0


# --- the restart policy in three keys: the old keys refused, naming what replaced them ------------

@pytest.mark.parametrize(("old", "names"), [
    ("crash_loop_failures: 5", "restart.crash_loop_failures: replaced by restart.max_failures"),
    ("crash_loop_window: 600", "restart.crash_loop_window: replaced by restart.stable_after"),
    ("initial_delay: 1", "restart.initial_delay: derived now: the first restart waits 1 s"),
    ("multiplier: 2", "restart.multiplier: derived now: each further failure in a row doubles the wait"),
    ("jitter: 1", "restart.jitter: derived now: up to 1 s at random"),
])
def test_an_old_restart_key_is_one_line_naming_the_new_one(tmp_path, old, names):
    from vsup.config.schema import parse_config
    from vsup.errors import ConfigError

    text = f"model: m\nrestart:\n  max_delay: 30\n  {old}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, "vsup.yaml")
    assert str(err.value).startswith(f"vsup.yaml:4: {names}") and "\n" not in str(err.value)
    assert "restart.max_delay" in str(err.value) or "restart.max_failures" in str(err.value)


def test_an_old_restart_key_stops_vsup_run_before_anything_starts(tmp_path, fsroot):
    config = write(tmp_path, f"model: fake-model\ninstances: 1\n{SMALL}restart:\n  crash_loop_failures: 3\n")
    assert one_error_line(run(config, fsroot)) == (
        f"{config}:{line(config, 'crash_loop_failures')}: restart.crash_loop_failures: replaced by restart.max_failures "
        "(failures in a row, with no start ready restart.stable_after seconds between them, that mark an instance failed): "
        "rename this key")
