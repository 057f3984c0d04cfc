"""`vsup top`: a live table of the running vsup's instances, refreshed in place (q or Ctrl-C quits).

It polls the control socket's status (the same JSON as `vsup status --format json`) every
--interval seconds and redraws one rich Table on the terminal's alternate screen, so the shell
comes back as it was. Keys are read in cbreak mode (no Enter needed; Ctrl-C still interrupts);
the terminal's settings are restored however the view ends. Plain colours and box lines that
rich turns into ASCII on a non-UTF-8 terminal: readable over SSH.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import click
from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from vsup.errors import VsupError
from vsup.observe import batch_view, by_model, fmt
from vsup.observe.fmt import duration
from vsup.safetext import printable
from vsup.supervisor.control import request
from vsup.topology.cpulist import format_list

from .answers import StatusAnswer, checked
from .status import config_option, placement_word, socket_for, socket_option

STATE_STYLES = {"ready": "bold green", "starting": "yellow", "backoff": "yellow", "stopping": "yellow",
                "unhealthy": "bold red", "failed": "bold red", "stopped": "dim"}
QUIT_KEYS = ("q", "Q")


def header(status: Mapping[str, Any], error: str | None, interval: float) -> Text:
    v = status.get("vsup") or {}
    instances = status.get("instances", ())
    text = Text()
    text.append(f"vsup {v.get('proxy', '?')}", style="bold")
    text.append(f"  pid {v.get('pid')}  up {duration(v.get('uptime'))}  ")
    ready = v.get("ready", 0)
    text.append(f"{ready}/{len(instances)} ready", style="green" if ready == len(instances) else "bold red")
    text.append(f"  {v.get('in_flight', 0)} in flight")
    queues = status.get("queues") or {}
    if queues:  # admission (proxy.max_in_flight_per_instance): requests waiting in the proxy
        waiting = sum(q.get("waiting", 0) for q in queues.values())
        text.append(f"  {waiting} queued", style="bold yellow" if waiting else "")
    total = sum((e.get("metrics") or {}).get("generation_tokens_per_s") or 0.0 for e in instances)
    text.append(f"  {total:.1f} tok/s")
    if v.get("stopping"):
        text.append("  STOPPING", style="bold red")
    if by_model.several(status):  # a second line: "chat 2/2 ready  embed 0/1 ready"
        for i, m in enumerate(by_model.models(status)):
            whole = m.get("ready", 0) == len(m.get("instances") or ())
            text.append("  " if i else "\n")
            text.append(printable(by_model.ready_text(m)), style="green" if whole else "bold red")
    text.append("\n")
    if error:
        text.append(f"not answering: {printable(error)}", style="bold red")
    else:
        every = v.get("metrics_interval")
        text.append(f"figures every {every:g}s" if every else "figures off (metrics.interval 0)", style="dim")
    text.append(f"   refresh {interval:g}s   q quits", style="dim")
    return text


COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("#", "right"), ("STATE", "left"), ("PHASE", "left"), ("PID", "right"), ("CPUS", "left"), ("NODE", "left"), ("UP", "right"), ("RST", "right"),
    ("INFL", "right"), ("TOK/S", "right"), ("RUN", "right"), ("WAIT", "right"), ("KV", "right"), ("CPU%", "right"),
    ("RSS", "right"), ("LOCAL", "right"), ("PLACE", "left"), ("LAST EXIT", "left"))


def table(status: Mapping[str, Any]) -> Table:
    """One row per instance; with several models a MODEL column, the rows grouped by model, each
    group under a bold row of its model's totals (ready, in flight, tokens/s, running, waiting)."""
    several = by_model.several(status)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
    for name, justify in COLUMNS[:1] + ((MODEL_COLUMN,) if several else ()) + COLUMNS[1:]:
        t.add_column(name, justify=justify, no_wrap=name != "LAST EXIT", overflow="ellipsis",
                     max_width=MODEL_WIDTH if name == MODEL_COLUMN[0] else None)
    if not several:
        for e in status.get("instances", ()):
            t.add_row(*_cells(e))
        return t
    for i, m in enumerate(by_model.models(status)):
        name = str(m.get("name"))
        entries = by_model.of_model(status, name)
        if i:
            t.add_section()
        t.add_row(*_model_cells(m, entries), style="bold")
        for e in entries:
            t.add_row(*_cells(e, model=name))
    return t


MODEL_COLUMN: tuple[str, JustifyMethod] = ("MODEL", "left")
MODEL_WIDTH = 24  # a long served name is cut with an ellipsis, not the figures


def _cells(e: Mapping[str, Any], model: str | None = None) -> list[Text]:
    f = fmt.figures(e)
    state = str(e.get("state"))
    if state == "backoff" and e.get("next_start_in") is not None:
        state += f" {e['next_start_in']:.0f}s"
    placement = placement_word(e)
    return [cell if isinstance(cell, Text) else _plain(cell) for cell in (
        str(e.get("index")), *(() if model is None else (model,)),
        Text(state, style=STATE_STYLES.get(str(e.get("state")), "")), fmt.phase(e), str(e.get("pid") or "-"),
        format_list(e.get("cpus", ())) or "-", format_list(e.get("nodes", ())) or "-", duration(e.get("uptime")),
        str(e.get("restarts", 0)), str(e.get("in_flight", 0)), f["tok/s"], f["run"], f["wait"], f["kv"], f["cpu%"],
        f["rss"], f["local"], Text(placement, style="bold red" if placement == "DRIFT" else ""),
        e.get("last_exit") or "",
    )]


