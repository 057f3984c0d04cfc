"""The supervisor's seam to the machine it runs on: what `Supervisor` itself does to this process
and to the host, in one small object (the role of supervisord's `options`).

The per-instance driver has its own seam (operations.py: spawn, stop a tree, probe...); `Host` is
the level above: pin vsup to the reserved CPUs, become the subreaper of the instances' orphans,
reap them, sweep stale /dev/shm files, and read where an instance's threads really run.
`SystemHost` does it for real; the in-process tests (tests/test_supervisor_inprocess.py) pass a
recording fake, so pytest neither becomes a subreaper nor sweeps the machine's /dev/shm, and the
tests see what the supervisor asked for.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from vsup.supervisor import placement, processes

if TYPE_CHECKING:
    from vsup.supervisor.operations import Process


class Host(Protocol):
    def pin_self(self, cpus: Collection[int]) -> None:
        """Pin every thread of vsup to `cpus`; VsupError (one line) when they are not available."""

    def become_subreaper(self) -> bool:
        """Adopt the instances' orphaned processes; False where the kernel refuses."""

    def reap_orphans(self) -> list[int]:
        """Reap adopted zombie orphans of the instances (cheap: called every tick)."""

    def sweep_stale_shm(self) -> list[str]:
        """Remove stale /dev/shm files of ours that no live process uses; the paths removed.
        Runs in a worker thread."""

    def placement_drift(self, process: Process, cpus: Collection[int], nodes: Collection[int] | None) -> list[str] | None:
        """Where the threads of `process`'s tree run outside `cpus` (and memory `nodes`), one line
        per thread; [] when none does; None when the process is not one this host can read."""


class SystemHost:
    """The real machine: this process, /proc, /dev/shm."""

    def pin_self(self, cpus: Collection[int]) -> None:
        placement.pin_self(cpus)

    def become_subreaper(self) -> bool:
        return processes.become_subreaper()

    def reap_orphans(self) -> list[int]:
        return processes.reap_orphans()

    def sweep_stale_shm(self) -> list[str]:
        return processes.sweep_stale_shm()

    def placement_drift(self, process: Process, cpus: Collection[int], nodes: Collection[int] | None) -> list[str] | None:
        if not isinstance(process, processes.Child):
            return None
        return placement.placement_drift(placement.read_placement(processes.tree_pids(process)), cpus, nodes)
