"""BatchShare (vsup/proxy/batch_share.py), pure: the lines' share of an instance while its model
is quiet and while interactive traffic is recent, and which lines an interactive request preempts.
The forwarder's side (real sockets, a real fake vLLM) is tests/test_batch_forward.py."""

from __future__ import annotations

from vsup.proxy.backends import Backend
from vsup.proxy.batch_share import ANSWERING, PREEMPTED, QUIET, BatchShare, lines_beside


class Line:
    """A batch line in flight, as the forwarder's Exchange: its phase, and abort() records why."""

    def __init__(self, phase: str = "non_streaming") -> None:
        self.phase = phase
        self.aborted: str | None = None

    def abort(self, reason: str) -> None:
        self.aborted = reason


class Box:
    """One BatchShare over instances with `slots` each, the forwarder's counting done by hand."""

    def __init__(self, slots: int = 4, reserved: int = 0, quiet_after: float = 10.0, beside: float = 1.0) -> None:
        self.now = 100.0
        self.in_flight: dict[str, int] = {}
        self.share = BatchShare(self.in_flight, lambda: self.now)
        self.share.configure({"chat": slots}, 128, {"chat": reserved}, 0, quiet_after, beside)
        self.a, self.b = Backend("a", "http://127.0.0.1:1", "chat"), Backend("b", "http://127.0.0.1:2", "chat")

    def line(self, backend: Backend, phase: str = "non_streaming") -> Line:
        line = Line(phase)
        self.in_flight[backend.name] = self.in_flight.get(backend.name, 0) + 1
        self.share.started(backend.name, line)
        return line

    def end(self, backend: Backend, line: Line | None = None) -> None:
        self.in_flight[backend.name] -= 1
        if line is not None:
            self.share.ended(backend.name, line)

    def interactive(self, backend: Backend) -> int:
        """An interactive request counted in flight on `backend`, as _send does: how many lines it preempted."""
        self.in_flight[backend.name] = self.in_flight.get(backend.name, 0) + 1
        self.share.interactive(backend.model)
        return self.share.crowded(backend)


def test_a_quiet_instance_is_taken_whole_and_queued_lines_beyond():
    box = Box(slots=4)
    assert box.share.room(box.a) == 4 * QUIET
    for _ in range(4 * QUIET):
        box.line(box.a)
    assert box.share.room(box.a) == 0
    assert box.share.total([box.a, box.b], "chat") == 4 * QUIET


def test_recent_interactive_traffic_keeps_one_slot_and_quiet_after_gives_it_back():
    box = Box(slots=4, quiet_after=10.0)
    box.interactive(box.a)
    box.end(box.a)
    assert box.share.room(box.a) == 3  # no request in flight, one slot kept for the next
    box.now += 9.9
    assert box.share.room(box.a) == 3
    box.now += 0.2
    assert box.share.room(box.a) == 4 * QUIET


def test_beside_recent_chats_lines_hold_their_share_of_the_slots_and_the_whole_again_once_quiet():
    box = Box(slots=16, quiet_after=10.0, beside=0.25)
    assert box.share.room(box.a) == 16 * QUIET  # quiet: the share does not apply
    box.interactive(box.a)
    box.end(box.a)
    assert box.share.room(box.a) == 4  # a quarter of 16 slots
    lines = [box.line(box.a) for _ in range(3)]
    assert box.share.room(box.a) == 1
    box.line(box.a)
    assert box.share.room(box.a) == 0  # 12 slots free, but the chats' steps stay small
    assert box.share.room(box.b) == 4  # per instance
    box.end(box.a, lines[0])
    assert box.share.room(box.a) == 1
    box.now += 10.1
    assert box.share.room(box.a) == 16 * QUIET - 3


def test_the_first_chat_after_a_quiet_spell_preempts_the_lines_down_to_their_share_beside_it():
    box = Box(slots=16, beside=0.125)
    lines = [box.line(box.a) for _ in range(16 * QUIET)]
    other = [box.line(box.b) for _ in range(16 * QUIET)]
    assert box.interactive(box.a) == 16 * QUIET - 2  # its first token waits behind 2 lines' steps, not 32
    assert [line.aborted for line in lines[:2]] == [None, None]  # the oldest stay: the most work kept
    assert {line.aborted for line in lines[2:]} == {PREEMPTED}
    assert box.share.room(box.a) == 0
    assert box.interactive(box.a) == 0  # the next chat finds the share held already
    assert {line.aborted for line in other} == {None}  # only the chat's instance; b's on the next chat there
    assert box.interactive(box.b) == 16 * QUIET - 2


