"""The proxy's read-only /status page: vsup's status JSON as one auto-refreshing HTML page.

`render_page(status, refresh)` is pure (the template is package data, vsup/supervisor/data/
status.html, filled with string.Template; every value is HTML-escaped). `status_page` makes the
proxy's handler: behind an admin key when keys are set (Bearer, or the key as the Basic-auth
password a browser asks for; another key gets 403: the page shows every tenant's traffic), never
cached.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from string import Template
from typing import Any

from vsup.observe import batch_view, by_model, fmt
from vsup.observe.fmt import duration
from vsup.proxy import errors
from vsup.proxy.auth import ADMIN
from vsup.proxy.messages import Request, Response
from vsup.safetext import printable
from vsup.topology.cpulist import format_list

TRANSITIONS_SHOWN = 20
MIN_REFRESH = 2  # seconds
DEFAULT_REFRESH = 5  # when metrics collection is off

MODEL_COLUMNS = ("Model", "Ready", "Not ready", "Instances", "In flight", "Tok/s")
INSTANCE_COLUMNS = ("#", "State", "Phase", "PID", "Port", "CPUs", "Nodes", "Uptime", "Restarts", "In flight", "Placement",
                    "Tok/s", "Running", "Waiting", "KV cache", "CPU %", "RSS", "PSS", "Node-local mem", "Last exit")


@cache
def _template() -> Template:
    return Template(resources.files("vsup.observe").joinpath("data/status.html").read_text(encoding="utf-8"))


def _cell(text: Any, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<td{attr}>{html.escape(printable(text))}</td>"  # (bidi overrides would reorder the row)


def _state(state: str, extra: str = "") -> str:
    return f'<td><span class="state {html.escape(printable(state))}">{html.escape(printable(state + extra))}</span></td>'


def instance_row(e: Mapping[str, Any], model: bool = False) -> str:
    """One instance's row; `model`: with its model's cell after the index (a status with several models)."""
    m = e.get("metrics") or {}
    f = fmt.figures(e)
    placement = {None: "-", True: "ok", False: "DRIFT"}[e.get("placement_ok")]
    backoff = f" ({e['next_start_in']:.0f}s)" if e.get("state") == "backoff" and e.get("next_start_in") is not None else ""
    cells = [
        _cell(e.get("index")), *([_cell(e.get("model") or "-")] if model else []), _state(str(e.get("state")), backoff), _phase(e),
        _cell(e.get("pid") or "-", "num"),
        _cell(e.get("port"), "num"), _cell(format_list(e.get("cpus", ())) or "-"), _cell(format_list(e.get("nodes", ())) or "-"),
        _cell(duration(e.get("uptime")), "num"), _cell(e.get("restarts", 0), "num"), _cell(e.get("in_flight", 0), "num"),
        f'<td><span class="state {placement}">{placement}</span></td>' if placement == "DRIFT" else _cell(placement),
        _cell(f["tok/s"], "num"), _cell(f["run"], "num"), _cell(f["wait"], "num"), _cell(f["kv"], "num"),
        _cell(f["cpu%"], "num"), _cell(f["rss"], "num"), _cell(fmt.size(m.get("pss_bytes")), "num"),
        _cell(_local(m), "num"), _cell(e.get("last_exit") or "-", "wrap"),
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def _phase(e: Mapping[str, Any]) -> str:
    """Where a start is; under it, a waiting line of vLLM's and what it means in this phase."""
    cell = html.escape(printable(fmt.phase(e)))
    note = fmt.phase_note(e)
    if note:
        cell += f'<br><span class="note">{html.escape(printable(note))}</span>'
    return f'<td class="wrap">{cell}</td>'


def _local(m: Mapping[str, Any]) -> str:
    ratio = m.get("numa_local_ratio")
    if ratio is None:
        return "-"
    return f"{fmt.percent(ratio)} ({fmt.size(m.get('numa_remote_bytes'))} remote)"


def transition_rows(status: Mapping[str, Any], limit: int = TRANSITIONS_SHOWN) -> list[str]:
    """The newest `limit` transitions of all instances, newest first."""
    uptime = (status.get("vsup") or {}).get("uptime") or 0.0
    every = [(t.get("at", 0.0), e.get("index"), t) for e in status.get("instances", ()) for t in e.get("transitions", ())]
    every.sort(key=lambda item: item[0], reverse=True)
    rows = []
    for at, index, t in every[:limit]:
        rows.append("<tr>" + _cell(f"{duration(max(0.0, uptime - at))} ago", "num") + _cell(index) + _cell(t.get("from"))
                    + _state(str(t.get("to"))) + _cell(t.get("event")) + _cell(t.get("reason") or "", "wrap") + "</tr>")
    return rows or ['<tr><td colspan="6" class="muted">none yet</td></tr>']


