"""ratelimit.py: token buckets on a virtual clock, OpenAI's headers, the token estimate."""

from __future__ import annotations

import math

import pytest

from vsup.proxy.ratelimit import KeyLimits, TokenBucket, duration, estimate_tokens


def test_bucket_bursts_a_minute_then_refills_at_its_rate():
    bucket = TokenBucket(60, now=0.0)  # one a second
    for _ in range(60):
        assert bucket.wait(1) == 0
        bucket.level -= 1
    assert bucket.wait(1) == pytest.approx(1.0)
    bucket.refill(0.5)
    assert bucket.wait(1) == pytest.approx(0.5)
    bucket.refill(30.0)
    assert bucket.level == pytest.approx(30.0)
    bucket.refill(1000.0)
    assert bucket.level == 60  # never above a minute's worth
    assert bucket.wait(61) == math.inf


def test_both_buckets_must_have_room_and_a_refusal_takes_nothing():
    limits = KeyLimits(requests_per_minute=2, tokens_per_minute=600, now=0.0)
    assert limits.take(500, 0.0) == 0.0
    wait = limits.take(200, 0.0)  # 100 tokens left: 100 more at 10/s
    assert wait == pytest.approx(10.0)
    assert limits.requests.level == 1  # the refused request took no request either
    assert limits.take(100, 0.0) == 0.0
    assert limits.take(1, 0.0) == pytest.approx(30.0)  # no request left: one every 30 s
    assert limits.take(1, 30.0) == 0.0
    assert limits.take(601, 1e6) == math.inf


def test_headers_as_openai_sends_them():
    limits = KeyLimits(requests_per_minute=60, tokens_per_minute=None, now=0.0)
    limits.take(7, 0.0)
    assert limits.headers() == [("x-ratelimit-limit-requests", "60"), ("x-ratelimit-remaining-requests", "59"),
                                ("x-ratelimit-reset-requests", "1s")]
    assert [duration(s) for s in (0.0201, 0.5, 1, 1.5, 360, 61.25)] == ["21ms", "500ms", "1s", "1.5s", "6m0s", "1m1.25s"]


def test_token_estimate():
    body = 400  # bytes -> 100 tokens
    assert estimate_tokens("/v1/chat/completions", {"max_tokens": 50}, body) == 150
    assert estimate_tokens("/v1/chat/completions", {"max_completion_tokens": 20}, body) == 120
    assert estimate_tokens("/v1/completions", {}, body) == 116  # vLLM's default of 16
    assert estimate_tokens("/v1/embeddings", {"max_tokens": 50}, body) == 100  # pooling generates nothing
    assert estimate_tokens("/v1/chat/completions", {"max_tokens": True}, 0) == 16  # not a number: the default