def _model_cells(m: Mapping[str, Any], entries: list[Mapping[str, Any]]) -> list[Text]:
    """A model's totals row: its name, ready count, in flight, tokens/s, running and waiting summed."""
    total = len(m.get("instances") or ())
    ready = m.get("ready", 0)

    def summed(key: str, digits: int = 0) -> str:
        values = [v for e in entries if (v := (e.get("metrics") or {}).get(key)) is not None]
        return fmt.number(sum(values), digits) if values else "-"

    cells = ["", str(m.get("name")), Text(f"{ready}/{total} ready", style="green" if ready == total else "bold red"),
             "", "", "", "", "", "", str(m.get("in_flight", 0)), f"{by_model.tokens_per_s(entries):.1f}",
             summed("requests_running"), summed("requests_waiting"), "", "", "", "", "", ""]
    return [cell if isinstance(cell, Text) else _plain(cell) for cell in cells]


def _plain(value: object) -> Text:
    # a str cell would be read as rich markup: the instance's own text ([/] in an error) must show as written
    return Text(printable(value))


def notes(status: Mapping[str, Any]) -> Text | None:
    """vLLM's alarming waiting lines during a start, each explained next to its phase."""
    lines = [f"{e.get('index')} {(e.get('phase') or {}).get('name')}: {note}"
             for e in status.get("instances", ()) if (note := fmt.phase_note(e))]
    return Text(printable("\n".join(lines), newlines=True), style="yellow") if lines else None


def batch_panel(status: Mapping[str, Any], now: float) -> Panel | None:
    """The Batch API's running batches and those ended lately: a bar each, then batch_view's cells
    (a client's metadata and ids `printable`, as Text: never read as markup). Every column but
    METADATA keeps its width (ids and names cut at CUT_WIDTH); METADATA takes what is left."""
    batches = status.get("batches") or []
    if not batches:
        return None
    columns = batch_view.COLUMNS
    rows = [[_plain(cell) for cell in batch_view.cells(entry, now)] for entry in batches]
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
    for i, name in enumerate(columns):
        if name == "METADATA":
            t.add_column(name, no_wrap=True, overflow="ellipsis", min_width=8, ratio=1)
            continue
        width = min(max(len(name), *(row[i].cell_len for row in rows)), CUT_WIDTH)
        t.add_column(name, justify="right" if i >= 4 else "left", no_wrap=True, overflow="ellipsis", min_width=width, max_width=width)
        if name == "STATUS":
            t.add_column("", no_wrap=True, min_width=BAR_WIDTH)  # the bar
    for entry, cells in zip(batches, rows, strict=True):
        cells[1].stylize(batch_view.STATUS_STYLES.get(str(entry.get("status")), ""))
        bar = ProgressBar(total=1.0, completed=batch_view.fraction(entry), width=BAR_WIDTH)
        t.add_row(*cells[:2], bar, *cells[2:])
    return Panel(t, title="batches", title_align="left", box=box.ROUNDED, expand=False)


BAR_WIDTH = 12
CUT_WIDTH = 16  # batch_<32 hex> cut to this: enough to tell them apart (`vsup batch show` takes the whole id)


def view(status: Mapping[str, Any], error: str | None, interval: float) -> RenderableType:
    below = notes(status)
    batches = batch_panel(status, time.time())
    return Group(header(status, error, interval), table(status), *((below,) if below is not None else ()),
                 *((batches,) if batches is not None else ()))


@contextlib.contextmanager
def keys(stream) -> Iterator[Callable[[float], str | None]]:
    """read(timeout) -> the keys typed meanwhile, or None; the terminal is put back on exit."""
    fd = stream.fileno() if stream is not None and stream.isatty() else None
    if fd is None:
        yield lambda timeout: time.sleep(timeout)
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)

        def read(timeout: float) -> str | None:
            ready, _, _ = select.select([fd], [], [], timeout)
            return os.read(fd, 64).decode(errors="replace") if ready else None

        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def fetch(path) -> dict:
    return checked(StatusAnswer, asyncio.run(request(path, "GET", "/status", timeout=5)), path, "/status")


@click.command("top")
@config_option
@socket_option
@click.option("--interval", "-n", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Seconds between refreshes (any key refreshes at once).")
def top_command(config_path: str | None, socket_path: str | None, interval: float) -> None:
    """Live view of the running vsup's instances: state, tokens/s, requests running/waiting,
    KV cache, CPU %, RSS, node-local memory; the running batches with a bar each. q or Ctrl-C quits."""
    path = socket_for(config_path, socket_path)
    status = fetch(path)  # not running: one line and exit 2, before the screen is touched
    error = None
    console = Console()
    try:
        with keys(sys.stdin) as read, Live(view(status, error, interval), console=console, screen=True,
                                           auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as live:
            while True:
                typed = read(interval)
                if typed and any(key in typed for key in QUIT_KEYS):
                    return
                try:
                    status, error = fetch(path), None
                except VsupError as exc:  # vsup stopped or restarts: say so, keep the last figures
                    error = str(exc)
                live.update(view(status, error, interval), refresh=True)
    except KeyboardInterrupt:
        return