def summary(status: Mapping[str, Any]) -> str:
    v = status.get("vsup") or {}
    instances = status.get("instances", ())
    parts = [f"pid {v.get('pid')}", f"up {duration(v.get('uptime'))}",
             f"{v.get('ready', 0)}/{len(instances)} instances ready", f"{v.get('in_flight', 0)} in flight"]
    interval = v.get("metrics_interval")
    ages = [m["age"] for e in instances if (m := e.get("metrics")) and m.get("age") is not None]
    if interval:
        parts.append(f"figures every {interval:g}s" + (f", last {min(ages):.0f}s ago" if ages else ", none yet"))
    else:
        parts.append("figures off (metrics.interval 0)")
    if v.get("stopping"):
        parts.append("STOPPING")
    return html.escape(" · ".join(parts))


def model_rows(status: Mapping[str, Any]) -> list[str]:
    """Per model: ready count, the states of the others, its instances, in flight, tokens/s."""
    rows = []
    for m in by_model.models(status):
        name = str(m.get("name"))
        total = len(m.get("instances") or ())
        ready = m.get("ready", 0)
        colour = "ready" if ready == total else ("starting" if ready else "failed")  # green, yellow, red (the CSS)
        cells = [_cell(name), f'<td><span class="state {colour}">{html.escape(f"{ready}/{total}")}</span></td>', _cell(by_model.not_ready(m) or "-"),
                 _cell(format_list(i for i in m.get("instances") or () if isinstance(i, int)) or "-"),
                 _cell(m.get("in_flight", 0), "num"), _cell(f"{by_model.tokens_per_s(by_model.of_model(status, name)):.1f}", "num")]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return rows


def models_section(status: Mapping[str, Any]) -> str:
    """The Models table, only when the status has several models (a fleet of one looks as before)."""
    if not by_model.several(status):
        return ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in MODEL_COLUMNS)
    return ('<h2>Models</h2>\n<table id="models">\n<thead><tr>' + head + "</tr></thead>\n<tbody>\n"
            + "\n".join(model_rows(status)) + "\n</tbody>\n</table>\n")


BATCH_COLUMNS = ("Batch", "Status", "Model", "Owner", "Done", "Failed", "Lines/s", "ETA", "Age", "Metadata")


def batch_rows(status: Mapping[str, Any], now: float) -> list[str]:
    """The Batch API's running batches and those ended lately (batch_view.py's cells; a client's
    metadata shown as data: printable, then HTML-escaped)."""
    rows = []
    for entry in status.get("batches") or ():
        cells = batch_view.cells(entry, now)
        colour = {"in_progress": "ready", "finalizing": "ready", "validating": "starting", "cancelling": "starting",
                  "failed": "failed", "expired": "failed"}.get(str(entry.get("status")), "stopped")
        row = [_cell(cells[0]), f'<td><span class="state {colour}">{html.escape(printable(cells[1]))}</span></td>',
               _cell(cells[2]), _cell(cells[3]), f'<td class="num">{html.escape(printable(cells[4]))}'
               f' <progress max="1" value="{batch_view.fraction(entry):.3f}"></progress></td>',
               *(_cell(c, "num") for c in cells[5:9]), _cell(cells[9], "wrap")]
        rows.append("<tr>" + "".join(row) + "</tr>")
    return rows


def batches_section(status: Mapping[str, Any], now: float) -> str:
    """The Batches table, only when there are batches to show."""
    rows = batch_rows(status, now)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in BATCH_COLUMNS)
    return ('<h2>Batches</h2>\n<table id="batches">\n<thead><tr>' + head + "</tr></thead>\n<tbody>\n"
            + "\n".join(rows) + "\n</tbody>\n</table>\n")


def render_page(status: Mapping[str, Any], refresh: int, now: float | None = None) -> str:
    v = status.get("vsup") or {}
    instances = list(status.get("instances", ()))
    several = by_model.several(status)
    columns = INSTANCE_COLUMNS[:1] + (("Model",) if several else ()) + INSTANCE_COLUMNS[1:]
    return _template().substitute(
        refresh=refresh,
        proxy=html.escape(str(v.get("proxy", ""))),
        ready=v.get("ready", 0),
        total=len(instances),
        summary=summary(status),
        models=models_section(status),
        instance_head="".join(f"<th>{html.escape(c)}</th>" for c in columns),
        instance_rows="\n".join(instance_row(e, several) for e in instances)
        or f'<tr><td colspan="{len(columns)}" class="muted">no instances</td></tr>',
        transition_rows="\n".join(transition_rows(status)),
        batches=batches_section(status, time.time() if now is None else now),
    )


def refresh_seconds(interval: float) -> int:
    return max(MIN_REFRESH, round(interval)) if interval > 0 else DEFAULT_REFRESH


def status_page(status: Callable[[], Mapping[str, Any]], interval: float):
    """The proxy's handler for GET /status (ProxyServer.add_page)."""
    refresh = refresh_seconds(interval)

    async def handler(request: Request, auth) -> Response:
        allowed = auth.access(request, ADMIN, browser=True)
        if allowed == 401:
            return Response(status=401, text="401: this vsup's /status needs an admin key (as the password)\n",
                                headers={"WWW-Authenticate": 'Basic realm="vsup", charset="UTF-8"'})
        if allowed == 403:
            return errors.forbidden("/status")
        body = render_page(status(), refresh)
        return Response(text=body, content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-store"})

    return handler
