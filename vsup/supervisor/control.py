"""The control endpoint: a unix socket (mode 0600) that `vsup status` and `vsup restart` talk to.

HTTP/JSON over the socket (aiohttp on both ends):
    GET  /status                          -> {"vsup": {...}, "instances": [{index, state, pid, ...}]}
    POST /restart {"target": "all"|N, "rolling": bool, "wait": bool}
                                          -> {"instances": [...]} once the restart is done (wait)
                                             or has begun (wait false)
Errors come back as {"error": "one line"} with status 400 (bad request) or 409 (cannot do it now).

Where the socket lives: `control.socket` when set; under systemd `$RUNTIME_DIRECTORY/control.sock`;
else `/tmp/vsup-<uid>/control-<proxy port>.sock` (a private 0700 directory; the proxy port in the
name keeps two vsups on one machine apart). A unix socket is never reachable from another host,
and only this user (or root) may connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from vsup.supervisor.config import VsupConfig
from vsup.supervisor.errors import VsupError
from vsup.supervisor.rundir import ensure_private, private_dir, systemd_dir


class Controlled(Protocol):
    """What the control endpoint needs of the running vsup (the Supervisor), and no more."""

    @property
    def instance_count(self) -> int: ...

    def status(self) -> dict[str, Any]: ...

    def instance_statuses(self, indices: list[int]) -> list[dict[str, Any]]: ...

    async def restart(self, indices: list[int], rolling: bool) -> list[dict[str, Any]]:
        """VsupError (-> 409) when it cannot be done now."""


SYSTEMD_DEFAULT = Path("/run/vsup/control.sock")  # RuntimeDirectory=vsup, seen from a shell


def _runtime_socket(environ: Mapping[str, str]) -> Path | None:
    """Under systemd: `$RUNTIME_DIRECTORY/control.sock` (its first directory)."""
    runtime = systemd_dir(environ)
    return runtime / "control.sock" if runtime else None


def control_socket_path(config: VsupConfig, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a vsup run with `config` listens (see the module docstring)."""
    if config.control.socket is not None:
        return Path(config.control.socket)
    return _runtime_socket(environ) or private_dir(environ) / f"control-{config.proxy.port}.sock"


def client_socket_candidates(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """Without --socket/--config: where a vsup with default settings would listen."""
    defaults = [private_dir(environ) / "control-8000.sock", SYSTEMD_DEFAULT]
    runtime = _runtime_socket(environ)
    return [runtime, *defaults] if runtime else defaults


def _prepare_directory(path: Path, environ: Mapping[str, str]) -> None:
    directory = path.parent
    if directory == private_dir(environ):
        # another user could have created it first in a shared /tmp: never put our socket there
        ensure_private(directory, "control socket", "set control.socket")
    elif not directory.is_dir():
        raise VsupError(f"control.socket {str(path)!r}: directory {directory} does not exist; create it or choose another path")


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
            return True
        except OSError:
            return False


class ControlServer:
    def __init__(self, path: Path, target: Controlled, environ: Mapping[str, str] = os.environ) -> None:
        self.path = Path(path)
        self.target = target
        self.environ = environ
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self._jobs: set[asyncio.Task] = set()

    async def start(self) -> None:
        if len(os.fsencode(self.path)) > 107:
            raise VsupError(f"control.socket {str(self.path)!r} is longer than the 107 bytes a unix socket path may have")
        _prepare_directory(self.path, self.environ)
        if self.path.exists() or self.path.is_symlink():
            if _answers(self.path):
                raise VsupError(f"another vsup is already running here: it answers on the control socket {self.path} "
                                "(stop it, or give this one another proxy.port or control.socket)")
            self.path.unlink()  # left behind by a vsup that was killed
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_post("/restart", self._restart)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # created 0600: no window in which others could connect
        try:
            sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise VsupError(f"cannot create the control socket {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._sock = sock
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        for job in list(self._jobs):
            job.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.target.status())

    async def _restart(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        target, rolling, wait = body.get("target"), bool(body.get("rolling")), body.get("wait", True)
        count = self.target.instance_count
        if target == "all":
            indices = list(range(count))
        elif isinstance(target, int) and not isinstance(target, bool):
            indices = [target]
        else:
            return _error(400, f"target {target!r} is not an instance index or \"all\"")
        if target != "all" and not 0 <= target < count:
            return _error(400, f"no instance {target}: this vsup runs instances 0..{count - 1}")
        # The restart runs as its own task: a client that goes away must not cut a rolling restart
        # in half.
        job = asyncio.create_task(self.target.restart(indices, rolling))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        job.add_done_callback(_consume)
        if not wait:
            await asyncio.sleep(0)
            return web.json_response({"instances": self.target.instance_statuses(indices)})
        try:
            result = await asyncio.shield(job)
        except VsupError as exc:
            return _error(409, str(exc))
        return web.json_response({"instances": result})


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved here so a job nobody waits for does not log "never retrieved"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


# ---- the client side (vsup status / vsup restart) --------------------------------------------------

def resolve_socket(socket_path: str | None, config: VsupConfig | None, environ: Mapping[str, str] = os.environ) -> Path:
    """--socket, else the path the config implies, else the first default that exists."""
    if socket_path:
        return Path(socket_path)
    if config is not None:
        return control_socket_path(config, environ)
    candidates = client_socket_candidates(environ)
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise VsupError("vsup is not running (no control socket at " + ", ".join(map(str, candidates))
                    + "); if it runs with another proxy.port or control.socket, pass --config FILE or --socket PATH")


async def request(path: Path, method: str, route: str, body: Any = None, timeout: float | None = None) -> Any:
    """One request to a running vsup; VsupError (one line) when it is not there or says no."""
    if not path.exists():
        raise VsupError(f"vsup is not running: no control socket at {path}")
    connector = aiohttp.UnixConnector(path=str(path))
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.request(method, f"http://vsup{route}", json=body) as response:
                data = await response.json(content_type=None)
                if response.status != 200:
                    raise VsupError(data.get("error") if isinstance(data, dict) else f"HTTP {response.status}")
                return data
    except aiohttp.ClientConnectorError as exc:
        raise VsupError(f"vsup is not running: the control socket {path} does not answer ({exc.os_error.strerror if exc.os_error else exc})") from None
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        raise VsupError(f"talking to vsup over {path} failed: {exc}") from None
    except TimeoutError:
        raise VsupError(f"vsup did not answer within {timeout:g}s on {path}") from None
