"""`vsup export kubernetes|slurm`: the plan of one node type (this machine, or a dump under --fsroot)
as Kubernetes manifests + kubelet configuration, or as an sbatch script (vsup/export/)."""

from __future__ import annotations

from pathlib import Path

import click

from vsup.cli.options import fsroot_option
from vsup.errors import VsupError

config_option = click.option("--config", "-c", "config_path", required=True, type=click.Path(dir_okay=False),
                             help="The vsup YAML the export is planned from (`vsup config --example --all` lists every key).")
hosts_option = click.option("--hosts", type=click.IntRange(1), default=1, show_default=True,
                            help="How many hosts of this type run vsup.")
output_option = click.option("--output-dir", "-o", type=click.Path(file_okay=False), default=None,
                             help="Write the file(s) into this directory instead of printing them.")


def _plan(config_path: str, fsroot: str):
    """The config, the machine as a node type, its plan and the planner's settings."""
    from vsup.config.fleet import is_fleet
    from vsup.config.planning import settings_from_config
    from vsup.config.schema import load_config
    from vsup.export.pod import node_type
    from vsup.topology.planner import plan
    from vsup.topology.sysfs import read_machine

    cfg = load_config(config_path)
    machine = node_type(read_machine(fsroot))
    if is_fleet(cfg):
        return cfg, machine, None, None
    # numactl is what runs in the image and on the hosts, not necessarily here
    settings = settings_from_config(cfg, numactl_available=True)
    return cfg, machine, plan(machine, settings), settings


def _fleet_plan(cfg, machine):
    """A fleet's plan on the node type, and each model's planner settings, by name."""
    from vsup.config.fleet import models_of
    from vsup.config.planning import reworded, settings_from_config
    from vsup.topology.fleet import ModelSettingError, plan_fleet
    from vsup.topology.plan_model import FleetModel

    views = models_of(cfg)
    settings = {v.name: settings_from_config(v.config, numactl_available=True) for v in views}
    try:
        fleet_plan = plan_fleet(machine, [FleetModel(v.name, settings[v.name], v.share) for v in views])
    except ModelSettingError as exc:
        view = next(v for v in views if v.name == exc.model)
        raise reworded(exc.error, view.config) from None
    return views, fleet_plan, settings


def _write(output_dir: str | None, files: dict[str, str]) -> None:
    if output_dir is None:
        click.echo("".join(files.values()), nl=False)
        return
    directory = Path(output_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text)
    except OSError as exc:
        raise VsupError(f"--output-dir {output_dir}: {exc.strerror or exc}") from None
    for name in files:
        click.echo(f"wrote {directory / name}", err=True)


def _replicas(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise VsupError(f"--replicas-per-host {text!r}: expected a whole number of pods per host, or auto") from None


@click.group("export")
def export_command() -> None:
    """Write the plan of this node type as another engine's placement (Kubernetes, Slurm)."""


@export_command.command("kubernetes")
@config_option
@fsroot_option
@click.option("--image", default=None, help="Container image of vsup + vLLM's CPU build (the repository's Dockerfile). [default: vsup:<version>, a placeholder]")
@click.option("--replicas-per-host", default="auto", show_default=True,
              help="Pods per host, each one NUMA node's share; auto: one per NUMA node with instances.")
@hosts_option
@click.option("--name", default="vsup", show_default=True, help="Name of the StatefulSet, its Services and ConfigMap.")
@click.option("--shm-gib", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Size of each pod's /dev/shm (memory-backed, counted in the pod's memory).")
@output_option
def kubernetes_command(config_path, fsroot, image, replicas_per_host, hosts, name, shm_gib, output_dir) -> None:
    """StatefulSet (one NUMA node's share per pod, Guaranteed QoS), ConfigMap, Services, and the
    kubelet configuration the nodes need (vsup.yaml and kubelet-config.yaml with --output-dir).
    With `models:`, a StatefulSet per model (NAME-<model>) and a front vsup proxy routing by model."""
    from vsup.export.kubernetes import DEFAULT_IMAGE, export_kubernetes
    from vsup.export.kubernetes_fleet import export_kubernetes_fleet, shape_models
    from vsup.export.pod import MiB, shape_pod

    per_host = _replicas(replicas_per_host.strip())
    cfg, machine, host_plan, settings = _plan(config_path, fsroot)
    shm_bytes = round(shm_gib * 1024) * MiB
    if host_plan is None:  # a fleet: a StatefulSet per model and a front proxy
        views, fleet_plan, by_model = _fleet_plan(cfg, machine)
        shapes = shape_models(machine, fleet_plan, views, by_model, shm_bytes=shm_bytes)
        result = export_kubernetes_fleet(machine, shapes, cfg, name=name, image=image or DEFAULT_IMAGE,
                                         replicas_per_host=per_host, hosts=hosts)
    else:
        shape = shape_pod(machine, host_plan, cfg, settings, shm_bytes=shm_bytes)
        result = export_kubernetes(machine, shape, cfg, name=name, image=image or DEFAULT_IMAGE,
                                   replicas_per_host=per_host, hosts=hosts)
    _write(output_dir, {"vsup.yaml": result.manifests_text, "kubelet-config.yaml": "---\n" + result.kubelet_text})


@export_command.command("slurm")
@config_option
@fsroot_option
@hosts_option
@click.option("--job-name", default="vsup", show_default=True, help="The job's name (#SBATCH --job-name).")
@output_option
def slurm_command(config_path, fsroot, hosts, job_name, output_dir) -> None:
    """An sbatch script: one step per NUMA node (vsup run bound to the node's CPUs and memory) on
    every host, and the front proxy (vsup.sbatch with --output-dir). With `models:`, one step per
    model and node of its share, and the front routes by the request's model."""
    from vsup.export.slurm import export_slurm

    cfg, machine, host_plan, _settings = _plan(config_path, fsroot)
    if host_plan is None:  # a fleet: steps per model, the front routing by model
        _views, host_plan, _by_model = _fleet_plan(cfg, machine)
    _write(output_dir, {"vsup.sbatch": export_slurm(machine, host_plan, cfg, hosts=hosts, job_name=job_name)})
