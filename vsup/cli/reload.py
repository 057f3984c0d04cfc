"""`vsup reload`: the running vsup re-reads its configuration and applies the difference."""

from __future__ import annotations

import asyncio
import json
import sys

import click

from vsup.safetext import printable
from vsup.supervisor.control import request

from .answers import ReloadAnswer, checked
from .options import format_option
from .rollout_view import render_rollout
from .status import config_option, socket_for, socket_option


@click.command("reload")
@click.option("--no-wait", is_flag=True, help="Return once the file is checked and the reload has begun.")
@config_option
@socket_option
@format_option("text", "json")
def reload_command(no_wait: bool, config_path: str | None, socket_path: str | None, output_format: str) -> None:
    """Re-read the running vsup's configuration file and apply what changed, without going dark.

    vsup re-reads the file it was started with and checks it as `vsup run` does; an invalid file
    or an impossible plan is refused with the error (exit 2) and nothing changes. Proxy, health,
    restart and stop settings apply at once; instances whose command line, environment, CPUs or
    memory binding changed are replaced one at a time (warmed up before they serve, the old one
    drained). Waits until it is done; exit code 1 if an instance did not come up. Same as SIGHUP
    and `systemctl reload vsup`. --config only finds the running vsup's control socket (from its
    proxy.port and control.socket: a file that is not YAML or has those wrong is refused here,
    exit 2); with --socket it is not read.
    """
    # a --config that cannot say where its vsup listens is its one-line error (exit 2): never a
    # guess at the default sockets, where another vsup may be the one that answers
    path = socket_for(config_path, socket_path)
    data = checked(ReloadAnswer, asyncio.run(request(path, "POST", "/reload", {"wait": not no_wait})), path, "/reload")
    record = data["rollout"]
    if output_format == "json":
        click.echo(json.dumps(record, indent=2))
    else:
        if no_wait and record["state"] == "running":
            click.echo(f"reload begun: {len(record['steps'])} instance(s) to change; `vsup status` shows its progress")
        for line in render_rollout(record):
            click.echo(line)
    if record["state"] == "failed":
        click.echo(printable(f"vsup: error: the reload stopped: {record['error']}"), err=True)
        sys.exit(1)
