"""`vsup tune` given what would break it: a hand-edited results file under --resume, a report or
config path it cannot write, a server without /tokenize, and candidate errors that read as rich
markup or terminal escapes. Each is one line naming the flag or the file:line, found before anything
is measured; the report of a search whose errors quote `[/srv/models/x]` is written whole.

A search with nothing left to measure is a --resume of a results file whose runs are all
recorded (and cost more than --budget, so every later trial is skipped): the real CLI, the real
report, no candidate started."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.test_tune_cli import Tuning
from tests.tools import need_nobody_running
from tests.vsup_harness import VSUP

pytestmark = pytest.mark.timeout(240)

@pytest.fixture
def tuning(tmp_path):
    made: list[Tuning] = []

    def make(**kw) -> Tuning:
        made.append(Tuning(tmp_path, **kw))
        return made[-1]

    yield make
    for t in made:
        t.cleanup()


LAYOUTS = ("i1", "i1-t1", "i2")  # the kept layouts of the 2-core test machine (test_tune_cli)
HOSTILE = ("[/srv/models/x] not found; [bold red]x[/] [link=http://evil]y[/link] \x1b]0;pwned\x07\x1b[2J "
           "![t](http://evil/t.png) <img src=http://evil/i>")


def fingerprint(t: Tuning) -> dict:
    return {"model": "fake-model", "candidates": list(LAYOUTS), "objective": "throughput", "slo": [], "levels": ["c4"],
            "workload": "synthetic 8/12"}


def level(tok_s: float) -> dict:
    stats = {"mean": 0.1, "p50": 0.1, "p90": 0.2, "p99": 0.3}
    return {"level": "c4", "duration_s": 1.0, "completed": 10, "errors": 0, "output_tokens": 120, "input_tokens": 80,
            "output_throughput": tok_s, "request_throughput": 8.0,
            "latency": {m: dict(stats) for m in ("ttft", "tpot", "itl", "e2el")}, "error_samples": []}


def run_line(candidate: str, *, ok: bool, error: str | None = None) -> dict:
    # wall_s far beyond --budget: after the replay every further trial is skipped, none measured
    return {"type": "run", "candidate": candidate, "stage": "screen", "duration_s": 1.0, "ok": ok, "error": error,
            "wall_s": 5000.0, "load_s": 1.0, "levels": [level(100.0)] if ok else [], "extra": {}}


def recorded(t: Tuning, runs: list[dict], extra_lines: list[bytes] = ()) -> None:
    t.report.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"type": "tune", "fingerprint": fingerprint(t)}).encode(), *(json.dumps(r).encode() for r in runs),
             *extra_lines]
    (t.report / "results.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def resume(t: Tuning, *extra: str):
    return t.run("--budget", "1s", "--preload", "none", "--resume", *extra, timeout=120)


def test_a_search_whose_errors_read_as_markup_reports_them_as_written(tuning):
    t = tuning()
    recorded(t, [run_line("i1", ok=True), run_line("i1-t1", ok=False, error=HOSTILE), run_line("i2", ok=False, error="[/]")])
    out = resume(t)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not t.leftovers()
    # the table and the progress lines show the errors literally, no terminal escape gets through
    assert "\x1b" not in out.stdout and "\x1b" not in out.stderr
    assert "[/srv/models/x] not found" in out.stdout and "[bold red]x[/]" in out.stdout
    assert "[link=http://evil]y[/link]" in out.stdout and "\\x1b]0;pwned\\x07\\x1b[2J" in out.stdout
    assert "FAILED: [/srv/models/x] not found" in out.stderr and "\\x1b]0;pwned" in out.stderr
    summary = (t.report / "summary.md").read_text()
    assert "**Best: `i1`**" in summary and "\\[/srv/models/x\\] not found" in summary and "\x1b" not in summary
    # rendered, the summary shows the error as text: no image fetched from elsewhere, no HTML
    assert "\\!\\[t\\](http://evil/t.png) \\<img src=http://evil/i\\>" in summary and "](http://evil/t.png)" in summary
    assert not re.search(r"(?<!\\)!\[t\]|(?<!\\)<img", summary)
    assert (t.report / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


GOOD = run_line("i1", ok=True)


def without(key: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != key}


@pytest.mark.parametrize(("line", "problem"), [
    (json.dumps(without("stage")).encode(), "a run line that cannot be replayed: no 'stage'"),
    (json.dumps({**GOOD, "duration_s": "long"}).encode(), "'duration_s' is 'long', not int or float"),
    (json.dumps({**GOOD, "levels": [{**level(1.0), "completed": "10"}]}).encode(), "levels[0].'completed' is '10', not int"),
    (json.dumps({**GOOD, "levels": ["c4"]}).encode(), "levels[0] is not an object"),
    (json.dumps({**GOOD, "extra": {"roofline": 0.5}}).encode(), "extra.'roofline' is not"),
    (json.dumps({**GOOD, "extra": {"start": {"vsup_s": 3.0, "ready_s": "2m"}}}).encode(), "extra.'start' is not"),
    (b'{"type": "run", "candidate": "i1", "error": "\xff\xfe"}', "not UTF-8 text"),
    (b"[1, 2]", "not a JSON object"),
    (b"{not json", "not a JSON line"),
])
def test_a_hand_edited_results_line_is_one_line_naming_file_and_line(tuning, line, problem):
    t = tuning()
    recorded(t, [], [line, json.dumps(run_line("i2", ok=False, error="x")).encode()])  # the bad line is not the last
    out = resume(t)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith(f"vsup: error: --resume: {t.report / 'results.jsonl'}:2: ") and problem in out.stderr, out.stderr
    assert "remove that line" in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert not (t.report / "logs").exists()  # nothing was measured


def test_a_header_without_a_fingerprint_object_is_one_line(tuning):
    t = tuning()
    t.report.mkdir(parents=True)
    (t.report / "results.jsonl").write_text('{"type": "tune", "fingerprint": 3}\n')
    out = resume(t)
    assert out.returncode == 2 and "has no vsup tune header" in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize("flag", ["--report", "--write-config"])
def test_a_path_under_a_file_is_refused_before_measuring(tuning, flag):
    t = tuning()
    blocker = t.tmp / "a-file"
    blocker.write_text("")
    target = blocker / ("r" if flag == "--report" else "tuned.yaml")
    args = ["--report", str(target)] if flag == "--report" else ["--write-config", str(target)]
    out = subprocess.run([*t.argv("--budget", "2m", "--preload", "none"), *args], cwd=t.tmp, env=t.env, capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith(f"vsup: error: {flag} {target}: {blocker} is not a folder") and out.stderr.count("\n") == 1
    assert not (t.report / "logs").exists() and not t.leftovers()


@pytest.fixture
def shared_dir():
    """A folder the unprivileged user can read (pytest's tmp_path is root's alone), not write."""
    path = Path(tempfile.mkdtemp(prefix="vsup-tune-ro-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("flag", ["--report", "--write-config"])
def test_a_folder_the_user_cannot_write_is_refused_before_measuring(shared_dir, flag):
    # a second uid: root writes anywhere, nobody cannot write in root's 0755 folder
    config = shared_dir / "c.yaml"
    config.write_text("model: m\nplacement:\n  model_size_gib: 0.25\n")
    config.chmod(0o644)
    target = shared_dir / ("report" if flag == "--report" else "tuned.yaml")
    unmade = Path(f"/tmp/vsup-tune-unmade-{os.getpid()}")  # (a --report uid 65534 could make: never made here)
    args = ["--report", str(target)] if flag == "--report" else ["--report", str(unmade), "--write-config", str(target)]
    out = subprocess.run([*need_nobody_running(VSUP), "tune", "-c", str(config),
                          "--no-roofline", *args], capture_output=True, text=True, timeout=60, cwd="/", stdin=subprocess.DEVNULL,
                         env={**os.environ, "HOME": "/nonexistent"})
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr == f"vsup: error: {flag} {target}: {shared_dir} is not writable by this user; " \
                         f"choose {'a folder' if flag == '--report' else 'a file'} path you can write\n", out.stderr
    assert list(shared_dir.iterdir()) == [config] and not unmade.exists()


def test_a_server_without_tokenize_is_named_not_a_traceback(tuning):
    t = tuning()
    t.env["FAKE_VLLM_TOKENIZE"] = "0"
    out = t.run("--budget", "2m", "--preload", "none", "--instances-per-node", "1", "--omp-threads", "all",
                "--housekeeping-core", "off", "--smt", "off")
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("vsup: error: the server at http://") and "/tokenize (HTTP 404)" in last, out.stderr[-3000:]
    assert "--workload" in last and "Traceback" not in out.stderr
    assert not t.leftovers()


def test_tokenize_answers_that_are_not_json_are_named_not_a_json_error():
    # a plain aiohttp server: its 404 is text ("404: Not Found"), which failed as JSONDecodeError
    import asyncio

    from aiohttp import web

    from vsup.errors import VsupError
    from vsup.tune import load

    async def broken(_request):
        return web.Response(status=500, text="<html>\x1b[2Joops</html>")

    async def go():
        app = web.Application()
        app.router.add_post("/v2/tokenize", broken)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with load.Client(f"http://127.0.0.1:{port}", "m") as client:
                with pytest.raises(VsupError, match=r"has no /tokenize \(HTTP 404\)"):
                    await client.tokenize("hello")
            async with load.Client(f"http://127.0.0.1:{port}/v2", "m") as client:
                with pytest.raises(RuntimeError, match=r"HTTP 500: <html>\\x1b\[2Joops</html>"):
                    await client.tokenize("hello")
        finally:
            await runner.cleanup()

    asyncio.run(go())
