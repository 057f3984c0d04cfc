"""The share of each instance batch lines may take: what interactive requests leave.

An instance runs `slots` requests at once (batch.slots_per_instance: auto is its model's
admission limit, else its --max-num-seqs, else vLLM's CPU default). Batch lines may hold at most
`slots − keep − interactive in flight` of them (interactive: the proxy's other requests there, and
admission slots granted to a waiter not yet running). `keep` is proxy.reserved_slots, but at
least one while the model has had an interactive request in the last batch.quiet_after seconds:
a colleague's next message finds a slot free; and then lines hold no more than
batch.beside_interactive of the slots (`lines_beside`): on a CPU every running line's next token
shares the engine step a chat's first token waits for (docs/batch.md measures the shares). A
quiet model's instances are used whole, and as many lines again wait in each vLLM's own queue
(QUIET times the slots in all): the engine takes the next lines the moment running ones end
instead of after a round trip through vsup — lines started together end together, so a queue
shorter than the slots leaves slots empty — which is what lets a client loop that keeps more
requests in flight than the slots beat one that keeps exactly the slots.

An interactive request takes its slot back, and its first token goes first:
- one counted in flight on an instance where the lines hold more than it leaves them, or more
  than their share beside it (`crowded`: the first after a quiet spell), or one that waits in
  the admission queue while lines hold slots it could use (`make_room`), preempts the youngest
  line there still waiting for its answer (the least work lost): the line's request is cancelled, which closes its connection and so aborts it in vLLM,
  and the line is answered busy, which costs it no attempt (its runner sends it again first);
- a streamed one holds new lines off its instance until its first byte (`hold`): a line started
  then would put its prompt's prefill in the engine's next steps, beside or ahead of its own;
- while interactive traffic is recent, new lines start staggered: an instance starts at most one
  per STAGGER slots within the time recent streams took to their first byte (`ttft`, which the
  holds measure), so lines that ended together do not start together and put a wave of prefills
  in one engine step, which a chat arriving then would wait behind.
A model whose interactive requests wait in the admission queue has no room for new lines. Lines
never wait in the proxy: one that finds no room is answered at once (503, `x-vsup-batch: busy`).
Pure: the forwarder counts and cancels.

Across hosts (a front `vsup proxy --batch-dir` over the nodes' vsups): the front's Sender marks
each line `X-Vsup-Batch: line` (LINE_HEADER), and a node places such a request as a batch line of
its own: into its instances' share (preempted there like its own lines), else its busy answer at
once. The front cannot see a node's interactive traffic, so a node's busy answer teaches it: that
node takes no more batch lines than the front has in flight there (`refused`), for BUSY_HOLD
seconds, then the front tries the full share again (one busy answer a node per BUSY_HOLD at most,
while interactive traffic fills it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

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


class Line(Protocol):
    """A batch line in flight (the forwarder's Exchange): `abort` cancels its request."""
    phase: str

    def abort(self, reason: str) -> None: ...


# A quiet model's instances take this many times their slots of lines (the rest queued in vLLM, the
# first preempted).
QUIET = 2
# While interactive traffic is recent: lines an instance may start within one `ttft`, per this many slots.
STAGGER = 8
# (the most start times kept per instance)
STAGGER_MAX = 1024
# The weight of a new first-byte time in a model's `ttft` (an exponential mean).
TTFT_WEIGHT = 0.3
# Exchange.abort's reason for a preempted line (the forwarder answers it busy).
PREEMPTED = "preempted"
# A line in this phase is receiving its answer: done but for the bytes, never preempted.
ANSWERING = "response"


class BatchShare:
    """`in_flight`: the forwarder's requests per instance, batch lines included (it tells this of
    them: `started`, `ended`). `waiting(model)`: interactive requests queued for that model;
    `granted(name)`: admission slots granted on that instance to waiters not running yet (the
    gate's, when built)."""

    def __init__(self, in_flight: dict[str, int], clock: Callable[[], float] = lambda: 0.0) -> None:
        self.in_flight = in_flight
        self.clock = clock
        self.learned: dict[str, tuple[int, float]] = {}  # backend name -> (lines it holds at most, until when)
        self.lines: dict[str, list[Line]] = {}  # backend name -> its batch lines in flight, oldest first
        self.stopping: dict[str, int] = {}  # backend name -> lines preempted there and not ended yet
        self.preempted: dict[str, int] = {}  # model -> lines preempted so far (the metric)
        self.slots: dict[str, int] = {}  # model -> slots per instance
        self.default_slots = CPU_DEFAULT_SLOTS  # a model without figures of its own
        self.reserved: dict[str, int] = {}  # model -> proxy.reserved_slots
        self.default_reserved = 0
        self.quiet_after = 0.0  # batch.quiet_after
        self.beside = 1.0  # batch.beside_interactive: the slots' fraction lines may hold while interactive traffic is recent
        self.seen: dict[str, float] = {}  # model -> when its latest interactive request started
        self.holding: dict[str, int] = {}  # backend name -> streamed interactive requests there awaiting their first byte
        self.holds: dict[str, list[tuple[float, str]]] = {}  # backend name -> (since, model) of each hold, oldest first
        self.ttft: dict[str, float] = {}  # model -> recent streams' seconds to their first byte (a mean)
        self.young: dict[str, deque[float]] = {}  # backend name -> when its recent lines started
        self.on_free: Callable[[], None] = lambda: None  # told when a hold ends (the runner may send again)
        self.waiting: Callable[[str], int] = lambda model: 0
        self.granted: Callable[[str], int] = lambda name: 0
        # how many more requests at the batch priority the admission limit lets in there; None: no limit
        self.admits: Callable[[Backend], int | None] = lambda backend: None

    def configure(self, slots: Mapping[str, int], default_slots: int, reserved: Mapping[str, int], default_reserved: int,
                  quiet_after: float = 0.0, beside: float = 1.0) -> None:
        self.slots, self.default_slots = dict(slots), default_slots
        self.reserved, self.default_reserved = dict(reserved), default_reserved
        self.quiet_after, self.beside = quiet_after, beside

    def interactive(self, model: str) -> None:
        """An interactive request of `model` starts: a slot stays free for the next one for quiet_after seconds."""
        self.seen[model] = self.clock()

    def hold(self, name: str, model: str = "") -> None:
        """A streamed interactive request was sent to the instance `name`: no new line starts there
        until its first byte (`released`)."""
        self.holding[name] = self.holding.get(name, 0) + 1
        self.holds.setdefault(name, []).append((self.clock(), model))

    def released(self, name: str, answered: bool = True) -> None:
        """A hold on `name` ends: `answered`, by its first byte (its time joins the model's ttft), else
        by the attempt's end."""
        holds = self.holds.get(name)
        if holds:
            since, model = holds.pop(0)  # (the oldest: streams answer in about the order they came)
            if not holds:
                del self.holds[name]
            if answered and model:
                took = self.clock() - since
                known = self.ttft.get(model)
                self.ttft[model] = took if known is None else known + TTFT_WEIGHT * (took - known)
        left = self.holding.get(name, 0) - 1
        if left > 0:
            self.holding[name] = left
            return
        self.holding.pop(name, None)
        self.on_free()

    def recent(self, model: str) -> bool:
        """Whether `model` had an interactive request in the last quiet_after seconds."""
        seen = self.seen.get(model)
        if seen is None:
            return False
        if self.clock() - seen < self.quiet_after:
            return True
        del self.seen[model]
        return False

    def held(self, name: str) -> int:
        """Batch lines in flight on the instance `name`, those preempted and not ended yet included."""
        return len(self.lines.get(name, ())) + self.stopping.get(name, 0)

    def _cap(self, backend: Backend, new: bool = False) -> int:
        """Batch lines `backend` may hold, by what interactive requests hold there, and no more
        than its share beside them while its model's interactive traffic is recent; `new`: for new
        lines, so one slot more is kept while that traffic is recent, and QUIET times the slots are
        taken while it is quiet (a line is preempted for a request that needs its slot or for the
        share beside the chats, never to keep a slot free or to empty vLLM's queue)."""
        model, name = backend.model, backend.name
        slots = self.slots.get(model, self.default_slots)
        keep = self.reserved.get(model, self.default_reserved)
        recent = self.recent(model)
        if new:
            if recent:
                keep = max(keep, 1)
            else:
                slots *= QUIET
        interactive = self.in_flight.get(name, 0) - self.held(name) + self.granted(name)
        cap = slots - keep - interactive
        return min(cap, lines_beside(slots, self.beside)) if recent else cap

    def cap(self, backend: Backend) -> int:
        """Batch lines `backend` may hold now (its share; less for a while after a node's busy answer)."""
        cap = self._cap(backend, new=True)
        name = backend.name
        learned = self.learned.get(name)
        if learned is not None:
            if self.clock() < learned[1]:
                return min(cap, learned[0])
            del self.learned[name]
        return cap

    def refused(self, name: str) -> None:
        """The instance `name` (a node's vsup) answered a batch line busy: for BUSY_HOLD seconds it
        takes no more lines than it holds now (the line just refused is no longer counted)."""
        self.learned[name] = (self.held(name), self.clock() + BUSY_HOLD)

    def room(self, backend: Backend) -> int:
        """How many more batch lines `backend` takes now."""
        if backend.name in self.holding:
            return 0
        room = self.cap(backend) - self.held(backend.name)
        if room > 0 and self.recent(backend.model):
            room = min(room, self._stagger(backend))
        admits = self.admits(backend)
        return max(0, room if admits is None else min(room, admits))

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

    def _stagger(self, backend: Backend) -> int:
        """Lines `backend` may start now while interactive traffic is recent (see the module's doc)."""
        ttft = self.ttft.get(backend.model)
        young = self.young.get(backend.name)
        if ttft is None or not young:
            return STAGGER_MAX
        since = self.clock() - ttft
        while young and young[0] < since:
            young.popleft()
        slots = self.slots.get(backend.model, self.default_slots)
        return max(1, slots // STAGGER) - len(young)

    def started(self, name: str, line: Line) -> None:
        self.lines.setdefault(name, []).append(line)
        young = self.young.setdefault(name, deque())
        young.append(self.clock())
        if len(young) > STAGGER_MAX:
            young.popleft()

    def ended(self, name: str, line: Line) -> None:
        lines = self.lines.get(name)
        if lines is not None and line in lines:
            lines.remove(line)
            if not lines:
                del self.lines[name]
            return
        left = self.stopping.get(name, 0) - 1  # a preempted line, its request now over
        if left > 0:
            self.stopping[name] = left
        else:
            self.stopping.pop(name, None)

    # -- an interactive request takes its slot back
    def crowded(self, backend: Backend) -> int:
        """An interactive request was just counted in flight on `backend`: preempt lines there
        while they hold more than the share — the first request after a quiet spell finds lines
        in every slot and as many queued in vLLM, and its first token would wait behind all of
        their steps until they end (how many were preempted)."""
        preempted = 0
        while len(self.lines.get(backend.name, ())) > self._cap(backend) and self._preempt(backend):
            preempted += 1
        return preempted

    def make_room(self, backends: Iterable[Backend]) -> bool:
        """An interactive request waits in the admission queue for one of `backends`: preempt one
        line on the one holding most (its end releases the slot to the waiter); False: none held."""
        fullest = max(backends, key=lambda b: len(self.lines.get(b.name, ())), default=None)
        return fullest is not None and self._preempt(fullest)

    def _preempt(self, backend: Backend) -> bool:
        """Stop the youngest line on `backend` still waiting for its answer."""
        name = backend.name
        lines = self.lines.get(name, [])
        victim = next((line for line in reversed(lines) if line.phase != ANSWERING), None)
        if victim is None:
            return False
        lines.remove(victim)
        if not lines:
            del self.lines[name]
        self.stopping[name] = self.stopping.get(name, 0) + 1
        self.preempted[backend.model] = self.preempted.get(backend.model, 0) + 1
        victim.abort(PREEMPTED)
        return True


def lines_beside(slots: int, share: float) -> int:
    """Lines an instance of `slots` holds while its model's interactive traffic is recent
    (batch.beside_interactive: `share` of the slots, one at least unless it is 0, so a batch
    still moves while chats go on)."""
    return 0 if share <= 0 else max(1, int(slots * share))


def lowest_below(priorities: Iterable[int]) -> int:
    """batch.priority null: one below the lowest priority in use (0 when none is set)."""
    return min(priorities, default=0) - 1
