"""Finding and removing what a vsup that is gone left running, with real processes: a "dead vsup"
is the identity (pid, start time) of a process that has exited; its "instances" are processes
carrying its VSUP_TREE mark. /dev/shm stand-ins live under tmp_path."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vsup.cli.run import check_port_free
from vsup.errors import VsupError
from vsup.supervisor import proctree
from vsup.supervisor.leftovers import _command, describe_port_holder, read_states, remove_leftovers, write_state

pytestmark = pytest.mark.timeout(60)

# argv: ready file, shm file to map ("" for none), port to listen on (0 for none); ignores SIGTERM
# when LEFTOVER_IGNORE_TERM=1, starts one child (an "EngineCore") that maps the same file.
LEFTOVER = r"""
import mmap, os, signal, socket, subprocess, sys, time
ready, shm, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if os.environ.get("LEFTOVER_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
keep = []
if shm:
    with open(shm, "r+b") as f:
        keep.append(mmap.mmap(f.fileno(), 0))
if port:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port)); s.listen(); keep.append(s)
if os.environ.get("LEFTOVER_CHILD") != "0":
    env = dict(os.environ, LEFTOVER_CHILD="0")
    keep.append(subprocess.Popen([sys.executable, sys.argv[0], ready + ".child", shm, "0"], env=env))
    while not os.path.exists(ready + ".child"):
        time.sleep(0.02)
open(ready, "w").close()
time.sleep(3600)
"""


def dead_identity() -> tuple[int, int]:
    """(pid, start time) of a process that has exited: a vsup that is gone."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    st = proctree.read_stat(proc.pid)
    proc.kill()
    proc.wait()
    return st.pid, st.start


@pytest.fixture
def start_leftover(tmp_path):
    """start(owner, ...) -> [leader, child] ProcStats of a fake instance marked as `owner`'s.
    Whatever is left at teardown is SIGKILLed (exact processes only) and the leaders reaped."""
    started: list[tuple[subprocess.Popen, list[proctree.ProcStat]]] = []

    def start(owner: tuple[int, int], *, shm: Path | None = None, port: int = 0, ignore_term: bool = False) -> list[proctree.ProcStat]:
        ready = tmp_path / f"ready-{len(started)}"
        env = {**os.environ, proctree.TOKEN_VAR: f"{owner[0]}-{owner[1]}-{len(started):06d}",
               "LEFTOVER_IGNORE_TERM": "1" if ignore_term else "0"}
        script = tmp_path / "leftover.py"
        script.write_text(LEFTOVER)
        proc = subprocess.Popen([sys.executable, str(script), str(ready), str(shm or ""), str(port)], env=env,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the leftover did not start"
            time.sleep(0.02)
        stats = [proctree.read_stat(proc.pid)]
        stats += [st for pid, st in proctree.find_marked(env[proctree.TOKEN_VAR]).items() if pid != proc.pid]
        started.append((proc, stats))
        return stats

    yield start
    for proc, stats in started:
        for st in stats:
            proctree.signal_exact(st, signal.SIGKILL)
        proc.wait(10)


def make_shm(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_bytes(b"\0" * 4096)
    return path


def write_dead_state(directory: Path, owner: tuple[int, int]) -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"vsup-{owner[0]}.json"
    path.write_text(json.dumps({"pid": owner[0], "start": owner[1], "config": "/etc/vsup/vsup.yaml",
                                "proxy": "127.0.0.1:8000", "ports": [8100]}))
    return path


async def test_what_a_dead_vsup_left_is_stopped_swept_and_named(tmp_path, start_leftover, caplog):
    owner = dead_identity()
    shm = make_shm(tmp_path, "psm_leftover")
    unrelated = make_shm(tmp_path, "psm_someone_else")
    stubborn = start_leftover(owner, shm=shm, ignore_term=True)  # a leader that ignores SIGTERM, and its child
    assert len(stubborn) == 2 and all(proctree.alive(st) for st in stubborn)
    runtime = tmp_path / "run"
    state = write_dead_state(runtime, owner)

    with caplog.at_level(logging.WARNING, logger="vsup.leftovers"):
        removals = await remove_leftovers(runtime, grace=0.5, shm_dir=tmp_path)

    assert not any(proctree.alive(st) for st in stubborn)
    (removal,) = removals
    assert sorted(removal.processes) == sorted(st.pid for st in stubborn)
    assert removal.killed == sorted(st.pid for st in stubborn)  # SIGTERM was ignored: SIGKILL after the grace
    assert removal.shm_removed == [str(shm)] and not shm.exists() and unrelated.exists()
    assert not state.exists()
    line = caplog.records[-1].getMessage()
    assert f"vsup pid {owner[0]} is no longer running (config /etc/vsup/vsup.yaml)" in line
    assert all(f"pid {st.pid} (" in line for st in stubborn) and "psm_leftover" in line


async def test_the_processes_of_a_running_vsup_are_never_touched(tmp_path, start_leftover):
    me = proctree.token_owner(proctree.own_mark())  # this test process plays the running vsup
    mine = start_leftover(me)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    state = write_state(runtime, config=None, proxy="127.0.0.1:8000", ports=[8100])
    assert [s.pid for s in read_states(runtime)] == [os.getpid()]
    assert await remove_leftovers(runtime, grace=0.5, shm_dir=tmp_path) == []
    assert all(proctree.alive(st) for st in mine) and state.exists()


async def test_a_dead_vsup_that_left_nothing_only_loses_its_state_file(tmp_path):
    runtime = tmp_path / "run"
    state = write_dead_state(runtime, dead_identity())
    (runtime / "vsup-garbage.json").write_text("{not json")
    assert await remove_leftovers(runtime, grace=0.5, shm_dir=tmp_path) == []
    assert not state.exists()


def test_port_not_free_names_the_holder_and_the_dead_vsup_it_came_from(tmp_path, start_leftover):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    owner = dead_identity()
    (leader, _) = start_leftover(owner, port=port)
    with pytest.raises(VsupError) as error:
        check_port_free("127.0.0.1", port, "vllm.base_port (instance 0)")
    message = str(error.value)
    assert message.startswith(f"vllm.base_port (instance 0): port {port} on 127.0.0.1 is not free (Address already in use): "
                              f"held by pid {leader.pid} (")
    assert f"a vLLM instance left behind by vsup pid {owner[0]}, which is no longer running (stop it: kill {leader.pid})" in message
    assert "\n" not in message


def test_port_holder_of_a_running_vsup_and_a_plain_process(tmp_path, start_leftover):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = proctree.token_owner(proctree.own_mark())
    (leader, _) = start_leftover(me, port=port)
    assert describe_port_holder(port).endswith(f", an instance of the vsup with pid {os.getpid()}, which is running")
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        assert describe_port_holder(plain.getsockname()[1]) == f"held by pid {os.getpid()} ({_command(os.getpid())})"
