"""Start an instance process with its output drained into an InstanceLog; stop its whole tree.

(Just over 400 lines for a reason: spawn and stop_tree share the Child and its output protocol;
finding the tree is proctree.py, /dev/shm is shm.py, the OOM verdict is oomkill.py.)

`spawn` runs the command in a new session (its pid is its process group and session id), stdin
from /dev/null, stdout/stderr read by a protocol as the bytes arrive: nothing ever buffers in a
pipe, whatever the child writes. It uses loop.subprocess_exec (what asyncio.create_subprocess_exec
wraps) with its own protocol because asyncio's Process.wait() returns only once the pipes close
too, and a SIGKILLed vLLM API server's orphaned EngineCore keeps them open: `Child.wait()` returns
when the leader itself exits.

The leader dies with vsup: it gets SIGTERM when vsup ends, even by SIGKILL (PR_SET_PDEATHSIG), and
vLLM then stops its EngineCore and Worker itself. The signal must be set in the child between
fork and exec, and never with preexec_fn (Python code in the forked child of a threaded process
can deadlock), so the child first runs `_EXEC_SHIM` with vsup's interpreter: it sets the signal,
checks that vsup did not die before that, and execs the command (same pid), reporting an exec
failure through a pipe as subprocess does. PR_SET_PDEATHSIG follows the *thread* that forked the
child, not the process: spawn runs on the main thread (the event loop's), which lives as long as
vsup, and refuses to run on another.

`stop_tree`: SIGTERM to the group (and to members that left it), `timeout` seconds of grace for
all of them (`ORPHAN_GRACE` when the leader is already dead: nothing of the tree can drain any
more), SIGKILL for what is left (again for anything forked meanwhile), reap the orphans
handed to us, then remove the /dev/shm files the tree had mapped or open and Intel OpenMP's files
named after its pids (shm.py). It works as well when
the leader is already dead. See docs/processes.md.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from vsup.errors import VsupError
from vsup.supervisor import oomkill, proctree, shm
from vsup.supervisor.logs import InstanceLog, LineSplitter
from vsup.supervisor.phases import OutputReader
from vsup.supervisor.proctree import become_subreaper  # noqa: F401 (re-exported)
from vsup.supervisor.shm import sweep_stale_shm  # noqa: F401 (re-exported)
from vsup.topology.fsroot import FsRoot

logger = logging.getLogger("vsup.processes")

KILL_WAIT = 5.0  # seconds to wait for SIGKILLed processes to disappear (D state can delay it)
# SIGTERM's grace for the rest of a tree whose leader (the API server) is already dead: nothing of
# it serves or drains any more (vLLM's EngineCore and Worker lose their only client with it), so
# waiting stop.timeout for them only keeps their memory and cores from the next start.
ORPHAN_GRACE = 1.0
OUTPUT_WAIT = 2.0  # seconds to wait for the last output after the tree is gone
_STREAMS = {1: "stdout", 2: "stderr"}


class _OutputProtocol(asyncio.SubprocessProtocol):
    """Feeds pipe bytes to the log as lines; resolves `exited` when the leader exits, `closed`
    when both pipes reached EOF (which needs every process holding them to be gone)."""

    def __init__(self, log: InstanceLog, loop: asyncio.AbstractEventLoop) -> None:
        self.log = log
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._splitters = {fd: LineSplitter() for fd in _STREAMS}
        self._open = set(_STREAMS)
        self._log_failed = False
        self.reader = OutputReader()  # where a start is, from the same lines (phases.py)
        self._reader_failed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._write(fd, self._splitters[fd].feed(data))

    def pipe_connection_lost(self, fd: int, exc) -> None:
        self._write(fd, self._splitters[fd].flush())
        self._open.discard(fd)
        if not self._open and not self.closed.done():
            self.closed.set_result(None)

    def process_exited(self) -> None:
        code = self.transport.get_returncode() if self.transport is not None else None
        if not self.exited.done() and code is not None:  # asyncio calls this after connection_made, with the status known
            self.exited.set_result(code)

    def _write(self, fd: int, lines: list[str]) -> None:
        if not lines:
            return
        try:
            self.reader.feed(lines)
        except Exception:  # a parser bug must not stop the draining either
            if not self._reader_failed:
                self._reader_failed = True
                logger.exception("[%s] reading the start phase from the output failed; the phase stays as it was", self.log.name)
        try:
            self.log.lines(_STREAMS[fd], lines)
        except Exception:  # a broken log must never stop the draining (the child would block)
            if not self._log_failed:
                self._log_failed = True
                logger.exception("[%s] writing instance output failed; output is dropped", self.log.name)


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class TreeWork:
    """CPU time and bytes read by a tree so far, from readings of its processes (`tree_work`): each
    process adds its growth since its previous reading (one first seen adds all it did: the tree
    started it), so the sums only grow, whatever processes come and go."""

    def __init__(self) -> None:
        self.cpu_seconds = 0.0
        self.rchar: int | None = None  # None until a process's /proc/<pid>/io could be read
        self.read_bytes: int | None = None
        self._last: dict[tuple[int, int], proctree.Counters] = {}

    def add(self, readings: dict[tuple[int, int], proctree.Counters]) -> None:
        """`readings`: (pid, start time) -> that process's counters now."""
        for key, now in readings.items():
            before = self._last.get(key, proctree.Counters(0.0, 0, 0))
            self.cpu_seconds += max(0.0, now.cpu_seconds - before.cpu_seconds)
            if now.rchar is not None:
                self.rchar = (self.rchar or 0) + max(0, now.rchar - (before.rchar or 0))
            if now.read_bytes is not None:
                self.read_bytes = (self.read_bytes or 0) + max(0, now.read_bytes - (before.read_bytes or 0))
        self._last = dict(readings)  # the gone ones keep what they added


