"""The generated unit's hardening as `systemd-analyze security --offline=true` rates it.

    .venv/bin/python bench/systemd_security.py

Renders the unit `vsup install-systemd` writes (vsup/systemd/unit.py, ExecStart= this
environment's vsup), runs systemd-analyze on it and writes docs/bench/systemd_security.json: the
overall exposure, systemd's version and every line of its table, so docs/systemd.md's figure has a
source and tests/test_systemd.py compares the live rating with it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)

from vsup.systemd.unit import UnitSettings, render_unit  # noqa: E402

EXPOSURE = re.compile(r"Overall exposure level for vsup\.service: (\d+\.\d+)")


def rate(analyze: str, vsup: str) -> tuple[float, str]:
    """(overall exposure, systemd-analyze's output) of the generated unit."""
    with tempfile.TemporaryDirectory(prefix="vsup-security-") as tmp:
        path = Path(tmp) / "vsup.service"
        path.write_text(render_unit(UnitSettings(vsup=vsup)))
        out = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(path)],
                             capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    match = EXPOSURE.search(text)
    if not match:
        raise SystemExit(f"systemd-analyze gave no exposure level:\n{text}")
    return float(match.group(1)), text


def systemd_version(analyze: str) -> str:
    return subprocess.run([analyze, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]


def main() -> int:
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        raise SystemExit("systemd-analyze is missing: install the `systemd` package")
    recorder = Recorder("systemd_security")
    exposure, text = rate(analyze, str(Path(sys.executable).parent / "vsup"))
    print(text)
    recorder.write({"exposure": exposure, "systemd": systemd_version(analyze), "output": text.splitlines()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
