"""`vsup doctor`: this machine against what vLLM CPU needs, one result per check, each with its fix.

Each check is a function of the facts it needs (an FsRoot, a probe of vLLM's Python environment,
a limit), so tests run them on fake trees and fake site-packages; `run_doctor` gathers the facts
of the live machine (or of a dump under --fsroot) and calls them in order. The checks live by
subject: vsup.doctor.machine (CPU, kernel, limits, affinity, bandwidth), vsup.doctor.vllm_env
(vLLM's Python environment), vsup.doctor.dependencies (pip check of vsup's and vLLM's
environments), vsup.doctor.libs (shared libraries); vsup.doctor.result has the statuses and the
text/JSON output.
"""

from __future__ import annotations

import os
import platform
import resource
from collections.abc import Mapping
from pathlib import Path

from vsup.config.fleet import is_fleet, models_of
from vsup.config.planning import plan_from_config
from vsup.config.schema import VsupConfig, load_config
from vsup.doctor.dependencies import check_dependencies
from vsup.doctor.libs import check_native_libs, check_preload, ldconfig_paths, native_extensions
from vsup.doctor.machine import (
    check_foreign_affinity,
    check_governor,
    check_isa,
    check_memory_bandwidth,
    check_numa_balancing,
    check_numa_syscalls,
    check_numactl,
    check_open_files,
    check_shm,
    check_transparent_hugepages,
    read_affinities,
)
from vsup.doctor.models import check_model_files, check_model_memory
from vsup.doctor.result import FAIL, PASS, SKIP, WARN, Result
from vsup.doctor.vllm_env import check_torch_extras, check_vllm, probe_python, vllm_python
from vsup.errors import VsupError
from vsup.observe.bandwidth import cpus_per_node, cpus_per_node_of, measure_bandwidth
from vsup.supervisor import preload
from vsup.supervisor.launch import vllm_command
from vsup.supervisor.vllm_command import build_needs, environment_of, resolve_vllm_command
from vsup.topology.errors import PlanError, TopologyError
from vsup.topology.fsroot import FsRoot
from vsup.topology.isa import AVX2_FLOOR, BuildNeeds
from vsup.topology.model import Machine
from vsup.topology.plan_model import Plan
from vsup.topology.sysfs import read_machine


def _check_plan(cfg: VsupConfig, fsroot: str) -> tuple[list[Result], Machine | None, Plan | None]:
    try:
        machine, plan = plan_from_config(cfg, fsroot)
    except (PlanError, TopologyError, VsupError) as exc:
        return [Result("memory-plan", FAIL, str(exc), "change instances / placement in the configuration (vsup plan shows the layout)")], None, None
    lines = [f"node {n.node}: {n.demand_bytes / 1024**3:.1f} of {n.budget_bytes / 1024**3:.1f} GiB" for n in plan.memory]
    results = [Result("memory-plan", PASS, f"{len(plan.instances)} instance(s) fit" + (f" ({'; '.join(lines)})" if lines else ""))]
    # the planner's own warnings, e.g. a node whose memory is taken by other processes right now
    for warning in plan.warnings:
        results.append(Result("plan-warning", WARN, warning))
    return results, machine, plan


def _build_needs(cfg: VsupConfig | None, environ: Mapping[str, str]) -> BuildNeeds:
    """What the installed vLLM build executes on any CPU, found as `vsup plan`/`run` find it (the
    strictest of a fleet's models); a command that does not resolve is the vllm check's to report."""
    needs = []
    for config in [view.config for view in models_of(cfg)] if cfg is not None else [None]:
        try:
            command = vllm_command(config, environ) if config is not None else resolve_vllm_command(None, environ=environ)
        except VsupError:
            continue
        needs.append(build_needs(environment_of(command, environ)))
    return max(needs, key=lambda n: len(n.flags), default=AVX2_FLOOR)


