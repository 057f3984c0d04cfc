"""A `Clock` for the proxy (vsup/proxy/clock.py) on the lifecycle tests' virtual time
(tests/lifecycle_fakes.VirtualClock, trio's autojump clock by hand): timers armed through it fire
only when the test moves time on (`advance`, or `run_until`, which jumps to the next timer while
nothing else can run). Real sockets, real processes: only the proxy's time limits are virtual, so
a 300 s limit is checked at 299 s and at 301 s in well under a second of real time."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from typing import Any

from tests.lifecycle_fakes import VirtualClock


class _Timer:
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future

    def cancel(self) -> None:
        self.future.cancel()


class ProxyClock:
    def __init__(self) -> None:
        self.virtual = VirtualClock()

    def time(self) -> float:
        return self.virtual.time

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> _Timer:
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda done: None if done.cancelled() else callback(*args))
        heapq.heappush(self.virtual._sleepers, (when, next(self.virtual._order), future))
        return _Timer(future)

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> _Timer:
        return self.call_at(self.virtual.time + max(0.0, delay), callback, *args)

    async def advance(self, seconds: float) -> None:
        await self.virtual.advance(seconds)
