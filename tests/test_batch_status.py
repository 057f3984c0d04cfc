"""A batch's status machine (vsup/batch/status.py): one table, every status timed, every path ends."""

from __future__ import annotations

import pytest

from vsup.batch.status import TERMINAL, TIMESTAMP, TRANSITIONS, BatchStateError, Status, check

S = Status


def test_the_table_names_every_status_and_its_timestamp():
    assert set(TRANSITIONS) == set(Status)
    assert set(TIMESTAMP) == set(Status)
    assert TIMESTAMP[S.VALIDATING] == "created_at"
    assert all(TIMESTAMP[s] == f"{s.value}_at" for s in Status if s is not S.VALIDATING)


def test_terminal_statuses_are_openais_four_ends():
    assert TERMINAL == {S.FAILED, S.COMPLETED, S.EXPIRED, S.CANCELLED}


@pytest.mark.parametrize("old,new", [
    (S.VALIDATING, S.IN_PROGRESS), (S.VALIDATING, S.FAILED), (S.VALIDATING, S.CANCELLING),
    (S.IN_PROGRESS, S.FINALIZING), (S.IN_PROGRESS, S.CANCELLING),
    (S.FINALIZING, S.COMPLETED), (S.FINALIZING, S.EXPIRED), (S.CANCELLING, S.CANCELLED),
])
def test_the_allowed_moves(old, new):
    assert check(old.value, new.value) is new


@pytest.mark.parametrize("old,new", [
    (S.VALIDATING, S.COMPLETED), (S.IN_PROGRESS, S.COMPLETED), (S.CANCELLING, S.IN_PROGRESS),
    (S.COMPLETED, S.CANCELLING), (S.FAILED, S.IN_PROGRESS), (S.FINALIZING, S.CANCELLED), (S.EXPIRED, S.FINALIZING),
])
def test_a_move_the_table_lacks_is_refused_naming_both(old, new):
    with pytest.raises(BatchStateError, match=f"from {old.value} to {new.value}"):
        check(old, new)


def test_an_unknown_status_is_refused():
    with pytest.raises(BatchStateError, match="unknown"):
        check("validating", "done")


def test_every_status_reaches_an_end():
    for start in Status:
        seen, todo = set(), [start]
        while todo:
            s = todo.pop()
            if s not in seen:
                seen.add(s)
                todo.extend(TRANSITIONS[s])
        assert seen & TERMINAL, start
