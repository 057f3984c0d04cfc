"""CPU and memory of one instance's process tree (API server, EngineCore, Worker), via psutil.

A `TreeSample` holds each process's CPU seconds keyed by (pid, create time), so CPU % between two
samples counts only what the same processes used meanwhile: a process that exited drops out, a
new one counts from its start (its whole CPU time is recent). RSS sums the processes' resident
sets (shared pages counted in each, as `ps` would add them); PSS shares them out, so it sums to
the tree's real footprint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil


@dataclass(frozen=True)
class ProcFigures:
    pid: int
    created: float  # psutil's create_time: with the pid, the process's identity
    cpu_seconds: float  # user + system, all threads
    rss: int
    pss: int | None  # None where smaps cannot be read (another user's process)


def read_process(pid: int, pss: bool = True) -> ProcFigures | None:
    """None when the process is gone (or was never there). `pss`: read smaps_rollup for it (the
    kernel walks the process's page tables: ~50 ms of CPU for a 6 GB model's worker); else None."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            times = process.cpu_times()
            created = process.create_time()
            try:
                if not pss:
                    raise psutil.AccessDenied(pid)  # (statm only: the RSS, no page walk)
                memory = process.memory_full_info()  # smaps_rollup: PSS too
                rss, proportional = memory.rss, getattr(memory, "pss", None)
            except psutil.AccessDenied:
                rss, proportional = process.memory_info().rss, None
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    return ProcFigures(pid, created, times.user + times.system, rss, proportional)


@dataclass(frozen=True)
class TreeSample:
    at: float  # monotonic seconds
    cpu: dict[tuple[int, float], float] = field(default_factory=dict)  # (pid, created) -> CPU seconds
    rss: int = 0
    pss: int | None = 0
    pids: tuple[int, ...] = ()

    @property
    def cpu_seconds(self) -> float:
        return sum(self.cpu.values())


def tree_sample(figures: Iterable[ProcFigures], at: float) -> TreeSample:
    figures = list(figures)
    pss_known = all(f.pss is not None for f in figures)
    return TreeSample(
        at=at,
        cpu={(f.pid, f.created): f.cpu_seconds for f in figures},
        rss=sum(f.rss for f in figures),
        pss=sum(f.pss for f in figures) if pss_known else None,  # type: ignore[misc]
        pids=tuple(sorted(f.pid for f in figures)),
    )


def read_tree(pids: Iterable[int], at: float, pss: bool = True) -> TreeSample:
    return tree_sample((f for pid in pids if (f := read_process(pid, pss)) is not None), at)


def cpu_percent(before: TreeSample | None, after: TreeSample) -> float | None:
    """CPU used between two samples of the same tree, in % of one CPU (200 = two CPUs busy);
    None without an earlier sample."""
    if before is None or after.at <= before.at:
        return None
    used = sum(seconds - before.cpu.get(key, 0.0) for key, seconds in after.cpu.items())
    return 100.0 * used / (after.at - before.at)
