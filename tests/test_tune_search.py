"""vsup tune's search (pure) driven by a made-up measure function: no processes, no clock."""

from __future__ import annotations

import pytest

from tests.machines import GiB, make_machine
from vsup.topology.plan_model import PlanSettings
from vsup.tune.candidates import Candidate, layouts, plan_tweak
from vsup.tune.metrics import LevelMetrics
from vsup.tune.objective import Objective, parse_duration, parse_slo
from vsup.tune.search import Outcome, Search, SearchSettings, rung_sizes

BASE = PlanSettings(instances=1, reserve_cores=0, model_size_bytes=GiB, kvcache_gib=1)
MACHINE = make_machine(cores_per_node=16)


def level(tok_s: float, ttft: float = 0.5, errors: int = 0, itl: float = 0.05) -> LevelMetrics:
    stats = lambda v: {"mean": v, "p50": v, "p90": v * 1.5, "p99": v * 2}  # noqa: E731
    return LevelMetrics("c8", 10.0, 10, errors, int(tok_s * 10), 100, tok_s, 1.0, {
        "ttft": stats(ttft), "tpot": stats(itl), "itl": stats(itl), "e2el": stats(ttft + 1)})


class FakeBench:
    """measure(): tok/s from a table by candidate id (a default for the rest), fixed costs."""

    def __init__(self, speeds: dict[str, float], *, overhead: float = 5.0, fail: dict[str, str] | None = None,
                 ttft: dict[str, float] | None = None, default: float = 10.0) -> None:
        self.speeds, self.overhead, self.fail, self.ttft, self.default = speeds, overhead, fail or {}, ttft or {}, default
        self.calls: list[tuple[str, str, float]] = []

    def __call__(self, trial) -> Outcome:
        cid = trial.candidate.id
        self.calls.append((cid, trial.stage, trial.duration_s))
        wall = self.overhead + trial.duration_s
        if cid in self.fail:
            return Outcome(cid, trial.stage, trial.duration_s, False, error=self.fail[cid], wall_s=self.overhead)
        lv = level(self.speeds.get(cid, self.default), self.ttft.get(cid, 0.5))
        return Outcome(cid, trial.stage, trial.duration_s, True, (lv,), wall_s=wall, load_s=trial.duration_s)


def no_tweaks(best):
    return []


def make(candidate: Candidate):
    return plan_tweak(MACHINE, BASE, candidate)


def test_rung_sizes_halve_down_to_two():
    assert rung_sizes(9, 2) == [9, 5, 3, 2]
    assert rung_sizes(2, 2) == [2]
    assert rung_sizes(1, 2) == [1]


def test_the_fastest_layout_wins_and_runs_longest():
    kept, pruned = layouts(MACHINE, BASE)
    assert len(kept) >= 6
    bench = FakeBench({"i4-t2": 50.0, "i2": 30.0, "i8": 20.0, "i1": 1.0})
    result = Search(SearchSettings(budget_s=3600, min_duration_s=5), Objective(), bench).run(kept, no_tweaks, make, pruned)
    assert result.best == "i4-t2"
    assert result.ranking[0] == "i4-t2" and result.ranking[1] == "i2"
    durations = {}
    for cid, _stage, duration in bench.calls:
        durations.setdefault(cid, []).append(duration)
    assert len(durations["i4-t2"]) == len(rung_sizes(len(kept), 2))  # promoted through every rung
    assert durations["i4-t2"] == sorted(durations["i4-t2"]) and durations["i4-t2"][-1] > durations["i4-t2"][0]
    assert len(durations["i1"]) == 1  # a slow layout ran once
    assert result.pruned == list(pruned)


def test_latency_objective_picks_the_lowest_median_ttft():
    kept, _ = layouts(MACHINE, BASE)
    bench = FakeBench({"i16": 90.0}, ttft={"i16": 0.1, "i1": 2.0})
    result = Search(SearchSettings(budget_s=3600), Objective("latency"), bench).run(kept, no_tweaks, make)
    assert result.best == "i16"
    throughput = Search(SearchSettings(budget_s=3600), Objective("throughput"), FakeBench({"i16": 5.0, "i1": 50.0}))
    assert throughput.run(kept, no_tweaks, make).best == "i1"


def test_a_layout_that_misses_the_slo_ranks_after_those_that_meet_it():
    kept, _ = layouts(MACHINE, BASE)
    bench = FakeBench({"i1": 100.0, "i2": 60.0}, ttft={"i1": 3.0})
    objective = Objective("throughput", parse_slo("ttft_p99=2s"))
    result = Search(SearchSettings(budget_s=3600), objective, bench).run(kept, no_tweaks, make)
    assert result.best == "i2"