def test_the_share_beside_chats_rounds_down_keeps_one_line_and_zero_stops_new_lines():
    assert [lines_beside(slots, 0.25) for slots in (1, 2, 4, 7, 8, 128)] == [1, 1, 1, 1, 2, 32]
    assert lines_beside(16, 1.0) == 16
    assert lines_beside(16, 0.0) == 0
    box = Box(slots=8, beside=0.0)
    box.interactive(box.a)
    box.end(box.a)
    assert box.share.room(box.a) == 0 and box.share.total([box.a, box.b], "chat") == 0
    box.now += 10.1
    assert box.share.room(box.a) == 8 * QUIET


def test_reserved_slots_are_kept_and_one_more_is_not_added_to_them():
    box = Box(slots=6, reserved=2)
    assert box.share.room(box.a) == 6 * QUIET - 2
    box.share.interactive("chat")
    assert box.share.room(box.a) == 4  # reserved_slots already keep slots free: not one more


def test_an_interactive_request_preempts_the_youngest_lines_down_to_the_slots_it_leaves():
    box = Box(slots=4)
    lines = [box.line(box.a) for _ in range(4 * QUIET)]
    assert box.interactive(box.a) == 4 * QUIET - 3  # 4 slots, 1 interactive: 3 lines stay
    assert [line.aborted for line in lines] == [None] * 3 + [PREEMPTED] * (4 * QUIET - 3)
    assert box.share.preempted == {"chat": 4 * QUIET - 3}
    # until their requests end, the preempted lines still hold their slots: no room, and no second preemption
    assert box.share.held("a") == 4 * QUIET and box.share.room(box.a) == 0
    assert box.share.crowded(box.a) == 0
    for line in lines[3:]:
        box.end(box.a, line)
    assert box.share.held("a") == 3 and box.share.room(box.a) == 0  # 4 - 1 kept - 1 interactive - 3 lines
    assert box.interactive(box.a) == 1  # a second interactive request: the youngest of the three
    assert lines[2].aborted == PREEMPTED and lines[1].aborted is None


def test_a_line_receiving_its_answer_is_never_preempted():
    box = Box(slots=2)
    old = box.line(box.a)
    answering = box.line(box.a, ANSWERING)  # (the youngest, but done but for the bytes)
    assert box.interactive(box.a) == 1
    assert (old.aborted, answering.aborted) == (PREEMPTED, None)
    box2 = Box(slots=1)
    only = box2.line(box2.a, ANSWERING)
    assert box2.interactive(box2.a) == 0 and only.aborted is None


def test_a_free_slot_is_taken_without_preempting():
    box = Box(slots=4)
    lines = [box.line(box.a) for _ in range(3)]
    assert box.interactive(box.a) == 0
    assert all(line.aborted is None for line in lines)


def test_a_waiter_preempts_one_line_on_the_fullest_of_its_instances():
    box = Box(slots=4)
    on_a = [box.line(box.a) for _ in range(2)]
    on_b = [box.line(box.b) for _ in range(3)]
    assert box.share.make_room([box.a, box.b])
    assert [line.aborted for line in on_b] == [None, None, PREEMPTED]
    assert all(line.aborted is None for line in on_a)
    assert not Box().share.make_room([Box().a])  # no line there: nothing to stop
    assert not box.share.make_room([])


def test_a_stream_awaiting_its_first_byte_holds_new_lines_off_its_instance_only():
    box = Box(slots=4)
    woken = []
    box.share.on_free = lambda: woken.append(True)
    box.share.hold("a")
    box.share.hold("a")
    assert box.share.room(box.a) == 0 and box.share.room(box.b) == 4 * QUIET
    box.share.released("a")
    assert box.share.room(box.a) == 0 and not woken  # the other stream still waits
    box.share.released("a")
    assert box.share.room(box.a) == 4 * QUIET and woken == [True]  # the runner is told at once


def test_while_chats_are_recent_lines_start_staggered_by_their_time_to_first_byte():
    box = Box(slots=16)
    box.share.hold("a", "chat")
    box.now += 0.75  # the chat's first byte 0.75 s later
    box.share.released("a")
    assert box.share.ttft == {"chat": 0.75}
    box.interactive(box.a)
    box.end(box.a)
    assert box.share.room(box.a) == 15  # none started lately: the share
    box.line(box.a)
    box.line(box.a)
    assert box.share.room(box.a) == 0  # 16 // STAGGER = 2 may start within 0.75 s
    box.now += 0.76
    assert box.share.room(box.a) == 2
    assert box.share.room(box.b) == 15  # another instance: its own
    box.now += 30.0  # quiet again: no stagger
    assert box.share.room(box.a) == 16 * QUIET - 2
    box.share.hold("b", "chat")
    box.now += 2.0
    box.share.released("b", answered=False)  # ended without a byte: no time to learn from
    assert box.share.ttft == {"chat": 0.75}
