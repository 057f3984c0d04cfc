"""Which ready instance gets the next request.

Both policies take the pool's ready tuple (stable order) and a set of instances already tried for
this request (retries go to *another* instance); they return None when nothing is left.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping

from vsup.supervisor.backends import Backend


class _Rotation:
    """The ready instances not yet tried, starting one further along at each request."""

    def __init__(self) -> None:
        self._counter = 0

    def _candidates(self, ready: tuple[Backend, ...], tried: Collection[str]) -> Iterator[Backend]:
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

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = ()) -> Backend | None:
        if tried or not ready:
            return next(self._candidates(ready, tried), None)
        start = self._counter  # the common case, inlined: a first try
        self._counter = start + 1
        return ready[start % len(ready)]


class LeastOutstanding(_Rotation):
    """The instance with the fewest requests in flight through this proxy; ties rotate (min keeps
    the first of equals), so an idle system still spreads requests instead of sending them all to
    the first instance."""

    name = "least_outstanding"

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = ()) -> Backend | None:
        return min(self._candidates(ready, tried), key=lambda b: in_flight.get(b.name, 0), default=None)


POLICIES = {RoundRobin.name: RoundRobin, LeastOutstanding.name: LeastOutstanding}


def make_balancer(policy: str) -> RoundRobin | LeastOutstanding:
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown proxy policy {policy!r}: use one of {', '.join(POLICIES)}") from None
