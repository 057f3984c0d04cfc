"""STUB (replaced by i29-parse)."""
from __future__ import annotations

MiB = 1024 * 1024


def default_limit(total: int) -> int:
    return max(32 * MiB, min(256 * MiB, total // 512))


class BodyBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0

    def reserve(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def release(self, n: int) -> None:
        self.held -= n
