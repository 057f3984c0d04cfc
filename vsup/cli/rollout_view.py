"""A reload's or rolling restart's record (`rollout` in the status JSON) as text lines, for
`vsup status` and `vsup reload`."""

from __future__ import annotations

from vsup.safetext import printable

from .status import duration

MARK = {"done": "done", "failed": "FAILED", "running": "running", "pending": "pending", "skipped": "not done"}


def render_rollout(record: dict | None, *, steps: bool = True) -> list[str]:
    """The head line, then one line per step (all of them while it runs or when it failed,
    else only when `steps`). Errors and details quote instances: each line is `printable`."""
    return [printable(line) for line in _rollout_lines(record, steps=steps)]


def _rollout_lines(record: dict | None, *, steps: bool) -> list[str]:
    if not record:
        return []
    when = f"{duration(record['took'])}"
    state = record["state"]
    if state == "pending":  # a SIGHUP came during the last change: what it did is for an older file
        return [f"{record['kind']} ({record['pending']}) pending: the file is re-read once the last change has ended"]
    reading = state == "running" and not record["steps"] and record["kind"] == "reload"
    if reading:
        head = f"{record['kind']} ({record['trigger']}) running for {when}: reading and checking the file"
    elif state == "running":
        head = f"{record['kind']} ({record['trigger']}) running for {when}: step {record['step']} of {len(record['steps'])}"
    else:
        head = f"last {record['kind']} ({record['trigger']}): {state.upper() if state in ('failed', 'rejected') else state}"
        head += f" after {when}"
    counts = _counts(record)
    if counts and state != "rejected" and not reading:
        head += f"; {counts}"
    if record.get("pending"):
        head += f"; then another reload ({record['pending']}: the file changed during this one)"
    lines = [head]
    if record.get("error"):
        lines.append(f"  error: {record['error']}")
    if steps or state in ("running", "failed"):
        for step in record["steps"]:
            line = f"  instance {step['index']}: {step['action']} ({step['why']})"
            if step.get("how"):
                line += f", {step['how']}"
            line += f": {MARK.get(step['state'], step['state'])}"
            new = step.get("new")
            if step["state"] == "running" and new:
                line += f" — {new['name']} on {new.get('at') or 'port ' + str(new['port'])} is {new['state']}"
            elif step.get("detail") and step["state"] != "failed":
                line += f" — {step['detail']}"
            lines.append(line)
    if record.get("applied"):
        lines.append(f"  applied at once: {', '.join(record['applied'])}")
    if record.get("not_applied"):
        lines.append(f"  not applied by the running vsup: {'; '.join(record['not_applied'])}")
    return lines


def render_changing(entries: list[dict]) -> list[str]:
    """Instances outside the fleet for a moment: a replacement starting beside the instance it
    replaces, or a replaced one draining."""
    return [printable(f"  instance {e['index']} ({e['name']}, {e.get('address') or 'port ' + str(e['port'])}, pid {e['pid'] or '-'}): {e['state']}"
            + (" (being replaced)" if e["state"] in ("draining", "stopping") else " (its replacement)"))
            for e in entries]


def _counts(record: dict) -> str:
    done = [s for s in record["steps"] if s["state"] == "done"]
    parts = []
    for action, word in (("replace", "replaced"), ("add", "added"), ("remove", "removed")):
        n = sum(s["action"] == action for s in done)
        if n:
            parts.append(f"{n} {word}")
    if record["kind"] == "reload":
        parts.append(f"{len(record['unchanged'])} unchanged")
    return ", ".join(parts)
