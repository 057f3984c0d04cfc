"""The gate a request passes before an instance is chosen: its priority, its key's rate limits,
then admission (admission.py) when its model's instances are full. Built only when some key
asks for it (proxy.max_in_flight_per_instance, api_keys, priority_header): otherwise the
forwarder has no gate and its path is as it was.

A request's priority: its named key's (proxy.api_keys[].priority; 0 for proxy.api_key or no
key), or the value of proxy.priority_header, which must be one of priority_header_values (else
400) and may not lift a key above its own priority (it is lowered to it): a client picks among
the priorities it was given, never a higher one. proxy.api_key is a key of priority 0 like any
other; only a proxy without any key (no auth: every client is alike) takes the header's value.

Answers in OpenAI's error shape: 429 rate_limit_exceeded (a key over its limit: Retry-After is
the time until its buckets have room, with OpenAI's x-ratelimit-* headers), 429 queue_full (the
model's queue at proxy.queue_max), 503 queue_timeout (waited proxy.queue_timeout). A key with
limits has the x-ratelimit-* headers on its served answers too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from vsup.config.schema import ProxyConfig
from vsup.proxy import errors, usage
from vsup.proxy.admission import EXPIRED, FULL, SHED, Admission, Limit
from vsup.proxy.backends import Backend
from vsup.proxy.messages import Response
from vsup.proxy.ratelimit import Charge, KeyLimits, estimate_tokens, prompt_estimate

# Seconds a request waited for a slot.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Retry-After of a full queue or an ended wait: a slot frees within a request's time, unknown here.
BUSY_RETRY_AFTER = errors.RETRY_AFTER_SECONDS


def limit_of(config: ProxyConfig) -> Limit | None:
    """A model's Limit from its (resolved: vsup/config/admission.py) proxy section; None: no queue."""
    limit = config.max_in_flight_per_instance
    if not isinstance(limit, int) or limit <= 0:
        return None  # max_num_seqs unresolved (a standalone proxy without a vLLM config) counts as none
    return Limit(limit, min(config.reserved_slots, limit - 1), config.queue_max, config.queue_timeout)


def needed(config: ProxyConfig, models: Mapping[str, ProxyConfig] | None) -> bool:
    return bool(config.api_keys or config.priority_header or limit_of(config)
                or any(limit_of(c) for c in (models or {}).values()))


def refit(gate: Gate | None, config: ProxyConfig, models: Mapping[str, ProxyConfig] | None, in_flight: dict[str, int],
          clock: Callable[[], float], families: list) -> Gate | None:
    """The gate for these settings (start, reload): built when some key asks for one, reconfigured
    while one does, and gone when none does any more, after letting its waiters go to the
    instances (no limit any more). `families`: the metrics' list its figures join."""
    if needed(config, models):
        if gate is None:
            gate = Gate(in_flight, clock)
            families.append(gate.families)
        gate.configure(config, models)
        return gate
    if gate is not None:
        gate.configure(config, {})  # no limits: every waiter is granted a slot now
        families.remove(gate.families)
    return None


class _Key:
    __slots__ = ("priority", "limits", "spec")

    def __init__(self, priority: int, limits: KeyLimits | None, spec: tuple) -> None:
        self.priority, self.limits, self.spec = priority, limits, spec


class _Waits:
    __slots__ = ("counts", "total", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.total = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        from bisect import bisect_left

        self.counts[bisect_left(WAIT_BUCKETS, seconds)] += 1
        self.total += 1
        self.sum += seconds

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip(WAIT_BUCKETS, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.total))
        return out


