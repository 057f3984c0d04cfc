"""Admission: a model's requests wait in the proxy, in priority order, while its instances are full.

An instance is full when the proxy has `limit` requests in flight on it (proxy.
max_in_flight_per_instance, or its --max-num-seqs); requests below the top priority in use see it
full `reserve` slots earlier (proxy.reserved_slots), so an interactive request never waits
behind a batch that has taken every slot. A request that finds no room waits in its queue (one
per routed name): higher priority first; within one priority the keys (proxy.api_keys) take
turns, first come first served within a key (start-time fair queueing: a waiter's round is one
past its key's previous waiter's, and never behind the round being served, so a key that
arrives behind another's hundred waiters goes next, not hundredth). A freed slot
(`release`) or a pool change (`poke`) grants the best waiter a slot on a particular instance; the
slot is reserved for it until its task runs, so a newcomer cannot take it in between; a waiter
not granted at once tells `crowding` its instances (the forwarder's batch share stops a batch line
there, whose end grants the slot: proxy/batch_share.py). A waiter
that leaves (its client gone, the drain) gives a granted slot on to the next at once.

Bounded: `queue_max` waiters per queue; a full queue refuses (FULL) unless the newcomer's
priority is above its last waiter's, which is then shed (SHED), or the newcomer's key holds
fewer of the places of its priority and below than another key holds less one: that key's
newest is shed, so no key keeps a model's whole queue from the others (each of k keys keeps
about queue_max / k places when all want more). `expire(now)` ends the waits past
`timeout` (EXPIRED); the forwarder's watchdog calls it, so there is no timer per waiter.

Pure: no sockets, no aiohttp; times are the caller's clock (a virtual one in the unit tests).
"""

from __future__ import annotations

import asyncio
from bisect import insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vsup.proxy.backends import Backend

FULL = "queue_full"
SHED = "shed"
EXPIRED = "queue_timeout"


@dataclass(frozen=True)
class Limit:
    limit: int  # requests in flight per instance
    reserve: int = 0  # of those, kept for the top priority
    queue_max: int = 256
    timeout: float = 60.0


class Waiter:
    __slots__ = ("order", "priority", "key", "round", "queue", "ready", "since", "future", "granted", "limit")

    def __init__(self, priority: int, seq: int, queue: str, ready: Callable[[], tuple[Backend, ...]], since: float,
                 future: asyncio.Future, limit: Limit, key: str = "", round_: int = 0) -> None:
        # the queue's sort key: highest priority, then the key's turn, then the oldest
        self.order = (-priority, round_, seq)
        self.priority = priority
        self.key = key  # the client's key (its name; "" for proxy.api_key or none)
        self.round = round_
        self.queue = queue
        self.ready = ready
        self.since = since
        self.future = future
        self.granted: Backend | None = None
        self.limit = limit

    def __lt__(self, other: Waiter) -> bool:
        return self.order < other.order


