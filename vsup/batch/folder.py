"""Where the batch store lives when batch.dir is unset (pure: the environment is an argument).

Under systemd (`StateDirectory=vsup`, one vsup per unit) `$STATE_DIRECTORY/batches`
(/var/lib/vsup/batches); else this user's state folder, one per proxy port as the control socket
is (`$XDG_STATE_HOME/vsup/batches-<port>`, `~/.local/state/vsup/batches-8000`): two vsups of one
user on other ports keep their own stores (a store is one process's: store.lock), and a vsup
started again on its port finds its batches. State that must outlive a restart, never a runtime or
temporary folder, never the working directory. The same rules as the instances' logs
(vsup/supervisor/rundir.py's default_log_dir): ownfiles.state_home.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from vsup.ownfiles import state_home


def default_dir(port: int, environ: Mapping[str, str] = os.environ) -> Path:
    """The batch store's folder for batch.dir: null, of the vsup whose proxy listens on `port`."""
    state = environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return Path(state) / "batches"
    return state_home(environ, "batch.dir") / f"batches-{port}"