def tree_work(leader: int, token: str, known: dict[int, int]) -> tuple[dict[int, int], dict[tuple[int, int], proctree.Counters]]:
    """(pid -> start time of the tree's live processes, (pid, start time) -> their counters).
    Touches nothing but /proc, so it may run in a thread."""
    tree = proctree.find_tree(leader, token=token or None, known=known)
    readings = {}
    for pid, st in tree.items():
        counters = proctree.read_counters(pid)
        if counters is not None:
            readings[(pid, st.start)] = counters
    return {pid: st.start for pid, st in tree.items()}, readings


@dataclass
class Child:
    """One started instance process (the API server; its tree hangs below it)."""

    pid: int  # == its process group id and session id
    argv: list[str]
    started_at: float  # time.monotonic()
    token: str = ""  # VSUP_TREE=<token> in the environment of every process of the tree
    seen: dict[int, int] = field(default_factory=dict)  # pid -> start time of tree members seen so far
    shm_seen: set[str] = field(default_factory=set)  # /dev/shm files the tree was seen using
    oom_before: oomkill.OomCounts | None = None  # the OOM-kill counters when it started
    work: TreeWork = field(default_factory=TreeWork)  # CPU time and bytes read by its tree so far
    _protocol: _OutputProtocol = field(repr=False, kw_only=True)  # only spawn() makes a Child

    @property
    def output(self) -> OutputReader:
        """What its output has said (the start phase, phases.py)."""
        return self._protocol.reader

    def sigkill_cause(self) -> str:
        """After the leader died of SIGKILL: the kernel's OOM killer, or someone else (oomkill.py)."""
        return oomkill.sigkill_cause(FsRoot("/"), self.pid, self.oom_before)

    @property
    def returncode(self) -> int | None:
        exited = self._protocol.exited
        return exited.result() if exited.done() else None

    async def wait(self) -> int:
        """Exit status of the leader; negative = killed by that signal. Cancelling a waiter is safe."""
        return await asyncio.shield(self._protocol.exited)

    async def output_closed(self, timeout: float | None = None) -> bool:
        """Wait until every process holding stdout/stderr is gone and the last line is logged."""
        try:
            await asyncio.wait_for(asyncio.shield(self._protocol.closed), timeout)
            return True
        except asyncio.TimeoutError:
            return False


# Children not yet fully stopped: their sessions mark the orphans reap_orphans() may reap.
_active: dict[int, Child] = {}


def _path_of(env: dict[str, str]) -> str:
    return env.get("PATH", os.defpath)


# argv: vsup's pid, the signal, the error pipe's fd, the command. Exit 127 after an exec failure
# (its errno went up the pipe), 1 when vsup was gone before the signal was set.
_EXEC_SHIM = """\
import ctypes, os, sys
parent, sig, report = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.set_inheritable(report, False)
ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    os._exit(1)
try:
    os.execvp(sys.argv[4], sys.argv[4:])
except OSError as exc:
    os.write(report, str(exc.errno).encode())
    os._exit(127)
"""
DEATH_SIGNAL = signal.SIGTERM  # what an instance leader gets when vsup dies: vLLM stops its tree on it


def _cannot_start(argv: list[str], env: dict[str, str], code: int, strerror: str | None = None) -> VsupError:
    if code == errno.ENOENT:
        where = "" if "/" in argv[0] else f" on PATH ({_path_of(env)})"
        return VsupError(
            f"cannot start {argv[0]!r}: program not found{where}; install it or give its full path "
            "(vllm.command, or the numactl/taskset launcher of the plan)"
        )
    if code == errno.EACCES:
        return VsupError(f"cannot start {argv[0]!r}: permission denied; make it executable (chmod +x) or fix vllm.command")
    # e.g. ENOEXEC: a script without a #! line
    return VsupError(f"cannot start {argv[0]!r}: {strerror or os.strerror(code)}; check vllm.command")


