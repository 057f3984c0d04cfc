"""Who listens at an instance's address: only the instance's own process tree may answer for it.

While an instance restarts its address is free. Over TCP (vllm.listen: tcp) any local user can
bind the port in that window and answer /health; before an instance is marked ready vsup checks
that every socket listening on its port is one of its tree's open files (the socket inodes of
/proc/net/tcp and tcp6 against the `socket:[inode]` links in /proc/<pid>/fd), and names the
holder otherwise. A Unix socket (the default) lives in vsup's private directory, which nobody else
can enter; `check_socket` still makes sure the path is a socket of ours before it is probed, and
`clear_socket` removes the socket a dead instance left there (vLLM's bind fails on an existing path).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vsup.errors import VsupError

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
PROC_NET = ("net/tcp", "net/tcp6")


@dataclass(frozen=True)
class Listening:
    port: int
    uid: int
    inode: int


def parse_proc_net_tcp(text: str) -> list[Listening]:
    """The listening sockets of one /proc/net/tcp or tcp6 table (header line skipped; lines that
    do not parse are too: the kernel's format, not user input)."""
    found = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
        if len(fields) < 10 or fields[3] != LISTEN or ":" not in fields[1]:
            continue
        try:
            found.append(Listening(int(fields[1].rsplit(":", 1)[1], 16), int(fields[7]), int(fields[9])))
        except ValueError:
            continue
    return found


def listeners_on(port: int, proc: Path = Path("/proc")) -> list[Listening]:
    """Every socket listening on TCP `port` (any local address, IPv4 and IPv6) in our network namespace."""
    found = []
    for table in PROC_NET:
        try:
            text = (proc / table).read_text()
        except OSError:
            continue
        found += [entry for entry in parse_proc_net_tcp(text) if entry.port == port]
    return found


def socket_inodes(pids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """inode -> pid of the sockets these processes hold open (processes that are gone are skipped)."""
    held: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(proc / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(proc / str(pid) / "fd" / fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                held.setdefault(int(link[8:-1]), pid)
    return held


def holder_of(inode: int, proc: Path = Path("/proc")) -> int | None:
    """The pid of a process that has the socket `inode` open, when we may look (root, or our own)."""
    needle = f"socket:[{inode}]"
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(proc / entry / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(proc / entry / "fd" / fd) == needle:
                    return int(entry)
            except OSError:
                continue
    return None


def _command(pid: int, proc: Path) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    text = " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
    text = "".join(ch if ch.isprintable() else "?" for ch in text)  # another user's words in our log
    return text if len(text) <= 60 else f"{text[:59]}…"


def check_port(port: int, tree: Iterable[int], who: str, proc: Path = Path("/proc")) -> str | None:
    """None when something listens on `port` and every listener is a socket of the `tree` pids;
    else why not, naming the holder ("port 8100 is held by pid 1234 (uid 65534, python3 …), not by
    instance 0's process tree; not routing to it")."""
    listeners = listeners_on(port, proc)
    if not listeners:
        return f"nothing listens on port {port} (the answer came from a process that is gone); not routing to it"
    ours = socket_inodes(tree, proc)
    for entry in listeners:
        if entry.inode in ours:
            continue
        pid = holder_of(entry.inode, proc)
        holder = (f"pid {pid} (uid {entry.uid}, {_command(pid, proc)})" if pid is not None
                  else f"uid {entry.uid} (its process is not visible to vsup)")
        return f"port {port} is held by {holder}, not by {who}'s process tree; not routing to it"
    return None


def check_socket(path: str) -> str | None:
    """None when `path` is a Unix socket owned by our uid; else why not."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror} (the instance's socket is not there); not routing to it"
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        return (f"{path} is not a socket of uid {os.getuid()} (mode {stat.filemode(info.st_mode)}, uid {info.st_uid}); "
                "not routing to it")
    return None


def clear_socket(path: str) -> None:
    """Remove the socket a dead instance left at `path` (vLLM refuses to bind over it); a file of
    any other type there is not ours to remove: VsupError naming it."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise VsupError(f"{path} exists and is not a socket of ours (mode {stat.filemode(info.st_mode)}, uid {info.st_uid}); "
                        "remove it or point TMPDIR/RUNTIME_DIRECTORY elsewhere")
    os.unlink(path)
