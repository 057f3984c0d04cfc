"""Was an instance that died of SIGKILL killed by the kernel's OOM killer, or by someone else?

Three readings, the most exact first:
- the kernel log (/dev/kmsg, root only): "Killed process <pid> (...)" names the victim;
- the instance's memory cgroup: `oom_kill` in memory.events (v2) or memory.oom_control (v1);
- /proc/vmstat `oom_kill`: every OOM kill on the machine since boot.
The counters are read when the instance starts (`OomCounts` via `read_counts`) and again after it
died (`sigkill_cause`): a count that moved means the OOM killer ran meanwhile. Everything is read
under a filesystem root (FsRoot), so the tests lay the kernel's files out in a directory.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import PurePosixPath

from vsup.topology.cgroup import read_mounts
from vsup.topology.fsroot import FsRoot

VMSTAT = "proc/vmstat"
KMSG = "dev/kmsg"
_KMSG_LIMIT = 4 << 20  # bytes of kernel log read at most (the ring buffer is far smaller)


@dataclass(frozen=True)
class OomCounts:
    vmstat: int | None  # /proc/vmstat oom_kill; None: unreadable
    cgroup: int | None  # the memory cgroup's oom_kill; None: no memory cgroup found
    cgroup_file: str | None  # where `cgroup` came from (absolute, as the kernel shows it)


def _field(text: str | None, name: str) -> int | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def memory_cgroup_file(fs: FsRoot, pid: int | str = "self") -> str | None:
    """The file with the OOM-kill count of `pid`'s memory cgroup, relative to the root."""
    v1 = v2 = None
    for line in (fs.read(f"proc/{pid}/cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    for mount in read_mounts(fs):
        if v1 is not None and mount.fstype == "cgroup" and "memory" in mount.options:
            path, name = v1, "memory.oom_control"
        elif v1 is None and v2 is not None and mount.fstype == "cgroup2":
            path, name = v2, "memory.events"
        else:
            continue
        inner = PurePosixPath(path)
        root = PurePosixPath(mount.root)
        rel = inner.relative_to(root) if inner == root or root in inner.parents else PurePosixPath(path.lstrip("/"))
        candidate = str(PurePosixPath(mount.point) / rel / name).lstrip("/")
        if fs.exists(candidate):
            return candidate
    return None


def read_counts(fs: FsRoot, pid: int | str = "self", cgroup_file: str | None = None) -> OomCounts:
    """The OOM-kill counters now; `cgroup_file` (from an earlier reading) when the process is gone."""
    where = cgroup_file or memory_cgroup_file(fs, pid)
    return OomCounts(_field(fs.read(VMSTAT), "oom_kill"), _field(fs.read(where), "oom_kill") if where else None, where)


def kernel_log_kill(fs: FsRoot, pid: int) -> tuple[bool, str | None]:
    """(whether the kernel log could be read, its record of the OOM killer killing `pid`)."""
    try:
        fd = os.open(fs.path(KMSG), os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False, None
    chunks, size = [], 0
    try:
        while size < _KMSG_LIMIT:
            try:
                chunk = os.read(fd, 8192)  # /dev/kmsg: one record per read
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on
                    continue
                break  # EAGAIN: the end
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    needle = f"Killed process {pid} ("
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        head, semicolon, text = line.partition(";")  # a record: "6,1234,5678,-;text"
        message = text if semicolon and "," in head and " " not in head else line
        if needle in message:
            return True, ", ".join(message.strip().split(", ")[:2])  # up to anon-rss: the rest is detail
    return True, None


UNKNOWN = "killed by SIGKILL (out of memory? check the memory plan)"


def sigkill_cause(fs: FsRoot, pid: int, before: OomCounts | None) -> str:
    """Who sent the SIGKILL that ended `pid`, in words, from the readings `before` (its start) and
    now. The instance's cgroup counter decides when there is one (the machine-wide count moves for
    any process's OOM kill); a readable kernel log that does not name `pid` rules the OOM killer out."""
    readable, logged = kernel_log_kill(fs, pid)
    if logged is not None:
        return f"killed by the kernel's OOM killer (kernel log: {logged})"
    if before is None:
        return UNKNOWN
    after = read_counts(fs, pid, before.cgroup_file)
    if before.cgroup is not None and after.cgroup is not None:
        old, new, where = before.cgroup, after.cgroup, f"/{before.cgroup_file}"
    elif before.vmstat is not None and after.vmstat is not None:
        old, new, where = before.vmstat, after.vmstat, "/proc/vmstat"
    else:
        return UNKNOWN
    if new > old and not readable:
        return f"killed by the kernel's OOM killer (oom_kill {old} -> {new} in {where}); check the memory plan"
    if new > old:
        return (f"killed by SIGKILL; the OOM killer ran meanwhile (oom_kill {old} -> {new} in {where}) "
                f"but the kernel log does not name pid {pid}")
    return f"killed by SIGKILL from outside vsup (not the OOM killer: oom_kill unchanged at {new} in {where})"
