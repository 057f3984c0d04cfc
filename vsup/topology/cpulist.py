"""Parse and format the two CPU-set notations the kernel uses.

- list:  "0-3,8,10-11"          (cpulist, shared_cpu_list, cpuset.cpus, isolated, online)
- mask:  "00000000,0000ff0f"    (cpumap, thread_siblings, shared_cpu_map): hex, 32-bit comma groups,
         most significant group first, any width.

Both tolerate the trailing newline / NUL bytes that sysfs and hand-made dumps leave behind, and
both reject anything else (signs, underscores, "0x" prefixes) so that a corrupt file is reported
instead of silently read as some other set.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBER = re.compile(r"\d+")
# "lo-hi" or "lo-hi:used/group" (the kernel's grouped-range form: "0-1023:2/256" takes the first
# 2 CPUs of every group of 256 between 0 and 1023).
_RANGE = re.compile(r"(\d+)-(\d+)(?::(\d+)/(\d+))?")
_HEX_GROUP = re.compile(r"[0-9a-fA-F]+")


def _clean(text: str) -> str:
    return text.replace("\x00", "").strip()


def parse_list(text: str) -> frozenset[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}. An empty string is the empty set. Raises ValueError when malformed."""
    text = _clean(text)
    cpus: set[int] = set()
    if not text:
        return frozenset()
    for raw_part in text.split(","):
        part = raw_part.strip()
        if not part:  # "0-3," from hand-made dumps: harmless, skip it
            continue
        if _NUMBER.fullmatch(part):
            cpus.add(int(part))
            continue
        match = _RANGE.fullmatch(part)
        if not match:
            raise ValueError(f"bad CPU list item {part!r} (expected N or N-M)")
        lo, hi = int(match.group(1)), int(match.group(2))
        if hi < lo:
            raise ValueError(f"bad CPU range {part!r}: end before start")
        if match.group(3) is None:
            cpus.update(range(lo, hi + 1))
            continue
        used, group = int(match.group(3)), int(match.group(4))
        if used <= 0 or group <= 0 or used > group:
            raise ValueError(f"bad CPU range {part!r}: expected lo-hi:used/group with 0 < used <= group")
        for start in range(lo, hi + 1, group):
            cpus.update(range(start, min(start + used, hi + 1)))
    return frozenset(cpus)


def parse_mask(text: str) -> frozenset[int]:
    """"00000000,0000000f" -> {0, 1, 2, 3}. Raises ValueError when it is not a hex mask.

    Each comma group holds 32 CPUs, so the groups are shifted by 32 bits rather than concatenated:
    a hand-written "1,0" means CPU 32, not CPU 4."""
    text = _clean(text)
    if not text:
        return frozenset()
    groups = [g.strip() for g in text.split(",")]
    value = 0
    for group in groups:
        if not _HEX_GROUP.fullmatch(group):
            raise ValueError(f"bad CPU mask {text!r}: {group!r} is not a hex group")
        if len(groups) > 1 and int(group, 16) >> 32:
            raise ValueError(f"bad CPU mask {text!r}: group {group!r} is wider than 32 bits")
        value = (value << 32) | int(group, 16)
    cpus = set()
    index = 0
    while value:
        if value & 1:
            cpus.add(index)
        value >>= 1
        index += 1
    return frozenset(cpus)


def format_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8" (the notation numactl, taskset and vLLM accept)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def format_mask(cpus: Iterable[int], *, min_groups: int = 1) -> str:
    """{0, 1, 2, 3} -> "0000000f": the kernel's cpumap notation (32-bit groups, most significant
    first). Used by tests to write sysfs files the way the kernel does."""
    value = 0
    for cpu in set(cpus):
        if cpu < 0:
            raise ValueError(f"bad CPU number {cpu}")
        value |= 1 << cpu
    groups: list[str] = []
    while value or len(groups) < min_groups:
        groups.append(f"{value & 0xFFFFFFFF:08x}")
        value >>= 32
    return ",".join(reversed(groups))
