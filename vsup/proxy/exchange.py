"""One request in flight through the forwarder: its phase, its current time limit and the
timestamps the forwarder's watchdog checks it by (vsup.proxy.forward)."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vsup.proxy.batch_share import BatchShare
    from vsup.proxy.load import Prefill
    from vsup.proxy.ratelimit import Charge


class Exchange:
    """One request in flight: its phase and its current time limit. The forwarder's watchdog
    (one timer for all requests, see Forwarder._sweep) cancels the handler when the instance stays
    silent past the limit or the proxy drains; per request and per chunk only timestamps are stored."""

    __slots__ = ("task", "limit", "limit_key", "last", "reason", "phase", "stream", "idle_limit", "first_data_at", "sent_at", "held", "backend", "size", "charge", "prefill", "holds")

    def __init__(self, task: asyncio.Task, now: float) -> None:
        self.task = task
        self.limit = math.inf  # no limit while the request body is read
        self.limit_key = ""
        self.last = now
        self.reason: str | None = None  # set when the proxy itself cancels: timeout or drain
        self.phase = "queued"
        self.stream = False
        self.idle_limit = 0.0
        self.first_data_at: float | None = None
        self.sent_at = 0.0
        self.held = 0  # bytes of its body counted against proxy.max_body_buffer
        self.backend: str | None = None  # the instance it is on now (stall.py reads it)
        self.size = 0  # its body's bytes
        self.charge: Charge | None = None  # its key's token reservation, settled by the answer (ratelimit.py)
        self.prefill: tuple[Prefill, str, float] | None = None  # counted as awaiting its first byte there (load.py)
        self.holds: tuple[BatchShare, str] | None = None  # a stream holding new batch lines off its instance until its first byte

    def on_data(self, now: float) -> None:
        """A piece of the response body arrived (the relay inlines this per chunk)."""
        self.last = now
        if self.first_data_at is None:
            self.first_data(now)

    def first_data(self, now: float) -> None:
        """From the first body byte on, the limit is the idle timeout."""
        self.first_data_at = now
        self.prefilled()
        self.limit = self.idle_limit
        self.limit_key = "proxy.idle_timeout"

    def prefilled(self) -> None:
        """No longer awaiting its first byte (it came, or the attempt ended): off the instance's prefill work."""
        if self.prefill is not None:
            prefill, name, tokens = self.prefill
            self.prefill = None
            prefill.done(name, tokens)
        if self.holds is not None:
            share, name = self.holds
            self.holds = None
            share.released(name, self.first_data_at is not None)

    def arm(self, limit: float, key: str, now: float) -> None:
        """A new phase with its own limit, counted from now."""
        self.limit = limit
        self.limit_key = key
        self.last = now

    def abort(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.task.cancel()
