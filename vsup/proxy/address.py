"""An instance's address, one string for everyone who talks to it: `unix:/abs/path.sock` (a Unix
socket in vsup's private runtime directory, the default under `vsup run`: no other user can reach
or replace it) or `http://127.0.0.1:P` (vllm.listen: tcp, or a standalone proxy's upstream).

The proxy's own client (upstream.py) opens either kind itself; aiohttp needs a session per Unix
socket (a ClientSession is bound to one connector, and a UnixConnector to one path): `Sessions`
keeps one for TCP and one per socket, for the health probe, the warm-up, /v1/models and the
metrics scrape.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

import aiohttp

UNIX = "unix:"
UNIX_BASE = "http://localhost"  # the URL aiohttp asks for over a Unix socket (the Host header)
SUN_PATH_MAX = 107  # bytes of a socket path that fit sockaddr_un.sun_path (108, with the NUL)


def unix_url(path: str | os.PathLike[str]) -> str:
    return f"{UNIX}{os.fspath(path)}"


def socket_path(url: str) -> str | None:
    """The socket's path of a `unix:` address; None for an http one."""
    return url[len(UNIX):] if url.startswith(UNIX) else None


def host_port(url: str) -> tuple[str, int]:
    """Host and port of an http address; ValueError for anything else (https is not spoken)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"{url}: the proxy talks plain http to its instances, or unix:/path.sock")
    return parts.hostname or "127.0.0.1", parts.port or 80


def label(url: str) -> str:
    """How status, top and logs name the address: the socket's path, or host:port."""
    path = socket_path(url)
    if path is not None:
        return path
    host, port = host_port(url)
    return f"{host}:{port}"


def http_base(url: str) -> str:
    """The URL prefix of requests to this address (aiohttp, over the session `Sessions.get` gives)."""
    return UNIX_BASE if url.startswith(UNIX) else url


class Sessions:
    """aiohttp sessions by instance address: one shared by every http address, one per Unix socket,
    all with the same connector and session options. `around(session)` wraps a session someone
    else owns as the TCP one (it is not closed here). A socket's session lives until `close()`:
    an instance's paths are its slots (`<i>.sock`, `<i>b.sock`), reused by every restart and
    replacement, so there are at most two per instance index."""

    def __init__(self, connector: dict[str, Any] | None = None, **session: Any) -> None:
        self._connector = dict(connector or {})
        self._session = session
        self._tcp: aiohttp.ClientSession | None = None
        self._owns_tcp = True
        self._unix: dict[str, aiohttp.ClientSession] = {}

    @classmethod
    def around(cls, tcp: aiohttp.ClientSession) -> Sessions:
        sessions = cls(timeout=tcp.timeout)
        sessions._tcp, sessions._owns_tcp = tcp, False
        return sessions

    def get(self, url: str) -> tuple[aiohttp.ClientSession, str]:
        """The session for `url` (created on first use; needs a running loop) and the URL prefix
        of its requests."""
        path = socket_path(url)
        if path is None:
            if self._tcp is None or self._tcp.closed:
                self._tcp = aiohttp.ClientSession(connector=aiohttp.TCPConnector(**self._connector), **self._session)
            return self._tcp, url
        session = self._unix.get(path)
        if session is None or session.closed:
            session = self._unix[path] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path, **self._connector), **self._session)
        return session, UNIX_BASE

    async def close(self) -> None:
        unix, self._unix = self._unix, {}
        for session in unix.values():
            await session.close()
        if self._tcp is not None and self._owns_tcp:
            await self._tcp.close()
