"""The search (pure: the measuring is injected, so tests drive it with made-up figures and no clock).

1. screen: every layout, one short run each;
2. rungs of successive halving: the better half (by the objective) runs again, η times longer,
   until two are left and one of them wins;
3. tweaks on the winning layout, one setting at a time (LD_PRELOAD, --max-num-seqs,
   --max-num-batched-tokens, KV cache): a value is kept when it beats the best so far by more
   than `min_gain`, and the next setting is tried on top of it.

The budget is wall-clock seconds for all of it, start-ups included. Before each stage the run
length is planned again from what is left: each run costs its start-up, warm-up and stop (the
mean measured so far, `overhead_guess_s` before the first) plus its load time; the run length is
what lets every remaining run fit, kept between min_duration_s and max_duration_s. A run that would
overrun the budget is not started (except the very first, which tells what a start-up costs): it
is reported as skipped.

Resume: outcomes already recorded (same candidate, same stage) are replayed instead of measured,
with their recorded cost, so the decisions and the budget come out as they would have.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vsup.tune.candidates import Candidate, Planned, Pruned
from vsup.tune.metrics import LevelMetrics
from vsup.tune.objective import Objective

SCREEN, TWEAK = "screen", "tweak"


@dataclass(frozen=True)
class Trial:
    candidate: Planned
    stage: str  # screen, rung1, rung2, …, tweak
    duration_s: float  # load time per level

    @property
    def key(self) -> tuple[str, str]:
        return (self.candidate.id, self.stage)


@dataclass(frozen=True)
class Outcome:
    candidate_id: str
    stage: str
    duration_s: float
    ok: bool
    levels: tuple[LevelMetrics, ...] = ()
    error: str | None = None
    wall_s: float = 0.0  # everything: start, warm-up, load, stop
    load_s: float = 0.0  # of which under load
    extra: Mapping[str, Any] = field(default_factory=dict)  # roofline figures etc., for the report


@dataclass(frozen=True)
class Skipped:
    candidate_id: str
    stage: str
    reason: str


@dataclass(frozen=True)
class SearchSettings:
    budget_s: float
    levels: int = 1  # load levels per run (each runs duration_s)
    min_duration_s: float = 10.0
    max_duration_s: float = 300.0
    eta: int = 2
    overhead_guess_s: float = 60.0
    min_gain: float = 0.05  # a tweak must win by more than run-to-run noise to become a setting
    expected_tweaks: int = 2  # tweak runs to keep budget for before the winner (and so its tweaks) is known


@dataclass
class SearchResult:
    outcomes: list[Outcome]
    pruned: list[Pruned]
    skipped: list[Skipped]
    best: str | None  # candidate id
    ranking: list[str]  # candidate ids with a successful run, best first
    spent_s: float

    def latest(self, candidate_id: str) -> Outcome | None:
        """The longest successful run of a candidate (its last one)."""
        runs = [o for o in self.outcomes if o.candidate_id == candidate_id and o.ok]
        return runs[-1] if runs else None

    def ranked(self, candidate_id: str) -> Outcome:
        """The latest run of a candidate in `ranking` (each has a successful one)."""
        found = self.latest(candidate_id)
        if found is None:
            raise KeyError(f"{candidate_id}: no successful run")
        return found


Measure = Callable[[Trial], Outcome]
TweakDims = Callable[[Planned], list[tuple[str, list]]]
Make = Callable[[Candidate], "Planned | Pruned"]
Listener = Callable[[str, Any], None]


def rung_sizes(n: int, eta: int) -> list[int]:
    """Candidates per stage: n, then ⌈n/η⌉, … down to the last stage with at least two."""
    sizes = [n]
    while sizes[-1] > 2:
        sizes.append(math.ceil(sizes[-1] / eta))
    return sizes


class Search:
    def __init__(self, settings: SearchSettings, objective: Objective, measure: Measure, *,
                 replay: Mapping[tuple[str, str], Outcome] | None = None, listener: Listener | None = None) -> None:
        self.s = settings
        self.objective = objective
        self.measure = measure
        self.replay = dict(replay or {})
        self.listener = listener or (lambda kind, data: None)
        self.outcomes: list[Outcome] = []
        self.skipped: list[Skipped] = []
        self.pruned: list[Pruned] = []
        self.spent = 0.0
        self.planned_total = settings.budget_s  # updated at every stage: spent + what is planned

    # ---- cost model ----------------------------------------------------------------------------

    def overhead(self) -> float:
        costs = [o.wall_s - o.load_s for o in self.outcomes if o.wall_s > 0]
        return sum(costs) / len(costs) if costs else self.s.overhead_guess_s

    def load_factor(self) -> float:
        """Load time over planned load time (warm-up, the last requests draining): ≥ 1."""
        ratios = [o.load_s / (o.duration_s * self.s.levels) for o in self.outcomes if o.ok and o.duration_s > 0]
        return max(1.0, sum(ratios) / len(ratios)) if ratios else 1.2

    def cost(self, duration: float) -> float:
        return self.overhead() + self.s.levels * duration * self.load_factor()

    def plan_duration(self, counts: Sequence[int], tweaks: int) -> float:
        """The run length for the current stage so that `counts[j]` runs at η^j times it, then
        `tweaks` runs at the last length, fit in what is left of the budget."""
        left = self.s.budget_s - self.spent
        runs = sum(counts) + tweaks
        units = sum(c * self.s.eta**j for j, c in enumerate(counts)) + tweaks * self.s.eta ** (len(counts) - 1)
        per_unit = self.s.levels * self.load_factor()
        duration = (left - runs * self.overhead()) / (units * per_unit) if units else self.s.max_duration_s
        duration = min(max(duration, self.s.min_duration_s), self.s.max_duration_s)
        self.planned_total = self.spent + sum(self.cost(min(duration * self.s.eta**j, self.s.max_duration_s)) * c
                                              for j, c in enumerate(counts))
        self.planned_total = min(self.s.budget_s, self.planned_total + tweaks * self.cost(duration))
        return duration

    # ---- running -------------------------------------------------------------------------------

    def run_trial(self, trial: Trial) -> Outcome | None:
        recorded = self.replay.get(trial.key)
        if recorded is None:
            # the first run always happens: until then the cost of a start-up is a guess
            if self.outcomes and self.spent + self.cost(trial.duration_s) > self.s.budget_s:
                skip = Skipped(trial.candidate.id, trial.stage, f"budget: {self.s.budget_s - self.spent:.0f}s left, "
                               f"a {trial.duration_s:.0f}s run costs about {self.cost(trial.duration_s):.0f}s")
                self.skipped.append(skip)
                self.listener("skipped", skip)
                return None
            self.listener("start", trial)
            outcome = self.measure(trial)
            replayed = False
        else:
            outcome, replayed = recorded, True
        self.outcomes.append(outcome)
        self.spent += outcome.wall_s
        self.listener("replayed" if replayed else "outcome", outcome)
        return outcome

    def _rank(self, outcomes: Iterable[Outcome]) -> list[Outcome]:
        return sorted((o for o in outcomes if o.ok), key=lambda o: self.objective.rank_key(o.levels))

    def run(self, layouts: Sequence[Planned], tweak_dims: TweakDims, make: Make, pruned: Sequence[Pruned] = ()) -> SearchResult:
        """`tweak_dims(best layout)`: [(Candidate field, values)] to try in order; `make(candidate)`:
        its plan, or why the planner refuses it."""
        self.pruned = list(pruned)
        sizes = rung_sizes(len(layouts), self.s.eta) if layouts else []
        alive: list[Planned] = list(layouts)
        best_outcome: Outcome | None = None
        for depth, size in enumerate(sizes):
            if depth > 0:
                ranked = self._rank(o for o in self.outcomes if o.stage == _stage(depth - 1))
                by_id = {p.id: p for p in alive}
                alive = [by_id[o.candidate_id] for o in ranked[:size] if o.candidate_id in by_id]
                if len(alive) < 2:
                    break  # nothing left to compare (failures, budget)
            duration = self.plan_duration([len(alive), *sizes[depth + 1:]], self.s.expected_tweaks)
            results = [self.run_trial(Trial(p, _stage(depth), duration)) for p in alive]
            ranked = self._rank(o for o in results if o is not None)
            if ranked:
                best_outcome = ranked[0]
        if best_outcome is None:
            return self._result(None)

        # tweaks: one setting at a time, each on top of the best so far
        best = {p.id: p for p in layouts}[best_outcome.candidate_id]
        dims = tweak_dims(best)
        pending = sum(len(values) for _, values in dims)
        duration = best_outcome.duration_s
        if pending:
            duration = max(self.s.min_duration_s, min(duration, self.plan_duration([0], pending)))
        for name, values in dims:
            round_best, round_pick = best_outcome, best
            for value in values:
                option = make(replace(best.candidate, **{name: value}))
                if isinstance(option, Pruned):
                    self.pruned.append(option)
                    self.listener("pruned", option)
                    continue
                outcome = self.run_trial(Trial(option, TWEAK, duration))
                if outcome is not None and outcome.ok and self._beats(outcome, round_best):
                    round_best, round_pick = outcome, option
            best, best_outcome = round_pick, round_best
        return self._result(best_outcome.candidate_id)

    def _beats(self, challenger: Outcome, holder: Outcome) -> bool:
        c_key = self.objective.rank_key(challenger.levels)
        h_key = self.objective.rank_key(holder.levels)
        if c_key[0] != h_key[0]:
            return c_key[0] < h_key[0]
        c_score, h_score = -c_key[1], -h_key[1]
        return c_score > h_score + abs(h_score) * self.s.min_gain

    def _result(self, best: str | None) -> SearchResult:
        # tweaks ran at the length of the last rung: they compete with its layouts
        last_rung = max((_depth(o.stage) for o in self.outcomes if o.stage != TWEAK), default=0)
        depth: dict[str, int] = {}
        for o in self.outcomes:
            if o.ok:
                level = last_rung if o.stage == TWEAK else _depth(o.stage)
                depth[o.candidate_id] = max(depth.get(o.candidate_id, 0), level)
        latest = {}
        for o in self.outcomes:
            if o.ok:
                latest[o.candidate_id] = o
        others = sorted((cid for cid in latest if cid != best),
                        key=lambda cid: (-depth[cid], self.objective.rank_key(latest[cid].levels)))
        ranking = ([best] if best in latest else []) + others
        return SearchResult(self.outcomes, self.pruned, self.skipped, best, ranking, self.spent)


def _stage(depth: int) -> str:
    return SCREEN if depth == 0 else f"rung{depth}"


def _depth(stage: str) -> int:
    return 0 if stage == SCREEN else int(stage[4:])
