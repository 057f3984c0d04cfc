"""Text from instances is data, never markup: warm-up errors, last exits, transition reasons and
vLLM's own lines reach `vsup top`, `vsup status`, the /status page and vsup's log as written,
with no rich markup read (`[/]` crashed top) and no terminal escape passed on (window title,
clear screen, hyperlinks), bidi overrides included. The tune report has its own test
(tests/test_tune_inputs.py)."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import logging
import re
import subprocess
import threading
from pathlib import Path

import pytest
from rich.console import Console

from tests.test_observe import SAMPLE_STATUS
from tests.vsup_harness import VSUP
from vsup.cli.rollout_view import render_changing, render_rollout
from vsup.cli.run import setup_logging
from vsup.cli.top import view
from vsup.observe.page import render_page
from vsup.safetext import printable
from vsup.supervisor.logs import InstanceLog

ATTACKS = ("[bold red]x[/]", "[/]", "[link=http://evil]y[/link]", "\x1b]0;pwned\x07", "\x1b[2J", "[/srv/models/x]",
           "\u202eevil", "\x9b31m")
HOSTILE = " ".join(ATTACKS)
# how each attack shows: literally, its control characters as visible escapes
SHOWN = ("[bold red]x[/]", "[/]", "[link=http://evil]y[/link]", "\\x1b]0;pwned\\x07", "\\x1b[2J", "[/srv/models/x]",
         "\\u202eevil", "\\x9b31m")
SGR = re.compile(r"\x1b\[[0-9;]*m")  # the colours rich itself writes


def hostile_status() -> dict:
    status = copy.deepcopy(SAMPLE_STATUS)
    status["instances"][1]["last_exit"] = f"warm-up failed after 1.0s: HTTP 500: {HOSTILE}"
    status["instances"][1]["transitions"][0]["reason"] = HOSTILE
    return status


def test_printable_makes_every_steering_character_visible_and_keeps_text():
    assert printable("\x1b]0;pwned\x07 \x1b[2J\r\x00\x7f") == "\\x1b]0;pwned\\x07 \\x1b[2J\\x0d\\x00\\x7f"
    assert printable("a\tb\nc") == "a\tb\\x0ac" and printable("a\tb\nc", newlines=True) == "a\tb\nc"
    assert printable("\u202a\u202e\u2066\u2069\u2028\ud800") == "\\u202a\\u202e\\u2066\\u2069\\u2028\\ud800"
    assert printable("Grüße, 東京, [bold]x[/]") == "Grüße, 東京, [bold]x[/]"
    assert printable(None) == "None"


def test_top_shows_an_instances_error_as_written_and_passes_no_escape_on():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=400)
    console.print(view(hostile_status(), f"vsup said {HOSTILE}", 2.0))  # `[/]` raised MarkupError here
    text = out.getvalue()
    assert "\x1b" not in SGR.sub("", text), repr(text)  # colours only: no title, no clear, no OSC 8 hyperlink
    assert "\x9b" not in text and "\u202e" not in text
    plain = SGR.sub("", text)
    for shown in SHOWN:
        assert shown in plain, (shown, plain)
    # the markup-looking text got no style: the row of instance 1 has the backoff colour and nothing else
    row = next(line for line in text.splitlines() if "warm-up failed" in line)
    assert not re.search(r"\x1b\[[0-9;]*1;31m|\x1b\[1m\x1b\[31m", row.split("backoff", 1)[1]), repr(row)


async def hostile_answer(_request):
    from aiohttp import web

    return web.json_response({**hostile_status(), "rollout": {
        "kind": "reload", "trigger": "SIGHUP", "state": "failed", "started": 1.0, "took": 3.0, "step": 1,
        "error": f"instance 1 did not become ready ({HOSTILE})", "unchanged": [], "applied": [],
        "steps": [{"index": 1, "action": "replace", "why": "args", "state": "failed", "detail": HOSTILE}]}})


@pytest.fixture
def control_socket(tmp_path):
    """serve(handler) -> the path of a control socket answering every request with it (a real unix socket)."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners = []

    def serve(handler) -> Path:
        path = tmp_path / f"control{len(runners)}.sock"

        async def start():
            app = web.Application()
            app.router.add_route("*", "/{route:.*}", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.UnixSite(runner, str(path)).start()
            return runner

        runners.append(asyncio.run_coroutine_threadsafe(start(), loop).result(10))
        return path

    yield serve
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_vsup_status_prints_instance_text_as_visible_escapes(control_socket):
    path = control_socket(hostile_answer)
    out = subprocess.run([*VSUP, "status", "--socket", str(path)], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\x9b" not in text, repr(text)
    last_exit = next(line for line in text.splitlines() if "warm-up failed" in line)
    assert last_exit.endswith("HTTP 500: " + " ".join(SHOWN))
    assert "  error: instance 1 did not become ready (" + " ".join(SHOWN) + ")" in text.splitlines()
    # JSON stays JSON: the text is there, escaped by JSON itself
    raw = subprocess.run([*VSUP, "status", "--socket", str(path), "--format", "json"], capture_output=True, timeout=60)
    assert b"\x1b" not in raw.stdout and HOSTILE in json.loads(raw.stdout)["instances"][1]["last_exit"]


def test_an_error_quoting_an_instance_is_one_plain_line(control_socket):
    from aiohttp import web

    async def refuse(_request):
        return web.json_response({"error": f"instance 1 is failed after the restart: {HOSTILE}\nvsup: forged"}, status=409)

    out = subprocess.run([*VSUP, "status", "--socket", str(control_socket(refuse))], capture_output=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.decode() == f"vsup: error: instance 1 is failed after the restart: {' '.join(SHOWN)}\\x0avsup: forged\n"


def test_restart_and_reload_print_instance_text_plain(control_socket):
    path = control_socket(hostile_answer)  # its instance 1 is in backoff with a hostile last exit; its rollout failed
    restart = subprocess.run([*VSUP, "restart", "1", "--socket", str(path)], capture_output=True, timeout=60)
    reload = subprocess.run([*VSUP, "reload", "--socket", str(path)], capture_output=True, timeout=60)
    assert restart.returncode == 1 and reload.returncode == 1, (restart.stderr, reload.stderr)
    for out in (restart, reload):
        assert b"\x1b" not in out.stdout + out.stderr and b"\x07" not in out.stdout + out.stderr, out
    assert restart.stderr.decode().startswith("vsup: error: instance 1 is backoff after the restart: warm-up failed")
    assert restart.stderr.decode().splitlines()[0].endswith(" ".join(SHOWN))
    assert reload.stderr.decode() == f"vsup: error: the reload stopped: instance 1 did not become ready ({' '.join(SHOWN)})\n"


def test_rollout_lines_for_vsup_reload_show_instance_text_as_written():
    record = {"kind": "reload", "trigger": "SIGHUP", "state": "running", "started": 1.0, "took": 3.0, "step": 1, "error": HOSTILE,
              "unchanged": [], "applied": [], "steps": [
                  {"index": 0, "action": "replace", "why": "args", "state": "running", "detail": None,
                   "new": {"name": "0b\x1b[2J", "port": 8200, "pid": 7, "state": "warming"}}]}
    lines = [*render_rollout(record), *render_changing([{"index": 0, "name": "\x1b]0;x\x07", "port": 8100, "pid": 3, "state": "draining"}])]
    assert not any("\x1b" in line or "\u202e" in line for line in lines), lines
    assert lines[1] == "  error: " + " ".join(SHOWN) and "0b\\x1b[2J on port 8200" in lines[2]
    assert "(\\x1b]0;x\\x07, port 8100" in lines[3]


def test_the_status_page_escapes_bidi_and_controls_too():
    page = render_page(hostile_status(), 5)
    assert "\u202e" not in page and "\x1b" not in page and "\\u202eevil" in page and "[/srv/models/x]" in page


def test_the_echo_of_instance_output_steers_no_terminal_and_the_file_keeps_it(tmp_path):
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("vsup.test.echo")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = Keep()
    logger.addHandler(handler)
    try:
        log = InstanceLog("i0", tmp_path, max_bytes=1 << 20, backups=1, echo=True, logger=logger)
        log.lines("stderr", [f"INFO loading\tweights {HOSTILE} Grüße"])
        log.close()
    finally:
        logger.removeHandler(handler)
    assert records == [f"[i0] INFO loading\tweights {' '.join(SHOWN)} Grüße"]
    assert HOSTILE in (tmp_path / "i0.log").read_text()  # the instance's own file: its bytes as they came


@pytest.mark.parametrize("journal", [False, True])
def test_vsups_log_lines_are_one_line_of_plain_text_whatever_they_quote(capfd, monkeypatch, journal):
    # the proxy and the supervisor log upstream errors and reasons: a formatter, not each call site, keeps them plain
    if journal:
        monkeypatch.setenv("JOURNAL_STREAM", "8:1")
    else:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        setup_logging("info", "text")
        logging.getLogger("vsup.proxy").warning("instance %s: %s", "i0", f"bad answer {HOSTILE}\nINFO vsup: forged line")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("vsup").exception("with a traceback")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    err = capfd.readouterr().err
    first = err.splitlines()[0]
    assert first.endswith("WARNING vsup.proxy: instance i0: bad answer " + " ".join(SHOWN) + "\\x0aINFO vsup: forged line")
    assert "\x1b" not in err and "\x07" not in err
    assert "Traceback (most recent call last):" in err.splitlines()  # a traceback keeps its lines
