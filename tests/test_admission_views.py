"""The admission queues in `vsup status` (a line per model) and `vsup top` (the head's count)."""

from __future__ import annotations

import copy
import io

from rich.console import Console

from tests.test_observe import SAMPLE_STATUS
from vsup.cli.status import render_queues
from vsup.cli.top import view

QUEUES = {"chat": {"waiting": 3, "by_priority": {"-10": 2, "10": 1}, "oldest_wait_s": 1.234, "waited": 40, "wait_sum_s": 32.0},
          "embed": {"waiting": 0, "by_priority": {}}}


def shown(renderable) -> str:
    console = Console(file=io.StringIO(), width=260, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_status_has_a_line_per_queue_highest_priority_first():
    assert render_queues(QUEUES) == [
        "queue chat: 3 waiting (priority 10: 1, priority -10: 2), oldest 1.23 s; 40 waited, mean 0.80 s",
        "queue embed: 0 waiting",
    ]
    assert render_queues({}) == []


def test_top_counts_the_queued_requests_in_its_head():
    status = copy.deepcopy(SAMPLE_STATUS)
    assert "queued" not in shown(view(status, None, 2.0))  # no admission queue: as before
    status["queues"] = QUEUES
    assert "3 queued" in shown(view(status, None, 2.0)).splitlines()[0]
