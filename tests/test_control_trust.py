"""The CLI talks only to its own vsup: a control socket another local user planted (uid 65534, in a
`vsup-0` folder they made first in a shared TMPDIR) is refused, the installed unit's vsup (/run/vsup,
here a root-owned stand-in for /run: tests/cli_with_run.py) is found before this user's private
folder, and an answer of another shape is one line, never a traceback. Real sockets, the real CLI
as a subprocess, the planter as a real second uid."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_control import Target
from tests.test_control_safety import one_line_error, vsup_cli
from tests.tools import need_nobody_running
from vsup.supervisor.control import ControlServer

pytestmark = pytest.mark.timeout(90)

WITH_RUN = [sys.executable, str(Path(__file__).parent / "cli_with_run.py")]

ROLLOUT = {"kind": "reload", "trigger": "vsup reload", "state": "done", "took": 0.5, "error": None, "step": 0,
           "steps": [], "unchanged": [0, 1], "applied": ["proxy.timeout"], "not_applied": [], "pending": None}


class FullTarget(Target):
    """A Target whose answers have the whole shape the CLI reads (a real vsup's)."""

    def status(self) -> dict:
        return {"vsup": {"pid": 1, "uptime": 5.0, "proxy": f"127.0.0.1:{self.proxy_port}", "ready": 2, "in_flight": 0},
                "instances": self.instance_statuses([0, 1]), "changing": [], "rollout": None, "queues": {}}

    def instance_statuses(self, indices: list[int]) -> list[dict]:
        return [{"index": i, "state": "ready", "pid": 100 + i, "port": 8100 + i, "cpus": [i], "nodes": [0],
                 "uptime": 5.0, "restarts": 0, "last_exit": None} for i in indices]

    async def reload(self, trigger: str, wait: bool) -> dict:
        await super().reload(trigger, wait)
        return ROLLOUT


# A vsup look-alike another user runs: it answers every request as a real vsup would, and says so
# in a file of its own (what it was asked).
PLANTED = textwrap.dedent("""
    import json, os, socketserver, sys
    from http.server import BaseHTTPRequestHandler
    path, asked = sys.argv[1], sys.argv[2]
    STATUS = {"vsup": {"pid": 1, "uptime": 1.0, "proxy": "127.0.0.1:8000", "ready": 0, "in_flight": 0}, "instances": []}
    ROLLOUT = {"kind": "reload", "trigger": "vsup reload", "state": "done", "took": 0.1, "steps": [],
               "unchanged": [], "applied": ["everything (the planted vsup)"]}
    class Handler(BaseHTTPRequestHandler):
        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            with open(asked, "a") as f:
                f.write(self.command + " " + self.path + "\\n")
        def do_GET(self):
            self.answer(STATUS)
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.answer({"rollout": ROLLOUT} if self.path == "/reload" else {"instances": []})
        def address_string(self):
            return "planted"
    os.makedirs(os.path.dirname(path), mode=0o777, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o777)
    server = socketserver.UnixStreamServer(path, Handler)
    os.chmod(path, 0o777)
    print("listening", flush=True)
    server.serve_forever()
""")


@pytest.fixture
def shared():
    """A TMPDIR every user may write (sticky, like /tmp) and a folder only the planter may write
    (where it says what it was asked); removed afterwards."""
    outer = Path(tempfile.mkdtemp(prefix="vsup-trust-"))  # in /tmp: uid 65534 can reach it
    outer.chmod(0o755)
    tmpdir = outer / "tmp"
    tmpdir.mkdir()
    tmpdir.chmod(0o1777)
    notes = outer / "notes"
    notes.mkdir()
    os.chown(notes, 65534, 65534)
    yield tmpdir, notes / "asked"
    shutil.rmtree(outer)


@pytest.fixture
def planted(shared):
    """uid 65534's look-alike at `<TMPDIR>/vsup-0/control-8000.sock` (root's private place, made
    first by them); yields (TMPDIR, the file where it notes what it was asked)."""
    tmpdir, asked = shared
    python = need_nobody_running([sys.executable, "-c", "pass"])
    path = tmpdir / f"vsup-{os.getuid()}" / "control-8000.sock"
    planter = subprocess.Popen([*python[:-2], "-c", PLANTED, str(path), str(asked)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd="/", stdin=subprocess.DEVNULL)
    try:
        assert planter.stdout is not None and planter.stdout.readline() == "listening\n", planter.stderr
        assert path.stat().st_uid == 65534
        yield tmpdir, asked
    finally:
        planter.kill()
        planter.communicate(timeout=10)


def asked_of(asked: Path) -> str:
    return asked.read_text() if asked.exists() else ""


@pytest.mark.parametrize("command", [["reload"], ["status"], ["restart", "all"]])
async def test_a_socket_another_user_planted_in_the_private_place_is_refused(planted, command):
    tmpdir, asked = planted
    env = {"TMPDIR": str(tmpdir)}
    empty_run = tmpdir.parent / "run"  # no installed unit here
    empty_run.mkdir(exist_ok=True)
    code, out, err = await run_cli(empty_run, *command, env=env)
    assert code == 2, out + err
    line = one_line_error(err)
    assert line.startswith("vsup: error: vsup is not running: no control socket answers at "), line
    assert "control-8000.sock (it belongs to uid 65534, not to you (uid 0) or root" in line, line
    assert "another user may have put it there" in line and "done" not in out
    # named with --socket: the same refusal, and it was asked nothing either way
    code, out, err = await vsup_cli(*command, "--socket", str(tmpdir / "vsup-0" / "control-8000.sock"), env=env)
    assert code == 2 and "it belongs to uid 65534, not to you (uid 0) or root" in one_line_error(err), out + err
    assert asked_of(asked) == ""


async def run_cli(run: Path, *args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """`vsup ARGS` with `run` standing for /run (tests/cli_with_run.py)."""
    process = await asyncio.create_subprocess_exec(*WITH_RUN, str(run), *args, stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   env={**os.environ, **env})
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.fixture
def run_dir(shared):
    """A root-owned 0755 folder standing for /run, with the unit's runtime directory `vsup` in it."""
    tmpdir, _asked = shared
    run = tmpdir.parent / "run"
    (run / "vsup").mkdir(parents=True)
    run.chmod(0o755)
    (run / "vsup").chmod(0o755)
    return run


async def test_the_installed_units_vsup_is_found_before_a_planted_private_one(planted, run_dir):
    tmpdir, asked = planted
    target = FullTarget()
    server = ControlServer(run_dir / "vsup" / "control.sock", target)
    await server.start()
    try:
        code, out, err = await run_cli(run_dir, "reload", env={"TMPDIR": str(tmpdir)})
        assert code == 0, out + err
        assert "applied at once: proxy.timeout" in out and "planted" not in out
        assert target.reloaded == [("vsup reload", True)]
        code, out, err = await run_cli(run_dir, "status", env={"TMPDIR": str(tmpdir)})
        assert code == 0 and out.startswith("vsup pid 1, up 5s, proxy 127.0.0.1:8000, 2/2 instances ready"), out + err
    finally:
        await server.stop()
    assert asked_of(asked) == ""


async def test_a_service_users_socket_in_its_runtime_directory_is_trusted_elsewhere_not(shared, run_dir):
    """What systemd does for `User=vsup`: /run/vsup belongs to the service's user, and so does the
    socket; root's CLI talks to it. The same user's socket in a folder of /tmp is refused."""
    tmpdir, asked = shared
    python = need_nobody_running([sys.executable, "-c", "pass"])
    os.chown(run_dir / "vsup", 65534, 65534)
    service = subprocess.Popen([*python[:-2], "-c", PLANTED, str(run_dir / "vsup" / "control.sock"), str(asked)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/", stdin=subprocess.DEVNULL)
    try:
        assert service.stdout is not None and service.stdout.readline() == "listening\n", service.stderr
        (run_dir / "vsup").chmod(0o755)  # (the look-alike made it 0777; systemd's is 0755)
        code, out, err = await run_cli(run_dir, "status", env={"TMPDIR": str(tmpdir)})
        assert code == 0 and out.startswith("vsup pid 1, up 1s, proxy 127.0.0.1:8000, 0/0 instances ready"), out + err
        assert asked_of(asked) == "GET /status\nGET /status\n"  # the search's probe, then the status
        # its folder writable by others: anyone could have put that socket there
        (run_dir / "vsup").chmod(0o777)
        code, out, err = await run_cli(run_dir, "status", env={"TMPDIR": str(tmpdir)})
        assert code == 2 and f"its folder {run_dir / 'vsup'} may be written by others (mode 0777)" in one_line_error(err)
    finally:
        service.kill()
        service.communicate(timeout=10)


# ---- an answer of another shape --------------------------------------------------------------------

class Foreign(Target):
    """Something that answers on a trusted socket, but not as this vsup does."""

    def status(self) -> dict:
        return {"vsup": {"pid": "one", "proxy": "127.0.0.1:8000"}, "instances": "none"}

    def instance_statuses(self, indices: list[int]) -> list[dict]:
        return [{"index": str(i), "state": None} for i in indices]

    async def reload(self, trigger: str, wait: bool) -> dict:
        await super().reload(trigger, wait)
        return {"state": 3}


@pytest.mark.parametrize(("command", "route", "field"), [
    (["status"], "/status", "vsup.pid"), (["top"], "/status", "vsup.pid"),
    (["restart", "all"], "/restart", "instances.0.index"), (["reload"], "/reload", "rollout.kind"),
])
async def test_an_answer_of_another_shape_is_one_line_not_a_traceback(tmp_path, command, route, field):
    path = tmp_path / "control.sock"
    server = ControlServer(path, Foreign())
    await server.start()
    try:
        began = time.monotonic()
        code, out, err = await vsup_cli(*command, "--socket", str(path))
        assert time.monotonic() - began < 60
    finally:
        await server.stop()
    assert code == 2, out + err
    line = one_line_error(err)
    assert line.startswith(f"vsup: error: the control socket {path} answered {route} with an unexpected shape ({field}: "), line
    assert line.endswith("not a vsup of this version? (`vsup --version` here)"), line
