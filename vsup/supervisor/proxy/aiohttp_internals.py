"""The aiohttp internals the proxy's hot path relies on, named in one place and checked at start-up.

- `web.BaseRequest` is built positionally by our request factory (server.py): the low-level
  `web.Server` gives the factory (message, payload, protocol, writer, task) and we add the loop.
- Streamed bodies are written straight to `request.transport`, framed by hand when
  `request.writer.chunked` says the response is chunked (BodySink, below; fed by upstream.py's
  relay), and ended with `StreamResponse.write_eof()`, whose last chunk must match that framing.

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
    if not hasattr(http_writer.StreamWriter, "chunked"):
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


# Pause relaying from an instance while the client's socket has this much unsent.
CLIENT_HIGH_WATER = 256 * 1024


class BodySink:
    """The body of a prepared StreamResponse, written straight to the client's transport: from the
    upstream socket's data callback, with no task switch and no `await` per piece (what
    StreamResponse.write would cost on every streamed token). Framed as HTTP/1.1 chunks when
    aiohttp chose chunked encoding for the response (`request.writer.chunked`), so that
    `StreamResponse.write_eof()` ends it correctly."""

    __slots__ = ("_transport", "_chunked", "drain")

    def __init__(self, transport, chunked: bool, drain) -> None:
        self._transport = transport
        self._chunked = chunked
        self.drain = drain  # waits until the client's buffer is below aiohttp's low-water mark

    @classmethod
    def of(cls, request: web.BaseRequest) -> "BodySink | None":
        """The sink of a request whose response is prepared; None when the client already left."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        writer = request.writer
        return cls(transport, writer.chunked, writer.drain)

    def write(self, data: bytes) -> bool:
        """Send one piece; True when the client reads slower than we write (the caller should
        stop reading upstream until `await drain()`). A client already gone is a no-op: its
        handler is being cancelled."""
        transport = self._transport
        if transport.is_closing():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        return transport.get_write_buffer_size() > CLIENT_HIGH_WATER


def make_request_factory(loop, max_body_bytes: int):
    """The request factory for `web.Server`: a plain BaseRequest with our body size limit."""

    def make_request(message, payload, protocol, writer, task) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=max_body_bytes)

    return make_request
