"""The instance state machine's table and the restart policy, without processes or clocks."""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vsup.config.schema import RestartConfig
from vsup.supervisor import backoff
from vsup.supervisor.backoff import RestartPolicy
from vsup.supervisor.lifecycle import describe_exit
from vsup.supervisor.states import RUNNING, TRANSITIONS, Event, InvalidTransition, State, diagram, next_state

# The whole table, written out once more by hand: an edit of TRANSITIONS that adds, drops or
# redirects a transition fails here until this list (and the docs' diagram) say the same.
EXPECTED = """
stopped start starting
starting healthy warming
starting startup_timeout stopping
starting stalled stopping
starting impostor stopping
starting exited stopping
starting stop stopping
warming warmed ready
warming warmup_failed stopping
warming exited stopping
warming stop stopping
ready unhealthy unhealthy
ready drain draining
ready exited stopping
ready stop stopping
unhealthy exited stopping
unhealthy stop stopping
draining drained stopping
draining exited stopping
draining stop stopping
stopping cleaned_up backoff
stopping crash_loop failed
stopping unrunnable failed
stopping restart starting
stopping halted stopped
backoff delay_over starting
backoff start starting
backoff stop stopped
failed start starting
failed stop stopped
"""


def test_the_table_is_exactly_the_expected_transitions():
    expected = {(State(src), Event(event)): State(dst) for src, event, dst in map(str.split, EXPECTED.strip().splitlines())}
    table = dict(TRANSITIONS)
    assert {k: v for k, v in table.items() if expected.get(k) != v} == {}, "in TRANSITIONS, not as expected"
    assert {k: v for k, v in expected.items() if table.get(k) != v} == {}, "expected, not in TRANSITIONS"


def test_a_pair_outside_the_table_is_rejected_naming_both():
    rejected = [(s, e) for s, e in itertools.product(State, Event) if (s, e) not in TRANSITIONS]
    assert len(rejected) == len(State) * len(Event) - len(TRANSITIONS) > 0
    for state, event in rejected:
        with pytest.raises(InvalidTransition, match=f"{event.value!r} is not valid in state {state.value!r}"):
            next_state(state, event)


def test_every_event_moves_some_state():
    # an event no row accepts is a dead name (or a row was lost)
    assert {event for _, event in TRANSITIONS} == set(Event)


def test_the_docs_carry_the_diagram_of_the_table():
    script = Path(__file__).resolve().parents[1] / "scripts" / "lifecycle_diagram.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}".strip()


def test_the_diagram_shows_every_transition_once():
    lines = diagram().splitlines()
    shown, src = [], None
    for line in lines:
        name, rest = line.split("──", 1)
        src = name.strip() or src
        events, dst = rest.split("──▶ ")
        shown += [(State(src), Event(e), State(dst)) for e in events.strip("─").split(", ")]
    assert sorted(shown) == sorted((s, e, d) for (s, e), d in TRANSITIONS.items())
    assert len({line.index("▶") for line in lines}) == 1  # the arrows line up


def test_every_state_is_reachable_from_stopped_and_can_get_back_to_stopped():
    def reachable(start: State) -> set[State]:
        seen, todo = {start}, [start]
        while todo:
            state = todo.pop()
            for (src, _), dst in TRANSITIONS.items():
                if src is state and dst not in seen:
                    seen.add(dst)
                    todo.append(dst)
        return seen

    assert reachable(State.STOPPED) == set(State)
    for state in State:
        assert State.STOPPED in reachable(state), f"{state} cannot be stopped"


def test_only_a_healthy_start_that_warmed_up_leads_to_ready():
    into_ready = [(src, event) for (src, event), dst in TRANSITIONS.items() if dst is State.READY]
    assert into_ready == [(State.WARMING, Event.WARMED)]
    into_warming = [(src, event) for (src, event), dst in TRANSITIONS.items() if dst is State.WARMING]
    assert into_warming == [(State.STARTING, Event.HEALTHY)]


def test_only_a_ready_instance_is_drained_and_a_drain_always_ends_in_a_stop():
    into_draining = [(src, event) for (src, event), dst in TRANSITIONS.items() if dst is State.DRAINING]
    assert into_draining == [(State.READY, Event.DRAIN)]
    out_of_draining = {dst for (src, _), dst in TRANSITIONS.items() if src is State.DRAINING}
    assert out_of_draining == {State.STOPPING}


