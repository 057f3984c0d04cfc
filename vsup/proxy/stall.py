"""Is an instance hung? An instance that answers /health but sends nothing to any request it
holds (a vLLM engine stall: the API server's health route does not see it) would otherwise keep
its share of the traffic, each request waiting out proxy.first_byte_timeout.

An instance counts as stalled when it holds requests and every one of them has been silent past
its allowance: proxy.stall_timeout since its last byte (or since it was sent), plus, for a request
still waiting for its first byte, a prefill allowance — its prompt's bytes at the slowest prefill
rate this instance's model has shown (seconds to first byte per request byte, ×PREFILL_MARGIN),
or DEFAULT_SECONDS_PER_BYTE before it has shown any. One request that streams keeps its instance
counted as alive: an engine that makes progress on anything is not hung.
Pure: the forwarder's watchdog hands it the requests in flight and the time (forward.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

# Before an instance's model has a measured prefill rate: ~4 bytes a token at 10 tokens/s, the
# slow end of a 7B model's prefill on a few CPU cores (docs/proxy.md).
DEFAULT_SECONDS_PER_BYTE = 1 / 40
# The allowance is this many times the slowest rate seen: a long prompt on a busy instance.
PREFILL_MARGIN = 4.0
# Prompts under this many bytes are measured as this many (fixed costs dominate a short prompt).
MIN_MEASURED_BYTES = 1024
# The slowest rate seen decays by this factor per measurement, so one slow outlier does not stay forever.
DECAY = 0.98


class InFlight(Protocol):
    """What the rule reads of a request in flight (the forwarder's Exchange)."""

    last: float  # its last byte from the instance, else when it was sent
    first_data_at: float | None
    backend: str | None
    size: int  # its body's bytes


@dataclass
class PrefillRates:
    """The slowest recent prefill rate per model (seconds to first byte per request byte)."""

    rates: dict[str, float] = field(default_factory=dict)

    def measured(self, model: str, seconds: float, size: int) -> None:
        rate = seconds / max(size, MIN_MEASURED_BYTES)
        self.rates[model] = max(rate, self.rates.get(model, 0.0) * DECAY)

    def allowance(self, model: str, size: int) -> float:
        rate = self.rates.get(model)
        if rate is None:
            return size * DEFAULT_SECONDS_PER_BYTE
        return PREFILL_MARGIN * rate * max(size, MIN_MEASURED_BYTES)


def stalled(requests: Iterable[InFlight], now: float, stall_timeout: float, rates: PrefillRates,
            model_of: Callable[[str], str]) -> dict[str, list[InFlight]]:
    """The instances whose every request in flight is silent past its allowance, with those requests."""
    by_backend: dict[str, list[InFlight]] = {}
    alive: set[str] = set()
    for request in requests:
        name = request.backend
        if name is None or name in alive:
            continue
        allowance = stall_timeout
        if request.first_data_at is None:
            allowance += rates.allowance(model_of(name), request.size)
        if now - request.last < allowance:
            alive.add(name)
            by_backend.pop(name, None)
            continue
        by_backend.setdefault(name, []).append(request)
    return by_backend
