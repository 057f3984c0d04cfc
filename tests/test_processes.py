"""The process layer with real processes: spawn, drain, stop_tree, orphans, escapees, /dev/shm.

Every process here is started by the test itself (a small Python tree script, or the fake vLLM
server); stop_tree only ever signals the group/session/token of a leader the test spawned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from vsup.errors import VsupError
from vsup.supervisor import proctree
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.processes import reap_orphans, spawn, stop_tree, sweep_stale_shm, tree_pids

SLACK = 20.0  # seconds of scheduling slack on a loaded 2-core machine; assertions are on behaviour

# One generation of a test tree. argv: pidfile depth. It records "<depth> <pid>" in pidfile, starts
# the next generation (depth - 1) and sleeps. Env knobs, inherited by every generation:
#   T_IGNORE_TERM=1   ignore SIGTERM          T_SETSID=1      the depth-0 process calls setsid()
#   T_EXIT=<depth>    that generation exits after starting its child (orphaning it)
#   T_SHM=<mapped>,<opened>   the depth-0 process mmaps the first file and keeps the second open
TREE_SCRIPT = r'''
import mmap, os, signal, subprocess, sys, time
script, pidfile, depth = sys.argv[0], sys.argv[1], int(sys.argv[2])
if os.environ.get("T_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if depth == 0 and os.environ.get("T_SETSID") == "1":
    os.setsid()
keep = []
if depth == 0 and os.environ.get("T_SHM"):
    mapped, opened = os.environ["T_SHM"].split(",")
    with open(mapped, "r+b") as f:
        keep.append(mmap.mmap(f.fileno(), 0))
    keep.append(open(opened, "rb"))
if depth > 0:
    subprocess.Popen([sys.executable, script, pidfile, str(depth - 1)], stdin=subprocess.DEVNULL)
with open(pidfile, "a") as f:
    f.write(f"{depth} {os.getpid()}\n")
print(f"generation {depth} pid {os.getpid()} ready", flush=True)
if os.environ.get("T_EXIT") == str(depth):
    sys.exit(0)
while True:
    time.sleep(3600)
'''


@pytest.fixture
def tree_script(tmp_path: Path) -> Path:
    path = tmp_path / "tree.py"
    path.write_text(TREE_SCRIPT)
    return path


@pytest.fixture
def instance_log(tmp_path: Path):
    log = InstanceLog("i0", tmp_path / "logs", max_bytes=8 * 1024 * 1024, backups=2, echo=False,
                      logger=logging.getLogger("test.processes"))
    yield log
    log.close()


@pytest.fixture
def subreaper():
    """This test process adopts its descendants' orphans (as `vsup run` does) for one test."""
    if not proctree.become_subreaper():
        pytest.skip("PR_SET_CHILD_SUBREAPER is not available here")
    yield
    proctree.stop_being_subreaper()


@pytest.fixture
def cleanup_pids():
    """Pids a test started; any still alive at teardown are SIGKILLed (exact process only)."""
    started: list[proctree.ProcStat] = []
    yield started
    for st in started:
        proctree.signal_exact(st, signal.SIGKILL)
    proctree.reap_zombies([st.pid for st in started])


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("T_")}
    env.update(extra)
    return env


