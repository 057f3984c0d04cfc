"""A batch's status machine as one table (pure, standard library only).

validating → in_progress → finalizing → completed | expired; validating → failed (the input did not
validate); validating | in_progress → cancelling → cancelled. A cancelling batch builds its files
without passing through finalizing (as OpenAI's do); an expired one passes through it, so a kill -9
while its files are built finds it again as finalizing.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


S = Status

# old -> the statuses it may become; the only place transitions live.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING}),
    S.FINALIZING: frozenset({S.COMPLETED, S.EXPIRED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.FAILED: frozenset(),
    S.COMPLETED: frozenset(),
    S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}

# status -> the batch object's field that records when the batch entered it
TIMESTAMP: dict[Status, str] = {
    S.VALIDATING: "created_at",
    S.FAILED: "failed_at",
    S.IN_PROGRESS: "in_progress_at",
    S.FINALIZING: "finalizing_at",
    S.COMPLETED: "completed_at",
    S.EXPIRED: "expired_at",
    S.CANCELLING: "cancelling_at",
    S.CANCELLED: "cancelled_at",
}

TERMINAL: frozenset[Status] = frozenset(s for s, after in TRANSITIONS.items() if not after)


class BatchStateError(Exception):
    """A transition the table does not allow (a bug in the caller, or a race it must handle)."""


def check(old: str, new: str) -> Status:
    """`new` as a Status when `old` may become it; BatchStateError naming both otherwise."""
    try:
        before, after = Status(old), Status(new)
    except ValueError:
        raise BatchStateError(f"unknown batch status: {old!r} -> {new!r}") from None
    if after not in TRANSITIONS[before]:
        raise BatchStateError(f"a batch cannot go from {before.value} to {after.value}")
    return after
