"""Weighted balancing for `vsup proxy` in front of other vsups: the balancer's shares and the
parsing of a vsup's /ready answer (pure parts; tests/test_multihost.py runs the whole thing)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vsup.proxy.backends import Backend
from vsup.proxy.balancer import LeastOutstanding, RoundRobin
from vsup.proxy.healthcheck import parse_ready

A, B, C = (Backend(name, f"http://{name}:8000") for name in ("a", "b", "c"))


def picks(balancer, ready, count: int, tried=()) -> list[str]:
    return [balancer.choose(ready, {}, tried).name for _ in range(count)]


def test_weights_give_exact_shares_spread_out():
    balancer = RoundRobin()
    balancer.set_weight("a", 4)
    balancer.set_weight("b", 2)
    sequence = picks(balancer, (A, B), 60)
    assert Counter(sequence) == {"a": 40, "b": 20}
    # smooth: never more than two a's in a row, b never twice in a row
    text = "".join(sequence)
    assert "aaa" not in text and "bb" not in text


def test_three_weights_and_a_change_of_weight():
    balancer = RoundRobin()
    for name, weight in (("a", 3), ("b", 2), ("c", 1)):
        balancer.set_weight(name, weight)
    assert Counter(picks(balancer, (A, B, C), 60)) == {"a": 30, "b": 20, "c": 10}
    balancer.set_weight("a", 1)
    assert Counter(picks(balancer, (A, B, C), 40)) == {"a": 10, "b": 20, "c": 10}


def test_all_weights_back_to_one_is_plain_round_robin():
    balancer = RoundRobin()
    balancer.set_weight("a", 5)
    balancer.set_weight("a", 1)
    assert picks(balancer, (A, B, C), 6) == ["a", "b", "c", "a", "b", "c"]


def test_a_backend_leaving_the_rotation_leaves_the_others_their_shares():
    balancer = RoundRobin()
    balancer.set_weight("a", 4)
    balancer.set_weight("b", 2)
    picks(balancer, (A, B), 7)
    assert set(picks(balancer, (B,), 5)) == {"b"}
    assert Counter(picks(balancer, (A, B), 60)) == {"a": 40, "b": 20}


def test_retries_skip_the_tried_backend_even_when_it_is_the_heaviest():
    balancer = RoundRobin()
    balancer.set_weight("a", 10)
    assert picks(balancer, (A, B), 5, tried=("a",)) == ["b"] * 5
    assert balancer.choose((A, B), {}, ("a", "b")) is None
    assert balancer.choose((), {}, ()) is None


def test_least_outstanding_counts_in_flight_per_unit_of_weight():
    balancer = LeastOutstanding()
    balancer.set_weight("a", 4)
    balancer.set_weight("b", 2)
    # a: 3 in flight for weight 4 (0.75) is less loaded than b: 2 for weight 2 (1.0)
    assert balancer.choose((A, B), {"a": 3, "b": 2}).name == "a"
    assert balancer.choose((A, B), {"a": 5, "b": 2}).name == "b"
    # idle: the weighted rotation breaks the ties
    assert Counter(balancer.choose((A, B), {}).name for _ in range(30)) == {"a": 20, "b": 10}


def test_a_weight_below_one_is_refused():
    with pytest.raises(ValueError, match="must be at least 1"):
        RoundRobin().set_weight("a", 0)


@pytest.mark.parametrize(
    "status, body, expected",
    [
        (200, {"ready": True, "instances_ready": 4, "instances": 4, "draining": False}, 4),
        (200, {"ready": True, "instances_ready": 1, "instances": 2, "draining": False}, 1),
        (503, {"ready": False, "instances_ready": 0, "instances": 2, "draining": False}, 0),
        (503, {"ready": False, "instances_ready": 2, "instances": 2, "draining": True}, 0),
        (404, {"detail": "Not Found"}, None),  # vLLM, the fake vLLM: no /ready
        (200, {"status": "ok"}, None),
        (200, {"instances_ready": "4"}, None),
        (200, {"instances_ready": True}, None),
        (500, {"instances_ready": 3}, None),
    ],
)
def test_parse_ready(status, body, expected):
    assert parse_ready(status, json.dumps(body).encode()) == expected


def test_parse_ready_of_something_that_is_not_json():
    assert parse_ready(200, b"OK") is None
    assert parse_ready(200, b"[1, 2]") is None
