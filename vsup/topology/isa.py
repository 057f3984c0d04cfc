"""Instruction-set facts vLLM CPU cares about.

Live, from the kernel's /proc/cpuinfo flags: they are what the kernel lets processes use (AMX,
for one, needs kernel support on top of the hardware bit) and reading them costs nothing, where
py-cpuinfo starts a helper process and takes about a second per `vsup` call. py-cpuinfo is the
fallback when /proc/cpuinfo has no flags line (not Linux, exotic architectures). Under a
filesystem root, from the first "flags" line of proc/cpuinfo; a dump without proc/cpuinfo has
unknown ISA, reported as all False."""

from __future__ import annotations

import functools
import platform

from vsup.topology.fsroot import FsRoot
from vsup.topology.model import Isa


def isa_from_flags(flags: set[str] | frozenset[str], arch: str = "") -> Isa:
    return Isa(
        avx2="avx2" in flags,
        avx512f="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        amx_bf16="amx_bf16" in flags,
        amx_tile="amx_tile" in flags,
        arch=arch,
    )


def parse_cpuinfo(text: str) -> tuple[frozenset[str], str]:
    """(flags of the first CPU, a guess at `uname -m`) from /proc/cpuinfo text."""
    flags: frozenset[str] = frozenset()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        fields.setdefault(key, value.strip())
        if key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    if "lm" in flags and "vendor_id" in fields:
        arch = "x86_64"
    elif "vendor_id" in fields:
        arch = "i686"
    elif fields.get("cpu", "").upper().startswith("POWER"):
        arch = "ppc64"
    elif fields.get("cpu architecture") == "8":
        arch = "aarch64"
    else:
        arch = ""
    return flags, arch


@functools.lru_cache(maxsize=1)
def _live_isa() -> tuple[Isa, str]:
    flags, _ = parse_cpuinfo(FsRoot("/").read("proc/cpuinfo") or "")
    if flags:
        return isa_from_flags(flags, platform.machine()), "/proc/cpuinfo"
    try:
        import cpuinfo  # py-cpuinfo

        flags = frozenset(cpuinfo.get_cpu_info().get("flags") or ())
    except Exception:  # py-cpuinfo probes many sources; a failure leaves the ISA unknown
        flags = frozenset()
    return isa_from_flags(flags, platform.machine()), "py-cpuinfo" if flags else "unknown (no CPU flags found)"


def read_isa(fs: FsRoot, live: bool) -> tuple[Isa, str]:
    """(Isa, where it came from)."""
    if live:
        return _live_isa()
    text = fs.read("proc/cpuinfo")
    if text is None:
        return Isa(), "none (no proc/cpuinfo under the fsroot)"
    flags, arch = parse_cpuinfo(text)
    return isa_from_flags(flags, arch), str(fs.path("proc/cpuinfo"))
