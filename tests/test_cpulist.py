"""The kernel's two CPU-set notations: lists ("0-3,8") and masks ("00000000,0000ff0f")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vsup.topology.cpulist import format_list, format_mask, parse_list, parse_mask

cpu_sets = st.frozensets(st.integers(min_value=0, max_value=1100), max_size=200)


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0-3,8", {0, 1, 2, 3, 8}),
        ("", set()),
        ("\n", set()),
        ("5\n\x00\x00\x00", {5}),
        ("0-2,4-5\n", {0, 1, 2, 4, 5}),
        ("7,3,3", {3, 7}),
        ("0-3,", {0, 1, 2, 3}),
        ("0-15:2/4", {0, 1, 4, 5, 8, 9, 12, 13}),  # the kernel's grouped ranges
        ("0-1023:2/256", {0, 1, 256, 257, 512, 513, 768, 769}),
        ("0-5:4/4", {0, 1, 2, 3, 4, 5}),
    ],
)
def test_parse_list(text, cpus):
    assert parse_list(text) == frozenset(cpus)


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "+1", "1_0", "0x1", "1 2", "0-7:2", "0-7:3/2", "0-7:0/4"])
def test_parse_list_rejects_what_the_kernel_never_writes(text):
    with pytest.raises(ValueError):
        parse_list(text)


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0000000f", {0, 1, 2, 3}),
        ("00000000,0000000f", {0, 1, 2, 3}),
        ("00000001,00000000", {32}),
        ("1,0", {32}),  # short groups are still 32 bits each
        ("1f", {0, 1, 2, 3, 4}),
        ("00000000\x00\n", set()),
        ("", set()),
        ("0000,00000011,11111111", {0, 4, 8, 12, 16, 20, 24, 28, 32, 36}),
        ("ffffffff," * 7 + "ffffffff", set(range(256))),
    ],
)
def test_parse_mask(text, cpus):
    assert parse_mask(text) == frozenset(cpus)


@pytest.mark.parametrize("text", ["zz", "0x0f", "0f,,0f", "100000000,0", "1 2", "-1"])
def test_parse_mask_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_mask(text)


def test_format_list():
    assert format_list([8, 3, 0, 1, 2]) == "0-3,8"
    assert format_list([]) == ""
    assert format_list([5]) == "5"
    assert format_list([1, 3, 5]) == "1,3,5"


def test_format_mask_is_the_kernels_notation():
    assert format_mask({0, 1, 2, 3}) == "0000000f"
    assert format_mask({32}) == "00000001,00000000"
    assert format_mask({0}, min_groups=3) == "00000000,00000000,00000001"
    assert format_mask(set()) == "00000000"


@given(cpu_sets)
def test_list_round_trip(cpus):
    assert parse_list(format_list(cpus)) == cpus


@given(cpu_sets)
def test_mask_round_trip(cpus):
    assert parse_mask(format_mask(cpus)) == cpus
    assert parse_mask(format_mask(cpus) + "\n\x00") == cpus