async def wait_for_pids(pidfile: Path, count: int, timeout: float = 30.0) -> dict[int, proctree.ProcStat]:
    """depth -> ProcStat of the generations once `count` of them have recorded their pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pidfile.exists():
            lines = [line.split() for line in pidfile.read_text().splitlines() if line.strip()]
            if len(lines) >= count:
                stats = {int(depth): proctree.read_stat(int(pid)) for depth, pid in lines}
                assert all(st is not None for st in stats.values()), f"a generation vanished early: {lines}"
                return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {pidfile.read_text() if pidfile.exists() else 'no'} pids after {timeout}s")


def assert_gone(stats, *, strictly: bool) -> None:
    """Not running; strictly: not even a zombie. A zombie may only remain if it is not ours to reap
    (its parent is init here, which in this sandbox does not reap)."""
    for st in stats:
        now = proctree.read_stat(st.pid)
        if now is None or now.start != st.start:
            continue
        assert now.zombie, f"pid {st.pid} ({st.comm}) is still running (state {now.state})"
        assert not strictly, f"pid {st.pid} is a zombie (parent {now.ppid}) but should have been reaped"
        assert now.ppid != os.getpid(), f"pid {st.pid} is our zombie and was not reaped"


def our_zombies() -> list[int]:
    return [p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]


# -- spawn and drain ---------------------------------------------------------------------------


async def test_heavy_output_is_drained_and_the_child_exits_normally(tmp_path):
    # 50 MB as fast as the child can write, on both pipes; it can only finish if we keep reading.
    code = (
        "import sys\n"
        "line = b'x' * 999 + b'\\n'\n"
        "for i in range(50_000):\n"
        "    (sys.stdout if i % 5 else sys.stderr).buffer.write(line)\n"
        "sys.stdout.buffer.write(b'last line\\n')\n"
    )
    log = InstanceLog("i0", tmp_path, max_bytes=4 * 1024 * 1024, backups=2, echo=False, logger=logging.getLogger("t"))
    rss_before = psutil.Process().memory_info().rss
    child = await spawn([sys.executable, "-c", code], base_env(), log=log)
    assert await asyncio.wait_for(child.wait(), 120) == 0
    assert await child.output_closed(30)
    rss_growth = psutil.Process().memory_info().rss - rss_before
    report = await stop_tree(child, 5)
    log.close()
    assert report.exit_status == 0 and report.graceful
    files = sorted(tmp_path.glob("i0.log*"))
    assert [f.name for f in files] == ["i0.log", "i0.log.1", "i0.log.2"]  # rotated, two backups kept
    assert all(f.stat().st_size <= 4 * 1024 * 1024 for f in files)
    tail = (tmp_path / "i0.log").read_text().splitlines()
    assert any(line.endswith(" stdout last line") for line in tail)
    assert any(" stderr " + "x" * 999 in line for line in (tmp_path / "i0.log.1").read_text().splitlines())
    assert rss_growth < 40 * 1024 * 1024, f"memory grew by {rss_growth} bytes while draining 50 MB"


async def test_a_200k_line_without_newline_is_capped_and_reading_goes_on(tmp_path, instance_log):
    code = "import sys; sys.stdout.write('y' * 200 * 1024); sys.stdout.flush(); sys.stdout.write('\\nafter\\n' + 'z' * 70000)"
    child = await spawn([sys.executable, "-c", code], base_env(), log=instance_log)
    assert await asyncio.wait_for(child.wait(), 60) == 0
    assert await child.output_closed(30)
    await stop_tree(child, 5)
    lines = (tmp_path / "logs" / "i0.log").read_text().splitlines()
    body = [line.split(" ", 2)[2] for line in lines if " stdout " in line]
    assert body[0] == "y" * 65536 + f"…[truncated {200 * 1024 - 65536} bytes]"
    assert body[1] == "after"
    assert body[2] == "z" * 65536 + f"…[truncated {70000 - 65536} bytes]"  # unterminated rest, at EOF


async def test_missing_or_unrunnable_program_is_a_clear_error(tmp_path, instance_log):
    with pytest.raises(VsupError, match=r"cannot start 'no-such-vllm-binary': program not found on PATH \(/nowhere\)"):
        await spawn(["no-such-vllm-binary", "serve"], {"PATH": "/nowhere"}, log=instance_log)
    with pytest.raises(VsupError, match=r"program not found; install it or give its full path"):
        await spawn([str(tmp_path / "absent")], base_env(), log=instance_log)
    not_executable = tmp_path / "vllm"
    not_executable.write_text("#!/bin/sh\n")
    with pytest.raises(VsupError, match=r"cannot start '.*/vllm': permission denied; make it executable"):
        await spawn([str(not_executable)], base_env(), log=instance_log)
    with pytest.raises(VsupError, match=r"working directory '/no/such/dir' does not exist"):
        await spawn([sys.executable, "-c", "pass"], base_env(), log=instance_log, cwd="/no/such/dir")
    with pytest.raises(VsupError, match="the command is empty"):
        await spawn([], base_env(), log=instance_log)


async def test_a_script_without_an_interpreter_line_is_a_clear_error(tmp_path, instance_log):
    script = tmp_path / "vllm"
    script.write_bytes(b"\x00\x01not a program\n")
    script.chmod(0o755)
    with pytest.raises(VsupError, match=r"cannot start '.*/vllm': Exec format error; check vllm.command"):
        await spawn([str(script)], base_env(), log=instance_log)
    assert not our_zombies()  # the child that failed to exec was reaped


# A process that runs spawn() the way vsup does, then waits to be killed. argv: the child's marker file.
SPAWNER = r"""
import asyncio, logging, os, sys
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.processes import spawn
CHILD = (
    "import signal, sys, time\n"
    "def term(*_):\n"
    "    open(sys.argv[1], 'w').write('SIGTERM')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "open(sys.argv[1], 'w').write('ready')\n"
    "time.sleep(3600)\n"
)
async def main():
    log = InstanceLog("i0", None, max_bytes=1 << 20, backups=0, echo=False, logger=logging.getLogger("spawner"))
    child = await spawn([sys.executable, "-c", CHILD, sys.argv[1]], dict(os.environ), log=log)
    print(child.pid, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_the_leader_gets_sigterm_when_its_spawner_is_sigkilled(tmp_path, cleanup_pids):
    marker = tmp_path / "marker"
    spawner = subprocess.Popen([sys.executable, "-c", SPAWNER, str(marker)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, env=base_env())
    try:
        pid = int(spawner.stdout.readline())
        leader = proctree.read_stat(pid)
        cleanup_pids.append(leader)
        deadline = time.monotonic() + SLACK
        while not (marker.exists() and marker.read_text() == "ready"):
            assert time.monotonic() < deadline, "the child never got ready"
            time.sleep(0.02)
        assert leader.ppid == spawner.pid and " -I -S -c " not in " ".join(psutil.Process(pid).cmdline())  # exec'd
        spawner.kill()  # like vsup under `kill -9` or the OOM killer
        spawner.wait(10)
    finally:
        if spawner.poll() is None:
            spawner.kill()
            spawner.wait(10)
        spawner.stdout.close()
    deadline = time.monotonic() + SLACK
    while proctree.alive(leader) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not proctree.alive(leader), "the instance leader outlived the vsup that started it"
    assert marker.read_text() == "SIGTERM"  # a catchable signal: vLLM stops its EngineCore/Worker on it


def test_spawn_refuses_to_run_off_the_main_thread(instance_log):
    errors = []

    def in_thread():
        try:
            asyncio.run(spawn([sys.executable, "-c", "pass"], base_env(), log=instance_log))
        except RuntimeError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join(30)
    assert errors and "main thread" in errors[0] and "PR_SET_PDEATHSIG" in errors[0]


async def test_wait_survives_a_cancelled_waiter(tmp_path, instance_log):
    child = await spawn([sys.executable, "-c", "import time; time.sleep(0.5)"], base_env(), log=instance_log)
    waiter = asyncio.ensure_future(child.wait())
    await asyncio.sleep(0.05)
    waiter.cancel()
    assert await asyncio.wait_for(child.wait(), 30) == 0
    assert child.returncode == 0
    await stop_tree(child, 5)


# -- stop_tree ---------------------------------------------------------------------------------


async def test_graceful_stop_of_a_tree(tmp_path, tree_script, instance_log, cleanup_pids, subreaper):
    pidfile = tmp_path / "pids"
    child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"], base_env(), log=instance_log)
    stats = await wait_for_pids(pidfile, 3)
    cleanup_pids.extend(stats.values())
    assert os.getsid(child.pid) == os.getpgid(child.pid) == child.pid
    assert set(tree_pids(child)) == {st.pid for st in stats.values()}
    report = await stop_tree(child, 10)
    assert report.graceful and report.killed == [] and report.escaped == []
    assert report.exit_status == -signal.SIGTERM
    assert report.duration < 10
    assert_gone(stats.values(), strictly=True)
    assert not set(our_zombies()) & {st.pid for st in stats.values()}
    log_text = (tmp_path / "logs" / "i0.log").read_text()
    assert "generation 0 pid" in log_text and "vsup stopped after SIGTERM" in log_text


async def test_sigterm_ignoring_tree_is_killed_after_the_timeout(tmp_path, tree_script, instance_log, cleanup_pids, subreaper):
    pidfile = tmp_path / "pids"
    child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"], base_env(T_IGNORE_TERM="1"), log=instance_log)
    stats = await wait_for_pids(pidfile, 3)
    cleanup_pids.extend(stats.values())
    timeout = 1.5
    began = time.monotonic()
    report = await stop_tree(child, timeout)
    elapsed = time.monotonic() - began
    assert timeout <= elapsed < timeout + SLACK
    assert not report.graceful
    assert report.exit_status == -signal.SIGKILL
    assert set(report.killed) == {st.pid for st in stats.values()}
    assert report.survivors == []
    assert_gone(stats.values(), strictly=True)
    assert proctree.find_tree(child.pid, token=child.token) == {}


@pytest.mark.parametrize("adopt", [True, False], ids=["subreaper", "init-adopts"])
async def test_kill_9_of_the_leader_then_stop_tree_kills_the_orphans(tmp_path, tree_script, instance_log, cleanup_pids, adopt):
    """The crucial case: SIGKILL of vLLM's API server leaves EngineCore and Worker running."""
    if adopt and not proctree.become_subreaper():
        pytest.skip("PR_SET_CHILD_SUBREAPER is not available here")
    try:
        pidfile = tmp_path / "pids"
        child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"], base_env(), log=instance_log)
        stats = await wait_for_pids(pidfile, 3)
        cleanup_pids.extend(stats.values())
        os.kill(child.pid, signal.SIGKILL)  # the leader, which this test started
        # wait() returns although the orphans still hold the output pipes open
        assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGKILL
        orphans = [stats[1], stats[0]]
        assert all(proctree.alive(st) for st in orphans), "the orphans must outlive their killed parent"
        # found through the leader's group/session alone (no token, nothing seen before)
        assert set(proctree.find_tree(child.pid)) == {st.pid for st in orphans}
        expected_parent = os.getpid() if adopt else None
        if expected_parent is not None:
            assert proctree.read_stat(stats[1].pid).ppid == os.getpid()
        report = await stop_tree(child, 5)
        assert report.exit_status == -signal.SIGKILL
        assert report.graceful  # they took SIGTERM
        assert_gone(orphans, strictly=adopt)
        assert not set(our_zombies()) & {st.pid for st in stats.values()}
        assert await child.output_closed(0.1)
    finally:
        if adopt:
            proctree.stop_being_subreaper()


async def test_kill_9_of_the_leader_with_sigterm_ignoring_orphans(tmp_path, tree_script, instance_log, cleanup_pids, subreaper):
    pidfile = tmp_path / "pids"
    child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"], base_env(T_IGNORE_TERM="1"), log=instance_log)
    stats = await wait_for_pids(pidfile, 3)
    cleanup_pids.extend(stats.values())
    os.kill(child.pid, signal.SIGKILL)
    await asyncio.wait_for(child.wait(), 30)
    report = await stop_tree(child, 1.0)
    assert not report.graceful
    assert set(report.killed) == {stats[1].pid, stats[0].pid}
    assert sorted(report.reaped) == sorted([stats[1].pid, stats[0].pid])  # adopted orphans reaped by pid
    assert_gone(stats.values(), strictly=True)


async def test_setsid_escapee_is_swept(tmp_path, tree_script, instance_log, cleanup_pids, subreaper):
    pidfile = tmp_path / "pids"
    child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"],
                        base_env(T_SETSID="1", T_IGNORE_TERM="1"), log=instance_log)
    stats = await wait_for_pids(pidfile, 3)
    cleanup_pids.extend(stats.values())
    escapee = stats[0]
    deadline = time.monotonic() + 30
    while proctree.read_stat(escapee.pid).sid != escapee.pid and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    now = proctree.read_stat(escapee.pid)
    assert now.sid == escapee.pid and now.pgid == escapee.pid != child.pid  # really left the group
    report = await stop_tree(child, 1.0)
    assert report.escaped == [escapee.pid]
    assert escapee.pid in report.killed
    assert_gone(stats.values(), strictly=True)


async def test_orphaned_setsid_escapee_is_found_by_its_token(tmp_path, tree_script, instance_log, cleanup_pids):
    # Generation 1 exits right after starting generation 0, which setsid()s: no parent link, no
    # group, no session ties it to the leader any more, and init (not us) adopts it.
    pidfile = tmp_path / "pids"
    child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"],
                        base_env(T_SETSID="1", T_EXIT="1"), log=instance_log)
    stats = await wait_for_pids(pidfile, 3)
    cleanup_pids.extend(stats.values())
    escapee = stats[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = proctree.read_stat(escapee.pid)
        if now.sid == escapee.pid and now.ppid != stats[1].pid:
            break
        await asyncio.sleep(0.05)
    assert now.sid == escapee.pid and now.ppid not in (stats[1].pid, child.pid)
    assert escapee.pid in tree_pids(child)
    report = await stop_tree(child, 5)
    assert escapee.pid in report.escaped
    assert_gone([stats[2], escapee], strictly=False)


async def test_stop_tree_on_a_leader_that_exited_by_itself(tmp_path, instance_log):
    child = await spawn([sys.executable, "-c", "raise SystemExit(3)"], base_env(), log=instance_log)
    assert await asyncio.wait_for(child.wait(), 30) == 3
    report = await stop_tree(child, 5)
    assert report.exit_status == 3 and report.graceful and report.killed == []


# -- /dev/shm --------------------------------------------------------------------------------


def _make_shm(directory: Path, name: str, size: int = 1 << 16) -> Path:
    path = directory / name
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize("where", ["tmp", "dev-shm"])
async def test_shm_files_of_the_killed_tree_are_removed_and_others_kept(tmp_path, tree_script, instance_log, cleanup_pids, subreaper, where):
    directory = tmp_path / "shm" if where == "tmp" else Path("/dev/shm")
    if where == "dev-shm" and not directory.is_dir():
        pytest.skip("no /dev/shm here")
    directory.mkdir(exist_ok=True)
    tag = secrets.token_hex(4)
    mapped = _make_shm(directory, f"psm_vsuptest_{tag}_tree")
    opened = _make_shm(directory, f"sem.mp-vsuptest_{tag}_tree", 32)
    foreign = _make_shm(directory, f"psm_vsuptest_{tag}_foreign")
    idle = _make_shm(directory, f"psm_vsuptest_{tag}_idle")
    holder = subprocess.Popen(  # an unrelated live process holding its own segment
        [sys.executable, "-c", "import mmap,sys,time; f=open(sys.argv[1],'r+b'); m=mmap.mmap(f.fileno(),0); print('ok',flush=True); time.sleep(600)", str(foreign)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"ok\n"
        pidfile = tmp_path / "pids"
        child = await spawn([sys.executable, str(tree_script), str(pidfile), "1"],
                            base_env(T_SHM=f"{mapped},{opened}", T_IGNORE_TERM="1"), log=instance_log)
        stats = await wait_for_pids(pidfile, 2)
        cleanup_pids.extend(stats.values())
        report = await stop_tree(child, 0.5, shm_dir=directory)  # SIGKILL: nothing cleans up itself
        assert sorted(report.shm_removed) == sorted([str(mapped), str(opened)])
        assert not mapped.exists() and not opened.exists()
        assert foreign.exists() and idle.exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        for path in (mapped, opened, foreign, idle):
            path.unlink(missing_ok=True)


async def test_shm_seen_earlier_is_removed_when_the_tree_died_on_its_own(tmp_path, tree_script, instance_log, cleanup_pids, subreaper):
    directory = tmp_path / "shm"
    directory.mkdir()
    mapped = _make_shm(directory, "psm_gone")
    opened = _make_shm(directory, "sem.mp-gone", 32)
    pidfile = tmp_path / "pids"
    child = await spawn([sys.executable, str(tree_script), str(pidfile), "1"],
                        base_env(T_SHM=f"{mapped},{opened}"), log=instance_log)
    stats = await wait_for_pids(pidfile, 2)
    cleanup_pids.extend(stats.values())
    tree_pids(child, shm_dir=directory)  # e.g. the placement check once ready
    for st in stats.values():  # the whole tree dies without our help (say, the OOM killer)
        proctree.signal_exact(st, signal.SIGKILL)
    await asyncio.wait_for(child.wait(), 30)
    assert await proctree.wait_gone(stats.values(), 30) == []
    report = await stop_tree(child, 5, shm_dir=directory)
    assert report.killed == [] and sorted(report.shm_removed) == sorted([str(mapped), str(opened)])
    assert list(directory.iterdir()) == []


async def test_fake_vllm_tree_killed_with_leader_first(tmp_path, instance_log, cleanup_pids, subreaper):
    """The fake vLLM server (EngineCore + Worker stand-ins, /dev/shm files): kill -9 of the API
    server, then stop_tree removes the orphans and their shared memory."""
    fixtures = pytest.importorskip("tests.fakevllm.fixtures")
    port = fixtures.free_port()
    argv = [*fixtures.fake_command(), "fake-model", "--host", "127.0.0.1", "--port", str(port)]
    child = await spawn(argv, base_env(FAKE_VLLM_START_DELAY="0"), log=instance_log)
    record = None
    deadline = time.monotonic() + 60
    while record is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        text = (tmp_path / "logs" / "i0.log").read_text()
        records = fixtures.start_records(text)
        record = records[0] if records else None
    assert record is not None, "the fake server never printed its start record"
    while len(tree_pids(child)) < 3 and time.monotonic() < deadline:  # server, EngineCore, Worker
        await asyncio.sleep(0.1)
    stats = [proctree.read_stat(pid) for pid in tree_pids(child)]
    cleanup_pids.extend(stats)
    assert len(stats) == 3 and record["engine_pid"] in {st.pid for st in stats}
    shm_paths = record["shm"]
    assert shm_paths and all(os.path.exists(p) for p in shm_paths)
    try:
        os.kill(child.pid, signal.SIGKILL)
        await asyncio.wait_for(child.wait(), 30)
        survivors = [st for st in stats if proctree.alive(st)]
        assert len(survivors) == 2, "EngineCore and Worker outlive a SIGKILLed API server"
        report = await stop_tree(child, 5)
        assert_gone(stats, strictly=True)
        assert sorted(report.shm_removed) == sorted(shm_paths)
        assert not any(os.path.exists(p) for p in shm_paths)
    finally:
        for path in shm_paths:
            Path(path).unlink(missing_ok=True)


async def test_the_rest_of_a_tree_whose_api_server_died_is_gone_within_2_s_whatever_the_stop_timeout(
        tmp_path, instance_log, cleanup_pids, subreaper):
    """vLLM's EngineCore and Worker outlive a SIGKILLed API server; with nothing left to drain they
    get ORPHAN_GRACE, not stop.timeout: here they even ignore SIGTERM (the slowest case), and
    stop.timeout is 30 s."""
    fixtures = pytest.importorskip("tests.fakevllm.fixtures")
    argv = [*fixtures.fake_command(), "fake-model", "--host", "127.0.0.1", "--port", str(fixtures.free_port())]
    child = await spawn(argv, base_env(FAKE_VLLM_IGNORE_SIGTERM="1"), log=instance_log)
    log = tmp_path / "logs" / "i0.log"
    deadline = time.monotonic() + 60
    # it binds after the EngineCore handshake, which comes once EngineCore and Worker ignore SIGTERM
    while "Application startup complete" not in log.read_text() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    stats = [proctree.read_stat(pid) for pid in tree_pids(child)]
    cleanup_pids.extend(stats)
    assert len(stats) == 3
    shm_paths = fixtures.start_records(log.read_text())[0]["shm"]
    try:
        os.kill(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.wait_for(child.wait(), 30)
        report = await stop_tree(child, 30.0)
        took = time.monotonic() - killed_at
        assert_gone(stats, strictly=True)
        assert sorted(report.killed) == sorted(st.pid for st in stats if st.pid != child.pid)  # they ignored SIGTERM
        assert report.duration < 2.0 and took < 2.5, (report.duration, took)  # ORPHAN_GRACE (1 s), then SIGKILL
        assert sorted(report.shm_removed) == sorted(shm_paths)
    finally:
        for path in shm_paths:
            Path(path).unlink(missing_ok=True)


async def test_reap_orphans_reaps_adopted_zombies_of_a_running_instance(tmp_path, tree_script, instance_log, cleanup_pids, subreaper):
    # Generation 1 exits; generation 0 is adopted by us and then killed by the test: a zombie of
    # ours until reap_orphans() collects it, while the instance (the leader) keeps running.
    pidfile = tmp_path / "pids"
    child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"], base_env(T_EXIT="1"), log=instance_log)
    stats = await wait_for_pids(pidfile, 3)
    cleanup_pids.extend(stats.values())
    deadline = time.monotonic() + 30
    while proctree.read_stat(stats[0].pid).ppid != os.getpid() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    os.kill(stats[0].pid, signal.SIGKILL)
    while not proctree.read_stat(stats[0].pid).zombie and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert stats[0].pid in reap_orphans()
    assert proctree.read_stat(stats[0].pid) is None
    assert child.returncode is None  # the leader is asyncio's to reap, and still running
    await stop_tree(child, 5)


def test_uvloop_kill_9_of_the_leader(tmp_path, tree_script, cleanup_pids):
    uvloop = pytest.importorskip("uvloop")

    async def scenario():
        log = InstanceLog("i0", None, max_bytes=1 << 20, backups=0, echo=False, logger=logging.getLogger("t"))
        pidfile = tmp_path / "pids"
        child = await spawn([sys.executable, str(tree_script), str(pidfile), "2"], base_env(), log=log)
        stats = await wait_for_pids(pidfile, 3)
        cleanup_pids.extend(stats.values())
        assert os.getsid(child.pid) == os.getpgid(child.pid) == child.pid  # start_new_session under uvloop too
        os.kill(child.pid, signal.SIGKILL)
        assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGKILL
        await stop_tree(child, 5)
        assert_gone(stats.values(), strictly=False)
        with pytest.raises(VsupError, match="program not found"):
            await spawn(["no-such-vllm-binary"], {"PATH": "/nowhere"}, log=log)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())



@pytest.mark.parametrize("where", ["tmp", "dev-shm"])
def test_sweep_stale_shm_removes_only_old_unused_files_of_ours(tmp_path, where):
    directory = tmp_path if where == "tmp" else Path("/dev/shm")
    if not directory.is_dir():
        pytest.skip("no /dev/shm here")
    tag = f"psm_vsuptest_{secrets.token_hex(4)}_"  # a prefix nobody else uses: other tests share /dev/shm
    old_unused = _make_shm(directory, tag + "old_unused")
    old_in_use = _make_shm(directory, tag + "old_in_use")
    fresh = _make_shm(directory, tag + "fresh")
    other_prefix = _make_shm(directory, "vsuptest_" + secrets.token_hex(4))
    hour_ago = time.time() - 3600
    for path in (old_unused, old_in_use, other_prefix):
        os.utime(path, (hour_ago, hour_ago))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import mmap,sys,time; f=open(sys.argv[1],'r+b'); m=mmap.mmap(f.fileno(),0); f.close(); print('ok',flush=True); time.sleep(600)", str(old_in_use)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"ok\n"
        removed = sweep_stale_shm(directory, prefixes=(tag, "vsuptest_never_"), min_age=60)
        assert removed == [str(old_unused)]
        assert old_in_use.exists() and fresh.exists() and other_prefix.exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        for path in (old_unused, old_in_use, fresh, other_prefix):
            path.unlink(missing_ok=True)


def test_sweep_keeps_a_semaphore_whose_creator_maps_it_under_its_first_name():
    """glibc's sem_open makes a semaphore under a temporary name, maps it, then links it to its
    real name and unlinks the first: its creator's /proc/<pid>/maps shows `sem.XXXXXX (deleted)`,
    never `sem.mp-…`. A starting vLLM's multiprocessing (spawn) creates such semaphores before the
    children that open them by name exist; on a loaded box that takes more than the sweep's minute,
    and a sweep that read names only deleted a live semaphore (the Worker then died rebuilding it).
    The sweep matches the file's inode against every mapping under /dev/shm, deleted names too."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    creator = subprocess.Popen(
        [sys.executable, "-c", "import multiprocessing as mp, time\n"
         "lock = mp.get_context('spawn').Lock()\n"
         "print(lock._semlock.name, flush=True)\n"
         "time.sleep(600)\n"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        name = creator.stdout.readline().decode().strip()
        assert name.startswith("/mp-"), name
        path = Path("/dev/shm") / ("sem." + name[1:])
        assert path.exists()
        hour_ago = time.time() - 3600
        os.utime(path, (hour_ago, hour_ago))
        removed = sweep_stale_shm(prefixes=("sem." + name[1:],), min_age=60)
        assert removed == [] and path.exists()
    finally:
        creator.kill()
        creator.wait()
        creator.stdout.close()
    # once its creator is gone, the same file is stale: the sweep removes it (the resource tracker may have first)
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        if sweep_stale_shm(prefixes=("sem." + name[1:],), min_age=60) == [str(path)]:
            break
        time.sleep(0.2)
    assert not path.exists()
