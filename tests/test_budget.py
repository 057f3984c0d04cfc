"""vsup/proxy/budget.py: the proxy-wide budget of request-body bytes held at once, its default
sized from the machine, and the proxy.max_body_buffer key that sets it."""

from __future__ import annotations

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vsup.config.schema import ProxyConfig, parse_config
from vsup.errors import ConfigError
from vsup.proxy.budget import CEILING, FLOOR, BodyBudget, configured_limit, default_limit

MiB = 1024**2
GiB = 1024**3


@given(limit=st.integers(0, 512 * MiB),
       steps=st.lists(st.tuples(st.booleans(), st.integers(0, 64 * MiB)), max_size=80))
def test_reserve_and_release_account_for_every_byte(limit, steps):
    budget = BodyBudget(limit)
    held: list[int] = []  # what the callers hold, as the model sees it
    peak = refused = 0
    for take, n in steps:
        if take:
            fits = sum(held) + n <= limit
            assert budget.reserve(n) is fits  # all or nothing
            if fits:
                held.append(n)
            else:
                refused += 1
        elif held:
            budget.release(held.pop(n % len(held)))
        peak = max(peak, sum(held))
        assert budget.held == sum(held) <= budget.limit == limit
        assert budget.free == limit - sum(held) and budget.peak == peak and budget.refused == refused
    assert budget.reset_peak() == peak and budget.peak == budget.held
    for n in held:
        budget.release(n)
    assert budget.held == 0


def test_releasing_more_than_is_held_is_refused_and_changes_nothing():
    budget = BodyBudget(10 * MiB)
    assert budget.reserve(3 * MiB) and not budget.reserve(8 * MiB)
    for wrong in (3 * MiB + 1, -1):
        with pytest.raises(ValueError, match="cannot release"):
            budget.release(wrong)
    assert budget.held == 3 * MiB
    with pytest.raises(ValueError, match="cannot reserve"):
        budget.reserve(-5)
    assert budget.held == 3 * MiB and budget.refused == 1
    assert BodyBudget(0).reserve(0) and not BodyBudget(0).reserve(1)
    with pytest.raises(ValueError):
        BodyBudget(-1)


def test_the_default_is_a_512th_of_memory_within_32_and_256_mib():
    assert default_limit(24 * GiB) == 48 * MiB
    assert default_limit(4 * GiB) == FLOOR == 32 * MiB
    assert default_limit(64 * GiB) == 128 * MiB
    assert default_limit(2048 * GiB) == CEILING == 256 * MiB
    assert default_limit(0) == FLOOR


def test_on_this_machine_the_flood_of_issue_29_stays_far_below_100_mib():
    # 60 connections of 8 MiB bodies: at most the limit is held, whatever the rest get
    limit = default_limit(psutil.virtual_memory().total)
    assert limit <= 64 * MiB < 60 * 8 * MiB
    budget = BodyBudget(limit)
    held = sum(8 * MiB for _ in range(60) if budget.reserve(8 * MiB))
    assert held == budget.held <= limit and budget.refused == 60 - held // (8 * MiB) > 0


@given(st.integers(0, 1 << 44), st.integers(0, 1 << 44))
def test_the_default_grows_with_memory_in_whole_mib(a, b):
    low, high = sorted((a, b))
    assert FLOOR <= default_limit(low) <= default_limit(high) <= CEILING
    assert default_limit(high) % MiB == 0


def test_auto_is_the_default_never_below_max_body_bytes():
    assert configured_limit(100 * MiB, 8 * MiB, 24 * GiB) == 100 * MiB
    assert configured_limit("auto", 8 * MiB, 24 * GiB) == configured_limit(None, 8 * MiB, 24 * GiB) == 48 * MiB
    assert configured_limit("auto", 300 * MiB, 24 * GiB) == 300 * MiB  # one accepted body must fit


def test_the_key_auto_by_default_at_least_max_body_bytes():
    assert ProxyConfig().max_body_buffer == "auto"
    assert parse_config("model: /srv/m\nproxy: {max_body_buffer: null}\n", "f.yaml").proxy.max_body_buffer is None
    assert parse_config("model: /srv/m\nproxy: {max_body_buffer: 67108864}\n", "f.yaml").proxy.max_body_buffer == 64 * MiB
    assert parse_config("model: /srv/m\nproxy: {max_body_buffer: 8388608}\n", "f.yaml").proxy.max_body_buffer == 8 * MiB


@pytest.mark.parametrize("text, message", [
    ("model: /srv/m\nproxy: {max_body_buffer: 1048576}\n",
     "max_body_buffer (1048576) must be at least max_body_bytes (8388608)"),
    ("model: /srv/m\nproxy: {max_body_bytes: 16777216, max_body_buffer: 16777215}\n",
     "max_body_buffer (16777215) must be at least max_body_bytes (16777216)"),
    ("model: /srv/m\nproxy: {max_body_buffer: 64MiB}\n", "proxy.max_body_buffer: '64MiB' is not valid"),
    ("models:\n  - {model: /srv/a, proxy: {max_body_buffer: 67108864}}\n", "models[0].proxy.max_body_buffer: is machine-wide"),
])
def test_errors_name_both_keys_on_one_line(text, message):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "f.yaml")
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("f.yaml:")
