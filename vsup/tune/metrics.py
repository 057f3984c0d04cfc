"""What one load level measured, with `vllm bench serve`'s definitions (pure).

Per request the load generator records when it was sent, when each content chunk arrived and how
many tokens the server says it generated (stream usage). From those, as vLLM's benchmark does:
- TTFT: first content chunk - send time;
- ITL: the gaps between consecutive content chunks, over all requests;
- TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one token;
- E2EL: last chunk - send time;
- output tokens/s and requests/s: totals of the successful requests / benchmark duration (first
  send to last completion); errors are the requests that failed.
Percentiles are numpy's (linear interpolation), as in `vllm bench serve`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds, one monotonic clock)."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with generated text
    output_tokens: int = 0  # from the stream's usage; else the chunk count
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)


@dataclass(frozen=True)
class LevelMetrics:
    """One level of load: closed loop at `concurrency`, or open loop at `request_rate`."""

    level: str  # "c8" (8 in flight) or "r2.5" (2.5 requests/s)
    duration_s: float
    completed: int
    errors: int
    output_tokens: int
    input_tokens: int
    output_throughput: float  # tokens/s
    request_throughput: float  # requests/s
    latency: dict[str, dict[str, float]]  # metric -> {"mean", "p50", "p90", "p99"} in seconds
    error_samples: tuple[str, ...] = ()

    def get(self, metric: str, stat: str) -> float:
        return self.latency.get(metric, {}).get(stat, float("nan"))

    def to_json(self) -> dict[str, Any]:
        return {
            "level": self.level, "duration_s": round(self.duration_s, 4), "completed": self.completed,
            "errors": self.errors, "output_tokens": self.output_tokens, "input_tokens": self.input_tokens,
            "output_throughput": round(self.output_throughput, 4), "request_throughput": round(self.request_throughput, 5),
            "latency": {m: {k: round(v, 6) for k, v in stats.items()} for m, stats in self.latency.items()},
            "error_samples": list(self.error_samples),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LevelMetrics:
        return cls(
            level=data["level"], duration_s=data["duration_s"], completed=data["completed"], errors=data["errors"],
            output_tokens=data["output_tokens"], input_tokens=data.get("input_tokens", 0),
            output_throughput=data["output_throughput"], request_throughput=data["request_throughput"],
            latency={m: dict(stats) for m, stats in data["latency"].items()},
            error_samples=tuple(data.get("error_samples", ())),
        )


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def level_metrics(level: str, records: Sequence[RequestRecord], duration_s: float) -> LevelMetrics:
    ok = [r for r in records if r.ok]
    ttft = [r.chunks[0] - r.sent for r in ok]
    e2el = [r.chunks[-1] - r.sent for r in ok]
    itl = [b - a for r in ok for a, b in pairwise(r.chunks)]
    tpot = [(r.chunks[-1] - r.chunks[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    output = sum(r.output_tokens for r in ok)
    samples = tuple(dict.fromkeys(r.error for r in records if r.error))[:3]
    return LevelMetrics(
        level=level,
        duration_s=duration_s,
        completed=len(ok),
        errors=len(records) - len(ok),
        output_tokens=output,
        input_tokens=sum(r.prompt_tokens for r in ok),
        output_throughput=output / duration_s if duration_s > 0 else 0.0,
        request_throughput=len(ok) / duration_s if duration_s > 0 else 0.0,
        latency={"ttft": _stats(ttft), "tpot": _stats(tpot), "itl": _stats(itl), "e2el": _stats(e2el)},
        error_samples=samples,
    )


def level_name(concurrency: int | None = None, rate: float | None = None) -> str:
    return f"c{concurrency}" if concurrency is not None else f"r{rate:g}"
