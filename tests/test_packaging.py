"""The installed distribution: one import name (`vsup`), its data files, no setuptools banner, and
vsup beside supervisord (which vLLM's CPU build pulls in, import name `supervisor`) in one venv.

These build a wheel from the checkout and install it into fresh venvs with pip from the package
index, as a user would; they take ~1 min together.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.wheel import build_wheel

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installs_one_import_name(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        top_level = zf.read(f"{dist_info}/top_level.txt").decode().split()
        record = [line.split(",")[0] for line in zf.read(f"{dist_info}/RECORD").decode().splitlines() if line]
    assert top_level == ["vsup"]
    outside = [path for path in record if not path.startswith(("vsup/", f"{dist_info}/"))]
    assert outside == [], f"the wheel installs files outside the vsup package: {outside}"
    # the packaged data the commands read at run time
    for data in ("vsup/config/data/vsup.yaml", "vsup/systemd/data/vsup.service.in", "vsup/__main__.py"):
        assert data in record
    # the license texts: ours and hwloc's (its test dumps ship in tests/data, not in the wheel)
    assert f"{dist_info}/licenses/LICENSE" in record
    assert not any(path.startswith("tests/") for path in record)


def test_the_build_prints_no_deprecation_banner(built):
    _, output = built
    for banner in ("SetuptoolsDeprecationWarning", "License classifiers are deprecated", "project.license` as a TOML table"):
        assert banner not in output, f"the build printed {banner!r}:\n{output[-3000:]}"


def test_vsup_and_supervisord_work_in_one_venv(built, tmp_path):
    wheel, _ = built
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    py, vsup = venv / "bin" / "python", venv / "bin" / "vsup"
    # supervisord second: before the namespace fix, its `supervisor/__init__.py` replaced ours here
    run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)])
    run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "supervisor"])

    assert "0.1.0" in run([str(vsup), "--version"]).stdout
    assert "0.1.0" in run([str(py), "-m", "vsup", "--version"]).stdout
    # a small KV cache: the plan must fit this machine's memory whatever it is
    plan = run([str(vsup), "plan", "--instances", "2", "--kvcache-gib", "0.25", "--format", "json"]).stdout
    assert '"instances"' in plan
    assert run([str(venv / "bin" / "supervisord"), "--version"]).stdout.strip()
    run([str(py), "-c", "import supervisor.supervisord"])

    # and taking supervisord out again leaves vsup whole (it used to delete the shared __init__.py)
    run([str(py), "-m", "pip", "uninstall", "-q", "-y", "supervisor"])
    assert "0.1.0" in run([str(vsup), "--version"]).stdout
    run([str(vsup), "doctor", "--help"])


def test_no_runtime_dependency_is_capped_or_pinned():
    """vsup installs into vLLM's venv (README): a cap or an exact pin on a library vLLM shares would one
    day refuse vLLM's newer release or downgrade vLLM's copy. Floors only."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("aiohttp") for d in dependencies)
    for requirement in dependencies:
        version = requirement.split(";")[0]
        assert not re.search(r"<|==|~=|!=|===", version), f"{requirement!r} in pyproject.toml caps or pins a version; give a floor (>=) only"
