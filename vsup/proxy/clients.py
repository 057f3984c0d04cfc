"""The proxy's side of its client connections: how many may be open, how long a client may keep
a request half-sent, and what a request aiohttp could not parse gets — an OpenAI-shaped error and
one rate-limited warning line, never a traceback per request (a bad client must not flood the log).

aiohttp_internals.make_server wires this policy into aiohttp's connection handling; the request
body's read timeout is the forwarder's (same limit, CLIENT_TIMEOUT).
"""

from __future__ import annotations

import logging
import resource
import time

from aiohttp import web

from vsup.proxy import errors
from vsup.proxy.metrics import ProxyMetrics

log = logging.getLogger("vsup.proxy")

# The longest a client may keep the proxy waiting for the rest of a request it started (its
# headers from the moment it connects or its previous answer ends; its body between two reads),
# and the longest an idle keep-alive connection stays open. nginx's client_header_timeout and
# client_body_timeout defaults. Would be proxy.client_timeout if it ever needs tuning.
CLIENT_TIMEOUT = 60.0
# At most this many client connections at once (and at most half the open-file limit, which the
# upstream connections and vLLM's own files share); one more is answered 503 and closed.
# Would be proxy.max_client_connections.
MAX_CLIENT_CONNECTIONS = 4096
# One warning line per this many seconds for each kind of bad client behaviour; the rest are counted.
WARN_EVERY = 10.0
# What an error message quotes of a client's bytes, at most.
QUOTE_LIMIT = 200


def connection_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CLIENT_CONNECTIONS
    return min(MAX_CLIENT_CONNECTIONS, max(16, soft // 2))


class RateLimitedWarning:
    """`warn(msg)` logs at most one line per `every` seconds; the lines it held back are counted
    in the next one that goes out."""

    def __init__(self, every: float = WARN_EVERY, clock=time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self.next_at = 0.0
        self.held = 0

    def warn(self, message: str, *args) -> bool:
        now = self.clock()
        if now < self.next_at:
            self.held += 1
            return False
        if self.held:
            message += f" ({self.held} more like it in the last {self.every:g} s not logged)"
            self.held = 0
        self.next_at = now + self.every
        log.warning(message, *args)
        return True


def _quote(text: str) -> str:
    text = " ".join(text.split())  # aiohttp's messages span lines (with a caret under the byte)
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT] + "..."


class ClientPolicy:
    """Counts open client connections (bounded), answers requests aiohttp could not parse or
    that crashed a handler, and notes connections closed for sending nothing in time."""

    def __init__(self, metrics: ProxyMetrics, limit: int | None = None, timeout: float | None = None) -> None:
        self.metrics = metrics
        self.limit = connection_limit() if limit is None else limit
        self.timeout = CLIENT_TIMEOUT if timeout is None else timeout
        self.open = 0
        self._warn_full = RateLimitedWarning()
        self._warn_malformed = RateLimitedWarning()
        self._warn_timeout = RateLimitedWarning()
        self._warn_crash = RateLimitedWarning()
        self._refusal = _raw_response(errors.error_response(
            503, f"the proxy has {self.limit} client connections open, its limit: retry shortly",
            "service_unavailable", "too_many_connections", headers={"Retry-After": str(errors.RETRY_AFTER_SECONDS)},
        ))

    # -- connections
    def opened(self) -> bytes | None:
        """A client connected: None to serve it, or the complete answer to send before closing."""
        if self.open >= self.limit:
            self.metrics.connection_refused()
            self._warn_full.warn("%d client connections open, the limit: refusing new ones with 503", self.open)
            return self._refusal
        self.open += 1
        return None

    def closed(self) -> None:
        self.open -= 1

    def no_request_in_time(self, peer) -> None:
        self.metrics.client_timeout("headers")
        self._warn_timeout.warn("client %s sent no complete request within %g s of connecting: closed", peer, self.timeout)

    def body_too_slow(self, peer) -> web.Response:
        self.metrics.client_timeout("body")
        self._warn_timeout.warn("client %s sent nothing of its request body for %g s: answered 408", peer, self.timeout)
        return errors.error_response(
            408, f"the request body stopped arriving: nothing for {self.timeout:g} s", "invalid_request_error", "request_timeout"
        )

    # -- requests that never reached a handler, or broke one
    def malformed(self, status: int, exc: BaseException | None, peer) -> web.Response:
        """aiohttp could not parse the request (status is its 400): an OpenAI-shaped answer,
        431 for header lines or counts over the limits."""
        detail = _quote(getattr(exc, "message", None) or str(exc) or type(exc).__name__)
        if _headers_too_large(exc):
            status = 431
            message = f"request header fields too large: {detail} (at most 8190 bytes per line and 128 headers)"
        else:
            message = f"malformed HTTP request: {detail}"
        self.metrics.malformed(status)
        self._warn_malformed.warn("client %s: %s: answered %d", peer, message, status)
        code = "request_header_fields_too_large" if status == 431 else "invalid_request"
        return errors.error_response(status, message, "invalid_request_error", code)

    def crashed(self, status: int, exc: BaseException | None, peer) -> web.Response:
        """A handler raised (a bug in the proxy): the traceback is logged, rate-limited."""
        if self._warn_crash.warn("request from %s failed inside the proxy: %r", peer, exc):
            log.error("the traceback of that failure", exc_info=exc)
        return errors.error_response(status, "internal error in the proxy (logged)", "server_error", "internal_error")


def _headers_too_large(exc: BaseException | None) -> bool:
    from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

    return isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc))


def _raw_response(response: web.Response) -> bytes:
    """A complete HTTP/1.1 answer as bytes, for a connection the proxy will not parse requests on."""
    body = response.body
    assert isinstance(body, bytes)
    head = [f"HTTP/1.1 {response.status} {response.reason}", f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in response.headers.items() if name.lower() != "content-length"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
