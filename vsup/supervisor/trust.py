"""Whether the CLI may believe a control socket is its own vsup's: one another local user put in
a folder they may write (a `/tmp/vsup-0/control-8000.sock` made before root's first vsup) would
otherwise answer `vsup reload` with "done" while the real vsup never reloaded.

A socket is trusted when nobody but the caller and root could have put it at its path:
- it belongs to the caller or root, and so does its folder, which no one else may write (a
  sticky folder such as /tmp is enough: others may not replace what is not theirs there); or
- it is a service's: it belongs to its folder's owner, a folder no one else may write directly in
  /run — a runtime directory systemd made for the unit's user (`/run/vsup`, owned by `User=`):
  only root creates folders in /run, so root gave it to that user. (A folder in /home is no such
  thing: that user may be anyone.)
The check is made on the real socket (links resolved), and on a link at the given name too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

ROOT = 0
RUN = Path("/run")  # where systemd makes RuntimeDirectory= (tests point it elsewhere)


def _mode(info: os.stat_result) -> str:
    return f"{stat.S_IMODE(info.st_mode):04o}"


def _others_write(info: os.stat_result) -> bool:
    return bool(info.st_mode & 0o022)


def _place_problem(path: Path, uid: int) -> str | None:
    """Why the entry `path` (not followed) might have been put there by someone else; None: it can't."""
    info = os.lstat(path)
    folder = os.stat(path.parent)  # (a folder above may be a link, e.g. /var/run -> /run)
    mine = (uid, ROOT)
    folder_shut = not _others_write(folder) or (bool(folder.st_mode & stat.S_ISVTX) and info.st_uid in mine)
    if info.st_uid in mine and folder.st_uid in mine and folder_shut:
        return None
    service_place = info.st_uid == folder.st_uid and path.parent.parent == RUN
    if service_place and not _others_write(folder):
        above = os.stat(RUN)
        if above.st_uid == ROOT and not _others_write(above):
            return None  # a service's runtime directory, made by root for its user
    if info.st_uid not in mine and not (service_place and _others_write(folder)):
        return f"it belongs to uid {info.st_uid}, not to you (uid {uid}) or root, in {path.parent} (uid {folder.st_uid}, mode {_mode(folder)})"
    if _others_write(folder):
        return f"its folder {path.parent} may be written by others (mode {_mode(folder)})"
    return f"its folder {path.parent} belongs to uid {folder.st_uid}, not to you (uid {uid}) or root"


def socket_trust_problem(path: Path, uid: int | None = None) -> str | None:
    """Why the control socket at `path` may be another user's, in words; None when it is this
    user's, root's or its service's (see the module docstring). OSError when it cannot be looked at."""
    uid = os.geteuid() if uid is None else uid
    path = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))  # (folders above that are links, /var/run -> /run, resolved)
    problem = _place_problem(real, uid)
    if problem is None and path.is_symlink():  # the link itself must not be another user's either
        problem = _place_problem(Path(os.path.realpath(path.parent)) / path.name, uid)
    if problem is None:
        return None
    return problem + ": another user may have put it there; vsup talks only to a socket of yours, root's or its service's"
