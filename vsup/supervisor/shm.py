"""Shared-memory files (/dev/shm) an instance leaves behind when its processes are SIGKILLed.

vLLM's `psm_*` (multiprocessing SharedMemory, hundreds of MB) and `sem.mp-*` (named semaphores)
carry no pid in their names, so ownership is read from the processes themselves: the files a
process has mapped (/proc/<pid>/maps) or open (/proc/<pid>/fd), matched by inode too (a
semaphore's creator maps it under the temporary name glibc made it with). `files_in_use(pids)` is taken
before a tree is killed; `remove_unused(paths)` deletes those no live process still uses. For an
instance whose processes were already gone, `sweep_stale_shm` removes matching files that are
ours (uid), older than `min_age` and used by no live process at all.

Intel OpenMP (libiomp5, LD_PRELOADed by vsup tune's `iomp` candidate) registers every process
that initializes it as `__KMP_REGISTERED_LIB_<pid>[_<uid>]` and maps it only for that moment, so
maps/fd cannot find it; a process that is killed leaves it. Its name carries the pid:
`remove_openmp_files(pids)` deletes those of processes that are gone, and the stale sweep those of
any dead pid (libiomp itself treats a dead pid's file as stale).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

from vsup.supervisor.proctree import all_pids, read_stat

SHM_DIR = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")
OPENMP_NAME = re.compile(r"__KMP_REGISTERED_LIB_(\d+)(?:_\d+)?")  # Intel OpenMP's; the suffix: a uid

logger = logging.getLogger("vsup.shm")


def _matches(path: str, directory: str, prefixes: tuple[str, ...]) -> bool:
    parent, _, name = path.rpartition("/")
    return parent == directory and name.startswith(prefixes)


Inode = tuple[int, int, int]  # (device major, minor, inode): a file, whatever name it was mapped by


def _files_of(pid: int, directory: str, prefixes: tuple[str, ...]) -> tuple[set[str], set[Inode]]:
    """The paths under `directory` with one of the prefixes that `pid` maps or holds open, and the
    inodes of every file under `directory` it maps or holds open, whatever the name: glibc's
    sem_open maps a semaphore under a temporary name (`sem.XXXXXX (deleted)` in maps) before it
    links it to its real one, so the creator's mapping names another file than the one it uses."""
    found: set[str] = set()
    inodes: set[Inode] = set()
    try:
        with open(f"/proc/{pid}/maps", errors="surrogateescape") as maps:
            text = maps.read()
    except OSError:
        text = ""  # gone, or not ours to read
    if directory + "/" in text:  # most processes map nothing there: skip the line parsing
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                path = fields[5].removesuffix(" (deleted)")
                if path.startswith(directory + "/"):
                    major, _, minor = fields[3].partition(":")
                    try:
                        inodes.add((int(major, 16), int(minor, 16), int(fields[4])))
                    except ValueError:
                        pass
                if _matches(path, directory, prefixes):
                    found.add(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found, inodes
    for fd in fds:
        try:
            path = os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)")
            if not path.startswith(directory + "/"):
                continue
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        inodes.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
        if _matches(path, directory, prefixes):
            found.add(path)
    return found, inodes


def _in_use(pids: Iterable[int], directory: str, prefixes: tuple[str, ...]) -> tuple[set[str], set[Inode]]:
    found: set[str] = set()
    inodes: set[Inode] = set()
    for pid in pids:
        paths, ids = _files_of(pid, directory, prefixes)
        found |= paths
        inodes |= ids
    return found, inodes


def files_in_use(pids: Iterable[int], shm_dir: str | Path = SHM_DIR, prefixes: tuple[str, ...] = PREFIXES) -> set[str]:
    """Paths under shm_dir with one of the prefixes that these processes map or hold open."""
    return _in_use(pids, os.path.realpath(shm_dir), prefixes)[0]


def remove_unused(paths: Iterable[str], shm_dir: str | Path = SHM_DIR, prefixes: tuple[str, ...] = PREFIXES) -> list[str]:
    """Delete those of `paths` that still exist and that no live process maps or holds open."""
    return _unlink_unused({p for p in paths if os.path.lexists(p)}, shm_dir, prefixes)


def sweep_stale_shm(
    shm_dir: str | Path = SHM_DIR,
    prefixes: tuple[str, ...] = PREFIXES,
    min_age: float = 60.0,
) -> list[str]:
    """Remove `prefixes` files in shm_dir owned by our uid, unmodified for `min_age` seconds and
    used by no live process. For after an instance died before its files could be attributed;
    the age keeps a just-starting server's not-yet-mapped file safe."""
    directory = os.path.realpath(shm_dir)
    now = time.time()  # wall clock on purpose: compared with file mtimes
    uid = os.getuid()
    candidates = []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        logger.warning("cannot list %s for stale shared memory: %s", directory, exc.strerror)
        return []
    for name in names:
        if not name.startswith(prefixes):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_mtime >= min_age:
            candidates.append(path)
    return _unlink_unused(candidates, directory, prefixes) + _unlink(_stale_openmp_files(directory, names, uid, now - min_age))


def _gone(pid: int) -> bool:
    st = read_stat(pid)
    return st is None or st.zombie


def _openmp_pid(name: str) -> int | None:
    match = OPENMP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def remove_openmp_files(pids: Iterable[int], shm_dir: str | Path = SHM_DIR) -> list[str]:
    """Delete Intel OpenMP's registration files of those of `pids` that are gone."""
    wanted = set(pids)
    directory = os.path.realpath(shm_dir)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [os.path.join(directory, n) for n in names if (pid := _openmp_pid(n)) in wanted and _gone(pid)]
    return _unlink(sorted(found))


def _stale_openmp_files(directory: str, names: list[str], uid: int, oldest: float) -> list[str]:
    stale = []
    for name in names:
        pid = _openmp_pid(name)
        if pid is None or not _gone(pid):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == uid and st.st_mtime <= oldest:
            stale.append(path)
    return stale


def _unlink(paths: list[str]) -> list[str]:
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass  # someone else cleaned it
        except OSError as exc:
            logger.warning("cannot remove %s: %s", path, exc.strerror)
    return removed


def _unlink_unused(candidates: Iterable[str], shm_dir: str | Path, prefixes: tuple[str, ...]) -> list[str]:
    """Delete those of `candidates` (in sorted order) that no live process maps or holds open."""
    candidates = sorted(candidates)
    if not candidates:
        return []
    busy, busy_inodes = _in_use(all_pids(), os.path.realpath(shm_dir), prefixes)
    return _unlink([path for path in candidates if path not in busy and _inode(path) not in busy_inodes])


def _inode(path: str) -> Inode | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
