"""The `vsup` command. Each subcommand lives in supervisor/commands/<name>.py; this module only
wires them together and turns user errors into one line on stderr and exit code 2."""

from __future__ import annotations

import sys

import click

from supervisor import __version__
from supervisor.errors import VsupError
from topology.errors import PlanError, TopologyError

USER_ERRORS = (VsupError, TopologyError, PlanError)


class VsupGroup(click.Group):
    """Prints user errors as `vsup: error: ...` (exit 2) instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            click.echo(f"vsup: error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=VsupGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vsup")
def main() -> None:
    """NUMA-aware supervisor for vLLM CPU servers behind one OpenAI endpoint.

    \b
    vsup topology            what this machine looks like (nodes, cores, L3, memory)
    vsup plan --instances 2  how N instances would be placed
    vsup run --config FILE   start them and the proxy, keep them healthy
    vsup status / restart    talk to a running vsup
    vsup proxy --upstream …  the proxy alone, in front of servers started elsewhere
    vsup doctor              check this machine against what vLLM CPU needs
    vsup install-systemd     install vsup as a systemd service
    """


def _register() -> None:
    from supervisor.commands import COMMANDS

    for command in COMMANDS:
        main.add_command(command)


_register()
