"""Which CPUs and memory nodes the cgroup cpuset lets this process use.

Finds the process's cpuset cgroup the way hwloc does, under any filesystem root:
1. the mounts (proc/self/mountinfo, else proc/mounts): a cgroup v1 hierarchy with the cpuset
   controller (type "cgroup" with option "cpuset", or the legacy type "cpuset" at /dev/cpuset),
   else the cgroup v2 hierarchy (type "cgroup2") when its cgroup.controllers offers cpuset;
2. the process's path in it (proc/self/cgroup: "N:...cpuset...:/path" for v1, "0::/path" for v2;
   else proc/self/cpuset, which old kernels and Slurm/Torque dumps carry);
3. the files: v2 cpuset.cpus.effective / cpuset.mems.effective; v1 cpuset.effective_cpus, then
   cpuset.cpus (or plain "cpus" on noprefix and legacy mounts). Where a cgroup has no such file
   (v2 cgroups without the cpuset controller enabled) its parent's applies, so the search walks up
   to the mount point.
Without a mount table (a hand-made or partial dump, a minimal container) or with no cgroup mount
in it, the standard places stand in for it, as in hwloc: /sys/fs/cgroup/cpuset.cpus.effective
(v2), /sys/fs/cgroup/cpuset/cpuset.cpus (v1), /dev/cpuset/cpus (legacy). Without a path in
proc/self/cgroup, the mount's own root is read (in a cgroup namespace: the container's cgroup).
No cpuset found means no restriction (cpus/mems None), and `note` says why, for `vsup topology`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from vsup.topology.fsroot import FsRoot

V1_CPU_FILES = ("cpuset.effective_cpus", "cpuset.cpus", "cpus")
V1_MEM_FILES = ("cpuset.effective_mems", "cpuset.mems", "mems")
V2_CPU_FILES = ("cpuset.cpus.effective",)
V2_MEM_FILES = ("cpuset.mems.effective",)
# (file whose presence marks the place, the mount it stands for), in hwloc's order
STANDARD_PLACES: tuple[tuple[str, tuple[str, str, frozenset[str]]], ...] = (
    ("sys/fs/cgroup/cpuset.cpus.effective", ("/sys/fs/cgroup", "cgroup2", frozenset())),
    ("sys/fs/cgroup/cpuset/cpuset.cpus", ("/sys/fs/cgroup/cpuset", "cgroup", frozenset({"cpuset"}))),
    ("dev/cpuset/cpus", ("/dev/cpuset", "cpuset", frozenset())),
)


@dataclass(frozen=True)
class Mount:
    root: str  # the path inside the cgroup hierarchy that the mount point shows ("/" from proc/mounts)
    point: str
    fstype: str
    options: frozenset[str]


@dataclass(frozen=True)
class Cpuset:
    cpus: frozenset[int] | None = None  # None: no cpuset restriction found
    mems: frozenset[int] | None = None
    cpus_file: str | None = None  # the file each came from (for `vsup topology` sources)
    mems_file: str | None = None
    note: str = ""  # how it was found when not through the mount table, or why none was found


def _unescape(field: str) -> str:
    """Mount tables escape space, tab, newline and backslash as \\ooo octal."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mounts(fs: FsRoot) -> list[Mount]:
    mountinfo = fs.read("proc/self/mountinfo")
    mounts: list[Mount] = []
    if mountinfo:
        # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue"
        for line in mountinfo.splitlines():
            left, sep, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if not sep or len(fields) < 5 or len(tail) < 1:
                continue
            options = set(fields[5].split(",")) if len(fields) > 5 else set()
            if len(tail) > 2:
                options |= set(tail[2].split(","))
            mounts.append(Mount(_unescape(fields[3]), _unescape(fields[4]), tail[0], frozenset(options)))
        return mounts
    for line in (fs.read("proc/mounts") or "").splitlines():
        # "cgroup /sys/fs/cgroup/cpuset cgroup rw,nosuid,cpuset 0 0"
        fields = line.split()
        if len(fields) < 4:
            continue
        mounts.append(Mount("/", _unescape(fields[1]), fields[2], frozenset(fields[3].split(","))))
    return mounts


