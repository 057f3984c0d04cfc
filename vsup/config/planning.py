"""From the YAML config to a plan: the I/O around the pure planner (model size on disk, whether
numactl is installed and what it supports, the machine's sysfs), and errors worded for where each
setting came from: the planner names a `vsup plan` flag; a value from the config file is named by
its key and file:line instead."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

from vsup.config.fleet import is_fleet, models_of
from vsup.config.loader import where
from vsup.config.schema import RELOAD, GiB, VsupConfig
from vsup.errors import ConfigError
from vsup.topology.errors import PlanError, SettingError
from vsup.topology.fleet import ModelPlanError, ModelSettingError, kept_of, plan_fleet
from vsup.topology.model import Machine
from vsup.topology.plan_model import FleetModel, Plan, PlanSettings
from vsup.topology.planner import plan
from vsup.topology.sysfs import read_machine

# Files that hold weights in a local model directory (safetensors, PyTorch, GGUF).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

# PlanSettings field -> the config key that sets it (the `plan=` of the key's reload class)
CONFIG_KEYS = {entry.plan: key for key, entry in RELOAD.items() if entry.plan is not None}


def settings_from_config(cfg: VsupConfig, *, numactl_available: bool | None = None,
                         preferred_many: bool | None = None) -> PlanSettings:
    p = cfg.placement
    model_size: int | None
    if p.model_size_gib is not None:
        model_size = round(p.model_size_gib * GiB)
    else:
        model_size = model_dir_size(cfg.model)
    launcher = p.launcher
    if launcher == "auto":
        if numactl_available is None:
            numactl_available = shutil.which("numactl") is not None
        launcher = "numactl" if numactl_available else "taskset"
    if preferred_many is None:  # asked only when it can matter
        preferred_many = launcher == "numactl" and p.membind == "preferred" and numactl_has_preferred_many()
    return PlanSettings(
        instances=cfg.instances,
        base_port=cfg.vllm.base_port,
        model_size_bytes=model_size,
        kvcache_gib=p.kvcache_gib,
        overhead_bytes=round(p.overhead_gib * GiB),
        memory_reserve_bytes=round(p.memory_reserve_gib * GiB),
        reserve_cores=p.reserve_cores,
        housekeeping_core=p.housekeeping_core,
        smt=p.smt,
        cores_per_instance=p.cores_per_instance,
        omp_threads=p.omp_threads,
        membind=p.membind,
        launcher=launcher,
        nodes=tuple(p.nodes) if p.nodes is not None else None,
        efficiency_cores=p.efficiency_cores,
        numactl_preferred_many=preferred_many,
    )


def numactl_has_preferred_many(program: str = "numactl") -> bool:
    """Whether the installed numactl knows --preferred-many (numactl 2.0.16+): its usage text,
    printed for any unknown option, lists it."""
    path = shutil.which(program)
    if path is None:
        return False
    try:
        result = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--preferred-many" in result.stdout + result.stderr


def model_dir_size(model: str) -> int | None:
    """Bytes of weight files in a local model directory (or one weight file); None when the model is
    not a local path (a hub id) or holds no weight files. Symlinks (HF cache snapshots) are followed."""
    path = Path(model).expanduser()
    try:
        if path.is_file():
            return path.stat().st_size if path.suffix in WEIGHT_SUFFIXES else None
        if not path.is_dir():
            return None
        total = sum(f.stat().st_size for f in path.rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    except OSError as exc:
        raise ConfigError(f"model: cannot read {model}: {exc.strerror or exc}") from None
    return total or None


def plan_from_config(cfg: VsupConfig, fsroot: str | Path = "/", *, numactl_available: bool | None = None,
                     flags: frozenset[str] = frozenset(), running: Plan | None = None) -> tuple[Machine, Plan]:
    """The plan of `cfg` on the machine under `fsroot`. `flags`: the PlanSettings fields that came
    from command-line options (`vsup plan --kvcache-gib`); an error about one of them names the
    flag, an error about any other setting names its config key and file:line. `running`: the
    plan a running fleet has (a reload): the models it runs unchanged keep their CPUs and KV cache
    (topology.fleet.kept_of)."""
    machine = read_machine(fsroot)
    views = models_of(cfg)
    if not is_fleet(cfg):
        try:
            one = plan(machine, settings_from_config(cfg, numactl_available=numactl_available))
        except SettingError as exc:
            raise reworded(exc, cfg, flags) from None
        name = views[0].name
        return machine, replace(one, instances=tuple(replace(inst, model=name, replica=inst.index) for inst in one.instances))
    models = []
    for view in views:
        models.append(FleetModel(view.name, settings_from_config(view.config, numactl_available=numactl_available), view.share))
    try:
        return machine, plan_fleet(machine, models, kept_of(running, models) if running is not None else None)
    except ModelSettingError as exc:
        view = next(v for v in views if v.name == exc.model)
        if exc.error.setting == "reserve_cores":  # machine-wide: the top level's key
            raise reworded(exc.error, cfg, flags) from None
        raise reworded(exc.error, view.config, flags) from None
    except ModelPlanError as exc:
        # the partition's own refusals name the entry's key (share, placement.nodes) or the entry
        view = next((v for v in views if v.name == exc.model), views[-1])
        named = where(view.config, exc.key or "model")
        raise PlanError(f"{named}: {exc.text}" if exc.model == view.name else str(exc)) from None


def reworded(exc: SettingError, cfg: VsupConfig, flags: frozenset[str] = frozenset()) -> PlanError:
    """The planner's error about one setting, naming where its value came from: the flag as the
    planner words it, else `<file>:<line>: <key>: <value> is not valid: ...` like a config error
    (`<file>: <key> (default)` when the file does not set it)."""
    if exc.setting not in CONFIG_KEYS or exc.setting in flags:
        return exc
    value = f"{exc.value} is not valid: " if exc.value is not None else ""
    return PlanError(f"{where(cfg, CONFIG_KEYS[exc.setting])}: {value}{exc.detail}")
