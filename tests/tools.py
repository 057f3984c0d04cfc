"""What a test needs from the machine beyond Python: a program (chromium, tmux, numactl,
systemd-nspawn, ...), root, the real vLLM build.

Outside CI a test that lacks one skips, saying what to install. Under CI (CI=true: .ci/run sets it)
it fails: scripts/test installs every such tool there and stops if it cannot, so a missing one is a
broken set-up, and a skip would let the tests that cover it pass unseen.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip with `reason`, or fail with it under CI."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: scripts/test provides what the tests need, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def need_tool(*names: str, package: str | None = None) -> str:
    """The path of the first of `names` on PATH; skips (fails under CI) naming the apt package when none is."""
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    unavailable(f"{names[0]} is not installed (apt-get install {package or names[0]})")


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def need_nobody_running(program: list[str]) -> list[str]:
    """`AS_NOBODY + program`, for a test that runs vsup as another uid (65534); skips (fails under
    CI) when it cannot: not root, no setpriv, or a folder above the venv that uid may not enter
    (a clone under a 0700 home or pytest's 0700 tmp; .ci/run makes its clone's folder 0755)."""
    import subprocess

    if os.geteuid() != 0:
        unavailable("running a program as uid 65534 needs root")
    need_tool("setpriv", package="util-linux")
    probe = subprocess.run([*AS_NOBODY, *program, "--help"], capture_output=True, text=True, timeout=60, cwd="/",
                           stdin=subprocess.DEVNULL, env={**os.environ, "HOME": "/nonexistent"})
    if probe.returncode != 0:
        unavailable(f"uid 65534 cannot run {program[0]} (a folder above it is not 0755?): {probe.stderr.strip()[-200:]}")
    return [*AS_NOBODY, *program]
