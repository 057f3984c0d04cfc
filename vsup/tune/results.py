"""The results file: JSON lines, written as the search goes, so an interrupted tune loses nothing.

    {"type": "tune", "fingerprint": {...}, ...}         what was searched (checked by --resume)
    {"type": "pruned", "candidate": ID, "reason": ...}  the planner refused it
    {"type": "run", "candidate": ID, "stage": ..., "ok": ..., "levels": [...], ...}   one per candidate and round
    {"type": "skipped", "candidate": ID, "stage": ..., "reason": ...}
    {"type": "result", "best": ID, "ranking": [...]}   once the search is over

`--resume` replays the "run" lines of a file whose fingerprint matches and appends to it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vsup.errors import VsupError
from vsup.tune.metrics import LevelMetrics
from vsup.tune.search import Outcome


def outcome_to_json(outcome: Outcome) -> dict[str, Any]:
    return {"type": "run", "candidate": outcome.candidate_id, "stage": outcome.stage, "duration_s": round(outcome.duration_s, 3),
            "ok": outcome.ok, "error": outcome.error, "wall_s": round(outcome.wall_s, 3), "load_s": round(outcome.load_s, 3),
            "levels": [lv.to_json() for lv in outcome.levels], "extra": dict(outcome.extra)}


def outcome_from_json(data: dict[str, Any]) -> Outcome:
    return Outcome(data["candidate"], data["stage"], data["duration_s"], data["ok"],
                   tuple(LevelMetrics.from_json(lv) for lv in data.get("levels", [])), data.get("error"),
                   data.get("wall_s", 0.0), data.get("load_s", 0.0), data.get("extra", {}))


class ResultsFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[dict[str, Any]]:
        entries = []
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                # the last line of a run killed while writing it: everything before it counts
                if number == len(self.path.read_text().splitlines()):
                    break
                raise VsupError(f"{self.path}:{number}: not a JSON line; this is not a vsup tune results file") from None
        return entries

    def start(self, fingerprint: dict[str, Any], resume: bool) -> dict[tuple[str, str], Outcome]:
        """Fresh file, or (with resume) the recorded runs to replay. Refuses to overwrite without it."""
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise VsupError(f"--report: {self.path} holds an earlier run; --resume continues it, "
                                "or remove it / choose another --report folder")
            entries = self.read()
            header = next((e for e in entries if e.get("type") == "tune"), None)
            if header is None:
                raise VsupError(f"--resume: {self.path} has no vsup tune header; remove it or choose another --report folder")
            if header.get("fingerprint") != fingerprint:
                changed = sorted(k for k in set(fingerprint) | set(header["fingerprint"])
                                 if fingerprint.get(k) != header["fingerprint"].get(k))
                raise VsupError(f"--resume: {self.path} was made by another search (it differs in {', '.join(changed)}); "
                                "run with the same options, or choose another --report folder")
            return {(e["candidate"], e["stage"]): outcome_from_json(e) for e in entries if e.get("type") == "run"}
        if resume:
            raise VsupError(f"--resume: nothing to resume: {self.path} does not exist")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.append({"type": "tune", "fingerprint": fingerprint, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        return {}

    def append(self, entry: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
