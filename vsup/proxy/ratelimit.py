"""Per-key rate limits: a token bucket for requests and one for tokens (proxy.api_keys).

A bucket holds up to one minute's worth (`per_minute`) and refills continuously at per_minute/60
a second, so a key may burst a minute's quota and then goes at its rate. A request is let through
only when both buckets have room, and takes from both; otherwise it takes nothing and is told how
long until they have (Retry-After). The `x-ratelimit-*` headers are OpenAI's: the limit, what
remains, and the time until the bucket is full again ("1s", "6m0s", "20ms").

What a request costs in tokens is known before it runs only as a bound: the most it may make
vLLM generate, read as vLLM reads the request (usage.py: max_tokens and max_completion_tokens as
pydantic coerces them, times n), plus its body's bytes / 4 for the prompt (about four characters a
token for English text, and the JSON around the prompt is small beside a long one). That much is
reserved when the request is let through; a request without a bound (a chat without max_tokens:
vLLM generates up to max_model_len - the prompt, which the proxy does not know for every instance)
reserves the key's whole bucket, so it waits for a full one and no second one runs beside it
(or less: n times max_model_len, when the gate knows it of every instance it may go to).

The answer settles the charge (`Charge.settle`): with the usage vLLM returned, the bucket is
given back the reservation and charged the prompt and generated tokens instead (more than was
reserved leaves the bucket below zero: the key waits that off); an answer without usage that
shows nothing was generated (vLLM's 4xx, no instance reached, the queue refused) gives back all
but the prompt estimate; a stream or answer cut off (the client left, the instance broke, a
timeout) keeps the whole reservation: what was generated is unknown.

Pure: times are the caller's clock (a virtual one in the unit tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vsup.proxy import usage

BYTES_PER_TOKEN = 4


def prompt_estimate(body_bytes: int) -> int:
    return math.ceil(body_bytes / BYTES_PER_TOKEN)


def estimate_tokens(path: str, document: Mapping[str, Any] | None, body_bytes: int, unbounded: int) -> int:
    """The tokens to reserve: the request's bound (`unbounded` when it has none) and its prompt estimate."""
    completion = usage.requested(path, document)
    prompt = prompt_estimate(body_bytes)
    return max(unbounded, prompt) if completion is usage.UNBOUNDED else completion + prompt


def duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* form: 20ms, 1s, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{text}" if minutes else text


class TokenBucket:
    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute  # starts full
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, amount: float) -> float:
        """Seconds until `amount` fits (0: now; inf: never, it is more than the bucket holds). Refill first."""
        if amount <= self.level:
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate

    def full_in(self) -> float:
        return (self.capacity - self.level) / self.rate


class KeyLimits:
    """The buckets of one key (either may be None: not limited)."""

    def __init__(self, requests_per_minute: float | None, tokens_per_minute: float | None, now: float) -> None:
        self.requests = TokenBucket(requests_per_minute, now) if requests_per_minute else None
        self.tokens = TokenBucket(tokens_per_minute, now) if tokens_per_minute else None

    def take(self, tokens: int, now: float) -> float:
        """0.0: let through (taken from both buckets); else the seconds until it would be (inf: never)."""
        wait = 0.0
        for bucket, amount in ((self.requests, 1), (self.tokens, tokens)):
            if bucket is not None:
                bucket.refill(now)
                wait = max(wait, bucket.wait(amount))
        if wait == 0.0:
            if self.requests is not None:
                self.requests.level -= 1
            if self.tokens is not None:
                self.tokens.level -= tokens
        return wait

    def give_back(self, tokens: int, now: float) -> None:
        """Settle a reservation: `tokens` (negative: more) back into the token bucket, never above full."""
        bucket = self.tokens
        if bucket is not None:
            bucket.refill(now)
            bucket.level = min(bucket.capacity, bucket.level + tokens)

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* headers, as of the last take()."""
        out = []
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out += [(f"x-ratelimit-limit-{kind}", f"{bucket.capacity:g}"),
                        (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(bucket.level)))),
                        (f"x-ratelimit-reset-{kind}", duration(bucket.full_in()))]
        return out


class Charge:
    """One request's reservation, settled once by what its answer shows (module docstring)."""

    __slots__ = ("limits", "reserved", "prompt", "settled", "strip")

    def __init__(self, limits: KeyLimits, reserved: int, prompt: int) -> None:
        self.limits = limits
        self.reserved = reserved
        self.prompt = prompt
        self.settled = False
        self.strip: bool | None = None  # a stream whose usage chunk the proxy asked for: take it out (usage.py)

    def settle(self, used: int | None, generated_nothing: bool, now: float) -> None:
        """`used`: the usage's tokens (prompt and generated); else whether the answer shows that
        nothing was generated (then the prompt estimate stays charged) or not (all stays)."""
        if self.settled:
            return
        self.settled = True
        if used is not None:
            self.limits.give_back(self.reserved - used, now)
        elif generated_nothing:
            self.limits.give_back(self.reserved - self.prompt, now)
