"""The `vllm_install` fixture: the real vLLM CPU venv (scripts/vllm-env) and the tiny model
(scripts/build_tiny_model.py), built once per machine and cached under ~/.cache/vsup. If they cannot
be built the tests that need them FAIL with the reason. Registered for every test module by
tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.tools import unavailable

ROOT = Path(__file__).resolve().parents[1]


def _run_step(argv: list[str], what: str, timeout: float) -> str:
    """Run a set-up script; its last stdout line is a path. Fails the test with its output otherwise."""
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {timeout:.0f}s: {' '.join(argv)}")
    if done.returncode != 0 or not done.stdout.strip():
        pytest.fail(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_install() -> tuple[Path, Path]:
    """(vLLM venv, model directory), built once per machine."""
    if os.environ.get("VSUP_SKIP_VLLM") == "1":
        unavailable("VSUP_SKIP_VLLM=1: real-vLLM tests skipped on request")
    venv = Path(_run_step([str(ROOT / "scripts" / "vllm-env")], "scripts/vllm-env (the vLLM CPU venv)", 3600))
    model = Path(_run_step([str(venv / "bin" / "python"), str(ROOT / "scripts" / "build_tiny_model.py")],
                           "scripts/build_tiny_model.py", 900))
    return venv, model


# The real-shape model of issue 31: Qwen2-1.5B's shape as a random-weight Llama (1.32 B parameters,
# fp32: 5.3 GB of weights). Cached beside the tiny model; its build is about a minute of CPU and
# writes 5.3 GB (5 min of wall time on this shared 2-core box while other work ran).
REAL_SHAPE = ("--hidden", "1536", "--layers", "28", "--heads", "12", "--kv-heads", "2", "--head-dim", "128",
              "--intermediate", "8960", "--max-positions", "8192")


@pytest.fixture(scope="session")
def real_shape_model(vllm_install) -> Path:
    """The real-shape random model directory (~/.cache/vsup/real-shape-llama), built once per machine."""
    venv, _tiny = vllm_install
    out = Path(os.environ.get("HOME", ".")) / ".cache" / "vsup" / "real-shape-llama"
    return Path(_run_step([str(venv / "bin" / "python"), str(ROOT / "scripts" / "build_tiny_model.py"), *REAL_SHAPE,
                           "--out", str(out)], "scripts/build_tiny_model.py (real shape)", 1800))
