"""The control plane does what it is asked, to the vsup it is asked of: a named --config or --socket
is never swapped for a guess, a control.socket path that is not a stale socket is never replaced
or deleted, and a socket the CLI may not open is one line, exit 2. Real sockets, the real `vsup`
CLI as a subprocess (as a second uid for EACCES), a ControlServer in-process as the vsup answering."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.test_control import Target
from tests.tools import need_nobody_running
from tests.vsup_harness import VSUP, make_config
from vsup.errors import VsupError
from vsup.supervisor.control import ControlServer

pytestmark = pytest.mark.timeout(60)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


async def vsup_cli(*args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> tuple[int, str, str]:
    """The `vsup` CLI as a subprocess, without blocking the loop an in-process server answers on."""
    process = await asyncio.create_subprocess_exec(*(prefix or []), *VSUP, *args, stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def one_line_error(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("vsup: error: "), err
    return err.strip()


# ---- a named --config is never swapped for the default sockets ---------------------------------------

@pytest.mark.parametrize("command", [["reload"], ["status"], ["restart", "0"]])
async def test_a_config_that_cannot_be_parsed_is_its_error_and_the_default_vsup_is_not_touched(tmp_path, command):
    # a vsup answers at the default place (proxy port 8000, this user's private directory)
    default = tmp_path / f"vsup-{os.getuid()}" / "control-8000.sock"
    target = Target()
    server = ControlServer(default, target, {"TMPDIR": str(tmp_path)})
    await server.start()
    try:
        # another vsup's file (proxy port 8123), with a typo elsewhere: its own vsup is asked (it
        # re-reads and refuses its file itself); none runs, and the one on 8000 is not tried
        other = tmp_path / "other.yaml"
        other.write_text("model: m\ninstances: 0\nproxy:\n  port: 8123\n")
        code, out, err = await vsup_cli(*command, "--config", str(other), env={"TMPDIR": str(tmp_path)})
        assert code == 2, out + err
        line = one_line_error(err)
        assert line.startswith("vsup: error: vsup is not running: no control socket answers at ") and "control-8123.sock" in line
        assert "control-8000.sock" not in line, line
        # the keys that say where it listens are wrong: that is the error
        bad = tmp_path / "bad.yaml"
        bad.write_text("model: m\nproxy:\n  port: 70000\n")
        code, out, err = await vsup_cli(*command, "--config", str(bad), env={"TMPDIR": str(tmp_path)})
        assert code == 2, out + err
        assert one_line_error(err).startswith(f"vsup: error: {bad}:3: proxy.port: 70000 is not valid"), err
        unreadable = tmp_path / "broken.yaml"
        unreadable.write_text("model: [m\n")
        code, _out, err = await vsup_cli(*command, "--config", str(unreadable), env={"TMPDIR": str(tmp_path)})
        assert code == 2 and one_line_error(err).startswith(f"vsup: error: {unreadable}:")
        assert target.reloaded == [] and target.restarted == []
    finally:
        await server.stop()


async def test_with_socket_named_the_config_is_not_read_and_nothing_else_is_tried(tmp_path):
    default = tmp_path / f"vsup-{os.getuid()}" / "control-8000.sock"
    target = Target()
    server = ControlServer(default, target, {"TMPDIR": str(tmp_path)})
    await server.start()
    try:
        missing = tmp_path / "gone.sock"
        code, _out, err = await vsup_cli("reload", "--socket", str(missing), env={"TMPDIR": str(tmp_path)})
        assert code == 2 and one_line_error(err) == f"vsup: error: vsup is not running: no control socket at {missing}"
        assert target.reloaded == []
    finally:
        await server.stop()


# ---- vsup status --socket PATH that may not be opened ---------------------------------------------

@pytest.fixture
def root_only_socket():
    """A listening socket of root's in a 0700 directory of root's: uid 65534 may not even look."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the CLI as another uid")
    outer = Path(tempfile.mkdtemp(prefix="vsup-eacces-"))  # /tmp itself: pytest's tmp_path is 0700
    outer.chmod(0o755)
    private = outer / "private"
    private.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(private / "control.sock"))
    listener.listen()
    yield private / "control.sock"
    listener.close()
    shutil.rmtree(outer)


