"""Files vsup writes (instance logs, tune's results, report and configuration) are its own: their
folder is vsup's user's and writable by no one else, each file is opened without following a link,
and what vsup creates is private (0700 folders, 0600 files; 0750/0640 for a named group).

Why: vsup often runs as root. In a folder another user may write (a shared working directory, a
folder they own) they could plant a symlink at a log's name, and root would append to, truncate
or create whatever it points to. So an existing folder is used only when this user owns it and
neither group nor others may write it — a sticky world-writable folder (/tmp) is refused too:
others could still plant names there that vsup then could not open. Each file is opened with
O_NOFOLLOW (a link at its name is an error, never followed) and O_CLOEXEC (no instance inherits
it), relative to the folder opened once (a folder swapped afterwards changes nothing).
"""

from __future__ import annotations

import errno
import grp
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Literal

from vsup.errors import VsupError

FILE_MODE = 0o600
DIR_MODE = 0o700
GROUP_FILE_MODE = 0o640
GROUP_DIR_MODE = 0o750

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC
_FLAGS = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}


def group_id(name: str | None, key: str) -> int | None:
    """The gid of `name` (a group name or number); VsupError naming `key` when there is none."""
    if name is None:
        return None
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise VsupError(f"{key} {name!r}: no such group on this machine; give an existing group or leave it unset") from None


def modes(gid: int | None) -> tuple[int, int]:
    """(folder mode, file mode): private, or readable by the group `gid`."""
    return (DIR_MODE, FILE_MODE) if gid is None else (GROUP_DIR_MODE, GROUP_FILE_MODE)


def folder_problem(info: os.stat_result) -> str | None:
    """Why a folder with this lstat is not vsup's own, in words; None when it is."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symlink (vsup does not follow it)"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by vsup's user (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"is writable by {'others' if info.st_mode & 0o002 else 'its group'} (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def own_folder(directory: Path, key: str, *, gid: int | None = None) -> Path:
    """`directory`, created private (0700; 0750 of group `gid`) with the folders above it if it
    is missing, or checked to be vsup's own if it exists; VsupError naming `key` and the path."""
    dir_mode, _ = modes(gid)
    directory = Path(directory)
    try:
        info = os.lstat(directory)
    except (FileNotFoundError, NotADirectoryError):
        try:
            os.makedirs(directory, mode=dir_mode)  # (the leaf gets dir_mode; folders above, the umask's)
            info = os.lstat(directory)
        except OSError as exc:
            raise VsupError(f"{key} {str(directory)!r} cannot be created ({exc.strerror or exc}); "
                            "choose a folder this user can write") from None
        if gid is not None:
            _give_group(directory, info, gid, dir_mode, key)
            info = os.lstat(directory)
    except OSError as exc:
        raise VsupError(f"{key} {str(directory)!r} cannot be used ({exc.strerror or exc})") from None
    problem = folder_problem(info)
    if problem:
        raise VsupError(f"{key} {str(directory)!r} {problem}: another user could plant links there; "
                        "use a folder of vsup's own user that only it may write (or leave the setting unset)")
    if gid is not None and info.st_gid != gid:
        _give_group(directory, info, gid, stat.S_IMODE(info.st_mode) & ~0o027 | 0o050, key)
    return directory


def _give_group(path: Path, info: os.stat_result, gid: int, mode: int, key: str) -> None:
    try:
        os.chown(path, -1, gid, follow_symlinks=False)
        os.chmod(path, mode)
    except OSError as exc:
        raise VsupError(f"{key}: cannot give {str(path)!r} to group {gid} ({exc.strerror or exc}); "
                        "vsup's user must be a member of that group (or root)") from None


def open_fd(path: Path | str, how: Literal["a", "w"], *, dir_fd: int | None = None, mode: int = FILE_MODE,
            gid: int | None = None, private: bool = True) -> int:
    """A descriptor of the file `path` (relative to `dir_fd` when given) for appending or
    rewriting: never through a symlink (OSError ELOOP), not inherited, created with `mode`; an
    existing file of ours gets `mode` (and group `gid`) too, so an older 0644 log becomes private
    (`private` False: a new file gets `mode` less the umask, an existing one keeps its own)."""
    fd = os.open(path, _FLAGS[how] | _OPEN, mode, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if private and info.st_uid == os.geteuid():
            if gid is not None and info.st_gid != gid:
                os.fchown(fd, -1, gid)
            if stat.S_IMODE(info.st_mode) != mode:
                os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path: Path | str, how: Literal["a", "w"], **options) -> IO[bytes]:
    return os.fdopen(open_fd(path, how, **options), f"{how}b")


def open_text(path: Path | str, how: Literal["a", "w"], **options) -> IO[str]:
    return os.fdopen(open_fd(path, how, **options), how, encoding="utf-8")


def open_read(path: Path | str) -> IO[bytes]:
    """`path` opened for reading, never through a symlink."""
    return os.fdopen(os.open(path, os.O_RDONLY | _OPEN), "rb")


def write_text(path: Path, text: str, key: str, **options) -> None:
    """Write `text` to `path` (replacing it) without following a link; VsupError naming `key`."""
    try:
        with open_text(path, "w", **options) as f:
            f.write(text)
    except OSError as exc:
        raise VsupError(f"{key}: cannot write {path} ({why(exc)}); choose a path this user owns") from None


def why(exc: OSError) -> str:
    """An OSError from opening one of vsup's files, in words (a symlink says so)."""
    if exc.errno == errno.ELOOP:
        return "it is a symlink, which vsup does not follow"
    return exc.strerror or str(exc)


def state_home(environ: Mapping[str, str], key: str) -> Path:
    """This user's folder for vsup's state: `$XDG_STATE_HOME/vsup`, else `~/.local/state/vsup`
    (an XDG_STATE_HOME that is not absolute is ignored, as the XDG rule says: never a folder under
    the working directory). No home folder: a VsupError naming `key`, the setting that avoids it."""
    state = environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(state):
        return Path(state) / "vsup"
    home = environ.get("HOME") or _home_of_user()
    if not home or not os.path.isabs(home):
        raise VsupError(f"{key} is unset and this user has no home folder for vsup's state (HOME); set {key}")
    return Path(home) / ".local" / "state" / "vsup"


def _home_of_user() -> str | None:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return None
