"""Where a running vsup keeps its files: its state file, by default its control socket, and the
instances' Unix sockets (vllm.listen: unix) in a private folder of their own, `instances-<proxy.port>`.

Under systemd (`RuntimeDirectory=vsup`) that is `$RUNTIME_DIRECTORY` (/run/vsup). Elsewhere it is
a private directory of the user, `$TMPDIR/vsup-<uid>` or `/tmp/vsup-<uid>`, mode 0700 and checked
on every use: in a shared /tmp another user could have created it first. systemd's runtime
directory may be readable by others (RuntimeDirectoryMode), the instances' folder is 0700 always.

The instances' logs (log.dir unset) go to systemd's `$LOGS_DIRECTORY` (/var/log/vsup) under the
unit, else to this user's state folder, `$XDG_STATE_HOME/vsup/logs` (`~/.local/state/vsup/logs`;
root's is /root/.local/state/vsup/logs): never the working directory, which others may write.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from vsup.errors import VsupError
from vsup.ownfiles import state_home


def private_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get("TMPDIR") or "/tmp") / f"vsup-{os.getuid()}"


def systemd_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """`$RUNTIME_DIRECTORY` (its first directory) under systemd, else None."""
    runtime = environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return Path(runtime) if runtime else None


def runtime_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return systemd_dir(environ) or private_dir(environ)


def default_log_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the instances' logs go when log.dir is unset (see the module docstring)."""
    logs = environ.get("LOGS_DIRECTORY", "").split(":")[0]
    if logs:
        return Path(logs)
    return state_home(environ, "log.dir") / "logs"


def ensure_private(directory: Path, what: str, alternative: str) -> None:
    """Create the private directory if needed; VsupError if it is not ours alone."""
    directory.mkdir(mode=0o700, parents=False, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise VsupError(f"{what} directory {directory} is not a private directory of this user "
                        f"(mode 0700, owned by us); remove it or {alternative}")


def prepare_runtime_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The runtime directory, created (private) or checked (systemd's); VsupError naming it."""
    directory = runtime_dir(environ)
    if directory == private_dir(environ):
        ensure_private(directory, "runtime", "point TMPDIR elsewhere")
    elif not directory.is_dir():
        raise VsupError(f"RUNTIME_DIRECTORY {str(directory)!r} does not exist")
    return directory


def instance_dir(proxy_port: int, environ: Mapping[str, str] = os.environ) -> Path:
    """The folder of the instances' sockets: one per vsup run of this user (`vsup tune` runs child
    vsups, each on its own proxy port; with port 0 the folder is this process's)."""
    return runtime_dir(environ) / f"instances-{proxy_port or f'pid{os.getpid()}'}"


def prepare_instance_dir(proxy_port: int, environ: Mapping[str, str] = os.environ) -> Path:
    """The instances' socket folder, created or checked private (0700, ours); VsupError naming it."""
    prepare_runtime_dir(environ)
    directory = instance_dir(proxy_port, environ)
    ensure_private(directory, "instance socket", "point TMPDIR or RUNTIME_DIRECTORY elsewhere")
    return directory


def remove_instance_dir(proxy_port: int, environ: Mapping[str, str] = os.environ) -> None:
    """After the instances have stopped: their sockets (vLLM leaves them) and the folder, if ours."""
    directory = instance_dir(proxy_port, environ)
    try:
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return
        for entry in directory.iterdir():
            found = entry.lstat()
            if stat.S_ISSOCK(found.st_mode) and found.st_uid == os.getuid():
                entry.unlink()
        directory.rmdir()
    except OSError:
        pass  # something else in it, or gone already: the next run checks and clears its own sockets
