"""Build vsup's wheel from the tracked files of the checkout, as a user's `pip install` would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(workdir: Path) -> tuple[Path, str]:
    """(the wheel, everything the build printed). Built from a copy of the tracked files, so the
    checkout gets no build/ or egg-info and an untracked file cannot sneak into the wheel."""
    source = workdir / "src"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        origin, target = ROOT / name, source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if origin.is_symlink():
            target.symlink_to(origin.readlink())
        elif origin.is_file():
            target.write_bytes(origin.read_bytes())
    dist = workdir / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(dist), str(source)],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise AssertionError(f"building vsup's wheel failed (exit {done.returncode}):\n{output[-4000:]}")
    (wheel,) = dist.glob("vsup-*.whl")
    return wheel, output