class Admission:
    """`in_flight`: the forwarder's requests per instance (it counts; this reads). `limit_of`:
    a backend's Limit, None for no limit (set by the gate from each model's settings)."""

    def __init__(self, in_flight: dict[str, int], limit_of: Callable[[Backend], Limit | None], top: int = 0) -> None:
        self.in_flight = in_flight
        self.limit_of = limit_of
        self.top = top  # the highest priority in use: the only one that may take reserved slots
        self.reserved: dict[str, int] = {}  # backend name -> slots granted to waiters not yet running
        self.queues: dict[str, list[Waiter]] = {}
        self.rounds: dict[str, dict[str, int]] = {}  # queue -> key -> the round of its newest waiter
        self.served: dict[str, int] = {}  # queue -> the round of the waiter granted last
        self.waiting = 0
        self.enqueued = 0  # requests that ever waited (a gate compares it around admit())
        # told of each waiter not granted at once, with its instances: batch lines there make room
        # (the forwarder's BatchShare.make_room preempts one; its end grants the slot)
        self.crowding: Callable[[tuple[Backend, ...]], object] = lambda backends: None

    # -- per request
    def room(self, backend: Backend, priority: int) -> bool:
        limit = self.limit_of(backend)
        if limit is None:
            return True
        cap = limit.limit - (limit.reserve if priority < self.top else 0)
        name = backend.name
        return self.in_flight.get(name, 0) + self.reserved.get(name, 0) < cap

    def space(self, backend: Backend, priority: int) -> int | None:
        """How many more requests of `priority` `backend` takes now; None: no limit."""
        limit = self.limit_of(backend)
        if limit is None:
            return None
        cap = limit.limit - (limit.reserve if priority < self.top else 0)
        name = backend.name
        return max(0, cap - self.in_flight.get(name, 0) - self.reserved.get(name, 0))

    def free(self, ready: Iterable[Backend], priority: int) -> tuple[Backend, ...]:
        return tuple(b for b in ready if self.room(b, priority))

    async def admit(self, queue: str, ready: Callable[[], tuple[Backend, ...]], priority: int, now: float,
                    limit: Limit, key: str = "") -> tuple[Backend, ...] | str:
        """The backends with room for this request (the caller counts it in flight on one of them
        before its next await), or why it may not wait (FULL, SHED, EXPIRED). Returns an empty
        tuple when nothing is ready. Cancellation (client gone, drain) leaves the queue at once."""
        waiters = self.queues.get(queue)
        if not waiters:
            backends = ready()
            if not backends:
                return ()
            free = self.free(backends, priority)
            if free:
                return free
        waiters = self.queues.setdefault(queue, [])
        if len(waiters) >= limit.queue_max:
            last = waiters[-1] if waiters else None
            if last is not None and last.priority < priority:
                self._leave(last, SHED)  # the newest of the lowest priority makes room
            else:
                hog = self._hog(waiters, priority, key)
                if hog is None:
                    return FULL
                self._leave(hog, SHED)  # the newest of the key holding the most places makes room
            waiters = self.queues.setdefault(queue, [])  # (its leaving may have dropped an emptied queue)
        self.enqueued += 1
        rounds = self.rounds.setdefault(queue, {})
        turn = max(rounds.get(key, -1) + 1, self.served.get(queue, 0))
        rounds[key] = turn
        waiter = Waiter(priority, self.enqueued, queue, ready, now, asyncio.get_running_loop().create_future(), limit,
                        key, turn)
        insort(waiters, waiter)
        self.waiting += 1
        self.poke()  # a slot may be free for it already (another queue's waiters blocked on other instances)
        if not waiter.future.done():
            self.crowding(ready())
        try:
            outcome = await waiter.future
        except asyncio.CancelledError:
            self._leave(waiter, None)
            raise
        if isinstance(outcome, str):
            return outcome
        # the granted slot becomes this request's own: the caller counts it in flight next
        self._unreserve(outcome)
        waiter.granted = None
        free = self.free(ready(), priority)
        if outcome not in free:
            free = (outcome, *free)
        return free

    def expire(self, now: float) -> int:
        """End the waits longer than their timeout; how many ended."""
        ended = 0
        for waiters in list(self.queues.values()):
            for waiter in [w for w in waiters if now - w.since >= w.limit.timeout]:
                self._leave(waiter, EXPIRED)
                ended += 1
        return ended

    # -- slots freed
    def release(self, backend: Backend) -> None:
        """A request on `backend` ended: its slot to the best waiter that may use it."""
        if not self.waiting:
            return
        best: Waiter | None = None
        for waiters in self.queues.values():
            if waiters:
                head = waiters[0]
                if (best is None or head.order < best.order) and backend in head.ready() and self.room(backend, head.priority):
                    best = head
        if best is not None:
            self._grant(best, backend)

    def poke(self) -> None:
        """Grant every slot free now (instances joined, limits raised, a waiter left)."""
        while self.waiting:
            heads = sorted(w[0] for w in self.queues.values() if w)
            for head in heads:
                backend = next((b for b in head.ready() if self.room(b, head.priority)), None)
                if backend is not None:
                    self._grant(head, backend)
                    break
            else:
                return

    # -- figures (/metrics, vsup status)
    def lengths(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for queue, waiters in self.queues.items():
            for waiter in waiters:
                key = (queue, waiter.priority)
                out[key] = out.get(key, 0) + 1
        return out

    def oldest(self, now: float) -> dict[str, float]:
        return {queue: now - min(w.since for w in waiters) for queue, waiters in self.queues.items() if waiters}

    # -- inside
    @staticmethod
    def _hog(waiters: list[Waiter], priority: int, key: str) -> Waiter | None:
        """In a full queue, the waiter a newcomer of `key` and `priority` takes the place of: the
        newest of the key holding the most places of that priority and below, when that key holds
        more than one more than the newcomer's; else None (the newcomer is refused)."""
        held: dict[str, int] = {}
        newest: dict[str, Waiter] = {}
        for waiter in waiters:
            if waiter.priority <= priority:
                held[waiter.key] = held.get(waiter.key, 0) + 1
                newest[waiter.key] = waiter  # (sorted: the last seen is the last served)
        if not held:
            return None
        most = max(held, key=lambda k: held[k])
        return newest[most] if most != key and held[most] > held.get(key, 0) + 1 else None

    def _grant(self, waiter: Waiter, backend: Backend) -> None:
        self.served[waiter.queue] = max(self.served.get(waiter.queue, 0), waiter.round)
        self._remove(waiter)
        waiter.granted = backend
        self.reserved[backend.name] = self.reserved.get(backend.name, 0) + 1
        waiter.future.set_result(backend)

    def _remove(self, waiter: Waiter) -> None:
        waiters = self.queues.get(waiter.queue)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            self.waiting -= 1
            if not waiters:
                del self.queues[waiter.queue]
                self.rounds.pop(waiter.queue, None)  # an empty queue starts its rounds again
                self.served.pop(waiter.queue, None)

    def _unreserve(self, backend: Backend) -> None:
        left = self.reserved.get(backend.name, 0) - 1
        if left > 0:
            self.reserved[backend.name] = left
        else:
            self.reserved.pop(backend.name, None)

    def _leave(self, waiter: Waiter, outcome: str | None) -> None:
        """`waiter` is done waiting: answered `outcome`, or (None) cancelled; a slot granted to it
        and not yet taken goes on to the next."""
        self._remove(waiter)
        granted, waiter.granted = waiter.granted, None
        if granted is not None:
            self._unreserve(granted)
            self.release(granted)
        if outcome is not None and not waiter.future.done():
            waiter.future.set_result(outcome)
