"""`vsup batch list | show ID [--follow] | cancel ID`: the Batch API's batches, from the proxy's own
OpenAI routes (/v1/batches), so it works against `vsup run` and a standalone `vsup proxy
--batch-dir` alike.

Where: `--url` (env VSUP_URL); else the local vsup's proxy, as its control socket's status names it
(found as `vsup status` finds it: --config, --socket, the defaults). Which key: `--api-key` (env
VSUP_API_KEY); a key sees its own batches, an admin key every one. Every field a client chose
(metadata, ids, error messages) is shown `printable`; rich cells are Text (never markup).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from vsup.batch import progress as progress_mod
from vsup.errors import VsupError
from vsup.observe import batch_view
from vsup.safetext import printable
from vsup.supervisor.control import request

from .answers import StatusAnswer, checked
from .options import Checked, format_option
from .status import config_option, socket_for, socket_option

TIMEOUT = 30.0  # seconds for one HTTP request
FINISHED = ("completed", "failed", "expired", "cancelled")
LIST_COLUMNS = ("BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED", "RATE/S", "ETA", "AGE", "METADATA")
TIMES = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at", "expires_at")


def _url(value: str) -> str | None:
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return value.rstrip("/")


url_option = click.option("--url", type=Checked(_url, "http://HOST:PORT"), envvar="VSUP_URL",
                          help="The proxy (env VSUP_URL); default: the local vsup's, from its control socket.")
key_option = click.option("--api-key", envvar="VSUP_API_KEY", metavar="KEY",
                          help="A key of the proxy (env VSUP_API_KEY): a key sees its own batches, an admin key all.")


def local_proxy(config_path: str | None, socket_path: str | None) -> str:
    """The URL of the local vsup's proxy, from its control socket's status (`vsup.proxy`)."""
    try:
        path = socket_for(config_path, socket_path)
        status = checked(StatusAnswer, asyncio.run(request(path, "GET", "/status", timeout=10)), path, "/status")
    except VsupError as exc:
        raise VsupError(f"{exc}; or give the proxy with --url http://HOST:PORT") from None
    host, _, port = str(status["vsup"]["proxy"]).rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # listening everywhere: ask it here
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class Client:
    """The proxy's Batch routes over HTTP; an error answer is one VsupError line."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url
        self.api_key = api_key

    def call(self, method: str, path: str, query: Mapping[str, Any] | None = None) -> dict[str, Any]:
        target = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(target, method=method, headers=headers, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as answer:  # noqa: S310 (http(s) only: --url is checked)
                body = answer.read()
        except urllib.error.HTTPError as exc:
            raise VsupError(self._refusal(exc.code, exc.read(), path)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise VsupError(f"no proxy answers at {self.url} ({reason}): is vsup running? (--url, VSUP_URL)") from None
        try:
            document = json.loads(body)
        except ValueError:
            document = None
        if not isinstance(document, dict):
            raise VsupError(f"{self.url}{path} answered something other than a JSON object: not a vsup proxy with the Batch API?")
        return document

    def _refusal(self, status: int, body: bytes, path: str) -> str:
        message = ""
        try:
            error = json.loads(body).get("error")
            message = error.get("message", "") if isinstance(error, dict) else ""
        except (ValueError, AttributeError):
            pass
        if status == 401:
            return f"the proxy at {self.url} wants an API key (401): give one with --api-key or VSUP_API_KEY"
        if status == 403:
            return f"the proxy at {self.url} refused this key (403): {message or 'it may not use the Batch API'}"
        if status == 404 and not message.startswith("No such"):
            return f"{self.url}{path}: 404: this proxy does not serve the Batch API (batch.enabled, vsup proxy --batch-dir)"
        return f"{self.url}{path}: {status}: {message or body[:200].decode('utf-8', 'replace')}"


def client(url: str | None, api_key: str | None, config_path: str | None, socket_path: str | None) -> Client:
    return Client(url or local_proxy(config_path, socket_path), api_key)


def entry(batch: Mapping[str, Any], now: float, earlier: tuple[float, int] | None = None) -> dict[str, Any]:
    """A batch object as batch_view's cells read it (counts at the top, the rate and ETA from progress.py)."""
    found = progress_mod.progress(batch, now, earlier)
    return {**batch, "total": found.total, "completed": found.completed, "failed": found.failed, "rate": found.rate,
            "eta": found.eta, "ended_at": next((batch.get(k) for k in ("completed_at", "failed_at", "expired_at", "cancelled_at")
                                                if isinstance(batch.get(k), (int, float))), None)}


def list_lines(batches: list[dict[str, Any]], now: float) -> list[str]:
    rows: list[tuple[str, ...]] = [LIST_COLUMNS]
    for b in batches:
        cells = batch_view.cells(entry(b, now), now)
        rows.append((cells[0], cells[1], str(b.get("endpoint") or "-"), *cells[4:]))
    shown = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in shown) for i in range(len(LIST_COLUMNS) - 1)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in shown]