def _check_preload(fs: FsRoot, cache: Mapping[str, str], probe: dict, arch: str, cfg: VsupConfig | None,
                   command: list[str] | None, environ: Mapping[str, str]) -> Result:
    """The preload libraries against what vsup preloads under the configuration (vllm.preload; its
    default, auto, without one). A listed library that is not there fails here as it fails `vsup run`."""
    config = cfg if cfg is not None and not is_fleet(cfg) else VsupConfig(model="MODEL")
    try:
        preloaded = preload.resolve(config, command, environ).libraries if command else ()
    except VsupError as exc:
        return Result("preload-libs", FAIL, str(exc), "fix vllm.preload in the configuration")
    return check_preload(fs, cache, probe, arch, config.vllm.env, preloaded)


def run_doctor(config_path: str | None, fsroot: str = "/", environ: Mapping[str, str] = os.environ,
               bandwidth: bool = True) -> list[Result]:
    fs = FsRoot(fsroot)
    live = Path(fsroot).resolve() == Path("/")
    results: list[Result] = []

    cfg: VsupConfig | None = None
    if config_path:
        try:
            cfg = load_config(config_path)
        except VsupError as exc:
            results.append(Result("config", FAIL, str(exc), "fix the configuration (`vsup config --example --all` lists every key)"))
        else:
            results.append(Result("config", PASS, f"{config_path} is valid"))

    machine = None
    planned: frozenset[int] | None = None
    plan: Plan | None = None
    if cfg is not None:
        plan_results, machine, plan = _check_plan(cfg, fsroot)
        planned = frozenset(c for inst in plan.instances for c in inst.cpus) if plan else None
        results += plan_results
        if is_fleet(cfg):  # every model's files and its part of the plan, each naming the model
            for view in models_of(cfg):
                results.append(check_model_files(view, fs, live))
                if plan is not None:
                    results.append(check_model_memory(view, plan))
    else:
        results.append(Result("memory-plan", SKIP, "no configuration given (--config FILE checks that the plan fits each node)"))
    if machine is None:
        try:
            machine = read_machine(fsroot)
        except TopologyError as exc:
            results.append(Result("topology", FAIL, str(exc)))
    if machine is not None:
        results.insert(0, check_isa(machine.isa, _build_needs(cfg, environ)))
    numa_nodes = len(machine.nodes) if machine is not None else 1

    path_env = environ.get("PATH", os.defpath)
    launcher = cfg.placement.launcher if cfg is not None else "auto"
    results.append(check_numactl(path_env if live else os.pathsep.join(str(fs.path(d)) for d in path_env.split(os.pathsep)), launcher))
    if live:
        results.append(check_numa_syscalls())
    results.append(check_numa_balancing(fs, numa_nodes))
    results.append(check_transparent_hugepages(fs))
    results.append(check_governor(fs))
    if live:
        results.append(check_open_files(*resource.getrlimit(resource.RLIMIT_NOFILE)))
        results.append(check_shm("/dev/shm"))

    if machine is not None:
        usable = frozenset(machine.cpus_online)
        results.append(check_foreign_affinity(read_affinities(fs), planned or frozenset(machine.cpus_usable), usable, os.getpid()))

    if live:
        configured = cfg.vllm.command if cfg is not None else None
        try:
            # the same choice `vsup run` makes (vllm.command, else vllm.venv, vsup's env, `vllm` on PATH)
            command = vllm_command(cfg, environ) if cfg is not None else resolve_vllm_command(None, environ=environ)
        except VsupError as exc:
            results.append(Result("vllm", FAIL, str(exc)))
            command = None
        probe = probe_python(vllm_python(command, path_env))
        if command is not None:
            results.append(check_vllm(probe, configured))
        results.append(check_torch_extras(probe))
        results += check_dependencies(probe)   # pip check of vsup's environment and of vLLM's
        cache = ldconfig_paths()
        results.append(check_native_libs(native_extensions(probe), fs, cache, probe.get("prefix")))
        arch = machine.isa.arch if machine is not None else platform.machine()
        results.append(_check_preload(fs, cache, probe, arch, cfg, command, environ))
        if bandwidth and machine is not None:
            groups = cpus_per_node(plan) if plan is not None else cpus_per_node_of(machine)
            results.append(check_memory_bandwidth(groups, lambda g: measure_bandwidth(g, seconds=0.5)))
    return results
