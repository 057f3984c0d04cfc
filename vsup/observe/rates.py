"""Per-second rates from a counter sampled now and then (tokens/s over the last minute).

A counter that goes down was reset (the instance restarted): the new value counts as what was
added since the reset, as Prometheus's rate() does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise

WINDOW = 60.0  # seconds


def increase(values: list[float]) -> float:
    total = 0.0
    for before, after in pairwise(values):
        total += after - before if after >= before else after
    return total


@dataclass
class CounterWindow:
    window: float = WINDOW
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, at: float, value: float) -> None:
        self.samples.append((at, value))
        self.prune(at)

    def prune(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.window:
            self.samples.popleft()

    def rate(self) -> float | None:
        """Per second between the oldest and newest sample in the window; None with fewer than two."""
        if len(self.samples) < 2:
            return None
        span = self.samples[-1][0] - self.samples[0][0]
        return increase([v for _, v in self.samples]) / span if span > 0 else None
