"""An instance's states, the events that move it, and what outside requests do: data only.

`TRANSITIONS` is the only place a transition lives; `Intent`, `ON_INTENT` and `AFTER_STOP` say
what a request from outside does in each state and how a stop ends (the driver that follows these
tables is `Instance` in vsup/supervisor/lifecycle.py). Standard library only, so docs tools and
the tests read the tables without loading the driver. `diagram()` renders `TRANSITIONS` as the
text diagram ARCHITECTURE.md and docs/supervisor.md carry (scripts/lifecycle_diagram.py rewrites
them; tests/test_lifecycle.py fails while they differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum


class State(StrEnum):
    STOPPED = "stopped"  # not running and not meant to (before the first start, after a stop)
    STARTING = "starting"  # process started, waiting for /health 200 (the model is loading: phases.py)
    WARMING = "warming"  # /health answered; the warm-up request runs (not in the rotation yet)
    READY = "ready"  # alive, healthy and warmed up: in the proxy's rotation
    UNHEALTHY = "unhealthy"  # was ready, /health failed too often: about to be restarted
    DRAINING = "draining"  # out of the rotation, alive: its requests in flight finish, then it stops
    STOPPING = "stopping"  # stop_tree running (SIGTERM, grace, SIGKILL, sweep, /dev/shm)
    BACKOFF = "backoff"  # after a failure, waiting before the next start
    FAILED = "failed"  # crash loop, or an exit a restart would repeat (SIGILL): left down until `vsup restart` gives it a new chance


class Event(StrEnum):
    START = "start"  # a start was asked for (first start, vsup restart of a failed/waiting instance)
    HEALTHY = "healthy"  # process alive and /health answered 200
    WARMED = "warmed"  # the warm-up request answered (or warm-up is off)
    WARMUP_FAILED = "warmup_failed"  # the warm-up request failed or timed out: a failed start
    DRAIN = "drain"  # leave the rotation and let the requests in flight finish (recycle, retire)
    DRAINED = "drained"  # nothing in flight any more, or the drain timeout passed
    STARTUP_TIMEOUT = "startup_timeout"  # not healthy within health.startup_timeout (the ceiling, progress or not)
    STALLED = "stalled"  # starting, and no progress for health.startup_stall (phases.py: phase, output, CPU, I/O)
    IMPOSTOR = "impostor"  # /health answered, but what listens at its address is not its own process tree
    UNHEALTHY = "unhealthy"  # health.failures failed polls in a row
    EXITED = "exited"  # the process ended by itself (any exit status)
    STOP = "stop"  # a stop was asked for (shutdown, restart) or follows from unhealthy
    CLEANED_UP = "cleaned_up"  # stopped after a failure: back off
    CRASH_LOOP = "crash_loop"  # stopped after a failure, too many failures in the window
    UNRUNNABLE = "unrunnable"  # stopped after an exit every restart would repeat (SIGILL: the CPU lacks an instruction the build uses)
    RESTART = "restart"  # stopped because a restart was asked for: start again now
    HALTED = "halted"  # stopped because a stop was asked for
    DELAY_OVER = "delay_over"  # the backoff delay elapsed


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.STOPPED, E.START): S.STARTING,
    (S.STARTING, E.HEALTHY): S.WARMING,
    (S.STARTING, E.STARTUP_TIMEOUT): S.STOPPING,
    (S.STARTING, E.STALLED): S.STOPPING,
    (S.STARTING, E.IMPOSTOR): S.STOPPING,
    (S.STARTING, E.EXITED): S.STOPPING,
    (S.STARTING, E.STOP): S.STOPPING,
    (S.WARMING, E.WARMED): S.READY,
    (S.WARMING, E.WARMUP_FAILED): S.STOPPING,
    (S.WARMING, E.EXITED): S.STOPPING,
    (S.WARMING, E.STOP): S.STOPPING,
    (S.READY, E.UNHEALTHY): S.UNHEALTHY,
    (S.READY, E.DRAIN): S.DRAINING,
    (S.READY, E.EXITED): S.STOPPING,
    (S.READY, E.STOP): S.STOPPING,
    (S.UNHEALTHY, E.EXITED): S.STOPPING,
    (S.UNHEALTHY, E.STOP): S.STOPPING,
    (S.DRAINING, E.DRAINED): S.STOPPING,
    (S.DRAINING, E.EXITED): S.STOPPING,
    (S.DRAINING, E.STOP): S.STOPPING,
    (S.STOPPING, E.CLEANED_UP): S.BACKOFF,
    (S.STOPPING, E.CRASH_LOOP): S.FAILED,
    (S.STOPPING, E.UNRUNNABLE): S.FAILED,
    (S.STOPPING, E.RESTART): S.STARTING,
    (S.STOPPING, E.HALTED): S.STOPPED,
    (S.BACKOFF, E.DELAY_OVER): S.STARTING,
    (S.BACKOFF, E.START): S.STARTING,
    (S.BACKOFF, E.STOP): S.STOPPED,
    (S.FAILED, E.START): S.STARTING,
    (S.FAILED, E.STOP): S.STOPPED,
}
del S, E


class InvalidTransition(RuntimeError):
    """An event that the state does not accept: a bug in the driver, never a user error."""


def next_state(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"event {event.value!r} is not valid in state {state.value!r}") from None


@dataclass(frozen=True)
class Transition:
    at: float  # Operations.now()
    old: State
    new: State
    event: Event
    reason: str


class Intent(IntEnum):
    """What was asked of an instance from outside. The value is the precedence: an instance holds
    one intent, and a request never replaces a stronger one (a restart cannot undo a pending halt,
    a start cannot undo a pending restart). The gentle ones drain a ready instance before they
    stop it; the one above each overrides it with a stop at once."""

    RUN = 1  # be running: the first start, a new chance for a failed instance
    RECYCLE = 2  # drain if ready, stop, start again (rolling restart, reload in place, memory watchdog)
    RESTART = 3  # stop if running, then start again at once (`vsup restart`)
    RETIRE = 4  # drain if ready, stop, stay stopped (a reload replaced or removed the instance)
    HALT = 5  # stop at once and stay stopped (shutdown; the proxy has drained already)


S, E, I = State, Event, Intent
_AT_REST = {I.RUN: E.START, I.RECYCLE: E.START, I.RESTART: E.START}  # stopped/failed/backoff: start
_LOADING = {I.RUN: None, I.RECYCLE: E.STOP, I.RESTART: E.STOP, I.RETIRE: E.STOP, I.HALT: E.STOP}  # not in rotation: nothing to drain
# What an intent does in the states that wait for one: the event it fires, or None (nothing to
# do; the intent is simply done, except in `draining`, where it is the drain's). An intent that
# fires STOP or DRAIN from a running state stays held until `stopping` has finished, which then
# ends the stop as AFTER_STOP says.
ON_INTENT: dict[tuple[State, Intent], Event | None] = {
    (S.STOPPED, I.RUN): E.START,
    (S.STOPPED, I.RECYCLE): E.START,
    (S.STOPPED, I.RESTART): E.START,
    (S.STOPPED, I.RETIRE): None,
    (S.STOPPED, I.HALT): None,
    **{(S.FAILED, i): e for i, e in {**_AT_REST, I.RETIRE: E.STOP, I.HALT: E.STOP}.items()},
    **{(S.BACKOFF, i): e for i, e in {**_AT_REST, I.RETIRE: E.STOP, I.HALT: E.STOP}.items()},
    **{(S.STARTING, i): e for i, e in _LOADING.items()},
    **{(S.WARMING, i): e for i, e in _LOADING.items()},
    (S.READY, I.RUN): None,
    (S.READY, I.RECYCLE): E.DRAIN,
    (S.READY, I.RESTART): E.STOP,
    (S.READY, I.RETIRE): E.DRAIN,
    (S.READY, I.HALT): E.STOP,
    **{(S.UNHEALTHY, i): e for i, e in _LOADING.items()},  # stopped anyway: the intent decides how the stop ends
    (S.DRAINING, I.RUN): None,
    (S.DRAINING, I.RECYCLE): None,  # already draining
    (S.DRAINING, I.RESTART): E.STOP,  # asked to hurry: stop now
    (S.DRAINING, I.RETIRE): None,  # keeps draining; the stop now ends in `stopped`
    (S.DRAINING, I.HALT): E.STOP,
}
# How `stopping` ends, by the intent held when the tree is gone; with none (or RUN) the stop was a
# failure: UNRUNNABLE after an exit every restart would repeat (lifecycle.UNRUNNABLE_EXITS), else
# the restart policy chooses between CLEANED_UP and CRASH_LOOP.
AFTER_STOP: dict[Intent, Event] = {I.HALT: E.HALTED, I.RETIRE: E.HALTED, I.RESTART: E.RESTART, I.RECYCLE: E.RESTART}
RUNNING = frozenset({S.STARTING, S.WARMING, S.READY, S.UNHEALTHY, S.DRAINING})  # a process exists
# The reason a transition names when an intent fires it without a reason of its own.
ASKED_FOR = {I.RUN: "start requested", I.RECYCLE: "restart requested (drained first)",
             I.RESTART: "restart requested", I.RETIRE: "retired (drained first)", I.HALT: "stop requested"}
del S, E, I, _AT_REST, _LOADING


def diagram(transitions: dict[tuple[State, Event], State] | None = None) -> str:
    """`TRANSITIONS` as text: one line per (state, next state), the events between them in table
    order, states in `State` order, the arrows aligned. Every transition is on exactly one line."""
    table = TRANSITIONS if transitions is None else transitions
    rows: list[tuple[str, str, str]] = []
    for state in State:
        targets: dict[State, list[Event]] = {}
        for (src, event), dst in table.items():
            if src is state:
                targets.setdefault(dst, []).append(event)
        for n, (dst, events) in enumerate(targets.items()):
            rows.append((state.value if n == 0 else "", ", ".join(e.value for e in events), dst.value))
    name_width = max(len(name) for name, _, _ in rows)
    events_width = max(len(events) for _, events, _ in rows)
    return "\n".join(f"{name:<{name_width}}  ──{events}{'─' * (events_width - len(events))}──▶ {dst}"
                     for name, events, dst in rows) + "\n"