def show_lines(batch: Mapping[str, Any], now: float) -> list[str]:
    """A batch's fields, one a line, each `printable`."""
    found = progress_mod.progress(batch, now)
    lines = [f"batch {batch.get('id')}: {batch.get('status')}", f"  endpoint {batch.get('endpoint')}",
             f"  progress {progress_mod.text(found)}", f"  input file {batch.get('input_file_id')}"]
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            lines.append(f"  {key.removesuffix('_id').replace('_', ' ')} {batch.get(key)}")
    for key in TIMES:
        at = batch.get(key)
        if isinstance(at, (int, float)):
            when = "in" if at > now else "ago"
            lines.append(f"  {key.removesuffix('_at').replace('_', ' ')} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))}"
                         f" ({progress_mod.eta_text(abs(now - at))} {when})")
    metadata = batch.get("metadata")
    if isinstance(metadata, Mapping):
        lines += [f"  metadata {k}: {v}" for k, v in metadata.items()]
    errors = (batch.get("errors") or {}).get("data") if isinstance(batch.get("errors"), Mapping) else None
    for error in (errors or [])[:20]:
        if isinstance(error, Mapping):
            where = f"line {error.get('line')}: " if error.get("line") is not None else ""
            lines.append(f"  error {where}{error.get('code')}: {error.get('message')}")
    if errors and len(errors) > 20:
        lines.append(f"  ... {len(errors) - 20} more errors (--format json shows them all)")
    return [printable(line) for line in lines]


@click.group("batch")
def batch_command() -> None:
    """The Batch API's batches on a vsup proxy: list, show (--follow: a progress bar), cancel."""


@batch_command.command("list")
@url_option
@key_option
@config_option
@socket_option
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True, help="How many, newest first.")
@click.option("--after", metavar="BATCH_ID", help="The page after this batch.")
@format_option("text", "json")
def list_command(url, api_key, config_path, socket_path, limit, after, output_format) -> None:
    """The newest batches (an admin key: every owner's): status, lines done, rate, ETA."""
    query = {"limit": limit, **({"after": after} if after else {})}
    page = client(url, api_key, config_path, socket_path).call("GET", "/v1/batches", query)
    data = page.get("data")
    if not isinstance(data, list):
        raise VsupError("the proxy answered /v1/batches without a data list: not a vsup proxy with the Batch API?")
    if output_format == "json":
        click.echo(json.dumps(page, indent=2))
        return
    batches = [b for b in data if isinstance(b, dict)]
    if not batches:
        click.echo("no batches")
        return
    for line in list_lines(batches, time.time()):
        click.echo(line)
    if page.get("has_more"):
        click.echo(printable(f"more: vsup batch list --after {batches[-1].get('id')}"))


@batch_command.command("show")
@click.argument("batch_id")
@url_option
@key_option
@config_option
@socket_option
@click.option("--follow", "-f", is_flag=True, help="A progress bar with rate and ETA until the batch ends (exit 1 unless it completed).")
@click.option("--interval", "-n", type=click.FloatRange(min=0.2), default=2.0, show_default=True, help="--follow: seconds between looks.")
@format_option("text", "json")
def show_command(batch_id, url, api_key, config_path, socket_path, follow, interval, output_format) -> None:
    """One batch: status, progress, files, times, metadata, validation errors."""
    api = client(url, api_key, config_path, socket_path)
    path = "/v1/batches/" + urllib.parse.quote(batch_id, safe="")
    batch = api.call("GET", path)
    if follow and batch.get("status") not in FINISHED:
        batch = follow_batch(api, path, batch, interval)
    if output_format == "json":
        click.echo(json.dumps(batch, indent=2))
    else:
        for line in show_lines(batch, time.time()):
            click.echo(line)
    if follow and batch.get("status") != "completed":
        sys.exit(1)


def follow_batch(api: Client, path: str, batch: dict[str, Any], interval: float) -> dict[str, Any]:
    """Redraw a bar (done/total, rate, ETA over the last minute's looks) until the batch ends; the last look."""
    samples = progress_mod.Samples()
    console = Console(stderr=True)
    columns = (TextColumn("{task.fields[status]}", markup=False), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[line]}", markup=False))
    try:
        with Progress(*columns, console=console, transient=False, auto_refresh=False) as bar:
            task = bar.add_task("", total=None, status="", line="")
            while True:
                found = samples.look([batch], time.time())[str(batch.get("id"))]
                line = progress_mod.text(found).partition(" · ")[2]
                bar.update(task, total=found.total or None, completed=found.done, status=printable(batch.get("status")),
                           line=printable(line))
                bar.refresh()
                if batch.get("status") in FINISHED:
                    return batch
                time.sleep(interval)
                batch = api.call("GET", path)
    except KeyboardInterrupt:
        sys.exit(130)


@batch_command.command("cancel")
@click.argument("batch_id")
@url_option
@key_option
@config_option
@socket_option
def cancel_command(batch_id, url, api_key, config_path, socket_path) -> None:
    """Cancel a validating or running batch: its pending lines fail, the running ones finish."""
    api = client(url, api_key, config_path, socket_path)
    batch = api.call("POST", "/v1/batches/" + urllib.parse.quote(batch_id, safe="") + "/cancel")
    click.echo(printable(f"batch {batch.get('id')}: {batch.get('status')}"))
