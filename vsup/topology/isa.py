"""Instruction-set facts vLLM CPU cares about.

Live, from the kernel's /proc/cpuinfo flags: they are what the kernel lets processes use (AMX,
for one, needs kernel support on top of the hardware bit) and reading them costs nothing, where
py-cpuinfo starts a helper process and takes about a second per `vsup` call. py-cpuinfo is the
fallback when /proc/cpuinfo has no flags line (not Linux, exotic architectures). Under a
filesystem root, from the first "flags" line of proc/cpuinfo; a dump without proc/cpuinfo has
unknown ISA, reported as all False (`Isa.flags_known` tells the two apart).

`shortfall` is the one wording of a CPU that cannot run vLLM's x86 build: `vsup doctor`'s cpu-isa
finding and the refusal of `vsup plan`, `vsup run` and `vsup reload` (vsup/supervisor/preflight.py)
say the same words. What a build needs (`BuildNeeds`) is read from the installed vLLM by
vsup/supervisor/vllm_command.py: AVX2 for vLLM's x86 build, more for builds made for more."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

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
        avx512_vnni="avx512_vnni" in flags,
        flags_known=bool(flags),
    )


X86_ARCHES = frozenset({"x86_64", "i686", "amd64"})

# A /proc/cpuinfo flag an x86 build of vLLM may be compiled for: its usual name, and the CPUs
# that have it (what the fix tells the user to run on).
INSTRUCTIONS = {
    "avx2": ("AVX2", "Haswell / Zen 1 or newer"),
    "avx512f": ("AVX-512", "Skylake-SP / Zen 4 or newer"),
    "avx512_vnni": ("AVX512-VNNI", "Cascade Lake / Zen 4 or newer"),
    "avx512_bf16": ("AVX512-BF16", "Cooper Lake / Sapphire Rapids / Zen 4 or newer"),
    "amx_bf16": ("AMX-BF16", "Sapphire Rapids or newer"),
    "amx_tile": ("AMX-TILE", "Sapphire Rapids or newer"),
}


@dataclass(frozen=True)
class BuildNeeds:
    """The instructions an installed x86 build of vLLM executes whatever the CPU (its floor)."""

    flags: tuple[str, ...] = ("avx2",)  # /proc/cpuinfo names, keys of INSTRUCTIONS
    build: str = "vLLM's x86 CPU build"  # how the finding names it
    instead: str = ""  # what would run on a lesser CPU ("" for the AVX2 floor: nothing does)
    why: str = "the floor of vLLM's x86 builds"  # how vsup knows, for docs and `vsup doctor`


AVX2_FLOOR = BuildNeeds()  # what every x86 build of vLLM executes, and all that most do


def shortfall(isa: Isa, needs: BuildNeeds = AVX2_FLOOR) -> tuple[str, str] | None:
    """(what is wrong, what would work) when the x86 CPU `isa` lacks an instruction set the
    build executes; None when it has them all. The caller decides that the CPU is x86."""
    missing = [flag for flag in needs.flags if not getattr(isa, flag, False)]
    if not missing:
        return None
    names = "/".join(INSTRUCTIONS[flag][0] for flag in missing)
    cpus = INSTRUCTIONS[missing[-1]][1]
    return (
        f"no {names}: {needs.build} stops with \"illegal instruction\"",
        f"run vLLM on a CPU with {names} ({cpus}){'; or ' + needs.instead if needs.instead else ''}; "
        "on a VM, expose the host CPU flags (e.g. -cpu host)",
    )


def refusal(isa: Isa, needs: BuildNeeds = AVX2_FLOOR, source: str = "") -> str | None:
    """The one line `vsup plan`/`run`/`reload` refuse with, in the doctor's words; None when the
    CPU is not x86, its flags are unknown (nothing to judge by) or it has what the build needs."""
    if not isa.flags_known or isa.arch not in X86_ARCHES:
        return None
    found = shortfall(isa, needs)
    if found is None:
        return None
    problem, fix = found
    return f"this CPU cannot run vLLM{f' (CPU flags from {source})' if source else ''}: {problem}; {fix} (vsup doctor checks the machine)"


# What an instance killed by SIGILL died of, in its description (vsup/supervisor/lifecycle.py).
SIGILL_CAUSE = ("the CPU lacks an instruction this vLLM build uses (AVX2, or AVX-512 for a build made for it; "
                "on an AMX CPU also bf16 with --enforce-eager: --dtype float32); see vsup doctor")


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
