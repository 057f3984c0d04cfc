"""vsup/batch/progress.py: a batch's done/failed/total, its rate over the recent window and its ETA,
and the one line every view shows (pure)."""

from __future__ import annotations

import pytest

from vsup.batch import progress as p


def row(completed: int, failed: int = 0, total: int = 5000, status: str = "in_progress", started: float = 0.0,
        batch_id: str = "batch_a") -> dict:
    return {"id": batch_id, "status": status, "total": total, "completed": completed, "failed": failed,
            "in_progress_at": started}


def test_a_first_look_takes_the_mean_since_the_batch_started():
    found = p.progress(row(100), now=50.0)
    assert (found.total, found.done, found.left) == (5000, 100, 4900)
    assert found.rate == pytest.approx(2.0)
    assert found.eta == pytest.approx(2450.0)


def test_the_rate_is_taken_from_the_earlier_sample_not_the_whole_run():
    # slow for 1000 s, then 10 lines/s for the last 10 s: the window's rate, not the mean
    found = p.progress(row(200), now=1010.0, earlier=(1000.0, 100))
    assert found.rate == pytest.approx(10.0)
    assert found.eta == pytest.approx(480.0)


def test_no_rate_before_a_second_has_passed_and_none_for_a_batch_not_running():
    assert p.progress(row(0, started=10.0), now=10.2).rate is None
    # a sample half a second old is too close: the mean since the start instead
    assert p.progress(row(3), now=10.5, earlier=(10.0, 1)).rate == pytest.approx(3 / 10.5)
    finished = p.progress({"status": "completed", "request_counts": {"total": 9, "completed": 7, "failed": 2}}, now=99.0)
    assert (finished.done, finished.failed, finished.rate, finished.eta) == (9, 2, None, None)


def test_a_stalled_batch_has_a_rate_of_zero_and_no_eta():
    found = p.progress(row(100), now=200.0, earlier=(100.0, 100))
    assert found.rate == 0.0
    assert found.eta is None
    assert p.text(found) == "100/5,000 · 0.0 lines/s"


def test_counts_that_are_not_counts_read_as_zero():
    assert p.counts({"total": "5", "completed": -1, "failed": True}) == (0, 0, 0)


def test_samples_keep_a_window_and_forget_a_batch_gone():
    samples = p.Samples(window=60.0)
    for t in range(0, 121, 2):  # 5 lines/s, sampled every 2 s
        found = samples.look([row(5 * t)], now=float(t))
    assert found["batch_a"].rate == pytest.approx(5.0)
    # a burst in the last two seconds moves the rate by a little, not to the burst's 50 lines/s
    found = samples.look([row(5 * 122 + 90)], now=122.0)
    assert 5.0 < found["batch_a"].rate < 7.0
    samples.look([row(1, batch_id="batch_b")], now=124.0)
    assert samples.look([row(700)], now=126.0)["batch_a"].rate == pytest.approx(700 / 126)  # forgotten: the mean again


@pytest.mark.parametrize(("seconds", "shown"), [(None, "-"), (44.6, "45 s"), (1200, "20 min"), (7500, "2 h 05 min"),
                                                 (3 * 86400 + 4 * 3600, "3 d 4 h")])
def test_eta_text(seconds, shown):
    assert p.eta_text(seconds) == shown


def test_the_one_line():
    found = p.Progress(total=5000, completed=1222, failed=12, rate=3.1, eta=1200.0)
    assert p.text(found) == "1,234/5,000 · 12 failed · 3.1 lines/s · ETA 20 min"
    assert p.text(p.Progress(10, 10, 0, None, None)) == "10/10"
    assert p.text(p.Progress(10, 1, 0, 0.04, 225.0)) == "1/10 · 0.04 lines/s · ETA 4 min"
