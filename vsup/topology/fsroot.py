"""Read sysfs/procfs files under a filesystem root ("/" or an unpacked dump), the way the kernel
writes them: trailing newlines and NUL bytes are stripped, a blank file reads as "".

Optional files come back as None when missing or unreadable; required ones raise TopologyError
naming the full path and what was expected, so a user can see which file of a dump is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from vsup.topology.cpulist import parse_list, parse_mask
from vsup.topology.errors import TopologyError


class FsRoot:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def is_dir(self, rel: str) -> bool:
        return self.path(rel).is_dir()

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def read(self, rel: str) -> str | None:
        """The file's text without NULs and surrounding whitespace; None if it cannot be read."""
        try:
            raw = self.path(rel).read_bytes()
        except OSError:
            return None
        return raw.replace(b"\x00", b"").decode("utf-8", errors="replace").strip()

    def read_nonblank(self, rel: str) -> str | None:
        """Like read(), but a blank file counts as missing (hand-made dumps leave empty files)."""
        text = self.read(rel)
        return text if text else None

    def require(self, rel: str, expected: str) -> str:
        text = self.read_nonblank(rel)
        if text is None:
            state = "empty" if self.exists(rel) else "missing"
            raise TopologyError(f"{self.path(rel)}: {state}; expected {expected}")
        return text

    def cpu_list(self, rel: str) -> frozenset[int] | None:
        """A list-notation file ("0-3,8"); None when missing or blank."""
        return self._cpus(rel, parse_list, "a CPU list like 0-3,8")

    def cpu_mask(self, rel: str) -> frozenset[int] | None:
        """A mask-notation file ("00000000,0000ff0f"); None when missing or blank."""
        return self._cpus(rel, parse_mask, "a hex CPU mask like 00000000,0000ffff")

    def _cpus(self, rel: str, parse: Callable[[str], frozenset[int]], expected: str) -> frozenset[int] | None:
        text = self.read_nonblank(rel)
        if text is None:
            return None
        try:
            return parse(text)
        except ValueError as exc:
            raise TopologyError(f"{self.path(rel)}: {exc}; expected {expected}") from None

    def integer(self, rel: str) -> int | None:
        text = self.read_nonblank(rel)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            raise TopologyError(f"{self.path(rel)}: {text[:40]!r} is not an integer") from None

    def numbered(self, rel: str, prefix: str) -> list[int]:
        """Sorted N of the entries `<prefix>N` in a directory (cpu0, cpu12, node3...)."""
        try:
            names = [p.name for p in self.path(rel).iterdir()]
        except OSError:
            return []
        pattern = re.compile(rf"{re.escape(prefix)}(\d+)")
        return sorted(int(m.group(1)) for name in names if (m := pattern.fullmatch(name)))
