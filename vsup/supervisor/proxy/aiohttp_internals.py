"""The aiohttp internals the proxy's hot path relies on, named in one place and checked at start-up.

- `web.BaseRequest` is built positionally by our request factory (server.py): the low-level
  `web.Server` gives the factory (message, payload, protocol, writer, task) and we add the loop.
- Streamed bodies are written straight to `request.transport`, framed by hand when
  `request.writer.chunked` says the response is chunked (upstream.py's relay, forward.py).

Neither is public API, so the range of aiohttp versions vsup is tested with is pinned in
pyproject.toml (SUPPORTED below is the same range) and `check()` refuses to start the proxy
outside it, or when the shapes above changed, with one line saying what to install.
"""

from __future__ import annotations

import inspect

import aiohttp
from aiohttp import http_writer, web

from vsup.supervisor.errors import VsupError

SUPPORTED = ((3, 9), (3, 15))  # >= first, < second: keep equal to the pin in pyproject.toml
REQUIREMENT = f"aiohttp>={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1]}"
REQUEST_PARAMETERS = ("message", "payload", "protocol", "payload_writer", "task", "loop")


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = (version.split(".") + ["0"])[:2]
    digits = "".join(ch for ch in minor if ch.isdigit()) or "0"
    return int(major), int(digits)


def problems(version: str = aiohttp.__version__) -> list[str]:
    """What does not match the internals vsup was written against (empty: all is well)."""
    found = []
    low, high = SUPPORTED
    if not low <= version_tuple(version) < high:
        found.append(f"aiohttp {version} is outside the tested range {REQUIREMENT}")
    parameters = tuple(inspect.signature(web.BaseRequest.__init__).parameters)[1:1 + len(REQUEST_PARAMETERS)]
    if parameters != REQUEST_PARAMETERS:
        found.append(f"web.BaseRequest takes {parameters}, not {REQUEST_PARAMETERS}")
    writer = http_writer.StreamWriter  # `chunked`: a class attribute since 3.10, set in __init__ before
    if not (hasattr(writer, "chunked") or "chunked" in writer.__init__.__code__.co_names):
        found.append("aiohttp's StreamWriter has no `chunked` attribute")
    return found


def check() -> None:
    """Raise VsupError naming what to install when the installed aiohttp is not one vsup knows."""
    found = problems()
    if found:
        raise VsupError(
            "the proxy relies on aiohttp internals and cannot run with this aiohttp: "
            + "; ".join(found) + f". Install a tested one: pip install '{REQUIREMENT}'"
        )


def make_request_factory(loop, max_body_bytes: int):
    """The request factory for `web.Server`: a plain BaseRequest with our body size limit."""

    def make_request(message, payload, protocol, writer, task) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=max_body_bytes)

    return make_request
