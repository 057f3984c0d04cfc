"""The control endpoint: a unix socket (mode 0600) that `vsup status`, `vsup restart` and
`vsup reload` talk to.

HTTP/JSON over the socket (aiohttp on both ends):
    GET  /status                          -> {"vsup": {...}, "instances": [{index, state, pid, ...}],
                                              "changing": [...], "rollout": {...} or null}
    POST /restart {"target": "all"|N, "rolling": bool, "wait": bool}
                                          -> {"instances": [...]} once the restart is done (wait)
                                             or has begun (wait false)
    POST /reload {"wait": bool}           -> {"rollout": {...}} once the reload is done (wait) or
                                             has begun (wait false; the file is checked first)
Errors come back as {"error": "one line"} with status 400 (bad request) or 409 (cannot do it now,
or the reload was refused: the fleet is untouched).

Where the socket lives: `control.socket` when set; under systemd `$RUNTIME_DIRECTORY/control.sock`;
else `/tmp/vsup-<uid>/control-<proxy port>.sock` (a private 0700 directory; the proxy port in the
name keeps two vsups on one machine apart). A unix socket is never reachable from another host,
and only this user (or root) may connect.

Where the client looks (`find_socket`): `--socket`; else, with `control.socket` set, there; else
the first that answers of `$RUNTIME_DIRECTORY/control.sock` (a command run by the unit, e.g.
ExecReload=), the installed unit's `/run/vsup/control.sock` (RuntimeDirectory=vsup: a root shell
beside the service) — with --config only when its vsup serves the config's proxy port —, and the
private `control-<proxy.port>.sock` of this user. Nothing answering is one line naming every place
looked at and what was found there. A socket another user could have put there (trust.py: not
the caller's, root's or a systemd runtime directory's) is never talked to, wherever it was found.

The server replaces only a stale socket (one that refuses connections: a killed vsup's) at its
path; anything else there (a file, a directory, a symlink) is refused, and at stop it removes
the path only while it is still the socket it bound (a typo in control.socket never deletes a
real file, even as root).
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import logging
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from vsup.config.schema import VsupConfig
from vsup.errors import VsupError
from vsup.supervisor.rundir import ensure_private, private_dir, systemd_dir
from vsup.supervisor.trust import socket_trust_problem

logger = logging.getLogger("vsup.supervisor")


def describe_indexes(indexes: list[int]) -> str:
    """`0..3` (as ever), or `0, 1, 3` when there are holes (a reload removed a model); `none` when empty."""
    if not indexes:
        return "none"
    if indexes == list(range(indexes[0], indexes[-1] + 1)):
        return f"{indexes[0]}..{indexes[-1]}"
    return ", ".join(map(str, indexes))


class Controlled(Protocol):
    """What the control endpoint needs of the running vsup (the Supervisor), and no more."""

    @property
    def instance_count(self) -> int: ...

    @property
    def instance_indexes(self) -> list[int]:
        """The fleet's indexes, in order (holes once a reload removed a model)."""

    def status(self) -> dict[str, Any]: ...

    def instance_statuses(self, indices: list[int]) -> list[dict[str, Any]]: ...

    async def restart(self, indices: list[int], rolling: bool) -> list[dict[str, Any]]:
        """VsupError (-> 409) when it cannot be done now."""

    async def reload(self, trigger: str, wait: bool) -> dict[str, Any]:
        """The rollout's record; VsupError (-> 409) when refused (nothing was changed)."""


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


def _prepare_directory(path: Path, environ: Mapping[str, str]) -> None:
    directory = path.parent
    if directory == private_dir(environ):
        # another user could have created it first in a shared /tmp: never put our socket there
        ensure_private(directory, "control socket", "set control.socket")
    elif not directory.is_dir():
        raise VsupError(f"control.socket {str(path)!r}: directory {directory} does not exist; create it or choose another path")


