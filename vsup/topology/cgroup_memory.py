"""The memory limit of the cgroup this process lives in (a container's or a pod's).

vLLM sizes nothing from it and the OOM killer enforces it, so the planner budgets from the smaller
of each node's MemTotal and this limit. Found the way vsup.topology.cgroup finds the cpuset:
1. the mounts: a cgroup v1 hierarchy with the memory controller (type "cgroup", option
   "memory"), else the cgroup v2 hierarchy whose cgroup.controllers offers memory;
2. the process's path in it (proc/self/cgroup: "N:...memory...:/path" for v1, "0::/path" v2);
3. the files: v2 memory.max ("max" = no limit), v1 memory.limit_in_bytes (a huge number = no
   limit). A limit holds for the whole subtree, so the effective one is the smallest found from
   the process's cgroup up to the mount point (a pod's limit sits on the pod's cgroup, the
   container's on its own).
No limit found means None."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from vsup.topology.cgroup import Mount, _relative, controller_paths, read_mounts
from vsup.topology.errors import TopologyError
from vsup.topology.fsroot import FsRoot

V2_FILE = "memory.max"
V1_FILE = "memory.limit_in_bytes"
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages);
# anything this large is no limit on any real machine.
UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int | None = None  # None: no limit found
    file: str | None = None  # the file that set it (for `vsup topology` sources)


def _limit_value(fs: FsRoot, rel: str) -> int | None:
    text = fs.read_nonblank(rel)
    if text is None or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        raise TopologyError(f"{fs.path(rel)}: {text[:40]!r}; expected a number of bytes or max") from None
    return None if value >= UNLIMITED or value < 0 else value


def _smallest_up(fs: FsRoot, mount: Mount, path: str, name: str) -> MemoryLimit:
    """The smallest limit in the process's cgroup and its ancestors up to the mount point."""
    point = PurePosixPath(mount.point)
    rel = _relative(path, mount.root)
    best = MemoryLimit()
    while True:
        file = str(point / rel / name)
        value = _limit_value(fs, file)
        if value is not None and (best.bytes is None or value < best.bytes):
            best = MemoryLimit(value, str(fs.path(file)))
        if rel == PurePosixPath(".") or str(rel) in ("", "/"):
            return best
        rel = rel.parent


def read_memory_limit(fs: FsRoot) -> MemoryLimit:
    mounts = read_mounts(fs)
    v1_path, v2_path = controller_paths(fs, "memory")
    v1 = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.options]
    if v1 and v1_path:
        limit = _smallest_up(fs, v1[0], v1_path, V1_FILE)
        if limit.bytes is not None:
            return limit
    for mount in (m for m in mounts if m.fstype == "cgroup2"):
        if not v2_path:
            break
        controllers = fs.read(str(PurePosixPath(mount.point) / "cgroup.controllers"))
        if controllers is not None and "memory" not in controllers.split():
            continue  # memory is bound to a v1 hierarchy (hybrid set-ups)
        limit = _smallest_up(fs, mount, v2_path, V2_FILE)
        if limit.bytes is not None:
            return limit
    return MemoryLimit()
