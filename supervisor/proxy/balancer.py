"""Which ready instance gets the next request.

Both policies take the pool's ready tuple (stable order) and a set of instances already tried for
this request (retries go to *another* instance); they return None when nothing is left.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from supervisor.backends import Backend


class RoundRobin:
    """Each ready instance in turn. With a stable ready set, N requests over k instances give each
    instance N/k (±1); when the set changes, the rotation simply continues over the new set."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = ()) -> Backend | None:
        n = len(ready)
        if n == 0:
            return None
        start = self._counter
        self._counter = start + 1
        for offset in range(n):
            backend = ready[(start + offset) % n]
            if backend.name not in tried:
                return backend
        return None


class LeastOutstanding:
    """The instance with the fewest requests in flight through this proxy; ties rotate, so an idle
    system still spreads requests instead of sending them all to the first instance."""

    name = "least_outstanding"

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = ()) -> Backend | None:
        n = len(ready)
        if n == 0:
            return None
        start = self._counter
        self._counter = start + 1
        best: Backend | None = None
        best_load = 0
        for offset in range(n):
            backend = ready[(start + offset) % n]
            if backend.name in tried:
                continue
            load = in_flight.get(backend.name, 0)
            if best is None or load < best_load:
                best, best_load = backend, load
        return best


POLICIES = {RoundRobin.name: RoundRobin, LeastOutstanding.name: LeastOutstanding}


def make_balancer(policy: str) -> RoundRobin | LeastOutstanding:
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown proxy policy {policy!r}: use one of {', '.join(POLICIES)}") from None
