"""The observed figures in human units, one short cell each ("-" when unknown), for `vsup status`,
`vsup top` and the /status page (pure). Reads the "metrics" dict of an instance's status JSON and
tolerates any key being absent (metrics off, an older vsup, a round not yet done)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DASH = "-"


def duration(seconds: float | None) -> str:
    """45s, 3m07s, 2h05m, 1d03h."""
    if seconds is None:
        return DASH
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def size(count: float | None) -> str:
    """Bytes as 512M, 1.5G (powers of 1024, as `top` shows memory)."""
    if count is None:
        return DASH
    for unit, scale in (("T", 1024**4), ("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if count >= scale:
            value = count / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{count:.0f}B"


def percent(fraction: float | None) -> str:
    return DASH if fraction is None else f"{100 * fraction:.0f}%"


def number(value: float | None, digits: int = 0) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def figures(entry: Mapping[str, Any]) -> dict[str, str]:
    """The observed cells of one instance (status JSON entry)."""
    m = entry.get("metrics") or {}
    return {
        "tok/s": number(m.get("generation_tokens_per_s"), 1),
        "run": number(m.get("requests_running")),
        "wait": number(m.get("requests_waiting")),
        "kv": percent(m.get("kv_cache_usage")),
        "cpu%": number(m.get("cpu_percent")),
        "rss": size(m.get("rss_bytes")),
        "local": percent(m.get("numa_local_ratio")),
    }


FIGURE_HEADERS = ("TOK/S", "RUN", "WAIT", "KV", "CPU%", "RSS", "LOCAL")


IDLE_SHOWN = 10.0  # a start idle (no progress) this many seconds says so in its phase cell


def phase(entry: Mapping[str, Any]) -> str:
    """Where a starting instance is (the status JSON's "phase"): "loading 31s · 1/2 shards ·
    2.1G/5.3G read", "compiling 1m12s", "compiling 2m40s · idle 45s"; "-" when it is not starting."""
    p = entry.get("phase")
    if not isinstance(p, Mapping):
        return DASH
    parts = [f"{p.get('name')} {duration(p.get('for'))}"]
    shards = p.get("shards")
    if isinstance(shards, list) and len(shards) == 2:
        parts.append(f"{shards[0]}/{shards[1]} shards")
    if p.get("read_bytes") is not None:
        parts.append(f"{size(p['read_bytes'])}/{size(p['weights_bytes'])} read" if p.get("weights_bytes") else f"{size(p['read_bytes'])} read")
    idle = p.get("idle")
    if p.get("judged") and isinstance(idle, (int, float)) and idle >= IDLE_SHOWN:
        parts.append(f"idle {duration(idle)}")
    return " · ".join(parts)


NOTE_LINE = 100  # characters of a waiting line shown in a note


def phase_note(entry: Mapping[str, Any]) -> str | None:
    """A waiting line of vLLM's during this phase, and what it means: 'vLLM (3×): "No available
    shared memory broadcast block found in 60 seconds. This…" — normal while compiling: …'. The
    line is the instance's own text: the caller escapes it (printable, html.escape, rich Text)."""
    p = entry.get("phase")
    waiting = p.get("waiting") if isinstance(p, Mapping) else None
    if not isinstance(waiting, Mapping):
        return None
    line = str(waiting.get("line", ""))
    message = line.split("] ", 1)[1] if "] " in line else line  # after vLLM's "(EngineCore pid=N) INFO ... [file.py:N]"
    if len(message) > NOTE_LINE:
        message = message[:NOTE_LINE] + "…"
    count = waiting.get("count") or 1
    return f'vLLM{f" ({count}×)" if count > 1 else ""}: "{message}" — {waiting.get("note", "")}'
