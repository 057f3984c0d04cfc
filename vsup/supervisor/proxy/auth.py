"""Optional Bearer-token check for the proxy's API (`proxy.api_key` / VSUP_API_KEY).

Constant-time comparison (hmac.compare_digest) so the key cannot be guessed byte by byte from
response times. /health and /ready stay open for load balancers and systemd; /metrics needs the
key when one is set (Prometheus sends it with `authorization: {credentials: KEY}`).
"""

from __future__ import annotations

import hmac

from aiohttp import web


class BearerAuth:
    def __init__(self, key: str | None) -> None:
        self._key = key.encode() if key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def allows(self, request: web.BaseRequest) -> bool:
        if self._key is None:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), self._key)
