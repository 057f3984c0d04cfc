"""The share of each instance batch lines may take: what interactive requests leave, but one slot.

An instance runs `slots` requests at once (batch.slots_per_instance: auto is its model's
admission limit, else its --max-num-seqs, else vLLM's CPU default). Batch lines may hold at most
`slots − max(reserved_slots, 1) − interactive in flight` of them (interactive: the proxy's other
requests there, and admission slots granted to a waiter not yet running), so at least one slot of
every instance stays free for an interactive request with no configuration at all. A model whose
interactive requests wait in the admission queue has no room for batch lines: they are admitted
ahead. Batch lines never wait in the proxy: a line that finds no room is answered at once (503,
`x-vsup-batch: busy`) and its runner keeps it for a later round. Pure: the forwarder counts.

Across hosts (a front `vsup proxy --batch-dir` over the nodes' vsups): the front's Sender marks
each line `X-Vsup-Batch: line` (LINE_HEADER), and a node places such a request as a batch line of
its own: into its instances' share, else its busy answer at once. The front cannot see a node's
interactive traffic, so a node's busy answer teaches it: that node takes no more batch lines than
the front has in flight there (`refused`), for BUSY_HOLD seconds, then the front tries the full
share again (one busy answer a node per BUSY_HOLD at most, while interactive traffic fills it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from vsup.batch.slots import CPU_DEFAULT_SLOTS
from vsup.proxy.backends import Backend

# The answer's header that marks "nothing could take this batch line now" (not an attempt).
BUSY_HEADER = "x-vsup-batch"
BUSY = "busy"
# The request's header (same name) that asks a vsup to place the request as a batch line: sent by a
# front's batch runner to the nodes; a client that sends it only gets less (no wait, never the last slot).
LINE_HEADER = "x-vsup-batch"
LINE = "line"
# Seconds a node's busy answer caps the front's lines there at those it already holds.
BUSY_HOLD = 1.0


class BatchShare:
    """`in_flight`: the forwarder's requests per instance, batch lines included (it counts them in
    `batch` too). `waiting(model)`: interactive requests queued for that model; `granted(name)`:
    admission slots granted on that instance to waiters not running yet (the gate's, when built)."""

    def __init__(self, in_flight: dict[str, int], clock: Callable[[], float] = lambda: 0.0) -> None:
        self.in_flight = in_flight
        self.clock = clock
        self.learned: dict[str, tuple[int, float]] = {}  # backend name -> (lines it holds at most, until when)
        self.batch: dict[str, int] = {}  # backend name -> batch lines in flight there
        self.slots: dict[str, int] = {}  # model -> slots per instance
        self.default_slots = CPU_DEFAULT_SLOTS  # a model without figures of its own
        self.reserved: dict[str, int] = {}  # model -> proxy.reserved_slots
        self.default_reserved = 0
        self.waiting: Callable[[str], int] = lambda model: 0
        self.granted: Callable[[str], int] = lambda name: 0
        self.admits: Callable[[Backend], bool] = lambda backend: True  # the admission limit has room at the batch priority

    def configure(self, slots: Mapping[str, int], default_slots: int, reserved: Mapping[str, int], default_reserved: int) -> None:
        self.slots, self.default_slots = dict(slots), default_slots
        self.reserved, self.default_reserved = dict(reserved), default_reserved

    def cap(self, backend: Backend) -> int:
        """Batch lines `backend` may hold now (its share)."""
        model, name = backend.model, backend.name
        slots = self.slots.get(model, self.default_slots)
        keep = max(self.reserved.get(model, self.default_reserved), 1)
        batch = self.batch.get(name, 0)
        interactive = self.in_flight.get(name, 0) - batch + self.granted(name)
        cap = slots - keep - interactive
        learned = self.learned.get(name)
        if learned is not None:
            if self.clock() < learned[1]:
                return min(cap, learned[0])
            del self.learned[name]
        return cap

    def refused(self, name: str) -> None:
        """The instance `name` (a node's vsup) answered a batch line busy: for BUSY_HOLD seconds it
        takes no more lines than it holds now (the line just refused is no longer counted)."""
        self.learned[name] = (self.batch.get(name, 0), self.clock() + BUSY_HOLD)

    def room(self, backend: Backend) -> int:
        """How many more batch lines `backend` takes now."""
        if not self.admits(backend):
            return 0
        return max(0, self.cap(backend) - self.batch.get(backend.name, 0))

    def free(self, backends: Iterable[Backend], queue: str) -> tuple[Backend, ...]:
        """The instances that take one more batch line now; none while `queue` has interactive waiters."""
        if self.waiting(queue):
            return ()
        return tuple(b for b in backends if self.room(b) > 0)

    def total(self, backends: Iterable[Backend], queue: str) -> int:
        """How many more batch lines these instances take now (the runner's room)."""
        if self.waiting(queue):
            return 0
        return sum(self.room(b) for b in backends)

    def started(self, name: str) -> None:
        self.batch[name] = self.batch.get(name, 0) + 1

    def ended(self, name: str) -> None:
        left = self.batch.get(name, 0) - 1
        if left > 0:
            self.batch[name] = left
        else:
            self.batch.pop(name, None)


def lowest_below(priorities: Iterable[int]) -> int:
    """batch.priority null: one below the lowest priority in use (0 when none is set)."""
    return min(priorities, default=0) - 1
