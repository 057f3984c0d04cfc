"""One `vsup doctor` result per check, and how a list of them is judged and shown.

Statuses: pass, warn (works, but slower or fragile), fail (vLLM or vsup will not work), skip (not
applicable or not readable here; never affects the exit status).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
_RANK = {SKIP: 0, PASS: 0, WARN: 1, FAIL: 2}
# exit status = the worst result, as Nagios plugins do: 0 pass, 1 warn, 2 fail
EXIT_CODES = {PASS: 0, WARN: 1, FAIL: 2}


@dataclass(frozen=True)
class Result:
    check: str
    status: str
    summary: str
    fix: str = ""


def worst(results: Iterable[Result]) -> str:
    statuses = [r.status for r in results if r.status != SKIP]
    return max(statuses, key=_RANK.__getitem__, default=PASS)


def exit_code(results: Iterable[Result]) -> int:
    return EXIT_CODES[worst(results)]


def to_json(results: list[Result]) -> dict:
    return {"status": worst(results), "exit_code": exit_code(results), "checks": [asdict(r) for r in results]}


def render_text(results: list[Result]) -> str:
    width = max((len(r.check) for r in results), default=0)
    lines = []
    for r in results:
        lines.append(f"{r.status:<4}  {r.check:<{width}}  {r.summary}")
        if r.fix and r.status in (WARN, FAIL):
            lines.append(f"{'':<4}  {'':<{width}}  fix: {r.fix}")
        elif r.fix:
            lines.append(f"{'':<4}  {'':<{width}}  tip: {r.fix}")
    counts = {s: sum(1 for r in results if r.status == s) for s in (PASS, WARN, FAIL, SKIP)}
    lines.append(f"\n{counts[PASS]} passed, {counts[WARN]} warning(s), {counts[FAIL]} failure(s), {counts[SKIP]} skipped")
    return "\n".join(lines) + "\n"
