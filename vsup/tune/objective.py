"""What "best" means (pure): the objective's score, the SLO limits, and parsing both from text.

- throughput: the geometric mean over the load levels of output tokens/s (each level counts the
  same, whatever its absolute numbers); higher is better.
- latency: the geometric mean over the levels of the median time to first token; lower is better.
A candidate that misses an SLO limit at any level, or lost requests, ranks after every candidate
that does not, whatever its score.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from vsup.tune.metrics import LATENCY_METRICS, PERCENTILES, LevelMetrics

OBJECTIVES = ("throughput", "latency")
STATS = ("mean", *(f"p{p}" for p in PERCENTILES))
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|min|m|h)?\s*$")


def parse_duration(text: str, default_unit: str = "s") -> float:
    """'30m', '1h', '90s', '200ms', '45' (default unit) -> seconds; ValueError on anything else."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 30m, 1h, 200ms)")
    return float(match.group(1)) * _UNITS[match.group(2) or default_unit]


@dataclass(frozen=True)
class Slo:
    metric: str  # ttft, tpot, itl, e2el
    stat: str  # mean, p50, p90, p99
    limit_s: float

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}"

    def __str__(self) -> str:
        return f"{self.key}≤{format_seconds(self.limit_s)}"


def parse_slo(text: str | None) -> tuple[Slo, ...]:
    """'ttft_p99=2s,itl_p99=200ms' -> limits; ValueError naming the bad part and what would work."""
    if not text:
        return ()
    limits = []
    known = [f"{m}_{s}" for m in LATENCY_METRICS for s in STATS]
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq:
            raise ValueError(f"{part.strip()!r} is not KEY=LIMIT (e.g. ttft_p99=2s)")
        metric, _, stat = key.strip().partition("_")
        if f"{metric}_{stat}" not in known:
            raise ValueError(f"{key.strip()!r} is not a metric; use one of {', '.join(known)}")
        limit = parse_duration(value, default_unit="s")
        if limit <= 0:
            raise ValueError(f"{key.strip()}={value}: the limit must be positive")
        limits.append(Slo(metric, stat, limit))
    return tuple(limits)


def format_seconds(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _geomean(values: Sequence[float]) -> float:
    if not values or any(not v > 0 or not math.isfinite(v) for v in values):
        return 0.0 if values and all(math.isfinite(v) for v in values) else float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass(frozen=True)
class Objective:
    kind: str = "throughput"
    slos: tuple[Slo, ...] = ()

    def value(self, levels: Sequence[LevelMetrics]) -> float:
        """The objective's own figure: tokens/s (throughput) or seconds of TTFT p50 (latency)."""
        if self.kind == "throughput":
            return _geomean([lv.output_throughput for lv in levels])
        return _geomean([lv.get("ttft", "p50") for lv in levels])

    def score(self, levels: Sequence[LevelMetrics]) -> float:
        """Higher is better; -inf when nothing was measured."""
        value = self.value(levels)
        if not levels or not math.isfinite(value):
            return -math.inf
        if self.kind == "throughput":
            return value
        return -value if value > 0 else -math.inf

    def violations(self, levels: Sequence[LevelMetrics]) -> list[str]:
        """Why a measurement does not qualify: SLO limits missed, requests lost."""
        found = []
        for lv in levels:
            if lv.errors:
                found.append(f"{lv.level}: {lv.errors} request(s) failed")
            for slo in self.slos:
                got = lv.get(slo.metric, slo.stat)
                if not got <= slo.limit_s:
                    found.append(f"{lv.level}: {slo.key} {format_seconds(got)} > {format_seconds(slo.limit_s)}")
        return found

    def rank_key(self, levels: Sequence[LevelMetrics]) -> tuple[int, float]:
        """Sort ascending: qualifying first, then the best score."""
        return (1 if self.violations(levels) else 0, -self.score(levels))
