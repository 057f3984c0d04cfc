"""What `vsup status`, `vsup top`, the /status page and /metrics see of the batches.

`Watch` turns the store into the status JSON's `batches` list (the running batches and those that
ended in the last `RECENT` seconds, each with its rate and ETA, progress.py) and the figures
/metrics renders (proxy/metrics.py): the line outcomes and the lines running by model are the
Store's own counts (`Store.outcomes`, `Store.in_flight`, kept where each line's state changes).

Nothing here is a tenant's secret to an admin: a batch's owner is its key's NAME (never a key),
and no id, owner or custom_id becomes a metric label (unbounded, and a tenant's).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vsup.batch.progress import Progress, Samples, progress
from vsup.batch.status import TERMINAL, TIMESTAMP, Status
from vsup.batch.store import Store

log = logging.getLogger("vsup.batch")

RECENT = 3600.0  # seconds a finished batch stays in the status JSON after its end
RECENT_LIMIT = 20  # the newest batches looked at for the validating and recently finished ones


@dataclass(frozen=True)
class Figures:
    """What /metrics shows of the batches (proxy/metrics.py renders it)."""
    outcomes: Mapping[tuple[str, str], int]  # (model, outcome) -> lines since the start
    lines: Mapping[tuple[str, str], int]  # (model, state: pending | running) -> lines now
    batches: Mapping[str, int]  # status -> batches in the store
    store_bytes: int


def ended_at(batch: Mapping[str, Any]) -> float | None:
    """When a finished batch ended (its terminal status's timestamp); None for one not finished."""
    try:
        status = Status(str(batch.get("status")))
    except ValueError:
        return None
    value = batch.get(TIMESTAMP[status]) if status in TERMINAL else None
    return value if isinstance(value, (int, float)) else None


def entry(batch: Mapping[str, Any], found: Progress, owner: str | None, models: list[str],
          pending: int | None = None, running: int | None = None) -> dict[str, Any]:
    """One batch as the status JSON shows it (every field a client chose — metadata, and the ids —
    is the views' to escape)."""
    return {
        "id": batch.get("id"), "status": batch.get("status"), "endpoint": batch.get("endpoint"),
        "models": models, "owner": owner,
        "total": found.total, "completed": found.completed, "failed": found.failed,
        "pending": pending, "running": running,
        "rate": None if found.rate is None else round(found.rate, 3),
        "eta": None if found.eta is None else round(found.eta, 1),
        "created_at": batch.get("created_at"), "in_progress_at": batch.get("in_progress_at"),
        "expires_at": batch.get("expires_at"), "ended_at": ended_at(batch),
        "metadata": batch.get("metadata"),
    }


class Watch:
    """The batches as the views see them; samples each running batch's progress when asked (each
    `vsup status`, `vsup top` refresh, /status page and scrape), so the rate is over the last
    minute of looks (progress.Samples; before a second look, the mean since its start)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self.samples = Samples()
        self._models: dict[str, list[str]] = {}  # batch id -> the models its lines named, seen while it ran

    def status(self) -> list[dict[str, Any]]:
        """The running batches (oldest first), then the validating ones and those that ended in the
        last RECENT seconds (newest first); [] (and a warning) when the store cannot be read: the
        rest of the status still answers."""
        try:
            return self._status()
        except sqlite3.Error as exc:
            log.warning("batch store: the status could not read it: %s", exc)
            return []

    def _status(self) -> list[dict[str, Any]]:
        store, now = self.store, self.clock()
        running = store.running()
        looked = self.samples.look(running, now)
        out = []
        for row in running:
            models = sorted(set(row.get("open_models") or ()) | set(self._models.get(row["id"], ())))
            self._models[row["id"]] = models
            out.append(entry(row, looked[row["id"]], row.get("owner"), models, row.get("pending"), row.get("running")))
        shown = {row["id"] for row in running}
        page, _ = store.batches(None, limit=RECENT_LIMIT)
        others = [b for b in page if b["id"] not in shown
                  and (b["status"] == Status.VALIDATING or now - (ended_at(b) or 0.0) <= RECENT)]
        owners = store.owners([b["id"] for b in others])
        for batch in others:
            out.append(entry(batch, progress(batch, now), owners.get(batch["id"]), self._models.get(batch["id"], [])))
        keep = shown | {b["id"] for b in others}
        self._models = {k: v for k, v in self._models.items() if k in keep}
        return out

    def figures(self) -> Figures | None:
        """What /metrics shows; None (and a warning) when the store cannot be read."""
        try:
            return self._figures()
        except sqlite3.Error as exc:
            log.warning("batch store: /metrics could not read it: %s", exc)
            return None

    def _figures(self) -> Figures:
        store = self.store
        # copies taken whole first: the runner's thread counts results while this reads
        outcomes, in_flight = dict(store.outcomes), dict(store.in_flight)
        pending: dict[str, int] = {}
        for row in store.running():
            for model, n in (row.get("models") or {}).items():
                pending[model] = pending.get(model, 0) + n
        lines = {(model, "pending"): n for model, n in pending.items()}
        lines.update({(model, "running"): n for model, n in in_flight.items()})
        for model in pending.keys() | in_flight.keys():  # both series of a model with either
            lines.setdefault((model, "pending"), 0)
            lines.setdefault((model, "running"), 0)
        return Figures(outcomes, lines, store.by_status(), store.usage())

