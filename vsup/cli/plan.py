"""`vsup plan`: how N instances would be placed on this machine (or a dump under --fsroot)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from vsup.cli.options import Checked as _Checked
from vsup.cli.options import fsroot_option
from vsup.cli.plan_render import render_shell, render_table
from vsup.config.fleet import is_fleet
from vsup.config.schema import VsupConfig, load_config
from vsup.errors import VsupError
from vsup.supervisor.launch import instance_preload
from vsup.supervisor.preflight import checked_plan
from vsup.topology.startmode import choose_start


def _at_least(minimum: int):
    def parse(text: str) -> int | None:
        number = int(text)
        return number if number >= minimum else None

    return parse


def _positive_float(text: str) -> float | None:
    number = float(text)
    return number if number > 0 and number != float("inf") else None


def _auto_or_at_least(minimum: int):
    def parse(text: str) -> int | str | None:
        return "auto" if text == "auto" else _at_least(minimum)(text)

    return parse


def _choice(*choices: str):
    return _Checked(lambda text: text if text in choices else None, " or ".join(choices))


def _node_list(text: str) -> tuple[int, ...] | None:
    nodes = tuple(int(part) for part in text.split(","))
    return nodes if nodes and all(n >= 0 for n in nodes) else None


@click.command("plan")
@click.option("--instances", "-n", type=_Checked(_auto_or_at_least(1), "a whole number of at least 1, or auto"), default=None,
              help="How many vLLM instances; auto = one per NUMA node with usable CPUs. [default: config's instances, or auto]")
@fsroot_option
@click.option("--config", "-c", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Take placement, model and vLLM settings from this YAML file; the options below override it.")
@click.option("--model", default=None, help="Model directory or name (sizes the weights when it is a local directory). [default: config's, or MODEL]")
@click.option("--model-size-gib", type=_Checked(_positive_float, "a positive number of GiB"), default=None,
              help="Weights per instance, in GiB. [default: size of the local model directory's weight files]")
@click.option("--kvcache-gib", type=_Checked(_positive_float, "a positive number of GiB"), default=None,
              help="KV cache per instance: whole GiB, or below 1. [default: largest equal share that fits]")
@click.option("--cores-per-instance", type=_Checked(_at_least(1), "a whole number of at least 1"), default=None,
              help="OpenMP cores per instance. [default: split all usable cores]")
@click.option("--omp-threads", type=_Checked(_at_least(1), "a whole number of at least 1"), default=None,
              help="OpenMP threads per instance, fewer than its OpenMP CPUs: the rest stay idle in its mask. [default: one per OpenMP CPU]")
@click.option("--reserve-cores", type=_Checked(_auto_or_at_least(0), "a whole number, 0 or more, or auto"),
              default=None, help="Physical cores kept for vsup, the proxy and the OS. [default: auto = 1 when the instances leave one free]")
@click.option("--housekeeping-core/--no-housekeeping-core", default=None,
              help="Give each instance one extra core for its API server and EngineCore, outside OpenMP.")
@click.option("--smt/--no-smt", default=None, help="One OpenMP thread per hardware thread instead of per physical core.")
@click.option("--membind", type=_choice("bind", "preferred"), default=None, help="numactl --membind (default) or --preferred.")
@click.option("--launcher", type=_choice("auto", "numactl", "taskset", "none"), default=None,
              help="What wraps each instance. [default: auto = numactl when installed, else taskset]")
@click.option("--nodes", type=_Checked(_node_list, "a comma list of NUMA node ids, e.g. 0,1"), default=None,
              help="Only place instances on these NUMA nodes.")
@click.option("--efficiency-cores", type=_choice("housekeeping", "instances", "unused"), default=None,
              help="Hybrid CPUs: what efficiency cores do besides the reserve. [default: housekeeping]")
@click.option("--base-port", type=_Checked(_at_least(1), "a TCP port, 1-65535"), default=None,
              help="With vllm.listen: tcp, the port of instance 0; instance i listens on base port + i. [default: 8100]")
@click.option("--format", "output_format", type=_choice("table", "json", "shell"), default="table", show_default=True,
              help="table: core map per node; json: the plan; shell: runnable launch lines.")
def plan_command(instances, fsroot, config_path, model, model_size_gib, kvcache_gib, cores_per_instance, omp_threads,
                 reserve_cores, housekeeping_core, smt, membind, launcher, nodes, efficiency_cores, base_port, output_format) -> None:
    """Show how N vLLM instances would be placed: cores, memory nodes, OpenMP binding, memory."""
    cfg = load_config(config_path) if config_path else VsupConfig(model=model or "MODEL")
    placement_overrides = {
        key: value
        for key, value in {
            "model_size_gib": model_size_gib,
            "kvcache_gib": kvcache_gib,
            "cores_per_instance": cores_per_instance,
            "omp_threads": omp_threads,
            "reserve_cores": reserve_cores,
            "housekeeping_core": housekeeping_core,
            "smt": smt,
            "membind": membind,
            "launcher": launcher,
            "nodes": list(nodes) if nodes is not None else None,
            "efficiency_cores": efficiency_cores,
        }.items()
        if value is not None
    }
    if is_fleet(cfg):  # the models' own keys: a flag could not say which model it means
        for flag, value in (("--instances", instances), ("--model", model)):
            if value is not None:
                raise VsupError(f"{flag}: {config_path} lists models: set {flag.lstrip('-')} in each entry of models "
                                "(placement flags apply to every model that does not set the key itself)")
    top: dict = {"placement": cfg.placement.model_copy(update=placement_overrides)}
    if instances is not None:
        top["instances"] = instances
    if model is not None:
        top["model"] = model
    flags = {"model": "--model"} if model is not None else {}
    if base_port is not None:
        if base_port > 65535:
            raise VsupError(f"--base-port {base_port}: expected a TCP port, 1-65535")
        top["vllm"] = cfg.vllm.model_copy(update={"base_port": base_port})
        flags["vllm.base_port"] = "--base-port"
    cfg = cfg.model_copy(update=top)

    # the same checks as `vsup run`: what plan accepts, run does not reject for the same reason.
    # Settings given as flags: errors about them name the flag, the others the config key and line.
    planned = {"model_size_bytes" if key == "model_size_gib" else key for key in placement_overrides}
    planned |= {key for key, value in (("instances", instances), ("base_port", base_port)) if value is not None}
    machine, the_plan = checked_plan(cfg, fsroot, os.environ, flags=flags, planned=frozenset(planned),
                                     runs_here=Path(fsroot).resolve() == Path("/"))
    preloads = {inst.index: instance_preload(inst, cfg, os.environ) for inst in the_plan.instances}  # vllm.preload
    start = choose_start(the_plan, cfg.start.mode)  # what `vsup run` would do (start.mode)
    if output_format == "json":
        data = the_plan.to_json()
        for inst in data["instances"]:
            inst["preload"] = preloads[inst["index"]].to_json()
        click.echo(json.dumps({**data, "start": start.to_json()}, indent=2))
    elif output_format == "shell":
        click.echo(render_shell(the_plan, cfg, os.environ), nl=False)
    else:
        click.echo(render_table(machine, the_plan, fleet=is_fleet(cfg), listen=cfg.vllm.listen, proxy_port=cfg.proxy.port,
                                preloads=preloads, start=start), nl=False)

