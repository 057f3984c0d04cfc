"""One /health probe of an instance: 200 within the timeout, or the reason it was not."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    detail: str  # "HTTP 200", "HTTP 500", "timeout after 5s", "connection refused", ...


async def probe_health(session: aiohttp.ClientSession, base_url: str, timeout: float) -> HealthResult:
    """GET <base_url>/health. Anything but a 200 within `timeout` seconds is a failure."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(f"{base_url}/health", allow_redirects=False) as response:
                await response.read()  # small body; reading it lets the connection be reused
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
