"""The status JSON's `batches` in `vsup status` (a real CLI process over a real control socket),
`vsup top`'s panel and the /status page: each batch's progress, rate and ETA, and a client's
metadata (ESC, a bidi override, <script>, rich markup) shown as data, steering nothing."""

from __future__ import annotations

import copy
import io
import json
import re
import subprocess
import time

from rich.console import Console

from tests.test_observe import SAMPLE_STATUS
from tests.test_untrusted_text import control_socket  # noqa: F401 (the fixture)
from tests.vsup_harness import VSUP
from vsup.cli.top import view
from vsup.observe import batch_view
from vsup.observe.page import render_page

HOSTILE = {"job": "\x1b]0;pwned\x07", "name": "\u202egnp.exe", "x": "<script>alert(1)</script>"}
SHOWN = "job=\\x1b]0;pwned\\x07, name=\\u202egnp.exe, x=<script>alert(1)</script>"
MARKUP = {"m": "[bold red]x[/]"}
SGR = re.compile(r"\x1b\[[0-9;]*m")
RUNNING_ID = "batch_" + "a" * 32
ENDED_ID = "batch_" + "b" * 32


def batches(now: float) -> list[dict]:
    return [
        {"id": RUNNING_ID, "status": "in_progress", "endpoint": "/v1/chat/completions", "models": ["chat"], "owner": "team-a",
         "total": 5000, "completed": 1222, "failed": 12, "pending": 3700, "running": 66, "rate": 3.1, "eta": 1200.0,
         "created_at": now - 600, "in_progress_at": now - 590, "expires_at": now + 86000, "ended_at": None,
         "metadata": HOSTILE},
        {"id": ENDED_ID, "status": "completed", "endpoint": "/v1/embeddings", "models": [], "owner": None,
         "total": 10, "completed": 10, "failed": 0, "pending": None, "running": None, "rate": None, "eta": None,
         "created_at": now - 900, "in_progress_at": now - 890, "expires_at": now + 85000, "ended_at": now - 300, "metadata": MARKUP},
    ]


def status_with_batches(now: float) -> dict:
    status = copy.deepcopy(SAMPLE_STATUS)
    status["batches"] = batches(now)
    return status


def test_the_cells_of_a_running_and_an_ended_batch():
    now = 1_800_000_000.0
    running, ended = (batch_view.cells(b, now) for b in batches(now))
    assert running[:8] == [RUNNING_ID, "in_progress", "chat", "team-a", "1,234/5,000", "12", "3.1", "20 min"]
    assert running[8] == "10 min" and running[9] == "job=\x1b]0;pwned\x07, name=\u202egnp.exe, x=<script>alert(1)</script>"
    assert ended[1:10] == ["completed", "-", "-", "10/10", "0", "-", "ended 5 min ago", "15 min", "m=[bold red]x[/]"]
    long = batch_view.metadata_text({"k": "v" * 100})
    assert len(long) == batch_view.METADATA_CHARS and long.endswith("…")
    assert batch_view.metadata_text(None) == batch_view.metadata_text({}) == "-"
    assert batch_view.fraction(batches(now)[0]) == 1234 / 5000


def test_vsup_status_prints_a_batches_table_with_metadata_as_visible_escapes(control_socket):  # noqa: F811
    from aiohttp import web

    async def answer(_request):
        return web.json_response(status_with_batches(time.time()))

    path = control_socket(answer)
    out = subprocess.run([*VSUP, "status", "--socket", str(path)], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)
    lines = text.splitlines()
    head = lines.index("batches:")
    assert lines[head + 1].split() == list(batch_view.COLUMNS)
    row = lines[head + 2]
    assert row.split()[:8] == [RUNNING_ID, "in_progress", "chat", "team-a", "1,234/5,000", "12", "3.1", "20"]
    assert row.endswith(SHOWN)
    assert lines[head + 3].split()[:3] == [ENDED_ID, "completed", "-"] and "ended 5 min ago" in lines[head + 3]
    raw = subprocess.run([*VSUP, "status", "--socket", str(path), "--format", "json"], capture_output=True, timeout=60)
    assert json.loads(raw.stdout)["batches"][0]["metadata"] == HOSTILE  # JSON keeps it as sent, JSON-escaped


def test_a_status_without_batches_shows_no_table_and_an_older_vsup_still_reads(control_socket):  # noqa: F811
    from aiohttp import web

    async def answer(_request):
        return web.json_response(SAMPLE_STATUS)

    out = subprocess.run([*VSUP, "status", "--socket", str(control_socket(answer))], capture_output=True, timeout=60)
    assert out.returncode == 0 and b"batches:" not in out.stdout, out


def test_top_draws_a_batches_panel_with_bars_and_no_escape_passed_on():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=300)
    console.print(view(status_with_batches(time.time()), None, 2.0))
    text = out.getvalue()
    assert "\x1b" not in SGR.sub("", text) and "\u202e" not in text, repr(text)
    plain = SGR.sub("", text)
    assert "batches" in plain and "1,234/5,000" in plain and "20 min" in plain and "ended 5 min ago" in plain
    assert "job=\\x1b]0;pwned\\x07" in plain and "m=[bold red]x[/]" in plain
    assert "━" in plain  # the bars
    row = next(line for line in text.splitlines() if "m=[bold" in line)
    assert not re.search(r"\x1b\[[0-9;]*1;31m|\x1b\[1m\x1b\[31m", row.split("m=[bold", 1)[1]), repr(row)  # no style read from it
    quiet = io.StringIO()
    Console(file=quiet, force_terminal=True, width=300).print(view(SAMPLE_STATUS, None, 2.0))
    assert "batches" not in SGR.sub("", quiet.getvalue())


def test_the_status_page_has_a_batches_table_escaped():
    now = 1_800_000_000.0
    page = render_page(status_with_batches(now), 5, now=now)
    assert '<table id="batches">' in page
    assert "<script>" not in page and "\u202e" not in page and "\x1b" not in page
    assert "job=\\x1b]0;pwned\\x07, name=\\u202egnp.exe, x=&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert '<progress max="1" value="0.247"></progress>' in page
    assert "<table id=\"batches\">" not in render_page(SAMPLE_STATUS, 5, now=now)
