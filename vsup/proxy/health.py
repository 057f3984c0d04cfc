"""One /health probe of an instance: 200 within the timeout, or the reason it was not.

vsup's proxy marks every answer it gives itself with the `X-Vsup-Proxy` header (its pid). Probing
a vLLM instance (`expect_instance=True`, the lifecycle's readiness and health checks), a marked
answer means the probe reached a vsup proxy on the instance's address (e.g. `proxy.port` equal to
the instance's port), not the instance, and is refused: an instance never counts as ready before
it has bound its own port. The standalone proxy's checks of its upstreams leave it off: there an
upstream may well be another vsup's proxy (the two-level layout).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

PROXY_HEADER = "X-Vsup-Proxy"  # on every response the vsup proxy answers itself; value: its pid


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    detail: str  # "HTTP 200", "HTTP 500", "timeout after 5s", "connection refused", ...


async def probe_health(session: aiohttp.ClientSession, base_url: str, timeout: float, *,
                       expect_instance: bool = False) -> HealthResult:
    """GET <base_url>/health. Anything but a 200 within `timeout` seconds is a failure, and so is,
    with `expect_instance`, an answer of a vsup proxy."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(f"{base_url}/health", allow_redirects=False) as response:
                await response.read()  # small body; reading it lets the connection be reused
                proxy = response.headers.get(PROXY_HEADER) if expect_instance else None
                if proxy is not None:
                    return HealthResult(False, f"HTTP {response.status} from a vsup proxy (pid {proxy[:20]}), not from the instance "
                                               "(is a proxy port the instance's port?)")
                return HealthResult(response.status == 200, f"HTTP {response.status}")
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return HealthResult(False, failure_detail(exc, timeout))


def failure_detail(exc: BaseException, timeout: float) -> str:
    """Why a probe got no answer, in a few words ("cannot connect: connection refused")."""
    if isinstance(exc, TimeoutError):
        return f"timeout after {timeout:g}s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        reason = exc.os_error.strerror if exc.os_error and exc.os_error.strerror else str(exc)
        return f"cannot connect: {reason.lower()}"
    return f"{type(exc).__name__}: {exc}".rstrip(": ")
