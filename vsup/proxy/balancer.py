"""Which ready instance gets the next request.

Every policy takes the pool's ready tuple (stable order), the requests in flight per instance, a
set of instances already tried for this request (retries go to *another* instance) and the
request's routing key (`key()`: None here; prefix_affinity, in affinity.py, reads the request's
prefix or session); they return None when nothing is left.

least_loaded scores each candidate by the engines' own queue and KV figures with the proxy's own
in-flight counts on top (load.py); prefix_affinity uses that same score as its load term.

Weights (`set_weight`, 1 by default) give an upstream a larger share: standalone `vsup proxy` in
front of other vsups weights each by the instances ready behind it (healthcheck.py), so a host
with 4 ready instances gets twice the requests of one with 2.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any, ClassVar, get_args

from vsup.config.schema import ProxyConfig
from vsup.proxy import load
from vsup.proxy.backends import Backend


class _Rotation:
    """The ready instances not yet tried, starting one further along at each request."""

    name: ClassVar[str]  # the policy's proxy.policy value, set by each policy class
    uses_load: ClassVar[bool] = False  # True: the server hands it a load.LoadProbe (`probe`)

    def __init__(self) -> None:
        self._counter = 0
        self._weights: dict[str, int] = {}  # only weights other than 1
        self._credit: dict[str, int] = {}
        self.decisions: dict[str, int] = {}  # routing decisions by kind (content-aware policies; /metrics)

    def key(self, document: dict | None, headers: Mapping[str, str]) -> Any:
        """What this policy routes a request by, computed once per request: nothing here."""
        return None

    def prefill_bytes(self, size: int) -> int:
        """Of the body (`size` bytes) of the request just chosen for, what the instance likely has
        to prefill (load.Prefill counts it until the first byte): all of it here."""
        return size

    def hold(self, name: str) -> Any:
        """The request just chosen for goes to `name`: what it holds there until `release` (a
        policy that counts its keys in flight per instance; nothing here)."""
        return None

    def release(self, held: Any) -> None:
        """The request that `hold` answered `held` for has ended there."""

    def set_weight(self, name: str, weight: int) -> None:
        if weight < 1:
            raise ValueError(f"weight of {name}: {weight}; must be at least 1 (take it out of rotation instead)")
        if weight == 1:
            self._weights.pop(name, None)
        else:
            self._weights[name] = weight

    def weight(self, name: str) -> int:
        return self._weights.get(name, 1)

    def _weighted(self, ready: tuple[Backend, ...], tried: Collection[str]) -> Iterator[Backend]:
        """nginx's smooth weighted round robin: each ready backend earns its weight, the richest
        untried one goes first and pays the sum. Over Σ weights requests each gets exactly its
        weight, spread out (a a b a a b) rather than in runs; the rest follow as retry candidates."""
        credit = {b.name: self._credit.get(b.name, 0) + self.weight(b.name) for b in ready}
        total = sum(self.weight(b.name) for b in ready)
        order = sorted((b for b in ready if b.name not in tried), key=lambda b: -credit[b.name])
        if order:
            credit[order[0].name] -= total
            self._credit = credit  # backends that left the rotation lose their credit
        yield from order

    def _candidates(self, ready: tuple[Backend, ...], tried: Collection[str]) -> Iterator[Backend]:
        if self._weights:
            yield from self._weighted(ready, tried)
            return
        n = len(ready)
        if n == 0:
            return
        start = self._counter
        self._counter = start + 1
        for offset in range(n):
            backend = ready[(start + offset) % n]
            if backend.name not in tried:
                yield backend


class RoundRobin(_Rotation):
    """Each ready instance in turn. With a stable ready set, N requests over k instances give each
    instance N/k (±1); when the set changes, the rotation simply continues over the new set."""

    name = "round_robin"

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = (), key: Any = None, size: int = 0) -> Backend | None:
        if tried or not ready or self._weights:
            return next(self._candidates(ready, tried), None)
        start = self._counter  # the common case, inlined: a first try, no weights
        self._counter = start + 1
        return ready[start % len(ready)]


class LeastOutstanding(_Rotation):
    """The instance with the fewest requests in flight through this proxy (per unit of weight); ties
    rotate (min keeps the first of equals), so an idle system still spreads requests instead of
    sending them all to the first instance."""

    name = "least_outstanding"

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = (), key: Any = None, size: int = 0) -> Backend | None:
        return min(self._candidates(ready, tried), key=lambda b: in_flight.get(b.name, 0) / self.weight(b.name), default=None)


class LeastLoaded(_Rotation):
    """The instance with the lowest load (load.py: vLLM's running + waiting + KV usage, corrected by
    the requests this proxy sent or saw finish since the sample; per unit of weight). Without fresh
    figures for every candidate (no probe, a failed or stale scrape), their in-flight counts, as
    least_outstanding. Ties rotate."""

    name = "least_loaded"
    uses_load = True

    def __init__(self) -> None:
        super().__init__()
        self.probe: load.LoadProbe | None = None

    def _count(self, decision: str) -> None:
        self.decisions[decision] = self.decisions.get(decision, 0) + 1

    def loads(self, names: list[str], in_flight: Mapping[str, int]) -> tuple[dict[str, float], bool]:
        """Each named instance's load (not per weight), and whether from the engines' figures."""
        probe = self.probe
        if probe is None:
            return {n: float(in_flight.get(n, 0)) for n in names}, False
        return load.loads(names, probe.samples, in_flight, time.monotonic(), probe.max_age)

    def works(self, names: list[str], in_flight: Mapping[str, int], size: int) -> dict[str, float]:
        """Each named instance's work before the first token of a request of `size` body bytes
        (load.work(): prefill not yet done, aged engine figures, decode a little; not per weight)."""
        return load.probed_works(self.probe, names, in_flight, size)

    def _least(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str]) -> tuple[Backend | None, bool]:
        candidates = list(self._candidates(ready, tried))
        if not candidates:
            return None, False
        values, engine = self.loads([b.name for b in candidates], in_flight)
        weight = self.weight
        # min keeps the first of equals: the rotation's, so equal loads still spread
        return min(candidates, key=lambda b: values[b.name] / weight(b.name)), engine

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = (), key: Any = None, size: int = 0) -> Backend | None:
        backend, engine = self._least(ready, in_flight, tried)
        if backend is not None:
            self._count("engine_load" if engine else "in_flight")
        return backend


POLICIES: tuple[str, ...] = get_args(ProxyConfig.model_fields["policy"].annotation)  # config.py lists them


def make_balancer(policy: str, config: ProxyConfig | None = None, pool: Any = None, model: str | None = None) -> _Rotation:
    """The balancer for `policy`; prefix_affinity and kv_aware take their settings from `config`
    (defaults without); kv_aware follows the instances of `pool` (a BackendPool; those of `model`
    when given), none without one."""
    if policy == RoundRobin.name:
        return RoundRobin()
    if policy == LeastOutstanding.name:
        return LeastOutstanding()
    if policy == LeastLoaded.name:
        return LeastLoaded()
    if policy == "prefix_affinity":
        from vsup.proxy.affinity import PrefixAffinity  # builds on LeastLoaded

        config = config or ProxyConfig()
        return PrefixAffinity(config.affinity_prefix_chars, config.affinity_load_factor)
    if policy == "kv_aware":
        from vsup.proxy.kv_aware import KvAware  # pyzmq, and a thread, only when chosen

        config = config or ProxyConfig()
        balancer = KvAware(config.affinity_load_factor)
        if pool is not None:
            balancer.attach(pool, model)
        return balancer
    raise ValueError(f"unknown proxy policy {policy!r}: use one of {', '.join(POLICIES)}")
