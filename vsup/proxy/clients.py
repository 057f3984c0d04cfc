"""The proxy's side of its client connections, before anything is authenticated: how many may be
open (in all and per client address), how many bytes and how long a request's headers may take,
how long its body may take, and what a request aiohttp could not parse gets — an OpenAI-shaped
error and one rate-limited warning line, never a traceback per request (a bad client must not
flood the log). A connection over a limit is refused, but /health and /ready are still answered
on a few reserve connections (probe_slot), from their request line alone.

client_conn.py applies this policy to each client connection; the request
body's deadline is enforced by the forwarder (body_timeout). The settings are proxy.* keys,
applied at once by `configure` (a reload): to the connections and requests that start after it.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from typing import Protocol

from vsup.config.schema import ProxyConfig
from vsup.proxy import errors
from vsup.proxy.messages import HeadTooLarge, Response
from vsup.proxy.metrics import ProxyMetrics

log = logging.getLogger("vsup.proxy")

# The longest an idle keep-alive connection stays open between two requests (aiohttp's
# keepalive_timeout). Would be proxy.keepalive_timeout if it ever needs tuning.
CLIENT_TIMEOUT = 60.0
# At most this many client connections at once (and at most half the open-file limit, which the
# upstream connections and vLLM's own files share); one more is answered 503 and closed.
# Would be proxy.max_client_connections.
MAX_CLIENT_CONNECTIONS = 4096
# Connections over a limit that may still ask for /health or /ready: this many at once (from one
# address: PROBE_PER_CLIENT), each reading at most PROBE_BYTES for PROBE_TIMEOUT seconds.
PROBE_RESERVE = 32
PROBE_PER_CLIENT = 4
PROBE_BYTES = 1024
PROBE_TIMEOUT = 2.0
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
    text = " ".join(text.split())  # a parser's message may span lines
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT] + "..."


class ProbeHolder(Protocol):
    """A refused connection holding a probe slot (client_conn.ClientConnection)."""

    def probe_evicted(self) -> None:
        """Refuse now: the slot is wanted by a newer connection."""


class ClientPolicy:
    """Counts open client connections (bounded, in all and per address), answers requests aiohttp
    could not parse or that crashed a handler, and notes connections closed for being too slow.

    `config` (a ProxyConfig) gives max_header_bytes, header_timeout, body_timeout and
    max_connections_per_client; `probes` (set by the ProxyServer) maps /health and /ready to the
    (status, JSON body) they answer, and `probe_headers` are header lines added to those answers."""

    def __init__(self, metrics: ProxyMetrics, config: ProxyConfig, limit: int | None = None) -> None:
        self.metrics = metrics
        self.limit = connection_limit() if limit is None else limit
        self.timeout = CLIENT_TIMEOUT
        self.open = 0
        self._by_address: dict[str, int] = {}
        self._probing: dict[ProbeHolder, str] = {}  # oldest first
        self._probing_by_address: dict[str, int] = {}
        self.probes: dict[bytes, Callable[[], tuple[int, bytes]]] = {}
        self.probe_headers = b""
        self._warn_full = RateLimitedWarning()
        self._warn_client = RateLimitedWarning()
        self._warn_malformed = RateLimitedWarning()
        self._warn_timeout = RateLimitedWarning()
        self._warn_crash = RateLimitedWarning()
        self._refusal = raw_response(errors.error_response(
            503, f"the proxy has {self.limit} client connections open, its limit: retry shortly",
            "service_unavailable", "too_many_connections", headers={"Retry-After": str(errors.RETRY_AFTER_SECONDS)},
        ))
        self.configure(config)

    def configure(self, config: ProxyConfig) -> None:
        """Apply the proxy.* settings of the front door (at start and on every reload)."""
        self.max_header_bytes = config.max_header_bytes
        self.header_timeout = config.header_timeout
        self.body_timeout = config.body_timeout
        self.per_client = config.max_connections_per_client
        self._client_refusal = raw_response(errors.error_response(
            429, f"this address has {self.per_client} connections to the proxy open, the limit per client "
                 "(proxy.max_connections_per_client): reuse or close some, or retry shortly",
            "rate_limit_error", "too_many_connections", headers={"Retry-After": str(errors.RETRY_AFTER_SECONDS)},
        ))

    # -- connections
    def opened(self, address: str) -> bytes | None:
        """A client connected from `address`: None to serve it, or the complete answer to send
        before closing (unless probe_slot lets it ask for /health or /ready first)."""
        if self.open >= self.limit:
            self.metrics.connection_refused()
            self._warn_full.warn("%d client connections open, the limit: refusing new ones with 503", self.open)
            return self._refusal
        held = self._by_address.get(address, 0)
        if self.per_client and held >= self.per_client:
            self.metrics.connection_refused()
            self._warn_client.warn("client %s has %d connections open, proxy.max_connections_per_client: refusing more with 429",
                                   address, held)
            return self._client_refusal
        self.open += 1
        self._by_address[address] = held + 1
        return None

    def closed(self, address: str) -> None:
        self.open -= 1
        held = self._by_address.pop(address, 1) - 1
        if held:
            self._by_address[address] = held

    def probe_slot(self, holder: ProbeHolder, address: str) -> bool:
        """May a refused connection still send a /health or /ready request line? A few at once;
        when all are taken the oldest is refused now (a health check sends its line at once, a
        flood of silent connections cannot keep it out)."""
        held = self._probing_by_address.get(address, 0)
        if held >= PROBE_PER_CLIENT:
            return False
        if len(self._probing) >= PROBE_RESERVE:
            next(iter(self._probing)).probe_evicted()  # calls probe_done
        self._probing[holder] = address
        self._probing_by_address[address] = held + 1
        return True

    def probe_done(self, holder: ProbeHolder) -> None:
        address = self._probing.pop(holder, None)
        if address is None:
            return
        held = self._probing_by_address.pop(address, 1) - 1
        if held:
            self._probing_by_address[address] = held

    def probe_answer(self, request_line: bytes, refusal: bytes) -> bytes:
        """The answer on a refused connection that sent `request_line`: /health's or /ready's own
        (GET or HEAD), else the refusal."""
        parts = request_line.split(b" ")
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") or not parts[2].startswith(b"HTTP/1."):
            return refusal
        probe = self.probes.get(parts[1].partition(b"?")[0])
        if probe is None:
            return refusal
        status, body = probe()
        head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n%s\r\n" % (
            status, b"OK" if status == 200 else b"Service Unavailable", len(body), self.probe_headers)
        return head if parts[0] == b"HEAD" else head + body

    def no_request_in_time(self, peer) -> None:
        self.metrics.client_timeout("headers")
        self._warn_timeout.warn("client %s sent no complete request headers within %g s (proxy.header_timeout): closed",
                                peer, self.header_timeout)

    def body_too_slow(self, peer) -> Response:
        self.metrics.client_timeout("body")
        self._warn_timeout.warn("client %s did not send its whole request body within %g s (proxy.body_timeout): answered 408",
                                peer, self.body_timeout)
        return errors.error_response(
            408, f"the request body did not arrive within {self.body_timeout:g} s (proxy.body_timeout)",
            "invalid_request_error", "request_timeout",
        )

    # -- requests that never reached a handler, or broke one
    def malformed(self, status: int, exc: BaseException | None, peer) -> Response:
        """The request could not be parsed (status 400): an OpenAI-shaped answer, 431 for header
        lines or counts over the limits."""
        detail = _quote(getattr(exc, "message", None) or str(exc) or type(exc).__name__)
        if status == 431 or isinstance(exc, HeadTooLarge):
            status = 431
            message = (f"request header fields too large: {detail} (at most 8190 bytes per line, 128 headers "
                       f"and {self.max_header_bytes} bytes in all)")
        else:
            message = f"malformed HTTP request: {detail}"
        self.metrics.malformed(status)
        self._warn_malformed.warn("client %s: %s: answered %d", peer, message, status)
        code = "request_header_fields_too_large" if status == 431 else "invalid_request"
        return errors.error_response(status, message, "invalid_request_error", code)

    def crashed(self, status: int, exc: BaseException | None, peer) -> Response:
        """A handler raised (a bug in the proxy): the traceback is logged, rate-limited."""
        if self._warn_crash.warn("request from %s failed inside the proxy: %r", peer, exc):
            log.error("the traceback of that failure", exc_info=exc)
        return errors.error_response(status, "internal error in the proxy (logged)", "server_error", "internal_error")


def raw_response(response: Response) -> bytes:
    """A complete HTTP/1.1 answer as bytes, for a connection the proxy will not parse requests on."""
    return response.encode(keep_alive=False)
