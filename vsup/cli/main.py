"""The `vsup` command. Each subcommand lives in vsup/cli/<name>.py; this module only
wires them together and turns user errors into one line on stderr and exit code 2."""

from __future__ import annotations

import sys

import click

from vsup import __version__
from vsup import cli as commands
from vsup.errors import VsupError
from vsup.safetext import printable
from vsup.topology.errors import PlanError, TopologyError

USER_ERRORS = (VsupError, TopologyError, PlanError)


class VsupGroup(click.Group):
    """Loads subcommands lazily (vsup/cli) and prints user errors as
    `vsup: error: ...` (exit 2) instead of a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return commands.command_names()

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return commands.load_command(name)

    def main(self, args=None, prog_name=None, **extra):
        # Click's own usage errors are several lines of usage text; ours are one line, exit 2.
        try:
            super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx else "vsup"
            click.echo(f"vsup: error: {exc.format_message()} (see `{command} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("vsup: aborted", err=True)
            sys.exit(1)
        sys.exit(0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            # one line, and plain: the message may quote an instance or a server (a last exit, an error body)
            click.echo(f"vsup: error: {printable(exc)}", err=True)
            sys.exit(2)


@click.group(cls=VsupGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vsup")
def main() -> None:
    """NUMA-aware supervisor for vLLM CPU servers behind one OpenAI endpoint.

    \b
    vsup topology            what this machine looks like (nodes, cores, L3, memory)
    vsup plan --instances 2  how N instances would be placed
    vsup run --config FILE   start them and the proxy, keep them healthy
    vsup status / restart    talk to a running vsup (vsup top: the live view)
    vsup reload              apply a changed config file, one instance at a time
    vsup batch list / show   the Batch API's batches (show --follow: a progress bar; cancel)
    vsup proxy --upstream …  the proxy alone, in front of servers started elsewhere
    vsup tune --config FILE  measure layouts on this machine, pick the best
    vsup doctor              check this machine against what vLLM CPU needs
    vsup config --example    the commented example configuration (--all: every key)
    vsup install-systemd     install vsup as a systemd service
    vsup export kubernetes   manifests + kubelet config from the plan (export slurm: sbatch)
    """