def _connect_errno(path: Path) -> int:
    """0 when something answers on the socket `path`, else the errno of the failed connect."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
            return 0
        except TimeoutError:
            return errno.ETIMEDOUT
        except OSError as exc:
            return exc.errno or errno.EIO


FILE_TYPES = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
              (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_type(mode: int) -> str:
    return next((words for test, words in FILE_TYPES if test(mode)), "not a regular file")


def socket_problem(path: Path) -> str | None:
    """Why a client cannot use `path` as a control socket, in words; None when it is a socket."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return "no such socket"
    except NotADirectoryError:
        return "a part of the path is not a directory"
    except PermissionError:
        return "permission denied: run as the service's user or root"
    except OSError as exc:
        return exc.strerror or str(exc)
    if not stat.S_ISSOCK(found.st_mode):
        return f"not a socket but {file_type(found.st_mode)}"
    try:
        return socket_trust_problem(path)
    except OSError as exc:
        return exc.strerror or str(exc)


class ControlServer:
    def __init__(self, path: Path, target: Controlled, environ: Mapping[str, str] = os.environ) -> None:
        self.path = Path(path)
        self.target = target
        self.environ = environ
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self._jobs: set[asyncio.Task] = set()
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound

    def _replace_stale(self) -> None:
        """Remove what a killed vsup left at the path (a socket nobody listens on); refuse anything
        else: a live vsup's socket, or a file that is not a socket at all (lstat: a symlink is
        not followed)."""
        try:
            found = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(found.st_mode):
            raise VsupError(f"control.socket {str(self.path)!r} is {file_type(found.st_mode)}, not a socket: vsup "
                            "replaces only a socket a killed vsup left behind; remove it or choose another path")
        error = _connect_errno(self.path)
        if error == 0:
            raise VsupError(f"another vsup is already running here: it answers on the control socket {self.path} "
                            "(stop it, or give this one another proxy.port or control.socket)")
        if error != errno.ECONNREFUSED:
            raise VsupError(f"control.socket {str(self.path)!r}: a socket is there and connecting to it fails with "
                            f"{os.strerror(error)}, not as a stale one would; remove it or choose another path")
        self.path.unlink()  # left behind by a vsup that was killed

    async def start(self) -> None:
        if len(os.fsencode(self.path)) > 107:
            raise VsupError(f"control.socket {str(self.path)!r} is longer than the 107 bytes a unix socket path may have")
        _prepare_directory(self.path, self.environ)
        self._replace_stale()
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_post("/restart", self._restart)
        app.router.add_post("/reload", self._reload)
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
        bound = os.lstat(self.path)
        self._bound = (bound.st_dev, bound.st_ino)
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
        if self._bound is not None:
            self._unlink_ours(self._bound)
            self._bound = None

    def _unlink_ours(self, bound: tuple[int, int]) -> None:
        """Remove the path only while it is still the socket we bound (someone may have put
        something else there since)."""
        try:
            found = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(found.st_mode) and (found.st_dev, found.st_ino) == bound:
            self.path.unlink()
        else:
            logger.warning("control socket %s was replaced by %s while vsup ran; left as it is",
                           self.path, file_type(found.st_mode) if not stat.S_ISSOCK(found.st_mode) else "another socket")

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
        indexes = self.target.instance_indexes
        if target == "all":
            indices = list(indexes)
        elif isinstance(target, int) and not isinstance(target, bool):
            indices = [target]
        else:
            return _error(400, f"target {target!r} is not an instance index or \"all\"")
        if target != "all" and target not in indexes:
            return _error(400, f"no instance {target}: this vsup runs instances {describe_indexes(indexes)}")
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


    async def _reload(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.body_exists else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        wait = body.get("wait", True)
        # Its own task, like a restart: a client that goes away does not cut a reload in half.
        job = asyncio.create_task(self.target.reload("vsup reload", bool(wait)))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        job.add_done_callback(_consume)
        try:
            record = await asyncio.shield(job)
        except VsupError as exc:
            return _error(409, str(exc))
        return web.json_response({"rollout": record})


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved here so a job nobody waits for does not log "never retrieved"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


# ---- the client side (vsup status / vsup restart) --------------------------------------------------

def socket_candidates(config: VsupConfig | None, environ: Mapping[str, str] = os.environ) -> list[tuple[Path, bool]]:
    """Where a vsup run with `config` (None: the defaults) may listen, in the order the client
    tries them: (path, whether it is this config's own path rather than a guess)."""
    if config is not None and config.control.socket is not None:
        return [(Path(config.control.socket), True)]
    port = config.proxy.port if config is not None else 8000
    found: list[tuple[Path, bool]] = []
    runtime = _runtime_socket(environ)
    if runtime is not None:
        found.append((runtime, True))
    # the installed unit's vsup before this user's private one: a /tmp/vsup-<uid> may have been
    # made by another user before this one ever ran vsup (socket_problem refuses what is theirs)
    if SYSTEMD_DEFAULT not in [path for path, _ in found]:
        found.append((SYSTEMD_DEFAULT, config is None))
    found.append((private_dir(environ) / f"control-{port}.sock", True))
    return found


def find_socket(socket_path: str | None, config: VsupConfig | None, environ: Mapping[str, str] = os.environ) -> Path:
    """--socket, else the first place (`socket_candidates`) where a vsup answers — for a guess,
    only one serving the config's proxy port; VsupError naming every place and what was there."""
    if socket_path:
        return Path(socket_path)
    looked = []
    for path, own in socket_candidates(config, environ):
        seen = _probe(path)
        if isinstance(seen, int) and (own or config is None or seen in (config.proxy.port, -1)):
            return path
        if isinstance(seen, int):
            seen = f"a vsup with proxy port {seen}, not {config.proxy.port}"  # type: ignore[union-attr]
        looked.append(f"{path} ({seen})")
    raise VsupError("vsup is not running: no control socket answers at " + ", ".join(looked)
                    + "; if it runs with another proxy.port or control.socket, pass --config FILE or --socket PATH")


def _probe(path: Path) -> int | str:
    """The proxy port of the vsup answering on `path` (-1: it answers, port unknown), or what
    was found there instead."""
    problem = socket_problem(path)
    if problem is not None:
        return problem
    client = http.client.HTTPConnection("vsup", timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5)
        sock.connect(str(path))
        client.sock = sock
        client.request("GET", "/status")
        data = json.loads(client.getresponse().read())
        return int(str(data["vsup"]["proxy"]).rpartition(":")[2])
    except PermissionError:
        return "permission denied: run as the service's user or root"
    except OSError as exc:
        return f"does not answer: {exc.strerror or exc}"
    except (ValueError, KeyError, TypeError, http.client.HTTPException):
        return -1
    finally:
        client.close()
        sock.close()


async def request(path: Path, method: str, route: str, body: Any = None, timeout: float | None = None) -> Any:
    """One request to a running vsup; VsupError (one line naming `path`) when it is not there,
    cannot be used, or says no."""
    problem = socket_problem(path)
    if problem == "no such socket":
        raise VsupError(f"vsup is not running: no control socket at {path}")
    if problem is not None:
        raise VsupError(f"cannot use the control socket {path}: {problem}")
    connector = aiohttp.UnixConnector(path=str(path))
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.request(method, f"http://vsup{route}", json=body) as response:
                data = await response.json(content_type=None)
                if response.status != 200:
                    error = data.get("error") if isinstance(data, dict) else None
                    raise VsupError(error if isinstance(error, str) else f"the control socket {path} answered HTTP {response.status}")
                return data
    except aiohttp.ClientConnectorError as exc:
        if isinstance(exc.os_error, PermissionError):
            raise VsupError(f"cannot connect to the control socket {path}: permission denied: "
                            "run as the service's user or root") from None
        raise VsupError(f"vsup is not running: the control socket {path} does not answer ({exc.os_error.strerror if exc.os_error else exc})") from None
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        raise VsupError(f"talking to vsup over {path} failed: {exc}") from None
    except TimeoutError:
        raise VsupError(f"vsup did not answer within {timeout:g}s on {path}") from None
