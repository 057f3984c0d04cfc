"""Parse and format the two CPU-set notations the kernel uses.

- list:  "0-3,8,10-11"          (cpulist, shared_cpu_list, cpuset.cpus, isolated, online)
- mask:  "00000000,0000ff0f"    (cpumap, thread_siblings, shared_cpu_map): hex, 32-bit comma groups,
         most significant group first, any width.

Both tolerate the trailing newline / NUL bytes that sysfs and hand-made dumps leave behind.
"""

from __future__ import annotations

from collections.abc import Iterable


def _clean(text: str) -> str:
    return text.replace("\x00", "").strip()


def parse_list(text: str) -> frozenset[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}. An empty string is the empty set. Raises ValueError when malformed."""
    text = _clean(text)
    cpus: set[int] = set()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo_s, _, hi_s = part.partition("-")
            stride = 1
            if ":" in hi_s:  # "0-15:2" (rare, but the kernel accepts it in cpusets)
                hi_s, _, stride_s = hi_s.partition(":")
                stride = int(stride_s.split("/")[0])
            lo, hi = int(lo_s), int(hi_s)
            if hi < lo or lo < 0 or stride <= 0:
                raise ValueError(f"bad CPU range {part!r}")
            cpus.update(range(lo, hi + 1, stride))
        else:
            value = int(part)
            if value < 0:
                raise ValueError(f"bad CPU number {part!r}")
            cpus.add(value)
    return frozenset(cpus)


def parse_mask(text: str) -> frozenset[int]:
    """"00000000,0000000f" -> {0, 1, 2, 3}. Raises ValueError when it is not hex."""
    text = _clean(text)
    if not text:
        return frozenset()
    bits = int(text.replace(",", ""), 16)
    cpus = set()
    index = 0
    while bits:
        if bits & 1:
            cpus.add(index)
        bits >>= 1
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
