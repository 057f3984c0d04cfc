"""Optional Bearer-token check for the proxy's API (`proxy.api_key` / VSUP_API_KEY).

Constant-time comparison (hmac.compare_digest) so the key cannot be guessed byte by byte from
response times. /health and /ready stay open for load balancers and systemd; /metrics needs the
key when one is set (Prometheus sends it with `authorization: {credentials: KEY}`). The /status
page also takes the key as the password of HTTP Basic auth (any user name): a browser asks for it.
"""

from __future__ import annotations

import base64
import binascii
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

    def allows_browser(self, request: web.BaseRequest) -> bool:
        """Bearer KEY, or Basic auth whose password is KEY (the browser's login prompt)."""
        if self._key is None or self.allows(request):
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            _, _, password = base64.b64decode(token.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(password, self._key)
