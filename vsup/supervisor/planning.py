"""From the YAML config to a plan: the I/O around the pure planner (model size on disk, whether
numactl is installed, the machine's sysfs)."""

from __future__ import annotations

import shutil
from pathlib import Path

from vsup.supervisor.config import GiB, VsupConfig
from vsup.supervisor.errors import ConfigError
from vsup.topology.model import Machine
from vsup.topology.plan_model import Plan, PlanSettings
from vsup.topology.planner import plan
from vsup.topology.sysfs import read_machine

# Files that hold weights in a local model directory (safetensors, PyTorch, GGUF).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def settings_from_config(cfg: VsupConfig, *, numactl_available: bool | None = None) -> PlanSettings:
    p = cfg.placement
    if p.model_size_gib is not None:
        model_size = round(p.model_size_gib * GiB)
    else:
        model_size = model_dir_size(cfg.model)
    launcher = p.launcher
    if launcher == "auto":
        if numactl_available is None:
            numactl_available = shutil.which("numactl") is not None
        launcher = "numactl" if numactl_available else "taskset"
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
    )


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


def plan_from_config(cfg: VsupConfig, fsroot: str | Path = "/", *, numactl_available: bool | None = None) -> tuple[Machine, Plan]:
    machine = read_machine(fsroot)
    return machine, plan(machine, settings_from_config(cfg, numactl_available=numactl_available))
