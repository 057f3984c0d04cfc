"""The contract between whoever knows the instances' health and the proxy that routes to them.

The supervisor (or, in `vsup proxy`, the proxy's own health checker) calls `set_state`; the proxy
reads `ready()` on every request, so an instance leaves the rotation the moment its state changes,
not at the next poll. Single event loop: no locks needed.

The proxy may also `eject` an instance it has just failed to reach (passive health, as nginx's
max_fails and Envoy's outlier detection): it leaves the rotation at once, and comes back when its
owner next reports it ready (the health checker's next success, the supervisor's restart) or, at
the latest, when the ejection runs out — so a refusal that was not a death costs little.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vsup.proxy.clock import Clock, Handle


@dataclass(frozen=True)
class Backend:
    name: str  # instance index ("0", "1", ...) or, for static upstreams, the URL
    url: str  # base URL without a trailing slash, e.g. http://127.0.0.1:8100
    # The served model name of the instance (`vsup run`: its model's name); "" = not known (the
    # upstreams of a standalone `vsup proxy`): routing then ignores the body's model (routing.py).
    model: str = ""
    # Where the instance publishes its KV-cache events (a ZMQ endpoint; kv_aware); "" = it does not.
    kv_events: str = ""


Listener = Callable[[Backend, str, bool], None]


class BackendPool:
    def __init__(self, backends: Iterable[Backend] = ()) -> None:
        self._backends: dict[str, Backend] = {}
        self._state: dict[str, str] = {}
        self._ready: dict[str, bool] = {}
        self._listeners: list[Listener] = []
        self._leaving: dict[str, list[asyncio.Future]] = {}  # wait_not_ready() callers
        self._ejected: dict[str, Handle] = {}  # name -> the timer that ends its ejection
        self.clock: Clock | None = None  # the ejections' timers (the proxy sets its clock; None: the loop)
        self.on_stalled: Callable[[str, str], None] | None = None  # the owner's answer to a hung instance
        self._rotation: tuple[Backend, ...] = ()  # ready(), rebuilt when readiness changes, not per request
        # Bumped at each rebuild: what routing.py's per-model tables compare, one int per request.
        self.version = 0
        for backend in backends:
            self.add(backend)

    def add(self, backend: Backend, state: str = "starting") -> None:
        self._backends[backend.name] = backend
        self._state[backend.name] = state
        self._ready[backend.name] = False
        self._rebuild_rotation()

    def remove(self, name: str) -> None:
        """`name` leaves for good (a reload replaced or removed the instance); it is out of the
        rotation first, so its waiters and listeners hear that."""
        if name not in self._backends:
            return
        self.set_state(name, "removed", False)
        del self._backends[name], self._state[name], self._ready[name]
        self._rebuild_rotation()

    def set_state(self, name: str, state: str, ready: bool) -> None:
        if name not in self._backends:
            raise KeyError(name)
        was = self.is_ready(name)
        if ready:
            self._end_ejection(name)  # its owner saw it healthy: trust that over our last failure
        changed = self._state[name] != state or self._ready[name] != ready
        self._state[name] = state
        self._ready[name] = ready
        self._rebuild_rotation()
        if changed or was != self.is_ready(name):
            self._changed(name, was)

    def eject(self, name: str, seconds: float) -> bool:
        """Take `name` out of the rotation now (the proxy could not reach it), until its owner
        reports it ready again or `seconds` pass. False if it was not in the rotation."""
        if not self.is_ready(name):
            return False
        self._ejected[name] = (self.clock or asyncio.get_running_loop()).call_later(seconds, self._ejection_over, name)
        self._rebuild_rotation()
        self._changed(name, True)
        return True

    def is_ejected(self, name: str) -> bool:
        return name in self._ejected

    def _ejection_over(self, name: str) -> None:
        self._ejected.pop(name, None)
        self._rebuild_rotation()
        self._changed(name, False)

    def _end_ejection(self, name: str) -> None:
        timer = self._ejected.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _changed(self, name: str, was_ready: bool) -> None:
        """Tell the listeners when `name` entered or left the rotation or changed state."""
        ready = self.is_ready(name)
        for listener in list(self._listeners):
            listener(self._backends[name], self._state[name], ready)
        if was_ready and not ready:
            for waiter in self._leaving.pop(name, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_not_ready(self, name: str, timeout: float) -> bool:
        """True once `name` is out of the rotation (at once if it already is; reported not ready
        or ejected), False after `timeout` seconds in it. Lets the proxy ask "did this instance
        just die?" when a connection to it breaks before the supervisor has seen the exit."""
        if not self.is_ready(name):
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._leaving.setdefault(name, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            waiters = self._leaving.get(name)
            if waiters and waiter in waiters:
                waiters.remove(waiter)

    def report_stalled(self, name: str, why: str) -> None:
        """The proxy found `name` hung (proxy/stall.py): its owner (vsup run) restarts it."""
        if self.on_stalled is not None:
            self.on_stalled(name, why)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def all(self) -> tuple[Backend, ...]:
        return tuple(self._backends.values())

    def ready(self) -> tuple[Backend, ...]:
        """Ready backends, in the order they were added (round-robin relies on a stable order)."""
        return self._rotation

    def _rebuild_rotation(self) -> None:
        self.version += 1
        self._rotation = tuple(b for name, b in self._backends.items() if self._ready[name] and name not in self._ejected)

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def is_ready(self, name: str) -> bool:
        """In the rotation: reported ready by its owner and not ejected by the proxy."""
        return self._ready.get(name, False) and name not in self._ejected

    def state(self, name: str) -> str:
        return self._state[name]

    def states(self) -> dict[str, str]:
        return dict(self._state)

    def models(self) -> dict[str, str]:
        """Each backend's model ("" where not known)."""
        return {name: backend.model for name, backend in self._backends.items()}
