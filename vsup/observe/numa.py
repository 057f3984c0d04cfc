"""Where a process's memory lives: bytes per NUMA node, from /proc/<pid>/numa_maps.

Each mapping line carries `N<node>=<pages>` counts and `kernelpagesize_kB=<k>` (4 for normal
pages, 2048 for huge pages); bytes = pages × that page size. Pages shared between processes
(libraries, /dev/shm) are counted in every process that maps them, like RSS: a tree's sum
overstates its total but not the share of it that is local.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)")
_PAGE_KB = re.compile(r"\bkernelpagesize_kB=(\d+)")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def parse_numa_maps(text: str, page_size: int = PAGE_SIZE) -> dict[int, int]:
    """Bytes per node in one numa_maps text; `page_size` for lines that do not name theirs."""
    by_node: dict[int, int] = {}
    for line in text.splitlines():
        counts = _NODE_PAGES.findall(line)
        if not counts:
            continue
        size = _PAGE_KB.search(line)
        line_page = int(size.group(1)) * 1024 if size else page_size
        for node, pages in counts:
            by_node[int(node)] = by_node.get(int(node), 0) + int(pages) * line_page
    return by_node


def read_numa_bytes(pid: int, proc_root: str | Path = "/proc") -> dict[int, int] | None:
    """Bytes per node of one process; None when it is gone or its numa_maps cannot be read
    (another user's process, a kernel without NUMA)."""
    try:
        with open(Path(proc_root) / str(pid) / "numa_maps", encoding="ascii", errors="replace") as f:
            return parse_numa_maps(f.read())
    except OSError:
        return None


def add_up(parts: Iterable[Mapping[int, int]]) -> dict[int, int]:
    total: dict[int, int] = {}
    for part in parts:
        for node, size in part.items():
            total[node] = total.get(node, 0) + size
    return total


def local_split(by_node: Mapping[int, int], nodes: Iterable[int]) -> tuple[int, int]:
    """(bytes on the instance's own nodes, bytes elsewhere)."""
    own = set(nodes)
    local = sum(size for node, size in by_node.items() if node in own)
    return local, sum(by_node.values()) - local


def local_ratio(by_node: Mapping[int, int], nodes: Iterable[int]) -> float | None:
    """Share of the memory on the instance's own nodes (0..1); None when there is none to judge."""
    local, remote = local_split(by_node, nodes)
    return local / (local + remote) if local + remote else None
