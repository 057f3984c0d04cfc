"""GET /v1/models: the union of what the *ready* instances serve, de-duplicated by id.

Asking only ready instances (not "the first configured one") means a client never sees a model
list from an instance that is down, and never a 5xx while another instance could answer. In a
fleet the ids each instance listed (its model, its LoRA adapters: an adapter's entry has `parent`
= its base model) are handed to `learn`, so routing.py routes every listed name to the instances
that serve it; an entry whose name another model owns (routing.py: `learn` leaves it out) is not
listed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable

import aiohttp

from vsup.proxy import errors
from vsup.proxy.address import Sessions
from vsup.proxy.backends import Backend
from vsup.proxy.messages import Response


async def models_of(sessions: Sessions, backend: Backend, timeout: float, connect_timeout: float) -> list[dict]:
    # Each instance has its own deadline: one hung instance must not hide the others' models.
    # The connect limit is given per request: it is proxy.connect_timeout, which a reload changes.
    session, base = sessions.get(backend.url)
    async with asyncio.timeout(timeout):
        async with session.get(base + "/v1/models", allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}")
            document = await response.json(content_type=None)
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise ValueError("no `data` list in the answer")
    return [entry for entry in data if isinstance(entry, dict) and "id" in entry]


async def merged_models(sessions: Sessions, ready: tuple[Backend, ...], timeout: float, connect_timeout: float,
                        learn: Callable[[str, Iterable[str]], frozenset[str]] | None = None) -> Response:
    if not ready:
        return errors.no_ready_instance()
    results = await asyncio.gather(*(models_of(sessions, b, timeout, connect_timeout) for b in ready), return_exceptions=True)
    seen: dict[str, dict] = {}
    failures = []
    for backend, result in zip(ready, results, strict=True):
        if isinstance(result, BaseException):
            if isinstance(result, asyncio.CancelledError):
                raise result
            why = f"no answer within {timeout:g} s" if isinstance(result, TimeoutError) else (str(result) or type(result).__name__)
            failures.append(f"instance {backend.name}: {why}")
            continue
        if learn is not None:
            kept = learn(backend.name, [entry["id"] for entry in result if isinstance(entry["id"], str)])
            result = [entry for entry in result if isinstance(entry["id"], str) and entry["id"] in kept]
        for entry in result:
            seen.setdefault(entry["id"], entry)
    if failures and not seen:
        return errors.bad_gateway("no ready instance answered /v1/models: " + "; ".join(failures))
    body = json.dumps({"object": "list", "data": list(seen.values())}).encode()
    return Response(body=body, content_type="application/json")