class Gate:
    def __init__(self, in_flight: dict[str, int], clock: Callable[[], float]) -> None:
        self.clock = clock
        self.admission = Admission(in_flight, self._backend_limit)
        self.keys: dict[str, _Key] = {}
        self.header: str | None = None
        self.authenticated = False  # some key is set (server.py): the header may then only lower a priority
        self.values: dict[str, int] = {}
        self.limits: dict[str, Limit | None] = {}  # model -> its Limit
        self.default: Limit | None = None  # a model without settings of its own; a standalone proxy's upstreams
        self.waits: dict[tuple[str, int], _Waits] = {}
        self.refused: dict[tuple[str, int, str], int] = {}  # (queue, priority, reason) -> requests
        self.limited: dict[tuple[str, str], int] = {}  # (key, requests|tokens) -> 429s
        self.context: dict[str, int] = {}  # backend name -> its max_model_len, from its /v1/models (server.py)

    def learn_context(self, backend: str, entries: list[dict]) -> None:
        """An instance's max_model_len, as its /v1/models lists it (the largest of its entries)."""
        lengths = [e["max_model_len"] for e in entries if type(e.get("max_model_len")) is int and e["max_model_len"] > 0]
        if lengths:
            self.context[backend] = max(lengths)
        else:
            self.context.pop(backend, None)

    def _unbounded(self, capacity: int, path: str, document: Mapping[str, Any] | None,
                   backends: tuple[Backend, ...]) -> int:
        """What a request without a bound reserves: the whole bucket, or less when every instance
        it may go to is known to stop sooner (n sequences of at most max_model_len tokens each,
        prompt included)."""
        context = self.context
        if not backends or any(b.name not in context for b in backends):
            return capacity
        sequences = usage.sequences(path, document)
        if sequences is None:
            return capacity
        return min(capacity, sequences * max(context[b.name] for b in backends))

    def configure(self, config: ProxyConfig, models: Mapping[str, ProxyConfig] | None) -> None:
        """Settings (start, reload): a key whose limits are unchanged keeps its buckets' levels."""
        now = self.clock()
        keys = {}
        for entry in config.api_keys:
            spec = (entry.requests_per_minute, entry.tokens_per_minute)
            old = self.keys.get(entry.name)
            limits = old.limits if old is not None and old.spec == spec else (
                KeyLimits(*spec, now) if any(spec) else None)
            keys[entry.name] = _Key(entry.priority, limits, spec)
        self.keys = keys
        self.header = config.priority_header.lower() if config.priority_header else None
        self.values = dict(config.priority_header_values)
        self.default = limit_of(config)
        self.limits = {name: limit_of(c) for name, c in (models or {}).items()}
        priorities = [k.priority for k in keys.values()] + list(self.values.values())
        self.admission.top = max(priorities, default=0)
        for queue, waiters in self.admission.queues.items():  # the waiting ones under the new bound and deadline too
            new = self._queue_limit(queue, waiters[0].ready())
            if new is not None:
                for waiter in waiters:
                    waiter.limit = new
        self.admission.poke()  # (a model without a limit now has room everywhere: its waiters go)

    def _backend_limit(self, backend: Backend) -> Limit | None:
        return self.limits.get(backend.model, self.default) if backend.model else self.default

    def _queue_limit(self, queue: str, ready: tuple[Backend, ...]) -> Limit | None:
        if queue in self.limits:
            return self.limits[queue]
        return self._backend_limit(ready[0]) if ready else self.default  # an adapter's name: its instances' model

    # -- per request
    def priority(self, client: str, headers: Mapping[str, str]) -> int | Response:
        key = self.keys.get(client)
        own = key.priority if key is not None else 0
        if self.header is None:
            return own
        value = headers.get(self.header)
        if value is None:
            return own
        asked = self.values.get(value.strip())
        if asked is None:
            allowed = ", ".join(repr(v) for v in self.values)
            return errors.bad_request(f"the header {self.header} may be one of {allowed}, not {value[:40]!r} "
                                      "(proxy.priority_header_values)", self.header)
        return min(asked, own) if key is not None or self.authenticated else asked

    def rate(self, client: str, path: str, document: Mapping[str, Any] | None, size: int,
             backends: tuple[Backend, ...] = ()) -> tuple[list[tuple[bytes, bytes]], Charge | None] | Response:
        """The x-ratelimit-* headers for the answer and the charge its answer settles (None: the
        key has no token limit), or the 429 of a key over its limit."""
        key = self.keys.get(client)
        if key is None or key.limits is None:
            return [], None
        limits = key.limits
        # a request without a bound reserves the whole bucket, or what its instances' max_model_len allows (ratelimit.py)
        unbounded = self._unbounded(math.ceil(limits.tokens.capacity), path, document, backends) if limits.tokens is not None else 0
        tokens = estimate_tokens(path, document, size, unbounded)
        wait = limits.take(tokens, self.clock())
        headers = limits.headers()
        if wait == 0.0:
            charge = Charge(limits, tokens, prompt_estimate(size)) if limits.tokens is not None else None
            return [(name.encode(), value.encode()) for name, value in headers], charge
        kind = "tokens" if limits.tokens is not None and limits.tokens.wait(tokens) > 0 else "requests"
        self.limited[(client, kind)] = self.limited.get((client, kind), 0) + 1
        bucket = limits.tokens if kind == "tokens" else limits.requests
        assert bucket is not None
        per = f"{kind} per minute: limit {bucket.capacity:g}, remaining {max(0, math.floor(bucket.level))}, requested {tokens if kind == 'tokens' else 1}"
        if math.isinf(wait):
            return errors.error_response(
                429, f"the key {client!r} can never send this request: it may use {tokens} tokens, more than its "
                f"{per} (proxy.api_keys: tokens_per_minute; a request is charged max_tokens or max_completion_tokens "
                "times n, plus body bytes / 4, until its answer's usage settles it)",
                kind, "rate_limit_exceeded", headers=dict(headers))
        retry = max(1, math.ceil(wait))
        return errors.error_response(
            429, f"rate limit of the key {client!r} reached on {per}; try again in {wait:.2f} s",
            kind, "rate_limit_exceeded", headers={**dict(headers), "Retry-After": str(retry)})

    async def admit(self, queue: str, ready: Callable[[], tuple[Backend, ...]], priority: int,
                    key: str = "") -> tuple[Backend, ...] | Response | None:
        """The instances with room (the forwarder picks among them), None (no queue for this model:
        route as without a gate; or nothing ready: the forwarder's own 503), or the refusal."""
        backends = ready()
        limit = self._queue_limit(queue, backends)
        if limit is None:
            return None
        started, enqueued = self.clock(), self.admission.enqueued
        outcome = await self.admission.admit(queue, ready, priority, started, limit, key)
        if isinstance(outcome, tuple):
            if not outcome:
                return None
            if self.admission.enqueued != enqueued:  # it was queued (had it not, nothing ran in between)
                self._waited(queue, priority, self.clock() - started)
            return outcome
        self.refused[(queue, priority, outcome)] = self.refused.get((queue, priority, outcome), 0) + 1
        shown = repr(queue) if queue else "the"
        limit = self._queue_limit(queue, ready()) or limit  # as a reload may have left it
        if outcome == EXPIRED:
            self._waited(queue, priority, self.clock() - started)
            return errors.error_response(
                503, f"every instance of {shown} model was busy for {limit.timeout:g} s (proxy.queue_timeout) while this "
                "request waited for one; retry shortly", "service_unavailable", "queue_timeout",
                headers={"Retry-After": str(BUSY_RETRY_AFTER)})
        why = ("a request of a higher priority, or of a key holding fewer of its places, took its place in the queue"
               if outcome == SHED else
               f"{limit.queue_max} requests already wait for it (proxy.queue_max)")
        return errors.error_response(
            429, f"every instance of {shown} model is busy and {why}; retry shortly", "overloaded", FULL,
            headers={"Retry-After": str(BUSY_RETRY_AFTER)})

    def _waited(self, queue: str, priority: int, seconds: float) -> None:
        waits = self.waits.get((queue, priority))
        if waits is None:
            waits = self.waits[(queue, priority)] = _Waits()
        waits.observe(seconds)

    # -- figures
    def status(self) -> dict[str, dict[str, Any]]:
        """Per queue (model): waiting by priority, the oldest wait, the mean wait so far (vsup status)."""
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for (queue, priority), count in self.admission.lengths().items():
            entry = out.setdefault(queue, {"waiting": 0, "by_priority": {}})
            entry["waiting"] += count
            entry["by_priority"][str(priority)] = count
        for queue, oldest in self.admission.oldest(now).items():
            out[queue]["oldest_wait_s"] = round(oldest, 3)
        for (queue, _priority), waits in self.waits.items():
            entry = out.setdefault(queue, {"waiting": 0, "by_priority": {}})
            entry["waited"] = entry.get("waited", 0) + waits.total
            entry["wait_sum_s"] = round(entry.get("wait_sum_s", 0.0) + waits.sum, 3)
        return out

    def families(self) -> Iterator[Any]:
        length = GaugeMetricFamily("vsup_proxy_queue_length", "Requests waiting in the proxy for an instance of their model, by priority",
                                   labels=["model", "priority"])
        for (queue, priority), count in self.admission.lengths().items():
            length.add_metric([queue, str(priority)], count)
        yield length
        oldest = GaugeMetricFamily("vsup_proxy_queue_oldest_wait_seconds", "How long the longest-waiting request of each model has waited",
                                   labels=["model"])
        for queue, seconds in self.admission.oldest(self.clock()).items():
            oldest.add_metric([queue], seconds)
        yield oldest
        waits = HistogramMetricFamily("vsup_proxy_queue_wait_seconds", "Time requests waited in the proxy before an instance took them "
                                      "(those that waited), by model and priority", labels=["model", "priority"])
        for (queue, priority), histogram in self.waits.items():
            waits.add_metric([queue, str(priority)], histogram.buckets(), histogram.sum)
        yield waits
        refused = CounterMetricFamily("vsup_proxy_queue_refusals", "Requests the admission queue refused: queue_full, shed (a higher "
                                      "priority took the place), queue_timeout", labels=["model", "priority", "reason"])
        for (queue, priority, reason), count in self.refused.items():
            refused.add_metric([queue, str(priority), reason], count)
        yield refused
        limited = CounterMetricFamily("vsup_proxy_rate_limited", "Requests refused (429) because their key was over its rate limit",
                                      labels=["key", "limit"])
        for (key, kind), count in self.limited.items():
            limited.add_metric([key, kind], count)
        yield limited
