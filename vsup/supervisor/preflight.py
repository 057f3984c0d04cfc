"""The checks `vsup plan`, `vsup run` and `vsup reload` share, so that a configuration one accepts
the others do not reject: the model path, the plan, the instances' (and their spare) ports against
the proxy's, the memory watchdog's limit, every instance's launch line (vllm.args, vllm.env,
vllm.command/venv), and the CPU against what the installed vLLM build executes (a CPU without AVX2
would only die by SIGILL; the words are `vsup doctor`'s, vsup.topology.isa)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping

from vsup.config.checks import check_instance_ports, check_model_path, check_rss_limit
from vsup.config.fleet import is_fleet, models_of
from vsup.config.planning import plan_from_config
from vsup.config.schema import VsupConfig
from vsup.errors import VsupError
from vsup.supervisor.launch import build_command, vllm_command
from vsup.supervisor.vllm_command import build_needs, environment_of
from vsup.topology.isa import refusal
from vsup.topology.model import Machine
from vsup.topology.plan_model import Plan


def checked_plan(cfg: VsupConfig, fsroot: str, environ: Mapping[str, str], *, runs_here: bool,
                 flags: Mapping[str, str] | None = None, planned: frozenset[str] = frozenset(),
                 running: Plan | None = None) -> tuple[Machine, Plan]:
    """Plan `cfg` on the machine under `fsroot` and check what would be launched.

    `runs_here`: the instances would start on this machine, so the model path must exist here
    (`vsup plan --fsroot DUMP` plans for another machine). `flags`: config key -> the command-line
    option that set it (`vsup plan --base-port`), so an error names what the user typed;
    `planned`: the same for the planner, as PlanSettings field names. `running`: a reload's
    running plan (its unchanged models keep their CPUs: plan_from_config)."""
    flags = flags or {}
    views = models_of(cfg)  # a fleet: each model's view (its errors name models[i].key)
    if runs_here:
        for view in views:
            check_model_path(view.config, flags.get("model"))
    machine, plan = plan_from_config(cfg, fsroot, flags=planned, running=running)
    check_isa(machine, cfg, environ)
    if cfg.vllm.listen == "tcp":  # under unix the instances have sockets, no ports
        check_instance_ports(cfg, len(plan.instances), flags.get("vllm.base_port"))
    for view in views:
        mine = plan.of_model(view.name) if is_fleet(cfg) else plan.instances
        check_rss_limit(view.config, [instance.weights_bytes for instance in mine])
        for instance in mine:
            build_command(instance, view.config, environ)
    return machine, plan


def check_isa(machine: Machine, cfg: VsupConfig, environ: Mapping[str, str]) -> None:
    """Refuse a CPU that lacks an instruction set the installed vLLM build executes (each model's
    build: a fleet's models may run different venvs), before anything starts."""
    for view in models_of(cfg):
        needs = build_needs(environment_of(vllm_command(view.config, environ), environ))
        refused = refusal(machine.isa, needs, dict(machine.sources).get("isa", ""))
        if refused is not None:
            raise VsupError(f"{view.key} ({view.name}): {refused}" if is_fleet(cfg) else refused)


def check_programs(argv: list[str], prefix_len: int) -> None:
    """The launcher and the server command must exist before anything starts (else: crash loop).
    `prefix_len`: the launcher's words (0: launcher none, the server command comes first)."""
    checks = [(0, "placement.launcher")] if prefix_len else []
    for position, what in [*checks, (prefix_len, "vllm.command")]:
        if position >= len(argv):
            continue
        program = argv[position]
        if shutil.which(program) is None:
            raise VsupError(f"{what}: {program!r} is not an executable program (not found on PATH or not executable); "
                            "install it or give its full path")
