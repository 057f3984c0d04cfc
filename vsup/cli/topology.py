"""`vsup topology`: what this machine (or a dump under --fsroot) looks like to vsup."""

from __future__ import annotations

import json

import click

from vsup.cli.options import format_option, fsroot_option
from vsup.topology.render import machine_to_json, render_text
from vsup.topology.sysfs import read_machine


@click.command("topology")
@fsroot_option
@format_option("text", "json")
def topology_command(fsroot: str, output_format: str) -> None:
    """Show NUMA nodes, physical cores (SMT siblings grouped), L3 domains, memory per node,
    the CPUs this process may use and why the others are unusable, and the ISA facts vLLM needs."""
    machine = read_machine(fsroot)
    if output_format == "json":
        click.echo(json.dumps(machine_to_json(machine), indent=2))
    else:
        click.echo(render_text(machine), nl=False)
