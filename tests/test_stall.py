"""proxy/stall.py: when an instance counts as hung, from its requests in flight alone."""

from __future__ import annotations

from dataclasses import dataclass

from vsup.proxy.stall import DEFAULT_SECONDS_PER_BYTE, PREFILL_MARGIN, PrefillRates, stalled


@dataclass
class Req:
    backend: str | None
    last: float
    size: int = 100
    first_data_at: float | None = None


def model(name: str) -> str:
    return "m"


def test_an_instance_is_stalled_only_when_every_request_is_silent_past_its_allowance():
    rates = PrefillRates()
    old = Req("a", last=0.0)
    assert stalled([old], 60.0, 60.0, rates, model) == {}  # 60 s + 100 bytes' prefill not yet over
    assert stalled([old], 63.0, 60.0, rates, model) == {"a": [old]}
    fresh = Req("a", last=50.0, first_data_at=40.0)  # streaming: its last byte 13 s ago
    assert stalled([old, fresh], 63.0, 60.0, rates, model) == {}
    assert stalled([fresh, old], 63.0, 60.0, rates, model) == {}  # order does not matter
    other = Req("b", last=0.0, first_data_at=0.0)
    assert stalled([old, other, Req(None, last=0.0)], 63.0, 60.0, rates, model) == {"a": [old], "b": [other]}


def test_a_long_prompt_gets_its_prefill_time_at_the_slowest_rate_seen():
    rates = PrefillRates()
    long = Req("a", last=0.0, size=400_000)
    assert rates.allowance("m", 400_000) == 400_000 * DEFAULT_SECONDS_PER_BYTE  # nothing measured yet
    assert stalled([long], 60.0 + 9_999.0, 60.0, rates, model) == {}
    rates.measured("m", 2.0, 100_000)  # 20 µs a byte
    assert rates.allowance("m", 400_000) == PREFILL_MARGIN * 2.0 / 100_000 * 400_000  # 32 s
    assert stalled([long], 60.0 + 31.0, 60.0, rates, model) == {}
    assert stalled([long], 60.0 + 33.0, 60.0, rates, model) == {"a": [long]}
    rates.measured("m", 0.1, 100_000)  # a faster one does not undo the slowest at once
    assert rates.allowance("m", 400_000) > PREFILL_MARGIN * 0.1 / 100_000 * 400_000 * 10
