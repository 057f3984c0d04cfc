"""`vsup restart INDEX|all [--rolling]`: restart instances of the running vsup."""

from __future__ import annotations

import asyncio
import json
import sys

import click

from vsup.errors import VsupError
from vsup.safetext import printable
from vsup.supervisor.control import request

from .answers import RestartAnswer, checked
from .options import format_option
from .status import config_option, render_instances, socket_for, socket_option


def parse_target(value: str) -> int | str:
    if value == "all":
        return value
    try:
        index = int(value)
    except ValueError:
        raise VsupError(f"restart target {value!r} is not an instance index (0, 1, ...) or \"all\"") from None
    if index < 0:
        raise VsupError(f"restart target {index} is negative; instance indexes start at 0")
    return index


@click.command("restart")
@click.argument("target")
@click.option("--rolling", is_flag=True, help="One at a time, each drained, restarted and warmed up; the next only after the previous is ready again.")
@click.option("--no-wait", is_flag=True, help="Return once the restart has begun instead of when it is done.")
@config_option
@socket_option
@format_option("text", "json")
def restart_command(target: str, rolling: bool, no_wait: bool, config_path: str | None, socket_path: str | None,
                    output_format: str) -> None:
    """Restart instance TARGET (an index, or all). A failed instance gets a new chance.

    Waits until the restarted instances are ready again; exit code 1 if one is not (e.g. failed
    again). Without --rolling, `all` restarts every instance at once: the endpoint answers 503 until
    one is ready again. With --rolling (the path `vsup reload` takes) the others keep serving and no
    request in flight is cut.
    """
    body = {"target": parse_target(target), "rolling": rolling, "wait": not no_wait}
    path = socket_for(config_path, socket_path)
    data = checked(RestartAnswer, asyncio.run(request(path, "POST", "/restart", body)), path, "/restart")
    if output_format == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        named = {inst.get("model") for inst in data["instances"] if inst.get("model")}
        for line in render_instances(data["instances"], models=len(named) > 1):  # as `vsup status` shows a fleet
            click.echo(line)
    if no_wait:
        return
    down = [inst for inst in data["instances"] if inst["state"] != "ready"]
    for inst in down:
        click.echo(printable(f"vsup: error: instance {inst['index']} is {inst['state']} after the restart: {inst['last_exit']}"),
                   err=True)
    if down and rolling and target == "all":
        click.echo("vsup: error: the rolling restart stopped there; the instances after it were not touched", err=True)
    if down:
        sys.exit(1)
