"""The doctor's library checks: where the dynamic linker finds a library (its cache, vLLM's venv,
the usual directories), the malloc/OpenMP libraries vLLM's CPU docs recommend preloading, and
whether the installed libstdc++/glibc/libnuma define the symbol versions vLLM's native extension
needs (read from the ELF files by vsup.doctor.elfinfo: the check behind "GLIBCXX_3.4.xx not found").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

from vsup.doctor.elfinfo import version_defs, version_needs
from vsup.doctor.result import FAIL, PASS, SKIP, WARN, Result
from vsup.supervisor.preload import IOMP_NAMES, LIB_DIRS, TCMALLOC_NAMES
from vsup.topology.fsroot import FsRoot

# the system libraries vLLM's native extension is linked against, with the package that has them
NATIVE_DEPS = {"libstdc++.so.6": "libstdc++6", "libc.so.6": "libc6", "libnuma.so.1": "libnuma1"}


# ---------------------------------------------------------------- libraries

def ldconfig_paths() -> dict[str, str]:
    """{soname: path} from the dynamic linker's cache (`ldconfig -p`); {} when unavailable."""
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.access("/sbin/ldconfig", os.X_OK) else None)
    if not ldconfig:
        return {}
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
        if m and m.group(1) not in found and ("64" in m.group(2) or "," not in m.group(2)):
            found[m.group(1)] = m.group(3)
    return found


def find_library(names: Iterable[str], fs: FsRoot, cache: Mapping[str, str], extra_dirs: Iterable[str] = ()) -> str | None:
    """The first of `names` in `extra_dirs` (absolute, e.g. vLLM's venv lib/), the linker cache, or
    the usual library directories under the fsroot."""
    names = list(names)
    for directory in extra_dirs:
        for name in names:
            if (Path(directory) / name).is_file():
                return str(Path(directory) / name)
    for name in names:
        if name in cache:
            return cache[name]
    for directory in LIB_DIRS:
        for name in names:
            if fs.path(f"{directory}/{name}").is_file():
                return str(fs.path(f"{directory}/{name}"))
    return None


def check_preload(fs: FsRoot, cache: Mapping[str, str], probe: dict, arch: str, vllm_env: Mapping[str, str],
                  preloaded: Iterable[str] = ()) -> Result:
    """`preloaded`: what vsup preloads under the configuration (vllm.preload, vsup/supervisor/preload.py)."""
    prefix_lib = [os.path.join(probe["prefix"], "lib")] if probe.get("prefix") else []
    tcmalloc = find_library(TCMALLOC_NAMES, fs, cache, prefix_lib)
    x86 = arch in ("x86_64", "amd64", "")
    iomp = find_library(IOMP_NAMES, fs, cache, prefix_lib) if x86 else None
    missing = []
    if not tcmalloc:
        missing.append(("tcmalloc", "apt-get install libtcmalloc-minimal4 (dnf install gperftools-libs)"))
    if x86 and not iomp:
        missing.append(("Intel OpenMP (libiomp5.so)", f"pip install intel-openmp (in {probe.get('prefix', 'vLLM’s venv')})"))
    if missing:
        return Result(
            "preload-libs", WARN, "not found: " + ", ".join(name for name, _ in missing) + " (vLLM's CPU docs recommend preloading them)",
            "; ".join(fix for _, fix in missing),
        )
    libs = [lib for lib in (tcmalloc, iomp) if lib]
    preloaded = list(preloaded)
    preload = ":".join([*preloaded, vllm_env.get("LD_PRELOAD", "")])
    if all(os.path.basename(lib) in preload for lib in libs):
        through = " and ".join(name for name, value in (("vllm.preload", preloaded), ("vllm.env", vllm_env.get("LD_PRELOAD"))) if value)
        return Result("preload-libs", PASS, f"preloaded through {through}: {preload.strip(':')}")
    return Result(
        "preload-libs", PASS, f"found {', '.join(libs)}",
        "vllm.preload: auto preloads them where vLLM's environment has them; to preload (LD_PRELOAD) these, "
        f"list them: vllm: {{preload: [{', '.join(libs)}]}}",
    )


def native_extensions(probe: dict) -> list[Path]:
    """vLLM's compiled extension(s) and torch's CPU library, where the probe found them."""
    files: list[Path] = []
    if probe.get("vllm"):
        files += sorted(Path(probe["vllm"]).parent.glob("_C*.so"))
    if probe.get("torch"):
        lib = Path(probe["torch"]).parent / "lib" / "libtorch_cpu.so"
        if lib.is_file():
            files.append(lib)
    return files


def check_native_libs(binaries: list[Path], fs: FsRoot, cache: Mapping[str, str], prefix: str | None) -> Result:
    """What `import vllm` needs from libstdc++/glibc/libnuma, against the versions the libraries
    that would be loaded define - the check behind "GLIBCXX_3.4.xx not found"."""
    if not binaries:
        return Result("native-libs", SKIP, "no vLLM/torch native library found to check")
    extra = [os.path.join(prefix, "lib")] if prefix else []  # conda ships its own libstdc++ and it wins
    problems, fixes = [], []
    defs_cache: dict[str, set[str]] = {}
    for binary in binaries:
        try:
            needs = version_needs(binary)
        except (OSError, ValueError) as exc:
            return Result("native-libs", SKIP, f"{binary}: {exc}")
        for dep, package in NATIVE_DEPS.items():
            if dep not in needs:
                continue
            provider = find_library([dep], fs, cache, extra)
            if provider is None:
                problems.append(f"{binary.name} needs {dep}, which is not installed")
                fixes.append(f"apt-get install {package}")
                continue
            if provider not in defs_cache:
                try:
                    defs_cache[provider] = version_defs(provider)
                except (OSError, ValueError):
                    defs_cache[provider] = set(needs[dep])  # unreadable: do not guess a failure
            lacking = sorted(needs[dep] - defs_cache[provider], key=_version_key)
            if lacking:
                problems.append(f"{binary.name} needs {', '.join(lacking)} from {dep}, which {provider} lacks")
                fixes.append(f"a newer {package} (or a newer OS / the distro's gcc runtime; in conda: conda install -c conda-forge libstdcxx-ng)")
    if problems:
        return Result("native-libs", FAIL, "; ".join(problems) + ": `import vllm` fails with \"version ... not found\"", "; ".join(dict.fromkeys(fixes)))
    return Result("native-libs", PASS, f"libstdc++/glibc/libnuma versions satisfy {', '.join(b.name for b in binaries)}")


def _version_key(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[._]", name.split("_", 1)[-1]))
