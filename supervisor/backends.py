"""The contract between whoever knows the instances' health and the proxy that routes to them.

The supervisor (or, in `vsup proxy`, the proxy's own health checker) calls `set_state`; the proxy
reads `ready()` on every request, so an instance leaves the rotation the moment its state changes,
not at the next poll. Single event loop: no locks needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    name: str  # instance index ("0", "1", ...) or, for static upstreams, the URL
    url: str  # base URL without a trailing slash, e.g. http://127.0.0.1:8100


Listener = Callable[[Backend, str, bool], None]


class BackendPool:
    def __init__(self, backends: Iterable[Backend] = ()) -> None:
        self._backends: dict[str, Backend] = {}
        self._state: dict[str, str] = {}
        self._ready: dict[str, bool] = {}
        self._listeners: list[Listener] = []
        for backend in backends:
            self.add(backend)

    def add(self, backend: Backend, state: str = "starting") -> None:
        self._backends[backend.name] = backend
        self._state[backend.name] = state
        self._ready[backend.name] = False

    def remove(self, name: str) -> None:
        self._backends.pop(name, None)
        self._state.pop(name, None)
        self._ready.pop(name, None)

    def set_state(self, name: str, state: str, ready: bool) -> None:
        if name not in self._backends:
            raise KeyError(name)
        changed = self._state[name] != state or self._ready[name] != ready
        self._state[name] = state
        self._ready[name] = ready
        if changed:
            for listener in list(self._listeners):
                listener(self._backends[name], state, ready)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def all(self) -> tuple[Backend, ...]:
        return tuple(self._backends.values())

    def ready(self) -> tuple[Backend, ...]:
        """Ready backends, in the order they were added (round-robin relies on a stable order)."""
        return tuple(b for name, b in self._backends.items() if self._ready[name])

    def is_ready(self, name: str) -> bool:
        return self._ready.get(name, False)

    def state(self, name: str) -> str:
        return self._state[name]

    def states(self) -> dict[str, str]:
        return dict(self._state)
