"""A recording stand-in for vsup/supervisor/host.py's `Host`: what `Supervisor` asks of its own
process and of the machine, written down instead of done (pytest does not become a subreaper, the
machine's /dev/shm is not swept). The in-process tests assert on `calls`."""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any


class RecordingHost:
    def __init__(self, *, subreaper: bool = True, drift: list[str] | None = None) -> None:
        self.subreaper = subreaper  # what become_subreaper answers
        self.drift = drift or []  # what placement_drift answers for every process
        self.calls: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()  # the sweep runs in a worker thread

    def _record(self, *call: Any) -> None:
        with self._lock:
            self.calls.append(call)

    def named(self, name: str) -> list[tuple[Any, ...]]:
        with self._lock:
            return [call for call in self.calls if call[0] == name]

    def pin_self(self, cpus: Collection[int]) -> None:
        self._record("pin_self", sorted(cpus))

    def become_subreaper(self) -> bool:
        self._record("become_subreaper")
        return self.subreaper

    def reap_orphans(self) -> list[int]:
        self._record("reap_orphans")
        return []

    def sweep_stale_shm(self) -> list[str]:
        self._record("sweep_stale_shm")
        return []

    def placement_drift(self, process: Any, cpus: Collection[int], nodes: Collection[int] | None) -> list[str] | None:
        self._record("placement_drift", process.pid, sorted(cpus), None if nodes is None else sorted(nodes))
        return list(self.drift)
