"""What `vsup status`, `vsup top`, the /status page and /metrics see of the batches.

`WatchedStore` is the Store with the line outcomes counted as they happen (for the Prometheus
counters: a store's rows say where each batch is, not how many lines each model finished since
the start) and the lines in flight per model; `Watch` turns the store into the status JSON's
`batches` list (the running batches and those that ended in the last `RECENT` seconds, each with
its rate and ETA, progress.py) and the figures /metrics renders (proxy/metrics.py).

Nothing here is a tenant's secret to an admin: a batch's owner is its key's NAME (never a key),
and no id, owner or custom_id becomes a metric label (unbounded, and a tenant's).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vsup.batch.progress import Progress, Samples, progress
from vsup.batch.status import TERMINAL, TIMESTAMP, Status
from vsup.batch.store import Claimed, Limits, Store

log = logging.getLogger("vsup.batch")

RECENT = 3600.0  # seconds a finished batch stays in the status JSON after its end
RECENT_LIMIT = 20  # the newest batches looked at for the validating and recently finished ones
OUTCOMES = ("completed", "failed", "requeued")


class WatchedStore(Store):
    """The Store, counting each line's outcome by model (completed, failed, requeued) and the lines
    claimed and not yet answered (in flight) by model. Counts start at zero with each open, as a
    Prometheus counter does with each process."""

    def __init__(self, db: sqlite3.Connection, limits: Limits, clock: Callable[[], float]) -> None:
        self.outcomes: dict[tuple[str, str], int] = {}  # (model, outcome) -> lines
        self.in_flight: dict[str, int] = {}  # model -> lines claimed and not answered yet
        super().__init__(db, limits, clock)

    @classmethod
    def open(cls, directory: Path, limits: Limits, clock: Callable[[], float] = time.time) -> WatchedStore:
        store = super().open(directory, limits, clock)
        assert isinstance(store, WatchedStore)  # (Store.open builds cls)
        return store

    def _count(self, model: str, outcome: str, n: int = 1) -> None:
        if n:
            self.outcomes[(model, outcome)] = self.outcomes.get((model, outcome), 0) + n

    def _landed(self, model: str) -> None:
        left = self.in_flight.get(model, 0) - 1
        if left > 0:
            self.in_flight[model] = left
        else:
            self.in_flight.pop(model, None)

    def claim(self, batch_id: str, n: int, model: str | None = None) -> list[Claimed]:
        claimed = super().claim(batch_id, n, model)
        for line in claimed:
            self.in_flight[line.model] = self.in_flight.get(line.model, 0) + 1
        return claimed

    def record(self, claimed: Claimed, status_code: int | None, body: bytes | None, request_id: str,
               error: dict | None = None) -> bool:
        done = super().record(claimed, status_code, body, request_id, error)
        self._landed(claimed.model)
        if done:
            ok = error is None and status_code is not None and 200 <= status_code < 300
            self._count(claimed.model, "completed" if ok else "failed")
        return done

    def requeue(self, claimed: Claimed, why: str) -> bool:
        done = super().requeue(claimed, why)
        self._landed(claimed.model)
        if done:
            self._count(claimed.model, "failed" if claimed.attempt >= self.limits.max_attempts else "requeued")
        return done

    def _fail_pending(self, db: sqlite3.Connection, batch_id: str | None, model: str | None, code: str, message: str) -> int:
        # (the one path of a cancel, an expiry and a removed model: counted by model before they go)
        where, args = ["state = 'pending'"], []
        for column, value in (("batch_id", batch_id), ("model", model)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        by_model = db.execute(f"SELECT model, COUNT(*) FROM lines WHERE {' AND '.join(where)} GROUP BY model", args).fetchall()
        failed = super()._fail_pending(db, batch_id, model, code, message)
        for name, n in by_model:
            self._count(name, "failed", n)
        return failed

    def by_status(self) -> dict[str, int]:
        """How many batches the store holds in each status (every status, 0 where none)."""
        found = {row[0]: row[1] for row in self._all("SELECT status, COUNT(*) FROM batches GROUP BY status")}
        return {s.value: int(found.get(s.value, 0)) for s in Status}

    def owners(self, batch_ids: list[str]) -> dict[str, str]:
        """Each batch's owner (its key's name)."""
        if not batch_ids:
            return {}
        marks = ", ".join("?" * len(batch_ids))
        return {row[0]: row[1] for row in self._all(f"SELECT id, owner FROM batches WHERE id IN ({marks})", tuple(batch_ids))}


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

    def __init__(self, store: WatchedStore, clock: Callable[[], float] = time.time) -> None:
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
            models = sorted(set(row.get("models") or ()) | set(self._models.get(row["id"], ())))
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
        pending: dict[str, int] = {}
        for row in store.running():
            for model, n in (row.get("models") or {}).items():
                pending[model] = pending.get(model, 0) + n
        lines = {(model, "pending"): n for model, n in pending.items()}
        lines.update({(model, "running"): n for model, n in store.in_flight.items()})
        for model in pending.keys() | store.in_flight.keys():  # both series of a model with either
            lines.setdefault((model, "pending"), 0)
            lines.setdefault((model, "running"), 0)
        return Figures(dict(store.outcomes), lines, store.by_status(), store.usage())

