"""Symbol-version names from ELF shared libraries, read from the section headers (no program run).

This is what the dynamic loader compares when it says "version `GLIBCXX_3.4.30' not found": a
library *needs* named versions from each of its dependencies (.gnu.version_r) and a dependency
*defines* the versions it provides (.gnu.version_d). Only 64-bit little-endian files are read
(x86_64, aarch64, ppc64le); anything else raises ValueError."""

from __future__ import annotations

import struct
from pathlib import Path

_SHT_GNU_VERDEF = 0x6FFFFFFD
_SHT_GNU_VERNEED = 0x6FFFFFFE


def _sections(f) -> list[tuple[int, int, int, int, int]]:
    """(type, offset, size, link, info) of each section header."""
    head = f.read(64)
    if head[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    if head[4] != 2 or head[5] != 1:
        raise ValueError("only 64-bit little-endian ELF files are read")
    shoff = struct.unpack_from("<Q", head, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    f.seek(shoff)
    raw = f.read(shentsize * shnum)
    out = []
    for i in range(shnum):
        _, typ, _, _, offset, size, link, info, _, _ = struct.unpack_from("<IIQQQQIIQQ", raw, i * shentsize)
        out.append((typ, offset, size, link, info))
    return out


def _read(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def _cstr(table: bytes, at: int) -> str:
    end = table.find(b"\0", at)
    return table[at : end if end >= 0 else len(table)].decode("ascii", "replace")


def _entries(path: str | Path, section_type: int, next_field: int):
    """(section data, its string table, offset of one entry) for each entry of the chained
    version records in sections of `section_type`; `next_field` is where an entry keeps the
    offset of the next one."""
    with open(path, "rb") as f:
        sections = _sections(f)
        for typ, offset, size, link, count in sections:
            if typ != section_type:
                continue
            data = _read(f, offset, size)
            strtab = _read(f, sections[link][1], sections[link][2])
            at = 0
            for _ in range(count):
                yield data, strtab, at
                next_at = struct.unpack_from("<I", data, at + next_field)[0]
                if not next_at:
                    break
                at += next_at


def version_needs(path: str | Path) -> dict[str, set[str]]:
    """{dependency file name: version names this library needs from it}."""
    needs: dict[str, set[str]] = {}
    # Elf64_Verneed: vn_version, vn_cnt, vn_file, vn_aux, vn_next
    for data, strtab, at in _entries(path, _SHT_GNU_VERNEED, 12):
        _, n_aux, file_at, aux_at, _ = struct.unpack_from("<HHIII", data, at)
        names = needs.setdefault(_cstr(strtab, file_at), set())
        aux = at + aux_at
        for _ in range(n_aux):
            _, _, _, name_at, aux_next = struct.unpack_from("<IHHII", data, aux)
            names.add(_cstr(strtab, name_at))
            aux += aux_next
    return needs


def version_defs(path: str | Path) -> set[str]:
    """The version names a library defines (e.g. GLIBCXX_3.4.29 for libstdc++.so.6)."""
    defs: set[str] = set()
    # Elf64_Verdef: vd_version, vd_flags, vd_ndx, vd_cnt, vd_hash, vd_aux, vd_next
    for data, strtab, at in _entries(path, _SHT_GNU_VERDEF, 16):
        aux_at = struct.unpack_from("<HHHHIII", data, at)[5]
        name_at, _ = struct.unpack_from("<II", data, at + aux_at)
        defs.add(_cstr(strtab, name_at))
    return defs