def controller_paths(fs: FsRoot, controller: str) -> tuple[str | None, str | None]:
    """(v1 path of `controller`'s hierarchy, v2 path) of this process, from proc/self/cgroup."""
    v1 = v2 = None
    for line in (fs.read("proc/self/cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v1, v2


def _process_paths(fs: FsRoot) -> tuple[str | None, str | None]:
    """(v1 cpuset path, v2 path) of this process, from proc/self/cgroup or proc/self/cpuset."""
    v1, v2 = controller_paths(fs, "cpuset")
    legacy = fs.read_nonblank("proc/self/cpuset")
    return v1 or legacy, v2 or legacy


def _relative(path: str, mount_root: str) -> PurePosixPath:
    """The process's cgroup path relative to the directory the mount point shows."""
    p, r = PurePosixPath(path), PurePosixPath(mount_root)
    if p == r:
        return PurePosixPath(".")
    if r in p.parents:
        return p.relative_to(r)
    # Not under the mount's root: a cgroup namespace reports paths relative to its own root
    # while a bind mount shows a host path. Start from the same path under the mount point;
    # the walk up ends at the mount point itself.
    return PurePosixPath(str(p).lstrip("/") or ".")


def _find_up(fs: FsRoot, mount: Mount, path: str, names: tuple[str, ...]):
    """The first non-blank file of `names` in the process's cgroup or its nearest ancestor."""
    point = PurePosixPath(mount.point)
    rel = _relative(path, mount.root)
    while True:
        directory = point / rel
        for name in names:
            file = str(directory / name)
            cpus = fs.cpu_list(file)
            if cpus is not None:
                return cpus, str(fs.path(file))
        if rel == PurePosixPath(".") or str(rel) in ("", "/"):
            return None, None
        rel = rel.parent


def _standard_mounts(fs: FsRoot) -> list[Mount]:
    """The first standard cgroup place whose cpuset file exists, as the mount it stands for."""
    for marker, (point, fstype, options) in STANDARD_PLACES:
        if fs.read_nonblank(marker) is not None:
            return [Mount("/", point, fstype, options)]
    return []


def _is_v1_cpuset(m: Mount) -> bool:
    return m.fstype == "cpuset" or (m.fstype == "cgroup" and "cpuset" in m.options)


def read_cpuset(fs: FsRoot) -> Cpuset:
    mounts = read_mounts(fs)
    note = ""
    if not any(_is_v1_cpuset(m) or m.fstype == "cgroup2" for m in mounts):
        table = "no proc/self/mountinfo or proc/mounts" if not mounts else "no cgroup mount in the mount table"
        mounts = _standard_mounts(fs)
        if not mounts:
            places = ", ".join(f"/{marker}" for marker, _ in STANDARD_PLACES)
            return Cpuset(note=f"none found ({table}, and none of {places}): every online CPU counts as allowed")
        note = f"found at its standard place: {table}"
    v1_path, v2_path = _process_paths(fs)
    v1 = [m for m in mounts if _is_v1_cpuset(m)]
    v2 = [m for m in mounts if m.fstype == "cgroup2"]
    if v1:
        mount = v1[0]
        path = v1_path or mount.root  # no path for this process: the mount's own cgroup
        cpus, cpus_file = _find_up(fs, mount, path, V1_CPU_FILES)
        mems, mems_file = _find_up(fs, mount, path, V1_MEM_FILES)
        if cpus is not None or mems is not None:
            return Cpuset(cpus, mems, cpus_file, mems_file, note)
    for mount in v2:
        controllers = fs.read(str(PurePosixPath(mount.point) / "cgroup.controllers"))
        if controllers is not None and "cpuset" not in controllers.split():
            continue  # cpuset is bound to a v1 hierarchy (hybrid set-ups) or not enabled at all
        cpus, cpus_file = _find_up(fs, mount, v2_path or mount.root, V2_CPU_FILES)
        mems, mems_file = _find_up(fs, mount, v2_path or mount.root, V2_MEM_FILES)
        if cpus is not None or mems is not None:
            return Cpuset(cpus, mems, cpus_file, mems_file, note)
    return Cpuset(note="none found in the cgroup mounts (no cpuset controller or cpuset files): every online CPU counts as allowed")
