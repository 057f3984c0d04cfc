"""Memory figures from /proc/meminfo and /sys/devices/system/node/nodeN/meminfo.

Both list "Name: value kB"; the per-node file prefixes each line with "Node N ". Raw MemFree
leaves out the page cache, so plans budget from an estimate of available memory instead."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vsup.topology.errors import TopologyError

_LINE = re.compile(r"^(?:Node\s+\d+\s+)?([A-Za-z0-9_()]+):\s+(\d+)(?:\s+kB)?\s*$")


@dataclass(frozen=True)
class Memory:
    total_bytes: int
    free_bytes: int
    available_bytes: int


def parse_meminfo(text: str) -> dict[str, int]:
    """Name -> value in bytes (HugePages_* counts stay counts). Unknown line shapes are skipped."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match:
            name, number = match.group(1), int(match.group(2))
            values[name] = number * 1024 if line.rstrip().endswith("kB") else number
    return values


def memory_from_meminfo(text: str, path: str) -> Memory:
    """MemTotal is required; available = MemFree + Active(file) + Inactive(file) + SReclaimable.

    Kernels before 2.6.28 have no Active(file)/Inactive(file): FilePages (the page cache) stands
    in for them. Kernels without SReclaimable count it as 0."""
    values = parse_meminfo(text)
    if "MemTotal" not in values:
        raise TopologyError(f"{path}: no MemTotal line; expected lines like 'Node 0 MemTotal: 16384 kB'")
    total = values["MemTotal"]
    free = values.get("MemFree", 0)
    if "Active(file)" in values or "Inactive(file)" in values:
        cache = values.get("Active(file)", 0) + values.get("Inactive(file)", 0)
    else:
        cache = values.get("FilePages", 0)
    available = min(total, free + cache + values.get("SReclaimable", 0))
    return Memory(total_bytes=total, free_bytes=free, available_bytes=available)
