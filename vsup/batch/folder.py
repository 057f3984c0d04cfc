"""Where the batch store lives when batch.dir is unset (pure: the environment is an argument).

Under systemd (`StateDirectory=vsup`) `$STATE_DIRECTORY/batches` (/var/lib/vsup/batches); else
this user's state folder, `$XDG_STATE_HOME/vsup/batches` (`~/.local/state/vsup/batches`): state
that must outlive a restart, never a runtime or temporary folder, never the working directory.
The same rules as the instances' logs (vsup/supervisor/rundir.py's default_log_dir).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from vsup.errors import VsupError


def default_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The batch store's folder for batch.dir: null."""
    state = environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return Path(state) / "batches"
    xdg = environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):  # (the XDG rule: a relative value is ignored)
        return Path(xdg) / "vsup" / "batches"
    home = environ.get("HOME") or _home_of_user()
    if not home or not os.path.isabs(home):
        raise VsupError("batch.dir is unset and this user has no home folder for vsup's state (HOME); set batch.dir")
    return Path(home) / ".local" / "state" / "vsup" / "batches"


def _home_of_user() -> str | None:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return None
