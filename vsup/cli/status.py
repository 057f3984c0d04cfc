"""`vsup status`: what a running vsup says about its instances."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import click

from vsup.config.schema import load_control_keys
from vsup.observe import batch_view, by_model, fmt
from vsup.observe.fmt import duration
from vsup.safetext import printable
from vsup.supervisor.control import find_socket, request
from vsup.topology.cpulist import format_list

from .answers import StatusAnswer, checked
from .options import format_option

config_option = click.option("--config", "-c", "config_path", type=click.Path(dir_okay=False, exists=True),
                             help="The running vsup's YAML (to find its control socket).")
socket_option = click.option("--socket", "socket_path", type=click.Path(dir_okay=False), envvar="VSUP_CONTROL_SOCKET",
                             help="The control socket (env VSUP_CONTROL_SOCKET); default: derived from --config or the defaults.")


def socket_for(config_path: str | None, socket_path: str | None):
    """--socket as given; else where --config's vsup (or, without one, a default vsup) listens.
    Of --config only proxy.port and control.socket are read: a file that cannot be read, is not
    YAML or has those wrong is a ConfigError, never a fall-back to the default sockets (another
    vsup may answer there); the rest is the running vsup's to check (a reload of it is refused and
    recorded there)."""
    if socket_path:
        return find_socket(socket_path, None)
    config = load_control_keys(config_path) if config_path else None
    return find_socket(None, config)


def placement_word(entry: Mapping[str, Any]) -> str:
    ok = entry.get("placement_ok")
    return "-" if ok is None else ("ok" if ok else "DRIFT")


def render_instances(instances: list[dict], *, models: bool = False) -> list[str]:
    """One line per instance; the observed figures (tokens/s ... node-local memory) come from the
    background collection and read "-" when it is off or has not run yet. `models`: a MODEL column
    after IDX (a status with several models)."""
    named = ("MODEL",) if models else ()
    header = ("IDX", *named, "STATE", "PHASE", "PID", "ADDRESS", "CPUS", "NODES", "UPTIME", "RESTARTS", "IN-FLIGHT", "PLACEMENT",
              *fmt.FIGURE_HEADERS, "LAST EXIT")
    rows = [header]
    for e in instances:
        state = e["state"]
        if state == "backoff" and e.get("next_start_in") is not None:
            state += f" ({e['next_start_in']:.0f}s)"
        rows.append((
            str(e["index"]), *((str(e.get("model") or "-"),) if models else ()), state, fmt.phase(e), str(e["pid"] or "-"),
            str(e.get("address") or e["port"]), format_list(e["cpus"]) or "-",
            format_list(e["nodes"]) or "-", duration(e.get("uptime")), str(e["restarts"]), str(e.get("in_flight", 0)),
            placement_word(e), *fmt.figures(e).values(), e.get("last_exit") or "-",
        ))
    shown = [[printable(cell) for cell in row] for row in rows]  # an instance's text shows as written, steers nothing
    widths = [max(len(row[i]) for row in shown) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in shown]
    for e in instances:
        for drift in e.get("placement_drift", []):
            lines.append(printable(f"  instance {e['index']} placement drift: {drift}"))
        if note := fmt.phase_note(e):  # vLLM's own alarming line, explained next to its phase
            lines.append(printable(f"  instance {e['index']} {(e.get('phase') or {}).get('name')}: {note}"))
    return lines


def render_models(status: dict) -> list[str]:
    """One summary line per model: ready count, the states of the others, in flight, tokens/s, instances."""
    lines = []
    for m in by_model.models(status):
        indexes = [i for i in m.get("instances") or () if isinstance(i, int)]
        line = f"model {m.get('name')}: {m.get('ready', 0)}/{len(m.get('instances') or ())} ready"
        if rest := by_model.not_ready(m):
            line += f" ({rest})"
        tokens = by_model.tokens_per_s(by_model.of_model(status, str(m.get("name"))))
        line += f", {m.get('in_flight', 0)} in flight, {tokens:.1f} tok/s, instances {format_list(indexes) or '-'}"
        lines.append(printable(line))  # the name is the config's (and clients send it): shown as data
    return lines


def render_queues(queues: dict) -> list[str]:
    """One line per model with an admission queue (proxy.max_in_flight_per_instance)."""
    lines = []
    for model, q in sorted(queues.items()):
        by = ", ".join(f"priority {p}: {n}" for p, n in sorted(q.get("by_priority", {}).items(), key=lambda i: -int(i[0])))
        line = f"queue {printable(model) or '-'}: {q.get('waiting', 0)} waiting" + (f" ({by})" if by else "")
        if "oldest_wait_s" in q:
            line += f", oldest {q['oldest_wait_s']:.2f} s"
        if q.get("waited"):
            line += f"; {q['waited']} waited, mean {q['wait_sum_s'] / q['waited']:.2f} s"
        lines.append(line)
    return lines


def render_batches(batches: list[dict], now: float) -> list[str]:
    """The Batches table: the running batches and those ended lately (batch_view.py's columns);
    every cell `printable` (metadata and ids are a client's)."""
    if not batches:
        return []
    rows = [batch_view.COLUMNS, *(batch_view.cells(b, now) for b in batches)]
    shown = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in shown) for i in range(len(rows[0]) - 1)]
    return ["batches:"] + ["  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
                           for row in shown]


@click.command("status")
@config_option
@socket_option
@format_option("text", "json")
def status_command(config_path: str | None, socket_path: str | None, output_format: str) -> None:
    """Show each instance of the running vsup: state, start phase, pid, address (socket or port), CPUs, uptime, restarts, placement,
    tokens/s (last minute), requests running/waiting, KV-cache use, CPU %, RSS, node-local memory, last exit; the Batch API's
    running batches (lines done, failed, rate, ETA)."""
    path = socket_for(config_path, socket_path)
    data = checked(StatusAnswer, asyncio.run(request(path, "GET", "/status", timeout=10)), path, "/status")
    if output_format == "json":
        click.echo(json.dumps(data, indent=2))
        return
    vsup = data["vsup"]
    total = len(data["instances"])
    click.echo(f"vsup pid {vsup['pid']}, up {duration(vsup['uptime'])}, proxy {vsup['proxy']}, "
               f"{vsup['ready']}/{total} instances ready, {vsup['in_flight']} in flight"
               + (", STOPPING" if vsup.get("stopping") else ""))
    several = by_model.several(data)
    if several:
        for line in render_models(data):
            click.echo(line)
    for line in render_instances(data["instances"], models=several):
        click.echo(line)
    for line in render_queues(data.get("queues") or {}):
        click.echo(line)
    for line in render_batches(data.get("batches") or [], time.time()):
        click.echo(line)
    from .rollout_view import render_changing, render_rollout  # (it uses this module's helpers)

    for line in [*render_changing(data.get("changing") or []), *render_rollout(data.get("rollout"), steps=False)]:
        click.echo(line)
