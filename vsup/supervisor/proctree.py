"""Finding, signalling and reaping every process of one instance's tree, from /proc.

An instance's processes are found by four marks, because any one of them can be lost:
- process group and session == the leader's pid (start_new_session=True; vLLM's EngineCore and
  Worker stay in them, and they outlive a SIGKILLed leader: the ids do not go away while in use);
- `VSUP_TREE=<token>` in /proc/<pid>/environ (inherited by every descendant, even one that called
  setsid() and was then orphaned to init); the token is `<vsup pid>-<vsup start time>-<random>`,
  so it also names the vsup that started the tree (pid + start time: never a reused pid), which
  lets a later vsup tell the trees of a vsup that is gone (vsup/supervisor/leftovers.py);
- pids seen in an earlier look (pid + start time, so a reused pid is never mistaken);
- parent links: the descendants of all of the above.

Signals go through pidfds where the kernel has them, so a pid reused between looking and killing
is never hit. Nothing here calls waitpid(-1): asyncio's child watcher owns the leader's status.

Subreaper: init in containers and sandboxes often does not reap orphans (they stay zombies), and
the parent of an orphaned EngineCore is init, out of our reach. `become_subreaper()` makes vsup the
parent of its instances' orphans instead; `reap_zombies()` then reaps those (by pid, WNOHANG).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import secrets
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TOKEN_VAR = "VSUP_TREE"
POLL = 0.05  # seconds between looks while waiting for processes to go

_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat this module needs."""

    pid: int
    comm: str
    state: str  # R, S, D, Z (zombie), ...
    ppid: int
    pgid: int
    sid: int
    start: int  # start time in clock ticks since boot: with pid, the process's identity

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")


def read_stat(pid: int) -> ProcStat | None:
    """None when the process does not exist (any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # comm may contain spaces and parentheses: it runs from the first "(" to the last ")".
    head, _, rest = raw.rpartition(")")
    comm = head.partition("(")[2]
    fields = rest.split()
    try:
        return ProcStat(pid, comm, fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Counters:
    """What one process has done so far: CPU time, and bytes read (None where /proc/<pid>/io cannot
    be read)."""

    cpu_seconds: float  # user + system
    rchar: int | None  # read() and friends, from the page cache too
    read_bytes: int | None  # fetched from storage (mmap faults too)


def read_counters(pid: int) -> Counters | None:
    """None when the process does not exist (any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().decode("utf-8", "replace").rpartition(")")[2].split()
        cpu = (int(rest[11]) + int(rest[12])) / CLK_TCK  # utime, stime: fields 14 and 15
    except (OSError, IndexError, ValueError):
        return None
    io: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f.read().decode("ascii", "replace").splitlines():
                key, _, value = line.partition(":")
                if value.strip().isdigit():
                    io[key] = int(value)
    except OSError:
        pass  # another user's process, or a kernel without task I/O accounting
    return Counters(cpu, io.get("rchar"), io.get("read_bytes"))


def all_pids() -> list[int]:
    """The pid of every process on the machine (zombies included)."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def scan() -> dict[int, ProcStat]:
    """Every process on the machine (zombies included)."""
    return {pid: st for pid in all_pids() if (st := read_stat(pid)) is not None}


def _carries_token(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return needle in environ or environ.startswith(needle[1:])  # needle is "\0VAR=token\0"


def own_mark() -> str:
    """`<pid>-<start time>-` of this process: the start of every token it hands out."""
    me = os.getpid()
    st = read_stat(me)
    return f"{me}-{st.start if st else 0}-"


def new_token() -> str:
    """A token for one start of one instance of this vsup."""
    return own_mark() + secrets.token_hex(6)


def token_owner(token: str) -> tuple[int, int] | None:
    """(pid, start time) of the vsup that handed out `token`; None if it is not one of ours."""
    pid, _, rest = token.partition("-")
    start, _, _ = rest.partition("-")
    return (int(pid), int(start)) if pid.isdigit() and start.isdigit() else None


def is_running(pid: int, start: int) -> bool:
    """True while the process with this pid and start time exists and is not a zombie."""
    st = read_stat(pid)
    return st is not None and st.start == start and not st.zombie


def read_token(pid: int) -> str | None:
    """The VSUP_TREE token in the environment of `pid`, if it has one (and we may read it)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    key = TOKEN_VAR.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key):].decode("utf-8", "replace")
    return None


