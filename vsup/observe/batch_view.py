"""The status JSON's `batches` as table cells, for `vsup status`, `vsup top` and the /status page
(pure). Cells are plain text as the client sent it (metadata, and the ids): each view escapes them
its own way (safetext.printable for a terminal, html.escape of that for the page)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vsup.batch.progress import eta_text, rate_text

COLUMNS = ("BATCH", "STATUS", "MODEL", "OWNER", "DONE", "FAILED", "RATE/S", "ETA", "AGE", "METADATA")
METADATA_CHARS = 60  # a longer metadata cell is cut (the JSON keeps it whole)
RUNNING = ("in_progress", "cancelling", "finalizing")
STATUS_STYLES = {"in_progress": "green", "finalizing": "green", "validating": "yellow", "cancelling": "yellow",
                 "completed": "dim", "cancelled": "dim", "failed": "bold red", "expired": "bold red"}


def metadata_text(metadata: Any) -> str:
    """`k=v, k=v` (cut at METADATA_CHARS), "-" for none."""
    if not isinstance(metadata, Mapping) or not metadata:
        return "-"
    shown = ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in metadata.items())
    return shown if len(shown) <= METADATA_CHARS else shown[: METADATA_CHARS - 1] + "…"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def cells(entry: Mapping[str, Any], now: float) -> list[str]:
    """One batch's cells in COLUMNS' order (raw text: escape it where shown)."""
    total, completed, failed = (_count(entry.get(k)) for k in ("total", "completed", "failed"))
    status = str(entry.get("status"))
    running = status in RUNNING
    created = entry.get("created_at")
    age = now - created if isinstance(created, (int, float)) else None
    eta = entry.get("eta")
    if running:
        when = eta_text(eta) if isinstance(eta, (int, float)) else "-"
    elif isinstance(ended := entry.get("ended_at"), (int, float)):
        when = f"ended {eta_text(max(0.0, now - ended))} ago"
    else:
        when = "-"
    rate = entry.get("rate")
    return [
        str(entry.get("id") or "-"), status, ",".join(str(m) for m in entry.get("models") or ()) or "-",
        str(entry.get("owner") or "-"), f"{completed + failed:,}/{total:,}", f"{failed:,}",
        rate_text(rate) if running and isinstance(rate, (int, float)) else "-", when,
        eta_text(age) if age is not None else "-", metadata_text(entry.get("metadata")),
    ]


def fraction(entry: Mapping[str, Any]) -> float:
    """Done over total (0 for an empty batch), for a bar."""
    total = _count(entry.get("total"))
    return min(1.0, (_count(entry.get("completed")) + _count(entry.get("failed"))) / total) if total else 0.0