def test_every_running_state_handles_an_exit_and_a_stop():
    # a process exists in these states: its exit and a stop request must always be accepted
    assert RUNNING == {State.STARTING, State.WARMING, State.READY, State.UNHEALTHY, State.DRAINING}
    for state in RUNNING:
        assert next_state(state, Event.EXITED) is State.STOPPING
        assert next_state(state, Event.STOP) is State.STOPPING


def test_failed_leaves_only_on_request():
    out_of_failed = {event for (src, event) in TRANSITIONS if src is State.FAILED}
    assert out_of_failed == {Event.START, Event.STOP}


def test_describe_exit_says_code_zero_is_a_failure_and_names_signals():
    assert "code 0" in describe_exit(0) and "engine" in describe_exit(0)
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL).startswith("killed by SIGKILL")
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    # SIGILL: what it is, and the cause behind it on a vLLM server (the words of vsup/topology/isa.py)
    assert describe_exit(-signal.SIGILL) == (
        "killed by SIGILL (illegal instruction): the CPU lacks an instruction this vLLM build uses (AVX2, or AVX-512 "
        "for a build made for it; on an AMX CPU also bf16 with --enforce-eager: --dtype float32); see vsup doctor")


def config(**overrides) -> RestartConfig:
    values = dict(max_delay=10.0, stable_after=300.0, max_failures=100)
    values.update(overrides)
    return RestartConfig(**values)


@pytest.fixture
def no_jitter(monkeypatch):
    monkeypatch.setattr(backoff, "JITTER", 0.0)


def test_backoff_doubles_from_one_second_and_is_capped(no_jitter):
    policy = RestartPolicy(config())
    delays = [policy.on_failure(now=float(i), ready_since=None).delay for i in range(7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_a_max_delay_under_one_second_is_every_wait_jitter_included():
    policy = RestartPolicy(config(max_delay=0.25))
    assert {policy.on_failure(now=float(i), ready_since=None).delay for i in range(20)} == {0.25}


@settings(max_examples=50, deadline=None)
@given(max_delay=st.floats(0.1, 600), failures=st.integers(1, 30), seed=st.integers(0, 2**32 - 1))
def test_backoff_with_jitter_never_exceeds_the_cap_and_never_shrinks_below_the_doubling(max_delay, failures, seed):
    random.seed(seed)  # tenacity's jitter draws from `random`
    policy = RestartPolicy(config(max_delay=max_delay))
    first = min(backoff.FIRST_DELAY, max_delay)
    for attempt in range(1, failures + 1):
        delay = policy.on_failure(now=float(attempt), ready_since=None).delay
        floor = min(first * backoff.GROWTH ** (attempt - 1), max_delay)
        assert floor - 1e-9 <= delay <= min(floor + min(backoff.JITTER, first), max_delay) + 1e-9


def test_a_start_that_counted_resets_the_backoff(no_jitter):
    policy = RestartPolicy(config(stable_after=60))
    for now in (0, 1, 2):
        policy.on_failure(now=now, ready_since=None)
    assert policy.on_failure(now=3, ready_since=2.5).delay == 8.0  # ready only briefly: keeps growing
    assert policy.on_failure(now=200, ready_since=100).delay == 1.0  # ready 100 s >= 60 s: starts over


def test_a_crash_loop_is_max_failures_in_a_row_however_far_apart():
    policy = RestartPolicy(config(max_failures=3, stable_after=60))
    assert not policy.on_failure(now=0, ready_since=None).give_up
    assert not policy.on_failure(now=5000, ready_since=4990).give_up  # ready 10 s: the start did not count
    decision = policy.on_failure(now=90_000, ready_since=None)  # a day later, still never stable
    assert decision.give_up and decision.attempt == 3


def test_failures_with_a_start_that_counted_between_them_never_make_a_crash_loop():
    policy = RestartPolicy(config(max_failures=3, stable_after=60))
    for i in range(10):
        decision = policy.on_failure(now=100.0 * i, ready_since=100.0 * i - 60)
        assert not decision.give_up and decision.attempt == 1


