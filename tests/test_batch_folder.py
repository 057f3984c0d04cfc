"""The batch store's default folder (vsup/batch/folder.py): state that outlives a restart, one per
proxy port outside systemd, never a relative or temporary place."""

from __future__ import annotations

from pathlib import Path

import pytest

from vsup.batch.folder import default_dir
from vsup.errors import VsupError


def test_systemd_state_directory_first():
    assert default_dir(8000, {"STATE_DIRECTORY": "/var/lib/vsup:/var/lib/other", "HOME": "/root"}) == Path("/var/lib/vsup/batches")


def test_xdg_state_home_then_home_each_port_its_own():
    assert default_dir(8000, {"XDG_STATE_HOME": "/s", "HOME": "/h"}) == Path("/s/vsup/batches-8000")
    assert default_dir(8001, {"XDG_STATE_HOME": "/s"}) == Path("/s/vsup/batches-8001")
    # a relative XDG_STATE_HOME is ignored (the XDG rule): never a folder under the working directory
    assert default_dir(8000, {"XDG_STATE_HOME": "state", "HOME": "/h"}) == Path("/h/.local/state/vsup/batches-8000")


def test_no_home_names_the_key(monkeypatch):
    monkeypatch.setattr("vsup.ownfiles._home_of_user", lambda: None)
    with pytest.raises(VsupError, match="batch.dir is unset .* set batch.dir"):
        default_dir(8000, {})
