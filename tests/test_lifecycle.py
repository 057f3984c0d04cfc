"""The instance state machine's table and the restart policy, without processes or clocks."""

from __future__ import annotations

import itertools
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vsup.config.schema import RestartConfig
from vsup.supervisor.backoff import RestartPolicy
from vsup.supervisor.lifecycle import RUNNING, TRANSITIONS, Event, InvalidTransition, State, describe_exit, next_state


def test_every_state_event_pair_maps_or_is_rejected():
    mapped = 0
    for state, event in itertools.product(State, Event):
        if (state, event) in TRANSITIONS:
            assert next_state(state, event) in State
            mapped += 1
        else:
            with pytest.raises(InvalidTransition, match=f"{event.value}.*{state.value}"):
                next_state(state, event)
    assert mapped == len(TRANSITIONS)


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


def config(**overrides) -> RestartConfig:
    values = dict(initial_delay=1.0, max_delay=10.0, multiplier=2.0, jitter=0.0, stable_after=300.0,
                  crash_loop_failures=100, crash_loop_window=600.0)
    values.update(overrides)
    return RestartConfig(**values)


def test_backoff_grows_exponentially_and_is_capped():
    policy = RestartPolicy(config())
    delays = [policy.on_failure(now=float(i), ready_since=None).delay for i in range(7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


@settings(max_examples=50, deadline=None)
@given(
    initial=st.floats(0, 5), max_delay=st.floats(0.1, 60), multiplier=st.floats(1, 4), jitter=st.floats(0, 3),
    failures=st.integers(1, 30),
)
def test_backoff_with_jitter_never_exceeds_the_cap_and_never_shrinks_below_the_exponential(initial, max_delay, multiplier, jitter, failures):
    policy = RestartPolicy(config(initial_delay=initial, max_delay=max_delay, multiplier=multiplier, jitter=jitter))
    for attempt in range(1, failures + 1):
        delay = policy.on_failure(now=float(attempt), ready_since=None).delay
        floor = min(initial * multiplier ** (attempt - 1), max_delay)
        assert floor - 1e-9 <= delay <= min(floor + jitter, max_delay) + 1e-9


def test_stable_period_resets_the_backoff():
    policy = RestartPolicy(config(stable_after=60))
    for now in (0, 1, 2):
        policy.on_failure(now=now, ready_since=None)
    assert policy.on_failure(now=3, ready_since=2.5).delay == 8.0  # ready only briefly: keeps growing
    assert policy.on_failure(now=200, ready_since=100).delay == 1.0  # ready 100 s >= 60 s: starts over


def test_crash_loop_is_failures_within_the_window():
    policy = RestartPolicy(config(crash_loop_failures=3, crash_loop_window=10))
    assert not policy.on_failure(now=0, ready_since=None).give_up
    assert not policy.on_failure(now=5, ready_since=None).give_up
    assert not policy.on_failure(now=11, ready_since=None).give_up  # the failure at 0 left the window
    decision = policy.on_failure(now=12, ready_since=None)  # 5, 11, 12
    assert decision.give_up and decision.failures_in_window == 3


def test_reset_gives_a_new_chance():
    policy = RestartPolicy(config(crash_loop_failures=2))
    policy.on_failure(now=0, ready_since=None)
    assert policy.on_failure(now=1, ready_since=None).give_up
    policy.reset()
    decision = policy.on_failure(now=2, ready_since=None)
    assert not decision.give_up and decision.delay == 1.0 and decision.attempt == 1
