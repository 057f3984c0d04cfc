"""How far a batch has come, and how fast (pure: no I/O, the time is passed in).

From a row of `Store.running()` (or a batch object's `request_counts`) and samples of its done
lines over time: lines done, failed, total; the rate over a recent window (lines per second), and
the time left at that rate. `vsup status`, `vsup top`, the /status page, and `vsup batch show
--follow` (which samples the batch object it polls) all read the same `Progress`.

The rate: lines done (completed + failed) between the oldest sample of the last `WINDOW` seconds
and now; with no sample old enough (a first look), the mean since the batch went in_progress.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

WINDOW = 60.0  # seconds of samples the rate is taken over
MIN_SPAN = 1.0  # seconds: two samples closer than this give no rate (a burst is not a rate)


@dataclass(frozen=True)
class Progress:
    total: int
    completed: int
    failed: int
    rate: float | None  # lines per second (done: completed + failed); None: not known yet
    eta: float | None   # seconds left at that rate; None: unknown (no rate, or nothing moves)

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def left(self) -> int:
        return max(0, self.total - self.done)


def counts(row: Mapping[str, Any]) -> tuple[int, int, int]:
    """(total, completed, failed) of a `Store.running()` row or a batch object (request_counts)."""
    nested = row.get("request_counts")
    source: Mapping[str, Any] = nested if isinstance(nested, Mapping) else row
    return _count(source.get("total")), _count(source.get("completed")), _count(source.get("failed"))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def rate_between(earlier: tuple[float, int] | None, now: float, done: int, started: float | None) -> float | None:
    """Lines per second from the sample `earlier` (time, done) to (now, done); without a sample
    MIN_SPAN old, the mean since `started` (in_progress_at); None when neither is known."""
    if earlier is not None and now - earlier[0] >= MIN_SPAN:
        return max(0, done - earlier[1]) / (now - earlier[0])
    if started is not None and now - started >= MIN_SPAN:
        return done / (now - started)
    return None


def progress(row: Mapping[str, Any], now: float, earlier: tuple[float, int] | None = None) -> Progress:
    """The progress of one batch at `now`; `earlier`: a sample (time, done) of the same batch."""
    total, completed, failed = counts(row)
    status = row.get("status")
    started = row.get("in_progress_at")
    if status not in ("in_progress", "cancelling", "finalizing"):  # not running: no rate to speak of
        return Progress(total, completed, failed, None, None)
    rate = rate_between(earlier, now, completed + failed, started if isinstance(started, (int, float)) else None)
    left = max(0, total - completed - failed)
    eta = left / rate if rate and status == "in_progress" else (0.0 if not left else None)
    return Progress(total, completed, failed, rate, eta)


class Samples:
    """Each batch's (time, done) samples of the last WINDOW seconds: `earlier()` gives the oldest
    of them, the one a rate is taken from. Batches not seen in a look are forgotten."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._by_batch: dict[str, deque[tuple[float, int]]] = {}

    def look(self, rows: Iterable[Mapping[str, Any]], now: float) -> dict[str, Progress]:
        """Each row's progress at `now` (against its oldest recent sample), and a sample taken."""
        out: dict[str, Progress] = {}
        seen = set()
        for row in rows:
            batch_id = str(row.get("id"))
            seen.add(batch_id)
            samples = self._by_batch.setdefault(batch_id, deque())
            while len(samples) > 1 and now - samples[1][0] >= self.window:
                samples.popleft()  # keep one sample at least WINDOW old, none older
            found = progress(row, now, samples[0] if samples else None)
            out[batch_id] = found
            if not samples or now - samples[-1][0] >= MIN_SPAN:
                samples.append((now, found.done))
        for gone in self._by_batch.keys() - seen:
            del self._by_batch[gone]
        return out


def eta_text(seconds: float | None) -> str:
    """ETA 45 s, 20 min, 2 h 05 min, 3 d 4 h."""
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{round(s / 60)} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def rate_text(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.1f}" if rate >= 0.1 or rate == 0 else f"{rate:.2g}"


def text(p: Progress) -> str:
    """One batch as a line: "1,234/5,000 · 12 failed · 3.1 lines/s · ETA 20 min" (failed, rate and
    ETA only when known and not nothing)."""
    parts = [f"{p.done:,}/{p.total:,}"]
    if p.failed:
        parts.append(f"{p.failed:,} failed")
    if p.rate is not None:
        parts.append(f"{rate_text(p.rate)} lines/s")
    if p.eta is not None and p.left:
        parts.append(f"ETA {eta_text(p.eta)}")
    return " · ".join(parts)
