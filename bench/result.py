"""One place that writes a bench's result file: docs/bench/<name>.json.

Every figure the README or docs/*.md quote comes from such a file (scripts/published_numbers.py
renders them, tests/test_published_numbers.py checks them), so each file carries what is needed to
judge and repeat it: the command line, when, on which commit, and the machine's facts — its CPUs
and its load average before and after the run (a number from a busy box is only worth its ratio
to a baseline of the same run).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "docs" / "bench"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except (OSError, ValueError):
        pass
    return None


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine() -> dict[str, Any]:
    """The facts of this machine now; the load average is read again at the end by write()."""
    return {
        "cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "mem_total_gib": _mem_total_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


class Recorder:
    """Created when a bench starts (load average, start time), written when it ends."""

    def __init__(self, name: str, argv: list[str] | None = None) -> None:
        self.name = name
        self.argv = list(sys.argv if argv is None else argv)
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.machine = machine()
        self.commit = _commit()  # the code that runs is the code at the start

    def write(self, figures: dict[str, Any], out_dir: Path | None = None, file_name: str | None = None) -> Path:
        ended = datetime.datetime.now(datetime.timezone.utc)
        facts = dict(self.machine, load_average_end=[round(x, 2) for x in os.getloadavg()])
        home = str(Path.home())  # the command as anyone would type it: ~ for this user's home
        args = ["~" + a[len(home):] if a.startswith(home + "/") else a for a in self.argv[1:]]
        # quoted as a shell would need it (a value with a space stays one argument); ~ left bare
        command = " ".join([".venv/bin/python", f"bench/{Path(self.argv[0]).name}",
                            *("~" + shlex.quote(a[1:]) if a.startswith("~/") else shlex.quote(a) for a in args)])
        data = {
            "bench": self.name,
            "command": command,
            "date": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "duration_s": round((ended - self.started).total_seconds(), 1),
            "commit": self.commit,
            "machine": facts,
            "figures": figures,
        }
        target = (out_dir or OUT_DIR) / (file_name or f"{self.name}.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(data, indent=2) + "\n")
        print(f"result: {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}", file=sys.stderr)
        return target
