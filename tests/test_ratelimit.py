"""ratelimit.py: token buckets on a virtual clock, OpenAI's headers, the token estimate."""

from __future__ import annotations

import math

import pytest

from vsup.proxy.ratelimit import Charge, KeyLimits, TokenBucket, duration, estimate_tokens


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
    chat = "/v1/chat/completions"
    assert estimate_tokens(chat, {"max_tokens": 50}, body, 1000) == 150
    assert estimate_tokens(chat, {"max_completion_tokens": 20}, body, 1000) == 120
    assert estimate_tokens("/v1/completions", {}, body, 1000) == 116  # vLLM's default of 16
    assert estimate_tokens("/v1/embeddings", {"max_tokens": 50}, body, 1000) == 100  # pooling generates nothing
    # as vLLM reads them (pydantic's lax mode): the larger of the two, coerced, times n
    assert estimate_tokens(chat, {"max_tokens": 1, "max_completion_tokens": 5000}, 0, 1000) == 5000
    assert estimate_tokens(chat, {"max_tokens": "5000"}, 0, 1000) == 5000
    assert estimate_tokens(chat, {"max_tokens": 5000.0}, 0, 1000) == 5000
    assert estimate_tokens(chat, {"max_tokens": True}, 0, 1000) == 1  # pydantic's int(True)
    assert estimate_tokens(chat, {"max_tokens": 200, "n": 20}, 0, 1000) == 4000
    assert estimate_tokens(chat, {"max_tokens": 200, "n": "20"}, 0, 1000) == 4000
    assert estimate_tokens("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 10, "n": 2}, 0, 1000) == 60
    assert estimate_tokens("/v1/responses", {"max_output_tokens": 30}, body, 1000) == 130
    # no bound (vLLM: up to max_model_len - the prompt), or one vLLM refuses: the unbounded reservation
    assert estimate_tokens(chat, {}, body, 1000) == 1000
    assert estimate_tokens(chat, {"max_tokens": 5000.5}, body, 1000) == 1000
    assert estimate_tokens(chat, {"max_tokens": 10, "n": "many"}, body, 1000) == 1000
    assert estimate_tokens("/v1/responses", {}, body, 1000) == 1000
    assert estimate_tokens(chat, None, body, 1000) == 1000
    assert estimate_tokens(chat, {}, 8000, 1000) == 2000  # never less than the prompt


def test_a_charge_is_settled_once_by_the_usage_or_given_back_when_nothing_was_generated():
    limits = KeyLimits(requests_per_minute=None, tokens_per_minute=1000, now=0.0)
    assert limits.take(600, 0.0) == 0.0
    charge = Charge(limits, 600, 100)
    charge.settle(150, False, 0.0)  # the usage: 150 tokens in all
    assert limits.tokens.level == 850  # type: ignore[union-attr]
    charge.settle(None, True, 0.0)  # once only
    assert limits.tokens.level == 850  # type: ignore[union-attr]
    assert limits.take(600, 0.0) == 0.0
    Charge(limits, 600, 100).settle(None, True, 0.0)  # refused before generating: the prompt estimate stays charged
    assert limits.tokens.level == 750  # type: ignore[union-attr]
    assert limits.take(600, 0.0) == 0.0
    Charge(limits, 600, 100).settle(None, False, 0.0)  # cut off: what was generated is unknown, all stays charged
    assert limits.tokens.level == 150  # type: ignore[union-attr]
    assert limits.take(100, 0.0) == 0.0
    Charge(limits, 100, 10).settle(400, False, 0.0)  # more than reserved: the bucket goes below zero
    assert limits.tokens.level == -250  # type: ignore[union-attr]
    Charge(limits, 10, 1).settle(0, False, 120.0)  # two minutes on: paid off and full, never above
    assert limits.tokens.level == 1000  # type: ignore[union-attr]
