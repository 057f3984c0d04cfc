"""The hwloc corpus of real machines' sysfs dumps, unpacked once per test session.

The corpus ships with the repository in tests/data/hwloc (sysfs dumps from hwloc's own test suite,
BSD-3-Clause, COPYING.hwloc beside them; truth.json is ours). A missing corpus FAILS the tests that
need it, with the path it looked at: a silently skipped corpus would let a broken reader pass.

Use in a test module:
    from tests.topology_fixtures import DUMP_NAMES   # the `corpus` fixture is registered by tests/conftest.py

    @pytest.mark.parametrize("name", DUMP_NAMES)
    def test_x(corpus, name):
        machine = read_machine(corpus.fsroot(name), live=False)
        facts = corpus.facts(name)
"""

from __future__ import annotations

import json
import re
import tarfile
import threading
from pathlib import Path

import pytest

CORPUS_DIR = Path(__file__).resolve().parent / "data" / "hwloc"
MISSING = "<hwloc corpus missing>"


def _dump_names() -> list[str]:
    try:
        truth = json.loads((CORPUS_DIR / "truth.json").read_text())
        return sorted(truth["dumps"])
    except (OSError, ValueError, KeyError):
        return [MISSING]  # one parameter whose test fails through the `corpus` fixture


DUMP_NAMES = _dump_names()


class Corpus:
    def __init__(self, directory: Path, workdir: Path):
        self.directory = directory
        self.workdir = workdir
        self.truth = json.loads((directory / "truth.json").read_text())["dumps"]
        self._lock = threading.Lock()
        self._unpacked: set[str] = set()

    def facts(self, name: str) -> dict:
        return self.truth[name]

    def fsroot(self, name: str) -> Path:
        """The unpacked dump's root directory (unpacked on first use)."""
        entry = self.truth[name]
        target = self.workdir / name
        with self._lock:
            if name not in self._unpacked:
                with tarfile.open(self.directory / entry["tarball"]) as tar:
                    if hasattr(tarfile, "data_filter"):
                        tar.extractall(target, filter="data")
                    else:  # Python < 3.11.4: the dumps are our own, trusted files
                        tar.extractall(target)
                self._unpacked.add(name)
        root = target / entry["fsroot"]
        if not root.is_dir():
            raise AssertionError(f"{entry['tarball']}: no directory {entry['fsroot']!r} inside")
        return root

    def lstopo_counts(self, name: str) -> dict[str, int] | None:
        """Object counts from hwloc's own expected lstopo output for the dump (<name>.console or
        <name>.xml), an independent cross-check of truth.json; None when neither file exists."""
        console = self.directory / f"{name}.console"
        if console.is_file():
            counts = {}
            for line in console.read_text().splitlines():
                match = re.match(r"\s*(?:Special )?depth -?\d+:\s+(\d+) (\w+) \(type", line)
                if match:
                    counts[match.group(2)] = int(match.group(1))
            return counts
        xml = self.directory / f"{name}.xml"
        if xml.is_file():
            counts: dict[str, int] = {}
            for kind in re.findall(r'<object type="(\w+)"', xml.read_text()):
                counts[kind] = counts.get(kind, 0) + 1
            return counts
        return None

    def cpu_kinds(self, name: str) -> list[tuple[int, frozenset[int]]] | None:
        """hwloc's "CPU kind #i efficiency E cpuset 0x.." lines: (efficiency rank, CPUs)."""
        console = self.directory / f"{name}.console"
        if not console.is_file():
            return None
        kinds = []
        for line in console.read_text().splitlines():
            match = re.match(r"CPU kind #\d+ efficiency (\d+) cpuset (0x[0-9a-f,x]+)", line)
            if match:
                value = int(match.group(2).replace("0x", "").replace(",", ""), 16)
                cpus = frozenset(i for i in range(value.bit_length()) if value >> i & 1)
                kinds.append((int(match.group(1)), cpus))
        return kinds or None


_shared: Corpus | None = None


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    # one unpacked copy per session, however the fixture is reached
    global _shared
    if _shared is not None:
        return _shared
    directory = CORPUS_DIR
    if not (directory / "truth.json").is_file():
        pytest.fail(
            f"hwloc topology corpus not found: {directory}/truth.json is missing. It ships with "
            f"the repository in tests/data/hwloc: restore it from git.",
            pytrace=False,
        )
    _shared = Corpus(directory, tmp_path_factory.mktemp("hwloc-corpus"))
    return _shared
