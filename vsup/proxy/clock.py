"""The proxy's seam to time: every time limit of the proxy (the forwarder's watchdog, the client
connections' header and idle deadlines, passive ejection, the admission queue's deadlines and the
rate limits' buckets) reads and arms time through a `Clock`. The running event loop is one (the
default); tests pass a virtual clock (tests/virtual_clock.py) whose time moves only when told, so
that a 300 s first-byte limit is checked at 299 s and 301 s in microseconds."""

from __future__ import annotations

from typing import Any, Protocol


class Handle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def time(self) -> float: ...

    def call_at(self, when: float, callback: Any, *args: Any) -> Handle: ...

    def call_later(self, delay: float, callback: Any, *args: Any) -> Handle: ...