async def _read_until_eof(fd: int) -> bytes:
    """Everything written to the pipe `fd` until its last writer closes it; closes `fd`."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    data = bytearray()
    eof: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        if chunk:
            data.extend(chunk)
        elif not eof.done():
            eof.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await eof
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return bytes(data)


async def spawn(argv: list[str], env: dict[str, str], *, log: InstanceLog, cwd: str | None = None) -> Child:
    """Start argv in a new session with stdout/stderr drained into `log`; the leader gets
    DEATH_SIGNAL when vsup dies. Runs on the main thread only (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("spawn() runs on the main thread only: PR_SET_PDEATHSIG would stop the child "
                           "when the thread that started it ends")
    if not argv or not argv[0]:
        raise VsupError("cannot start an instance: the command is empty; set vllm.command (default: vllm serve)")
    if cwd is not None and not os.path.isdir(cwd):
        raise VsupError(f"cannot start {argv[0]!r}: working directory {cwd!r} does not exist")
    token = proctree.new_token()  # which vsup started it, and which start
    child_env = dict(env)
    child_env[proctree.TOKEN_VAR] = token
    loop = asyncio.get_running_loop()
    report_r, report_w = os.pipe()  # both close-on-exec; the child's copy is passed explicitly
    shim = [sys.executable, "-I", "-S", "-c", _EXEC_SHIM, str(os.getpid()), str(int(DEATH_SIGNAL)), str(report_w)]
    try:
        transport, protocol = await loop.subprocess_exec(
            lambda: _OutputProtocol(log, loop),
            *shim, *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env,
            cwd=cwd,
            pass_fds=(report_w,),
            start_new_session=True,  # never preexec_fn: not fork-safe with threads
        )
    except OSError as exc:
        os.close(report_r)
        raise _cannot_start(argv, child_env, exc.errno or 0, exc.strerror) from None
    finally:
        os.close(report_w)
    report = await _read_until_eof(report_r)  # empty: the exec went through
    if report:
        await protocol.exited  # it exits right after writing; reaped by the loop's child watcher
        transport.close()
        raise _cannot_start(argv, child_env, int(report))
    pid = transport.get_pid()
    child = Child(
        pid=pid,
        argv=list(argv),
        started_at=time.monotonic(),
        token=token,
        oom_before=oomkill.read_counts(FsRoot("/"), pid),
        _protocol=protocol,
    )
    _active[child.pid] = child
    log.note(f"started pid {child.pid}: {' '.join(argv)}")
    return child


def _look(child: Child) -> dict[int, proctree.ProcStat]:
    tree = proctree.find_tree(child.pid, token=child.token, known=child.seen)
    for pid, st in tree.items():
        child.seen[pid] = st.start
    return tree


def tree_pids(child: Child, *, shm_dir: str | Path = shm.SHM_DIR) -> list[int]:
    """Leader (while alive) + live descendants + live members of its session/group + processes
    carrying its token. Each one is remembered, and so are the /dev/shm files they use: a later
    stop_tree finds an escaped process, and removes the files even if the whole tree died alone
    (call this once the instance is ready, e.g. for the placement check)."""
    tree = _look(child)
    child.shm_seen |= shm.files_in_use(tree, shm_dir)
    return sorted(tree)


def tree_rss(leader: int, token: str, known: dict[int, int]) -> tuple[dict[int, int], int]:
    """(pid -> start time of the tree's live processes, the sum of their resident memory in bytes).
    Pages the processes share (vLLM's shared memory) count once per process that maps them: an
    upper bound. Touches nothing but /proc, so it may run in a thread."""
    tree = proctree.find_tree(leader, token=token or None, known=known)
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * PAGE_SIZE  # the second field: resident pages
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return {pid: st.start for pid, st in tree.items()}, total


@dataclass
class StopReport:
    graceful: bool  # everything exited within the SIGTERM grace
    exit_status: int | None  # the leader's (negative = signal); None if it could not be reaped
    killed: list[int]  # pids that needed SIGKILL
    escaped: list[int]  # tree members outside the leader's process group (setsid/setpgid)
    shm_removed: list[str]  # /dev/shm files of the tree deleted after it was gone
    duration: float
    survivors: list[int] = field(default_factory=list)  # still alive after SIGKILL (uninterruptible sleep)
    reaped: list[int] = field(default_factory=list)  # orphans reaped by this process (subreaper / init)


async def stop_tree(child: Child, timeout: float, *, shm_dir: str | Path = shm.SHM_DIR) -> StopReport:
    """Stop the instance's whole tree; safe when the leader has already exited (what is left of the
    tree then gets ORPHAN_GRACE of `timeout`: it is gone within about a second and a half)."""
    began = time.monotonic()
    leader = child.pid
    escaped: set[int] = set()
    shm_files = set(child.shm_seen)
    if child.returncode is not None:
        timeout = min(timeout, ORPHAN_GRACE)

    def note(found: dict[int, proctree.ProcStat]) -> None:
        # before they are signalled: /dev/shm names carry no pid
        escaped.update(pid for pid, st in found.items() if st.pgid != leader)
        shm_files.update(shm.files_in_use(found, shm_dir))

    # SIGTERM: the group, plus members that left it; then grace for all of them (again for any
    # forked during shutdown).
    deadline = began + timeout
    found = _look(child)
    while True:
        note(found)
        proctree.signal_group(leader, signal.SIGTERM)
        for st in found.values():
            if st.pgid != leader:
                proctree.signal_exact(st, signal.SIGTERM)
        left = await proctree.wait_gone(found.values(), max(0.0, deadline - time.monotonic()))
        if left or time.monotonic() >= deadline:
            break
        found = _look(child)
        if not found:
            break
    graceful = not left

    # SIGKILL whatever is still there, looking again each round for anything forked meanwhile.
    killed: set[int] = set()
    survivors: list[proctree.ProcStat] = []
    for _ in range(3):
        live = {st.pid: st for st in left if proctree.alive(st)}
        live.update(_look(child))
        if not live:
            break
        note(live)
        graceful = False
        proctree.signal_group(leader, signal.SIGKILL)
        for st in live.values():
            proctree.signal_exact(st, signal.SIGKILL)
        killed |= set(live)
        survivors = await proctree.wait_gone(live.values(), KILL_WAIT)
        left = survivors

    # The leader's status comes from asyncio's watcher; orphans handed to us are reaped by pid.
    try:
        exit_status = await asyncio.wait_for(child.wait(), KILL_WAIT)
    except asyncio.TimeoutError:
        exit_status = None
    reaped = proctree.reap_zombies(_still_seen(child) | _zombie_orphans({leader}), exclude=[leader])
    if not await child.output_closed(OUTPUT_WAIT):
        logger.warning("pid %d: its output pipes are still held open after the tree was stopped", leader)
    if child._protocol.transport is not None:  # pipes and transport; the leader is reaped, nothing is killed
        child._protocol.transport.close()
    shm_removed = shm.remove_unused(shm_files, shm_dir) + shm.remove_openmp_files(child.seen, shm_dir)
    if not survivors:
        _active.pop(leader, None)
    report = StopReport(
        graceful=graceful,
        exit_status=exit_status,
        killed=sorted(killed),
        escaped=sorted(escaped),
        shm_removed=shm_removed,
        duration=time.monotonic() - began,
        survivors=sorted(st.pid for st in survivors),
        reaped=reaped,
    )
    if report.survivors:
        logger.error("pid %d: processes %s survived SIGKILL (uninterruptible sleep?)", leader, report.survivors)
    child._protocol.log.note(_describe(report))
    return report


def _describe(report: StopReport) -> str:
    how = "after SIGTERM" if report.graceful else f"after SIGKILL of {report.killed}"
    status = "not reaped" if report.exit_status is None else (
        f"signal {-report.exit_status}" if report.exit_status < 0 else f"exit code {report.exit_status}")
    parts = [f"stopped {how} in {report.duration:.1f}s, leader {status}"]
    if report.escaped:
        parts.append(f"swept escaped {report.escaped}")
    if report.shm_removed:
        parts.append(f"removed {len(report.shm_removed)} /dev/shm files")
    return "; ".join(parts)


def _still_seen(child: Child) -> set[int]:
    """Pids seen in the tree that still belong to the same processes (a reused pid never does)."""
    return {pid for pid, start in child.seen.items() if (st := proctree.read_stat(pid)) is not None and st.start == start}


def _zombie_orphans(sessions: set[int]) -> set[int]:
    """Zombie children of ours from these sessions/groups (orphans we were handed, seen or not)."""
    me = os.getpid()
    return {
        pid for pid, st in proctree.scan().items()
        if st.zombie and st.ppid == me and (st.sid in sessions or st.pgid in sessions)
    }


def reap_orphans() -> list[int]:
    """Reap zombie orphans of our instances that were handed to this process (it is a subreaper
    or pid 1). Cheap; the supervisor may call it now and then. Never touches the leaders, whose
    status belongs to asyncio's child watcher."""
    if not _active:
        return []
    sessions = set(_active)
    candidates = _zombie_orphans(sessions)
    for child in _active.values():
        candidates |= _still_seen(child)
    return proctree.reap_zombies(candidates, exclude=sessions)
