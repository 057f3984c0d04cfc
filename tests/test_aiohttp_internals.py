"""The aiohttp internals the proxy relies on: the installed aiohttp matches them, the pin in
pyproject.toml is the range the check enforces, and a mismatch is one clear error."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import aiohttp
import pytest

from vsup.supervisor.errors import VsupError
from vsup.supervisor.proxy import aiohttp_internals

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_aiohttp_has_the_internals_vsup_uses():
    assert aiohttp_internals.problems() == [], f"aiohttp {aiohttp.__version__} changed what the proxy relies on"
    aiohttp_internals.check()


def test_the_pin_in_pyproject_is_the_range_the_check_enforces():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if re.match(r"aiohttp\b", d)]
    assert pin.split(";")[0].strip() == aiohttp_internals.REQUIREMENT


@pytest.mark.parametrize("version, ok", [("3.9.0", True), ("3.14.5", True), ("3.15.0", False), ("4.0.0a1", False), ("3.8.6", False)])
def test_versions_outside_the_tested_range_are_refused(version, ok):
    found = [p for p in aiohttp_internals.problems(version) if "outside the tested range" in p]
    assert (found == []) == ok


def test_the_refusal_names_what_to_install(monkeypatch):
    monkeypatch.setattr(aiohttp_internals, "problems", lambda: ["aiohttp 3.15.0 is outside the tested range aiohttp>=3.9,<3.15"])
    with pytest.raises(VsupError, match=r"pip install 'aiohttp>=3\.9,<3\.15'"):
        aiohttp_internals.check()
