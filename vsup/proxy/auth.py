"""Optional Bearer-token check for the proxy's API (`proxy.api_key` / VSUP_API_KEY).

Constant-time comparison (hmac.compare_digest) so the key cannot be guessed byte by byte from
response times. /health and /ready stay open for load balancers and systemd; /metrics needs the
key when one is set (Prometheus sends it with `authorization: {credentials: KEY}`). The /status
page also takes the key as the password of HTTP Basic auth (any user name): a browser asks for it.

Named keys (proxy.api_keys) sit beside the one api_key: `identify` says which one a request
sent. Each token is compared by its SHA-256 digest against every key's, all of them every time
(no early exit), so neither a key's bytes nor which key matched shows in the response time.

What a key may open (`access`): the serving routes any key but a metrics key; the admin routes,
/metrics and /status an admin key only (proxy.api_key, a named key with `admin: true`, or anyone
when no key is set at all); /metrics also a `metrics: true` key, which opens nothing else. A
valid key where it may not go gets 403, no key or a wrong one 401.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence

from vsup.config.schema import ProxyConfig
from vsup.errors import VsupError
from vsup.proxy.messages import Request

# identify()'s answer for a request without a valid key (a key's name is a str, "" the api_key's).
REFUSED = None


# What a request may open (access()'s `kind`).
SERVING, ADMIN, METRICS = "serving", "admin", "metrics"


def roles(config: ProxyConfig) -> tuple[frozenset[str], frozenset[str]]:
    """The names of the admin keys and of the metrics keys of proxy.api_keys."""
    return (frozenset(e.name for e in config.api_keys if e.admin),
            frozenset(e.name for e in config.api_keys if e.metrics))


def named_keys(config: ProxyConfig, environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(name, token) of each proxy.api_keys entry; VsupError naming the entry whose key_env is unset."""
    out = []
    for i, entry in enumerate(config.api_keys):
        token = entry.key if entry.key is not None else environ.get(entry.key_env or "", "")
        if not token:
            raise VsupError(f"proxy.api_keys[{i}].key_env: the environment variable {entry.key_env} that holds the key of "
                            f"{entry.name!r} is not set (or is empty): export it before vsup starts, or write key")
        out.append((entry.name, token))
    return out


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class BearerAuth:
    def __init__(self, key: str | None, named: Sequence[tuple[str, str]] = (), admins: frozenset[str] = frozenset(),
                 scrapers: frozenset[str] = frozenset()) -> None:
        self._key = key.encode() if key else None
        self._admins, self._scrapers = admins, scrapers
        # every key as (its name, its token's digest); the api_key is named ""
        self._digests = [(name, _digest(token.encode())) for name, token in named]
        if self._key is not None and self._digests:
            self._digests.append(("", _digest(self._key)))

    @property
    def enabled(self) -> bool:
        return self._key is not None or bool(self._digests)

    def allows(self, request: Request) -> bool:
        return self.identify(request) is not REFUSED

    def identify(self, request: Request) -> str | None:
        """The name of the key the request sent ("" for proxy.api_key, or with no auth), or REFUSED."""
        if not self.enabled:
            return ""
        scheme, _, token = request.authorization.partition(" ")
        if scheme.lower() != "bearer":
            return REFUSED
        sent = token.strip().encode("utf-8", "surrogateescape")
        if not self._digests:
            return "" if hmac.compare_digest(sent, self._key) else REFUSED  # type: ignore[arg-type]
        return self._match(sent)

    def _match(self, sent: bytes) -> str | None:
        digest, found = _digest(sent), REFUSED
        for name, known in self._digests:
            if hmac.compare_digest(digest, known):
                found = name
        return found

    @property
    def has_admin(self) -> bool:
        """Some key may open the admin routes."""
        return self._key is not None or bool(self._admins)

    def may(self, client: str, kind: str) -> bool:
        """Whether the key `client` (identify's answer) opens routes of `kind`."""
        if kind == SERVING:
            return client not in self._scrapers
        return client == "" or client in self._admins or (kind == METRICS and client in self._scrapers)

    def access(self, request: Request, kind: str, browser: bool = False) -> int:
        """200, 401 (no valid key) or 403 (a valid key that may not open `kind`); `browser`: the
        key may also come as the password of Basic auth (the /status page's login prompt)."""
        client = self.identify(request)
        if client is REFUSED and browser:
            client = self._basic(request)
        if client is REFUSED:
            return 401
        return 200 if self.may(client, kind) else 403

    def _basic(self, request: Request) -> str | None:
        scheme, _, token = request.authorization.partition(" ")
        if scheme.lower() != "basic":
            return REFUSED
        try:
            _, _, password = base64.b64decode(token.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return REFUSED
        if not self._digests:
            return "" if self._key is not None and hmac.compare_digest(password, self._key) else REFUSED
        return self._match(password)

    def allows_browser(self, request: Request) -> bool:
        """Bearer KEY, or Basic auth whose password is KEY, of a key that may read /status."""
        return self.access(request, ADMIN, browser=True) == 200