async def test_a_socket_another_uid_may_not_open_is_one_line_exit_2_not_a_traceback(root_only_socket):
    need_nobody_running(VSUP)  # skips outside CI (fails in it) when uid 65534 cannot run this venv's vsup
    for command in (["status"], ["reload"], ["restart", "all"]):
        code, out, err = await vsup_cli(*command, "--socket", str(root_only_socket), prefix=NOBODY)
        assert code == 2, out + err
        assert one_line_error(err) == (f"vsup: error: cannot use the control socket {root_only_socket}: "
                                       "permission denied: run as the service's user or root")


async def test_a_socket_path_that_is_no_socket_names_what_is_there(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    cases = {
        str(regular): f"cannot use the control socket {regular}: not a socket but a regular file",
        str(regular / "sock"): f"cannot use the control socket {regular / 'sock'}: a part of the path is not a directory",
        str(tmp_path / "none"): f"vsup is not running: no control socket at {tmp_path / 'none'}",
    }
    for path, message in cases.items():
        code, _out, err = await vsup_cli("status", "--socket", path)
        assert code == 2 and one_line_error(err) == f"vsup: error: {message}"


# ---- control.socket at a path that is not a stale socket -----------------------------------------

async def test_control_socket_on_a_regular_file_a_directory_or_a_symlink_refuses_and_leaves_it(tmp_path):
    real = tmp_path / "precious.txt"
    real.write_text("keep me")
    (tmp_path / "adir").mkdir()
    (tmp_path / "link").symlink_to(real)
    for name, kind in [("precious.txt", "a regular file"), ("adir", "a directory"), ("link", "a symlink")]:
        with pytest.raises(VsupError) as err:
            await ControlServer(tmp_path / name, Target()).start()
        assert str(err.value) == (f"control.socket {str(tmp_path / name)!r} is {kind}, not a socket: vsup replaces "
                                  "only a socket a killed vsup left behind; remove it or choose another path")
    assert real.read_text() == "keep me" and (tmp_path / "adir").is_dir() and (tmp_path / "link").is_symlink()


async def test_a_stale_socket_is_replaced_a_live_one_refused(tmp_path):
    path = tmp_path / "control.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening: what a killed vsup leaves
    stale.close()
    first = ControlServer(path, Target())
    await first.start()
    try:
        with pytest.raises(VsupError, match="another vsup is already running here"):
            await ControlServer(path, Target()).start()
    finally:
        await first.stop()
    assert not path.exists()


async def test_stop_removes_only_the_socket_it_bound(tmp_path):
    path = tmp_path / "control.sock"
    server = ControlServer(path, Target())
    await server.start()
    path.unlink()
    path.write_text("someone else's file now")  # put there while vsup ran
    await server.stop()
    assert path.read_text() == "someone else's file now"


def test_vsup_run_with_control_socket_on_a_real_file_exits_2_and_keeps_the_file(tmp_path):
    real = tmp_path / "etc-passwd-like"
    real.write_text("root:x:0:0\n")
    config = make_config(tmp_path, instances=1, control={"socket": str(real)})
    (tmp_path / "vsup.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.Popen([*VSUP, "run", "--config", str(tmp_path / "vsup.yaml")], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True,
                           env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _out, err = run.communicate(timeout=30)
    finally:
        if run.poll() is None:  # it ran on (the file gone): take its instances along
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
    assert run.returncode == 2, err[-3000:]
    assert f"control.socket {str(real)!r} is a regular file, not a socket" in err
    assert "Traceback" not in err and real.read_text() == "root:x:0:0\n"