def find_marked(prefix: str) -> dict[int, ProcStat]:
    """Live processes of ours whose token starts with `prefix`, and all their descendants."""
    everything = scan()
    me, uid = os.getpid(), os.getuid()
    roots = {
        pid for pid, st in everything.items()
        if pid not in (1, me) and not st.zombie and _owned_by(pid, uid) and (read_token(pid) or "").startswith(prefix)
    }
    return _with_descendants(roots, everything)


def _with_descendants(roots: set[int], everything: dict[int, ProcStat]) -> dict[int, ProcStat]:
    me = os.getpid()
    children: dict[int, list[int]] = {}
    for pid, st in everything.items():
        children.setdefault(st.ppid, []).append(pid)
    tree: dict[int, ProcStat] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        found = everything.get(pid)
        if pid in tree or found is None or found.zombie or pid in (1, me):
            continue
        tree[pid] = found
        todo.extend(children.get(pid, ()))
    return tree


def find_tree(leader: int, *, token: str | None = None, known: Mapping[int, int] | None = None) -> dict[int, ProcStat]:
    """Live (not zombie) processes of the instance whose leader pid / group / session is `leader`.

    known: pid -> start time of processes seen before; they count while the same process lives.
    """
    everything = scan()
    me = os.getpid()
    uid = os.getuid()
    needle = f"\0{TOKEN_VAR}={token}\0".encode() if token else None
    roots: set[int] = set()
    for pid, st in everything.items():
        if pid in (1, me) or st.zombie:
            continue
        if pid == leader or st.pgid == leader or st.sid == leader:
            roots.add(pid)
        elif known and known.get(pid) == st.start:
            roots.add(pid)
        elif needle is not None and _owned_by(pid, uid) and _carries_token(pid, needle):
            roots.add(pid)
    return _with_descendants(roots, everything)


def _owned_by(pid: int, uid: int) -> bool:
    # Only our own processes can carry our token (root reads every environ: skip the others, fast).
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False


def alive(st: ProcStat) -> bool:
    """True while this very process (same start time) exists and is not a zombie."""
    return is_running(st.pid, st.start)


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False when the group has no member left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def signal_exact(st: ProcStat, sig: int) -> bool:
    """Signal this process only if it is still the one in `st` (no reused pid is ever hit)."""
    try:
        fd = os.pidfd_open(st.pid)
    except (AttributeError, OSError) as exc:
        if isinstance(exc, ProcessLookupError):
            return False
        return _signal_checked(st, sig)  # no pidfd support: the (tiny) check-then-kill window remains
    try:
        now = read_stat(st.pid)  # the pidfd now pins the process: if it is ours here, it stays ours
        if now is None or now.start != st.start:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    finally:
        os.close(fd)


def _signal_checked(st: ProcStat, sig: int) -> bool:
    now = read_stat(st.pid)
    if now is None or now.start != st.start:
        return False
    try:
        os.kill(st.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def wait_gone(procs: Iterable[ProcStat], timeout: float) -> list[ProcStat]:
    """Wait up to `timeout` s for the processes to exit (zombie counts as exited); returns those left."""
    left = [st for st in procs if alive(st)]
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        await asyncio.sleep(min(POLL, max(0.0, deadline - time.monotonic())))
        left = [st for st in left if alive(st)]
    return left


# -- subreaper and reaping ---------------------------------------------------------------------

def _prctl():
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl


def become_subreaper() -> bool:
    """Make this process the parent of its descendants' orphans (PR_SET_CHILD_SUBREAPER).
    False where the kernel refuses (not Linux); the caller then relies on init reaping them."""
    try:
        return _prctl()(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_being_subreaper() -> None:
    try:
        _prctl()(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def reap_zombies(candidates: Iterable[int], exclude: Iterable[int] = ()) -> list[int]:
    """Reap those of `candidates` that are zombie children of this process (orphans handed to us as
    subreaper or init), by pid with WNOHANG. `exclude`: pids whose status belongs to someone else
    (the leaders asyncio's child watcher waits for)."""
    me = os.getpid()
    skip = set(exclude)
    reaped = []
    for pid in set(candidates) - skip:
        st = read_stat(pid)
        if st is None or st.ppid != me or not st.zombie:
            continue
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            raise
        if done == pid:
            reaped.append(pid)
    return sorted(reaped)
