"""The results file: JSON lines, written as the search goes, so an interrupted tune loses nothing.

    {"type": "tune", "fingerprint": {...}, ...}         what was searched (checked by --resume)
    {"type": "pruned", "candidate": ID, "reason": ...}  the planner refused it
    {"type": "run", "candidate": ID, "stage": ..., "ok": ..., "levels": [...], ...}   one per candidate and round;
        its extra.start: what the start took (report.start_figures: vsup_s, ready_s, compile_s, instances)
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
from vsup.ownfiles import open_read, open_text, own_folder, why, write_text
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


_NUMBER = (int, float)
# what a "run" line and each of its levels must hold to be replayed (the search computes with them)
RUN_KEYS: dict[str, tuple[type, ...]] = {"candidate": (str,), "stage": (str,), "duration_s": _NUMBER, "ok": (bool,)}
RUN_OPTIONAL: dict[str, tuple[type, ...]] = {"levels": (list,), "error": (str, type(None)), "wall_s": _NUMBER,
                                             "load_s": _NUMBER, "extra": (dict,)}
LEVEL_KEYS: dict[str, tuple[type, ...]] = {"level": (str,), "duration_s": _NUMBER, "completed": (int,), "errors": (int,),
                                           "output_tokens": (int,), "output_throughput": _NUMBER,
                                           "request_throughput": _NUMBER, "latency": (dict,)}
LEVEL_OPTIONAL: dict[str, tuple[type, ...]] = {"input_tokens": (int,), "error_samples": (list,)}


def _wrong(data: dict[str, Any], required: dict[str, tuple[type, ...]], optional: dict[str, tuple[type, ...]],
           prefix: str = "") -> str | None:
    """What is wrong with `data` against the key tables, or None."""
    for key, types in (*required.items(), *optional.items()):
        if key not in data:
            if key in required:
                return f"no {prefix}{key!r}"
            continue
        value = data[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"{prefix}{key!r} is {value!r}, not {' or '.join(t.__name__ for t in types)}"
    return None


def run_problem(data: dict[str, Any]) -> str | None:
    """Why a "run" line cannot be replayed, or None."""
    problem = _wrong(data, RUN_KEYS, RUN_OPTIONAL)
    if problem:
        return problem
    for number, level in enumerate(data.get("levels", ())):
        where = f"levels[{number}]"
        if not isinstance(level, dict):
            return f"{where} is not an object"
        problem = _wrong(level, LEVEL_KEYS, LEVEL_OPTIONAL, where + ".")
        if problem:
            return problem
        if not all(isinstance(stats, dict) and all(isinstance(x, _NUMBER) for x in stats.values())
                   for stats in level["latency"].values()):
            return f"{where}.'latency' is not metric -> {{statistic: seconds}}"
    roofline = data.get("extra", {}).get("roofline")
    if roofline is not None and not (isinstance(roofline, dict) and all(
            isinstance(roofline.get(k), (*_NUMBER, type(None))) for k in ("fraction", "achieved_gbs", "limit_gbs"))):
        return "extra.'roofline' is not {fraction, achieved_gbs, limit_gbs: numbers}"
    start = data.get("extra", {}).get("start")
    if start is not None and not (isinstance(start, dict) and all(
            isinstance(start.get(k), (*_NUMBER, type(None))) and not isinstance(start.get(k), bool)
            for k in ("vsup_s", "ready_s", "compile_s"))):
        return "extra.'start' is not {vsup_s, ready_s, compile_s: seconds}"
    return None


class ResultsFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[tuple[int, dict[str, Any]]]:
        """(line number, entry) of every line; a line that is not one is a VsupError naming it."""
        try:
            with open_read(self.path) as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise VsupError(f"--resume: cannot read {self.path}: {why(exc)}") from None
        entries = []
        fix = "remove that line (its run is measured again) or start without --resume in another --report folder"
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise VsupError(f"--resume: {self.path}:{number}: not UTF-8 text; {fix}") from None
            except json.JSONDecodeError:
                # the last line of a run killed while writing it: everything before it counts
                if number == len(lines):
                    break
                raise VsupError(f"--resume: {self.path}:{number}: not a JSON line; {fix}") from None
            if not isinstance(entry, dict):
                raise VsupError(f"--resume: {self.path}:{number}: not a JSON object; {fix}")
            if entry.get("type") == "run" and (problem := run_problem(entry)):
                raise VsupError(f"--resume: {self.path}:{number}: a run line that cannot be replayed: {problem}; {fix}")
            entries.append((number, entry))
        return entries

    def start(self, fingerprint: dict[str, Any], resume: bool) -> dict[tuple[str, str], Outcome]:
        """Fresh file, or (with resume) the recorded runs to replay. Refuses to overwrite without it."""
        if self.path.is_symlink():  # planted there: vsup writes its files never through a link
            raise VsupError(f"--report: {self.path} is a symlink, which vsup does not follow; remove it or choose another --report folder")
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise VsupError(f"--report: {self.path} holds an earlier run; --resume continues it, "
                                "or remove it / choose another --report folder")
            entries = [entry for _, entry in self.read()]
            header = next((e for e in entries if e.get("type") == "tune"), None)
            if header is None or not isinstance(header.get("fingerprint"), dict):
                raise VsupError(f"--resume: {self.path} has no vsup tune header; remove it or choose another --report folder")
            if header.get("fingerprint") != fingerprint:
                changed = sorted(k for k in set(fingerprint) | set(header["fingerprint"])
                                 if fingerprint.get(k) != header["fingerprint"].get(k))
                raise VsupError(f"--resume: {self.path} was made by another search (it differs in {', '.join(changed)}); "
                                "run with the same options, or choose another --report folder")
            return {(e["candidate"], e["stage"]): outcome_from_json(e) for e in entries if e.get("type") == "run"}
        if resume:
            raise VsupError(f"--resume: nothing to resume: {self.path} does not exist")
        own_folder(self.path.parent, "--report")
        write_text(self.path, "", "--report")
        self.append({"type": "tune", "fingerprint": fingerprint, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        return {}

    def append(self, entry: dict[str, Any]) -> None:
        with open_text(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
