"""Opening the batch store's private SQLite file: its folder vsup's own (0700), the file 0600 and
never reached through a link (vsup/ownfiles.py), WAL, opened with synchronous FULL (the store
lowers it to NORMAL for a line's claim and result alone: Store._sync).

SQLite opens the path itself, so the file is created and checked first through a descriptor of the
folder with O_NOFOLLOW; the folder is private, so no one else can swap a name in it afterwards.
SQLite gives its -wal and -shm files the database's mode; a link planted at either is refused too.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import stat
from pathlib import Path

from vsup.errors import VsupError
from vsup.ownfiles import open_fd, own_folder, why

NAME = "batches.sqlite3"
LOCK = "store.lock"
KEY = "batch.dir"


def lock_folder(directory: Path) -> int:
    """An exclusive lock on the store's folder for this process's lifetime (the descriptor; closing it
    releases the lock, as the kernel does when the process dies, kill -9 included). Two vsups on one
    folder would each run the other's lines in flight again: the second is refused in one line."""
    directory = own_folder(Path(directory), KEY)
    try:
        fd = open_fd(directory / LOCK, "a")
    except OSError as exc:
        raise VsupError(f"{KEY}: cannot open {directory / LOCK} ({why(exc)}); remove it or choose another folder") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise VsupError(f"{KEY}: another vsup uses the batch store in {directory} (it holds {LOCK}): stop it, "
                        "or give this one a batch.dir of its own") from None
    return fd


def open_db(directory: Path, name: str = NAME) -> sqlite3.Connection:
    """The connection to `directory/name` (autocommit: the store opens its own transactions)."""
    directory = own_folder(Path(directory), KEY)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for extra in ("-wal", "-shm"):
            try:
                info = os.lstat(name + extra, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(info.st_mode):
                raise VsupError(f"{KEY}: {directory / (name + extra)} is not a regular file (a link?); "
                                "vsup does not follow it: remove it")
        try:
            os.close(open_fd(name, "a", dir_fd=dir_fd))  # created 0600, an older one made 0600, a link refused
        except OSError as exc:
            raise VsupError(f"{KEY}: cannot open {directory / name} ({why(exc)}); remove it or choose another folder") from None
    finally:
        os.close(dir_fd)
    # check_same_thread off: the store serializes its calls under a lock (an upload may run in a thread)
    db = sqlite3.connect(directory / name, isolation_level=None, check_same_thread=False)
    try:
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # a file that is not SQLite fails here
    except sqlite3.DatabaseError as exc:
        db.close()
        raise VsupError(f"{KEY}: {directory / name} cannot be used as the batch store ({exc}); "
                        "move it away and vsup starts an empty one") from None
    if str(mode).lower() != "wal":
        db.close()
        raise VsupError(f"{KEY}: {directory / name} cannot use SQLite's WAL journal (the folder's file system?); "
                        "choose a folder on a local disk")
    return db