def test_failed_candidates_are_recorded_and_never_promoted():
    kept, _ = layouts(MACHINE, BASE)
    bench = FakeBench({"i8": 99.0, "i4": 50.0}, fail={"i8": "instance 3 exited: killed by SIGKILL (out of memory?)"})
    result = Search(SearchSettings(budget_s=3600), Objective(), bench).run(kept, no_tweaks, make)
    assert result.best == "i4"
    failed = [o for o in result.outcomes if not o.ok]
    assert [(o.candidate_id, o.error) for o in failed] == [("i8", "instance 3 exited: killed by SIGKILL (out of memory?)")]
    assert "i8" not in result.ranking


def test_the_budget_is_honoured_and_what_did_not_fit_is_reported_skipped():
    kept, _ = layouts(MACHINE, BASE)
    bench = FakeBench({}, overhead=20.0)
    settings = SearchSettings(budget_s=100, min_duration_s=10, overhead_guess_s=20)
    result = Search(settings, Objective(), bench).run(kept, no_tweaks, make)
    assert result.spent_s <= 100
    assert len(bench.calls) == 3  # 3 x (20 s start + 10 s load) fit in 100 s, the 4th would not
    assert {s.candidate_id for s in result.skipped if s.stage == "screen"} == {p.id for p in kept[3:]}
    assert all(s.reason.startswith("budget:") for s in result.skipped)


def test_run_lengths_grow_with_the_budget():
    kept, _ = layouts(MACHINE, BASE)
    short, long = FakeBench({}), FakeBench({})
    Search(SearchSettings(budget_s=600, min_duration_s=1), Objective(), short).run(kept, no_tweaks, make)
    Search(SearchSettings(budget_s=6000, min_duration_s=1), Objective(), long).run(kept, no_tweaks, make)
    assert long.calls[0][2] > 5 * short.calls[0][2]
    assert sum(5 + d for _, _, d in long.calls) <= 6000


def test_tweaks_run_on_the_winner_one_setting_at_a_time_and_keep_what_wins():
    kept, _ = layouts(MACHINE, BASE, )
    dims = lambda best: [("preload", ["tcmalloc"]), ("max_num_seqs", [8, 64])]  # noqa: E731
    bench = FakeBench({"i2": 40.0, "i2-tcmalloc": 48.0, "i2-tcmalloc-seqs8": 30.0, "i2-tcmalloc-seqs64": 48.1})
    result = Search(SearchSettings(budget_s=3600), Objective(), bench).run(kept, dims, make)
    tweak_runs = [cid for cid, stage, _ in bench.calls if stage == "tweak"]
    assert tweak_runs == ["i2-tcmalloc", "i2-tcmalloc-seqs8", "i2-tcmalloc-seqs64"]
    # preload won by 20 %; seqs64 by 0.2 %, less than min_gain: not worth a setting
    assert result.best == "i2-tcmalloc"


def test_a_tweak_the_planner_refuses_is_pruned_with_its_reason():
    kept, _ = layouts(MACHINE, BASE, )
    dims = lambda best: [("kvcache_gib", [500.0])]  # noqa: E731
    result = Search(SearchSettings(budget_s=3600), Objective(), FakeBench({"i1": 99.0})).run(kept, dims, make)
    assert result.best == "i1"
    refused = [p for p in result.pruned if p.id == "i1-kv500"]
    assert refused and "GiB" in refused[0].reason


def test_resume_replays_recorded_runs_and_continues_with_the_same_decisions():
    kept, _ = layouts(MACHINE, BASE)
    speeds = {"i4-t2": 50.0, "i2": 30.0}
    full = FakeBench(speeds)
    whole = Search(SearchSettings(budget_s=3600), Objective(), full).run(kept, no_tweaks, make)
    interrupted_after = 5
    recorded = {(o.candidate_id, o.stage): o for o in whole.outcomes[:interrupted_after]}
    rest = FakeBench(speeds)
    resumed = Search(SearchSettings(budget_s=3600), Objective(), rest, replay=recorded).run(kept, no_tweaks, make)
    assert len(rest.calls) == len(full.calls) - interrupted_after
    assert rest.calls == full.calls[interrupted_after:]
    assert resumed.best == whole.best and resumed.spent_s == pytest.approx(whole.spent_s)


def test_parse_duration_and_slo_give_one_clear_error():
    assert parse_duration("30m") == 1800 and parse_duration("200ms") == pytest.approx(0.2) and parse_duration("45") == 45
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration("soon")
    slos = parse_slo("ttft_p99=2s,itl_p99=200ms")
    assert [(s.key, s.limit_s) for s in slos] == [("ttft_p99", 2.0), ("itl_p99", pytest.approx(0.2))]
    with pytest.raises(ValueError, match="'ttft_p77' is not a metric; use one of ttft_mean, ttft_p50"):
        parse_slo("ttft_p77=1s")
    with pytest.raises(ValueError, match="is not KEY=LIMIT"):
        parse_slo("ttft_p99")


def test_lost_requests_disqualify_like_a_missed_slo():
    objective = Objective()
    assert objective.violations([level(10.0, errors=2)]) == ["c8: 2 request(s) failed"]
    assert objective.rank_key([level(10.0)]) < objective.rank_key([level(99.0, errors=1)])
