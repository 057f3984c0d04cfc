"""The batch store: files, batches and each line's state and result in one SQLite file (WAL).

Synchronous, one connection, small operations (the proxy's event loop calls it). Every change is one
transaction, so a result and the counts it moves land together and a kill -9 leaves nothing half
written. A line is `pending`, `running` (claimed, with its attempt number) or `done` (its one
result). At open, `recover()` puts running lines back to pending with attempt+1: the answer of the
attempt a crash interrupted is refused by `record()`, so each custom_id has exactly one result.

Files' bytes live in the table `blobs` in pieces of at most 1 MiB (one row each), so an upload is
written and a download read a piece at a time, never whole. (The spec named sqlite3's blobopen;
rows of pieces do the same job and let finalize append an output file whose size it does not know
in advance. The API is the spec's.)

Owners: `owner` is the client's key name ("" when the proxy has no keys); None is an admin, who
sees everything. Another owner's object raises NotFound worded exactly as a missing one.

Where this differs from BATCH-SPEC.md (the signatures there hold; these are additions):
- `validate(..., *, step=STEP_BYTES)` and `finalize(..., *, step=STEP_LINES)` do their work in
  steps of about 0.1 s, each one transaction, so the event loop is never held for seconds (a
  200 MiB input took ~13 s whole): the batch stays `validating` / `finalizing` (or `cancelling`)
  until the last step; the runner calls them again while `validating()` / `finish_ready()` list
  it. `step=None` does it all in one call. A kill -9 between steps resumes where they stopped.
- `add_file` writes each 1 MiB piece in its own transaction (an upload cut short is removed at
  the next open), so the routes may call it in a thread (`asyncio.to_thread`): the connection is
  shared under a lock, and the loop's own calls run between the pieces.
- `cancel` of a cancelling or cancelled batch answers it as it is (a retried cancel), and fails
  the batch's pending lines at once (`batch_cancelled`); lines already running finish. A cancelling
  batch builds its files without passing through `finalizing` (OpenAI's cancelling -> cancelled).
- `recover()` is public (Store.open calls it).

Counts for /metrics (batch/watch.py): each line's outcome by model (`outcomes`: completed, failed,
requeued) and the lines running by model (`in_flight`), counted where a line's state changes, in
the transaction that changes it (applied at its commit): a result, a requeue, and every path that
fails lines (a cancel, an expiry, a removed model, finalize's leftover lines, a result over
batch.max_total_bytes). They start at zero with each open, as a Prometheus counter does with each
process.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from vsup.batch import lines as lines_mod
from vsup.batch.dbfile import lock_folder, open_db
from vsup.batch.errors import BadInput, Conflict, NotFound, TooLarge
from vsup.batch.status import TERMINAL, TIMESTAMP, BatchStateError, Status, check

MiB = 1 << 20
GiB = 1 << 30
PIECE = MiB           # a blob row's most bytes; content() yields pieces of this size
STEP_BYTES = MiB      # validate() reads about this much input per call (~0.1 s)
# finalize() writes about this many bytes, at most this many lines, per call (~40 ms here: a 1,000-line
# embeddings batch's 1.3 MB of results took two steps at 1 MiB, a round apart, before `completed`)
FINAL_BYTES = 2 * MiB
STEP_LINES = 2000
DAY = 86400
WINDOW = 24 * 3600    # completion_window "24h", the only one OpenAI offers

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    n INTEGER PRIMARY KEY AUTOINCREMENT,          -- the order of creation (pagination)
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    file_id TEXT NOT NULL,
    piece INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (file_id, piece)
);
CREATE TABLE IF NOT EXISTS batches (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    ending TEXT,                                  -- what finalizing ends in: completed or expired
    errors TEXT,                                  -- JSON list of LineErrors (a failed validation)
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    expires_at INTEGER NOT NULL,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    held INTEGER NOT NULL DEFAULT 0,              -- bytes of its lines' bodies and results (usage())
    metadata TEXT,
    -- work done in steps (validate, finalize), each step one transaction, so a kill -9 resumes it:
    progress INTEGER NOT NULL DEFAULT 0,          -- validating: input bytes read
    lines_read INTEGER NOT NULL DEFAULT 0,        -- validating: input lines read
    written INTEGER NOT NULL DEFAULT 0,           -- finalizing: the last line written to the files
    out_id TEXT, out_pieces INTEGER NOT NULL DEFAULT 0, out_bytes INTEGER NOT NULL DEFAULT 0,
    err_id TEXT, err_pieces INTEGER NOT NULL DEFAULT 0, err_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status, n);
CREATE TABLE IF NOT EXISTS uploads (                -- files being written: their pieces go if vsup dies first
    file_id TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    number INTEGER NOT NULL,                      -- the input file's line (1-based)
    custom_id TEXT NOT NULL,
    model TEXT NOT NULL,
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',        -- pending | running | done
    attempt INTEGER NOT NULL DEFAULT 1,
    status_code INTEGER,
    response BLOB,
    request_id TEXT,
    error TEXT,                                   -- JSON {code, message}
    PRIMARY KEY (batch_id, number),
    UNIQUE (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS lines_by_state ON lines (batch_id, state, number);
CREATE INDEX IF NOT EXISTS lines_by_model ON lines (batch_id, state, model, number);
CREATE INDEX IF NOT EXISTS lines_running ON lines (state) WHERE state = 'running';
"""

# The models with lines pending in a batch (?1), each found by one seek of lines_by_model (a loose
# index scan: SQLite has none of its own, and DISTINCT would visit every pending line).
_PENDING_MODELS = """
WITH RECURSIVE found(model) AS (
    SELECT (SELECT MIN(model) FROM lines WHERE batch_id = ?1 AND state = 'pending')
    UNION ALL
    SELECT (SELECT MIN(model) FROM lines WHERE batch_id = ?1 AND state = 'pending' AND model > found.model)
    FROM found WHERE found.model IS NOT NULL
) SELECT model FROM found WHERE model IS NOT NULL
"""

OUTCOMES = ("completed", "failed", "requeued")  # how a line's attempt ends, as `Store.outcomes` counts it
RUNNING = "running"  # (a change of `Store.in_flight` in a transaction's tally)

_OPEN = (Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING)
_UNFINISHED = tuple(s.value for s in Status if s not in TERMINAL)

# what a line not yet done gets when its batch ends without it
_LEFT = {
    Status.EXPIRED: ("batch_expired", "This request could not be executed before the completion window expired."),
    Status.CANCELLED: ("batch_cancelled", "The batch was cancelled before this request was run."),
    Status.COMPLETED: ("batch_failed", "The batch was finalized before this request was run."),
}


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int = 200 * MiB      # batch.max_file_bytes
    max_total_bytes: int = 10 * GiB      # batch.max_total_bytes: every file's bytes + lines and results, in all
    retention: float = 30 * DAY          # batch.retention (s): files and finished batches kept this long; 0: forever
    max_attempts: int = 3                # batch.max_attempts: a line's tries before it fails


@dataclass(frozen=True)
class Claimed:
    batch_id: str
    number: int
    custom_id: str
    model: str
    body: bytes
    attempt: int


def _file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "expires_at": None, "filename": row["filename"], "purpose": row["purpose"],
            "status": "processed", "status_details": None}


def _batch_object(row: sqlite3.Row) -> dict:
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": None if errors is None else {"object": "list", "data": errors},
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"], "failed_at": row["failed_at"],
        "expired_at": row["expired_at"], "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def _no_file(file_id: str, param: str = "file_id") -> NotFound:
    return NotFound(f"No such File object: {file_id}", param)


def _no_batch(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {batch_id}", "batch_id")


def _check_metadata(metadata: Any) -> None:
    """OpenAI's rule: at most 16 pairs, keys up to 64 characters, values strings up to 512."""
    if metadata is None:
        return
    ok = isinstance(metadata, dict) and len(metadata) <= 16 and all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())
    if not ok:
        raise BadInput("metadata must be an object of at most 16 string values (keys up to 64 characters, "
                       "values up to 512)", "metadata")


class _Writer:
    """A file's bytes appended to `blobs` a piece at a time."""

    def __init__(self, db: sqlite3.Connection, file_id: str, pieces: int = 0, size: int = 0):
        self.db, self.file_id = db, file_id
        self.buffer: list[bytes] = []
        self.buffered = 0
        self.pieces = pieces  # (a file written in steps goes on where the last step stopped)
        self.size = size

    def write(self, data: bytes) -> None:
        self.buffer.append(data)
        self.buffered += len(data)
        self.size += len(data)
        while self.buffered >= PIECE:
            joined = b"".join(self.buffer)
            self._put(joined[:PIECE])
            rest = joined[PIECE:]
            self.buffer, self.buffered = ([rest] if rest else []), len(rest)

    def close(self) -> None:
        """Write what is buffered (a piece shorter than PIECE)."""
        if self.buffered:
            self._put(b"".join(self.buffer))
            self.buffer, self.buffered = [], 0

    def _put(self, data: bytes) -> None:
        self.db.execute("INSERT INTO blobs (file_id, piece, data) VALUES (?, ?, ?)", (self.file_id, self.pieces, data))
        self.pieces += 1


class Store:
    """The batch store; see the module's docstring. Open it with `Store.open`."""

    def __init__(self, db: sqlite3.Connection, limits: Limits, clock: Callable[[], float]):
        self._db = db
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self.limits = limits
        self._clock = clock
        self._folder_lock: int | None = None  # dbfile.lock_folder's descriptor, held while open
        # from zero at each open (see the module's docstring); read them from any thread (the runner
        # writes results from its own): a copy, dict(...), is taken whole
        self.outcomes: dict[tuple[str, str], int] = {}  # (model, completed | failed | requeued) -> lines
        self.in_flight: dict[str, int] = {}  # model -> lines running (claimed, no result yet)
        self._tally: list[tuple[str, str, int]] = []  # the open transaction's (model, outcome or RUNNING, n)
        self._together = False  # inside together(): each write a savepoint of its one transaction
        self._usage: int | None = None  # usage() as read once inside together() (_usage_now)
        self._full = True  # the connection's synchronous setting (dbfile opens it FULL)

    @classmethod
    def open(cls, directory: Path, limits: Limits, clock: Callable[[], float] = time.time) -> Store:
        """The store in `directory` (made 0700; `batches.sqlite3` 0600, never through a link), recovered;
        one process at a time (a second gets a VsupError naming batch.dir)."""
        folder_lock = lock_folder(Path(directory))
        try:
            db = open_db(Path(directory))
        except BaseException:
            os.close(folder_lock)
            raise
        try:
            db.executescript(_SCHEMA)
            store = cls(db, limits, clock)
            store._folder_lock = folder_lock
            store.recover()
        except BaseException:
            db.close()
            os.close(folder_lock)
            raise
        return store

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._folder_lock is not None:
                os.close(self._folder_lock)
                self._folder_lock = None

    # -- plumbing

    def _now(self) -> int:
        return int(self._clock())

    def _sync(self, full: bool) -> None:
        """synchronous=FULL for what a client was told (an upload, a batch created, cancelled,
        finished: fsync'd at commit); NORMAL for a line's claim and result (WAL: on disk at the
        next fsync'd commit or checkpoint). A kill -9 loses neither (the WAL is in the kernel's
        page cache); a power cut may lose the latest results, and their lines run again: still
        one result per custom_id, at no fsync per line."""
        if full != self._full:
            self._db.execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")
            self._full = full

    @contextmanager
    def _tx(self, full: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: the write lock is taken at once); the lines it
        counted (`_count`) are added to `outcomes` and `in_flight` when it commits, never before.
        `full`: fsync'd at commit (_sync). Inside together(): a savepoint of its transaction, so
        one failing write leaves the others."""
        with self._lock:
            if self._together:
                mark = len(self._tally)
                self._db.execute("SAVEPOINT one")
                try:
                    yield self._db
                except BaseException:
                    del self._tally[mark:]
                    self._db.execute("ROLLBACK TO one")
                    self._db.execute("RELEASE one")
                    raise
                self._db.execute("RELEASE one")
                return
            self._sync(full)
            self._db.execute("BEGIN IMMEDIATE")
            self._tally = []
            try:
                yield self._db
            except BaseException:
                self._tally = []
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            tally, self._tally = self._tally, []
            self._add(tally)

    @contextmanager
    def together(self) -> Iterator[None]:
        """Several writes (record, requeue, ...) as one transaction: one commit, one fsync, for the
        results the runner collected meanwhile (a line's result each was one fsync: the runner's
        pace on fast lines such as embeddings). Each write inside is a savepoint: one that raises
        is undone alone; an error of the commit itself undoes them all (and is raised)."""
        with self._lock:
            if self._together:  # (nested: already one transaction)
                yield
                return
            self._sync(False)  # lines' results (see _sync)
            self._db.execute("BEGIN IMMEDIATE")
            self._tally, self._together, self._usage = [], True, None
            try:
                yield
            except BaseException:
                self._tally, self._together, self._usage = [], False, None
                self._db.execute("ROLLBACK")
                raise
            self._together, self._usage = False, None
            try:
                self._db.execute("COMMIT")
            except BaseException:
                self._tally = []
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            tally, self._tally = self._tally, []
            self._add(tally)

    def _count(self, model: str, what: str, n: int = 1) -> None:
        """Count n lines of `model` in the open transaction: an outcome (OUTCOMES), or a change of
        the lines running (RUNNING, n negative for lines leaving it)."""
        assert what == RUNNING or what in OUTCOMES, what
        if n:
            self._tally.append((model, what, n))

    def _add(self, tally: list[tuple[str, str, int]]) -> None:
        for model, what, n in tally:
            if what == RUNNING:
                left = self.in_flight.get(model, 0) + n
                if left > 0:
                    self.in_flight[model] = left
                else:  # (recover() takes back lines of an earlier open, which were never counted here)
                    self.in_flight.pop(model, None)
            else:
                self.outcomes[(model, what)] = self.outcomes.get((model, what), 0) + n

    def _one(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _file_row(self, file_id: str, owner: str | None, param: str = "file_id") -> sqlite3.Row:
        row = self._one("SELECT * FROM files WHERE id = ?", (file_id,))
        if row is None or (owner is not None and row["owner"] != owner):
            raise _no_file(file_id, param)
        return row

    def _batch_row(self, batch_id: str, owner: str | None = None) -> sqlite3.Row:
        row = self._one("SELECT * FROM batches WHERE id = ?", (batch_id,))
        if row is None or (owner is not None and row["owner"] != owner):
            raise _no_batch(batch_id)
        return row

    def _usage_now(self) -> int:
        """usage(), read once per together() transaction (nothing else writes while it holds the
        lock, and record() adds what it keeps): three aggregate queries per line's result were
        most of the writer's work on fast lines, and grow with the files and batches retained."""
        if not self._together:
            return self.usage()
        if self._usage is None:
            self._usage = self.usage()
        return self._usage

    def usage(self) -> int:
        """Bytes held in all: every file (uploads under way too), and the lines and results of unfinished batches."""
        files = self._one("SELECT COALESCE(SUM(bytes), 0) FROM files")
        uploading = self._one("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM blobs WHERE file_id IN (SELECT file_id FROM uploads)")
        held = self._one("SELECT COALESCE(SUM(held), 0) FROM batches")
        assert files is not None and held is not None and uploading is not None
        return int(files[0]) + int(held[0]) + int(uploading[0])

    # -- files

    def add_file(self, owner: str, filename: str, purpose: str, source: BinaryIO, size: int) -> dict:
        """Store `size` bytes read from `source` as a new file of `owner`; the OpenAI file object."""
        if purpose != "batch":
            raise BadInput(f"purpose {purpose!r} cannot be uploaded here; \"batch\" works", "purpose")
        limits = self.limits
        if size > limits.max_file_bytes:
            raise TooLarge("batch.max_file_bytes", limits.max_file_bytes, f"the file ({size} bytes)")
        if self.usage() + size > limits.max_total_bytes:
            raise TooLarge("batch.max_total_bytes", limits.max_total_bytes, f"the file ({size} bytes)")
        try:
            filename.encode()
        except UnicodeEncodeError:
            raise BadInput("the file's name is not valid Unicode text", "file") from None
        file_id = "file-" + secrets.token_hex(16)
        with self._tx() as db:
            db.execute("INSERT INTO uploads (file_id) VALUES (?)", (file_id,))
        try:
            # a piece per transaction: called from a thread, the event loop's calls go on between them
            written = pieces = 0
            while written <= size:
                data = _read_piece(source, min(PIECE, size + 1 - written))
                if not data:
                    break
                with self._tx() as db:
                    db.execute("INSERT INTO blobs (file_id, piece, data) VALUES (?, ?, ?)", (file_id, pieces, data))
                written += len(data)
                pieces += 1
            if written != size:
                raise BadInput(f"the upload has {written} bytes where {size} were announced", "file")
            with self._tx() as db:
                if self.usage() > limits.max_total_bytes:  # (others stored meanwhile; this file's pieces count already)
                    raise TooLarge("batch.max_total_bytes", limits.max_total_bytes, f"the file ({size} bytes)")
                db.execute("INSERT INTO files (id, owner, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                           (file_id, owner, filename, purpose, size, self._now()))
                db.execute("DELETE FROM uploads WHERE file_id = ?", (file_id,))
                row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        except BaseException:
            with self._tx() as db:
                db.execute("DELETE FROM blobs WHERE file_id = ?", (file_id,))
                db.execute("DELETE FROM uploads WHERE file_id = ?", (file_id,))
            raise
        return _file_object(row)

    def file(self, file_id: str, owner: str | None) -> dict:
        return _file_object(self._file_row(file_id, owner))

    def files(self, owner: str | None, purpose: str | None = None, after: str | None = None,
              limit: int = 10000, order: str = "desc") -> tuple[list[dict], bool]:
        """A page of files (newest first with order "desc"), and whether more follow."""
        if order not in ("asc", "desc"):
            raise BadInput(f"order {order!r} is not one of \"asc\", \"desc\"", "order")
        if not 1 <= limit <= 10000:
            raise BadInput(f"limit {limit} is out of range; 1 to 10000 works", "limit")
        where, args = ["1"], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append("n < ?" if order == "desc" else "n > ?")
            args.append(self._file_row(after, owner, "after")["n"])
        rows = self._all(f"SELECT * FROM files WHERE {' AND '.join(where)} ORDER BY n {order.upper()} LIMIT ?",
                         (*args, limit + 1))
        return [_file_object(r) for r in rows[:limit]], len(rows) > limit

    def content(self, file_id: str, owner: str | None) -> Iterator[bytes]:
        """The file's bytes in pieces of at most 1 MiB; NotFound at once (not at the first piece)."""
        self._file_row(file_id, owner)
        return self._pieces(file_id)

    def _pieces(self, file_id: str, piece: int = 0) -> Iterator[bytes]:
        while True:  # one small query per piece: no cursor held open between them
            row = self._one("SELECT data FROM blobs WHERE file_id = ? AND piece = ?", (file_id, piece))
            if row is None:
                return
            yield bytes(row[0])
            piece += 1

    def delete_file(self, file_id: str, owner: str | None) -> dict:
        with self._tx() as db:
            self._file_row(file_id, owner)
            reader = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({_marks(_UNFINISHED)})",
                                (file_id, *_UNFINISHED)).fetchone()
            if reader is not None:
                raise Conflict(f"{file_id} is the input of {reader['id']}, which has not ended; "
                               "cancel that batch or wait for it to end first", "file_id")
            db.execute("DELETE FROM blobs WHERE file_id = ?", (file_id,))
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches

    def create(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict | None) -> dict:
        """A new batch (status validating) over the owner's input file."""
        if endpoint not in lines_mod.ENDPOINTS:
            raise BadInput(f"endpoint {endpoint!r} cannot be batched; one of {', '.join(lines_mod.ENDPOINTS)} works",
                           "endpoint")
        if completion_window != "24h":
            raise BadInput(f"completion_window {completion_window!r} is not offered; \"24h\" works", "completion_window")
        _check_metadata(metadata)
        batch_id = "batch_" + secrets.token_hex(16)
        with self._tx() as db:
            source = self._file_row(input_file_id, owner, "input_file_id")
            if source["purpose"] != "batch":
                raise BadInput(f"{input_file_id} has purpose {source['purpose']!r}; an input file needs purpose \"batch\"",
                               "input_file_id")
            now = self._now()
            db.execute("INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, "
                       "expires_at, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (batch_id, owner, endpoint, input_file_id, completion_window, Status.VALIDATING.value, now,
                        now + WINDOW, None if metadata is None else json.dumps(metadata)))
        return self.batch(batch_id, None)

    def batch(self, batch_id: str, owner: str | None) -> dict:
        return _batch_object(self._batch_row(batch_id, owner))

    def batches(self, owner: str | None, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """A page of batches, newest first, and whether more follow."""
        if not 1 <= limit <= 100:
            raise BadInput(f"limit {limit} is out of range; 1 to 100 works", "limit")
        where, args = ["1"], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if after is not None:
            row = self._one("SELECT n, owner FROM batches WHERE id = ?", (after,))
            if row is None or (owner is not None and row["owner"] != owner):
                raise NotFound(f"No such Batch object: {after}", "after")
            where.append("n < ?")
            args.append(row["n"])
        rows = self._all(f"SELECT * FROM batches WHERE {' AND '.join(where)} ORDER BY n DESC LIMIT ?", (*args, limit + 1))
        return [_batch_object(r) for r in rows[:limit]], len(rows) > limit

    def by_status(self) -> dict[str, int]:
        """How many batches the store holds in each status (every status, 0 where none)."""
        found = {row[0]: row[1] for row in self._all("SELECT status, COUNT(*) FROM batches GROUP BY status")}
        return {s.value: int(found.get(s.value, 0)) for s in Status}

    def owners(self, batch_ids: list[str]) -> dict[str, str]:
        """Each batch's owner (its key's name); a batch not found is left out (no owner check: the views' own)."""
        if not batch_ids:
            return {}
        return {row[0]: row[1] for row in self._all(f"SELECT id, owner FROM batches WHERE id IN ({_marks(tuple(batch_ids))})",
                                                    tuple(batch_ids))}

    def cancel(self, batch_id: str, owner: str | None) -> dict:
        """validating / in_progress -> cancelling (its pending lines fail now; running ones finish);
        a cancelling or cancelled batch is answered as it is (a retried cancel); Conflict otherwise."""
        with self._tx() as db:
            row = self._batch_row(batch_id, owner)
            status = Status(row["status"])
            if status not in (Status.CANCELLING, Status.CANCELLED):
                if status not in (Status.VALIDATING, Status.IN_PROGRESS):
                    raise Conflict(f"{batch_id} is {status.value}; only a validating or in_progress batch can be cancelled",
                                   "batch_id")
                if status == Status.VALIDATING:  # lines of a file half read were never accepted: none to answer
                    db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                    self._move(db, batch_id, status, Status.CANCELLING, total=0, held=0, errors=None)
                else:
                    self._move(db, batch_id, status, Status.CANCELLING)
                    self._fail_pending(db, batch_id, None, *_LEFT[Status.CANCELLED])
        return self.batch(batch_id, None)

    def _move(self, db: sqlite3.Connection, batch_id: str, old: Status, new: Status, **columns: Any) -> None:
        """`old` -> `new` (checked against the table), its timestamp set, with other columns."""
        check(old, new)
        columns = {"status": new.value, TIMESTAMP[new]: self._now(), **columns}
        sets = ", ".join(f"{name} = ?" for name in columns)
        db.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*columns.values(), batch_id))

    # -- the runner's side (no owner checks)

    def validating(self) -> list[str]:
        return [r[0] for r in self._all("SELECT id FROM batches WHERE status = ? ORDER BY n", (Status.VALIDATING.value,))]

    def validate(self, batch_id: str, models: Callable[[str], bool] | None, *, step: int | None = STEP_BYTES) -> dict:
        """Read the input file: errors -> failed with `errors`; else a row per line, -> in_progress.
        One call reads about `step` bytes (None: all) and the batch stays validating until the
        file is read: call it again while validating() lists it (each step one transaction, so a
        kill -9 resumes where the last step ended). A batch no longer validating is left as it is."""
        with self._tx() as db:
            row = self._batch_row(batch_id)
            if row["status"] != Status.VALIDATING:
                return _batch_object(row)
            file_id = row["input_file_id"]
            found = db.execute("SELECT bytes FROM files WHERE id = ?", (file_id,)).fetchone()
            errors: list[lines_mod.LineError] = json.loads(row["errors"]) if row["errors"] else []
            if found is None:  # (a file an unfinished batch reads cannot be deleted; kept for safety)
                errors.append(lines_mod.error("file_not_found", f"the input file {file_id} is gone", None, None))
                return self._validated(db, batch_id, errors, 0, 0)
            size = found[0]
            if row["progress"] == 0 and self.usage() + size > self.limits.max_total_bytes:
                too = TooLarge("batch.max_total_bytes", self.limits.max_total_bytes, "running this batch")
                errors.append(lines_mod.error(too.code or "", too.message, None, None))
                return self._validated(db, batch_id, errors, 0, 0)
            offset, number, total, held = row["progress"], row["lines_read"], row["total"], row["held"]
            for number, raw, offset in _lines_from(self._pieces(file_id, row["progress"] // PIECE), row["progress"],
                                                   row["lines_read"]):
                if raw.strip():
                    item = lines_mod.check_line(number, raw, row["endpoint"], models, set())
                    if isinstance(item, lines_mod.Line) and not db.execute(
                            "INSERT OR IGNORE INTO lines (batch_id, number, custom_id, model, body) VALUES (?, ?, ?, ?, ?)",
                            (batch_id, item.number, item.custom_id, item.model, item.body)).rowcount:
                        item = lines_mod.error("duplicate_custom_id", "The custom_id of this line is used on an earlier "
                                               "line; each must be unique", "custom_id", number)
                    if isinstance(item, lines_mod.Line):
                        total += 1
                        held += len(item.body)
                    elif len(errors) < lines_mod.MAX_ERRORS:
                        errors.append(item)
                if step is not None and offset - row["progress"] >= step:
                    break
            if offset < size:  # more next time
                db.execute("UPDATE batches SET progress = ?, lines_read = ?, total = ?, held = ?, errors = ? WHERE id = ?",
                           (offset, number, total, held, json.dumps(errors) if errors else None, batch_id))
                return self.batch(batch_id, None)
            if not total and not errors:
                errors.append(lines_mod.error("empty_file", "The input file has no lines; each line is one request as JSON",
                                              None, None))
            return self._validated(db, batch_id, errors, total, held)

    def _validated(self, db: sqlite3.Connection, batch_id: str, errors: list, total: int, held: int) -> dict:
        """The end of validation: failed with its errors (no lines kept), or in_progress."""
        if errors:
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            self._move(db, batch_id, Status.VALIDATING, Status.FAILED, errors=json.dumps(errors), total=0, held=0)
        else:
            self._move(db, batch_id, Status.VALIDATING, Status.IN_PROGRESS, total=total, held=held)
        return _batch_object(db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone())

    def claim(self, batch_id: str, n: int, model: str | None = None) -> list[Claimed]:
        """Up to n pending lines (of `model`, if given), oldest first, now running; none unless in_progress."""
        if n <= 0:
            return []
        with self._tx(full=False) as db:
            status = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if status is None or status[0] != Status.IN_PROGRESS:
                return []
            if model is None:
                rows = db.execute("SELECT number, custom_id, model, body, attempt FROM lines WHERE batch_id = ? "
                                  "AND state = 'pending' ORDER BY number LIMIT ?", (batch_id, n)).fetchall()
            else:
                rows = db.execute("SELECT number, custom_id, model, body, attempt FROM lines WHERE batch_id = ? "
                                  "AND state = 'pending' AND model = ? ORDER BY number LIMIT ?", (batch_id, model, n)).fetchall()
            db.executemany("UPDATE lines SET state = 'running' WHERE batch_id = ? AND number = ?",
                           [(batch_id, r["number"]) for r in rows])
            for line_model, n in Counter(r["model"] for r in rows).items():
                self._count(line_model, RUNNING, n)
        return [Claimed(batch_id, r["number"], r["custom_id"], r["model"], bytes(r["body"]), r["attempt"]) for r in rows]

    def unclaim(self, lines: list[Claimed]) -> int:
        """Lines claimed and never sent (the runner's held lines at a stop) back to pending with
        the same attempt: no request of theirs is in flight, so there is no answer to forget."""
        done = 0
        with self._tx(full=False) as db:
            for claimed in lines:
                if db.execute("UPDATE lines SET state = 'pending' WHERE batch_id = ? AND number = ? AND state = 'running' "
                              "AND attempt = ?", (claimed.batch_id, claimed.number, claimed.attempt)).rowcount:
                    done += 1
                    self._count(claimed.model, RUNNING, -1)
        return done

    def record(self, claimed: Claimed, status_code: int | None, body: bytes | None, request_id: str,
               error: dict | None = None) -> bool:
        """The line's one result; False (ignored) when that attempt was forgotten or the line is done.
        A result that would take the store over batch.max_total_bytes is kept as an error instead."""
        ok = error is None and status_code is not None and 200 <= status_code < 300
        if error is None and status_code is None:
            error = {"code": "no_response", "message": "the request got no answer"}
        size = len(body or b"")
        if size and self._usage_now() + size > self.limits.max_total_bytes:
            too = TooLarge("batch.max_total_bytes", self.limits.max_total_bytes, "this request's answer")
            status_code, body, ok, size = None, None, False, 0
            error = {"code": too.code, "message": too.message}
        with self._tx(full=False) as db:
            done = db.execute("UPDATE lines SET state = 'done', status_code = ?, response = ?, request_id = ?, error = ? "
                              "WHERE batch_id = ? AND number = ? AND state = 'running' AND attempt = ?",
                              (status_code, body, request_id, None if error is None else json.dumps(error),
                               claimed.batch_id, claimed.number, claimed.attempt)).rowcount
            if done:
                db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, held = held + ? WHERE id = ?",
                           (int(ok), int(not ok), size, claimed.batch_id))
                if self._usage is not None:
                    self._usage += size
                self._count(claimed.model, "completed" if ok else "failed")  # (ok as kept: a result over the limit failed)
                self._count(claimed.model, RUNNING, -1)
        return bool(done)

    def requeue(self, claimed: Claimed, why: str) -> bool:
        """Back to pending with attempt+1; the attempt that reaches max_attempts fails the line instead."""
        with self._tx(full=False) as db:
            key = (claimed.batch_id, claimed.number, claimed.attempt)
            if claimed.attempt >= self.limits.max_attempts:
                error = json.dumps({"code": "attempts_exhausted", "message": why})
                done = db.execute("UPDATE lines SET state = 'done', error = ? WHERE batch_id = ? AND number = ? "
                                  "AND state = 'running' AND attempt = ?", (error, *key)).rowcount
                if done:
                    db.execute("UPDATE batches SET failed = failed + 1 WHERE id = ?", (claimed.batch_id,))
                    self._count(claimed.model, "failed")
            else:
                done = db.execute("UPDATE lines SET state = 'pending', attempt = attempt + 1 WHERE batch_id = ? "
                                  "AND number = ? AND state = 'running' AND attempt = ?", key).rowcount
                if done:
                    self._count(claimed.model, "requeued")
            if done:
                self._count(claimed.model, RUNNING, -1)
        return bool(done)

    def fail_pending(self, batch_id: str | None, model: str | None, code: str, message: str) -> int:
        """Every pending line (of that batch, of that model) fails with {code, message}; how many."""
        with self._tx() as db:
            return self._fail_pending(db, batch_id, model, code, message)

    def _fail_pending(self, db: sqlite3.Connection, batch_id: str | None, model: str | None, code: str, message: str) -> int:
        where, args = ["state = 'pending'"], []
        if batch_id is not None:
            where.append("batch_id = ?")
            args.append(batch_id)
        if model is not None:
            where.append("model = ?")
            args.append(model)
        sql_where = " AND ".join(where)
        counts = db.execute(f"SELECT batch_id, model, COUNT(*) FROM lines WHERE {sql_where} GROUP BY batch_id, model",
                            args).fetchall()
        db.execute(f"UPDATE lines SET state = 'done', error = ? WHERE {sql_where}",
                   (json.dumps({"code": code, "message": message}), *args))
        by_batch: Counter[str] = Counter()
        for batch, line_model, n in counts:
            by_batch[batch] += n
            self._count(line_model, "failed", n)
        db.executemany("UPDATE batches SET failed = failed + ? WHERE id = ?", [(n, b) for b, n in by_batch.items()])
        return sum(by_batch.values())

    def running(self) -> list[dict]:
        """The in_progress, cancelling and finalizing batches with their counts, pending lines per
        model (`models`: the runner's) and the models of their unfinished lines (`open_models`)."""
        rows = self._all(f"SELECT * FROM batches WHERE status IN ({_marks(_OPEN)}) ORDER BY n", tuple(s.value for s in _OPEN))
        out = []
        for row in rows:
            batch_id = row["id"]
            running = {r[0]: r[1] for r in self._all(
                "SELECT model, COUNT(*) FROM lines WHERE batch_id = ? AND state = 'running' GROUP BY model", (batch_id,))}
            waiting = [r[0] for r in self._all(_PENDING_MODELS, (batch_id,))]
            # the lines neither done (counted in the row) nor running are pending: no count of them
            # (a batch's pending lines may be millions, and the views ask every refresh) unless
            # several models share them
            left = row["total"] - row["completed"] - row["failed"] - sum(running.values())
            if len(waiting) == 1 and left > 0:
                models = {waiting[0]: left}
            elif waiting:
                models = {r[0]: r[1] for r in self._all(
                    "SELECT model, COUNT(*) FROM lines WHERE batch_id = ? AND state = 'pending' GROUP BY model", (batch_id,))}
            else:
                models = {}
            out.append({
                "id": batch_id, "owner": row["owner"], "endpoint": row["endpoint"], "status": row["status"],
                "total": row["total"], "completed": row["completed"], "failed": row["failed"],
                "pending": sum(models.values()), "running": sum(running.values()),
                "models": models, "open_models": sorted(models.keys() | running.keys()),  # (pending or running: the views')
                "created_at": row["created_at"], "in_progress_at": row["in_progress_at"],
                "expires_at": row["expires_at"], "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
            })
        return out

    def feedable(self) -> list[dict]:
        """The runner's round: the in_progress, cancelling and finalizing batches, oldest first, each
        with the models that have lines pending (`models`, by index seeks, one a model) and whether
        any does (`pending`). Unlike running() it counts nothing, so a round costs the same at a
        million lines as at ten (running() counted a 200,000-line batch's lines in ~50 ms, and a
        round runs whenever a line ends)."""
        rows = self._all(f"SELECT id, owner, endpoint, status, created_at FROM batches WHERE status IN ({_marks(_OPEN)}) "
                         "ORDER BY n", tuple(s.value for s in _OPEN))
        out = []
        for row in rows:
            models = [r[0] for r in self._all(_PENDING_MODELS, (row["id"],))]
            out.append({"id": row["id"], "owner": row["owner"], "endpoint": row["endpoint"], "status": row["status"],
                        "created_at": row["created_at"], "models": models, "pending": bool(models)})
        return out

    def finish_ready(self) -> list[str]:
        """Batches to finalize: in_progress with every line done, cancelling with none running, finalizing."""
        rows = self._all(
            "SELECT id FROM batches b WHERE (status = 'in_progress' AND NOT EXISTS (SELECT 1 FROM lines l "
            "WHERE l.batch_id = b.id AND l.state IN ('pending', 'running'))) OR (status = 'cancelling' AND NOT EXISTS "
            "(SELECT 1 FROM lines l WHERE l.batch_id = b.id AND l.state = 'running')) OR status = 'finalizing' ORDER BY n")
        return [r[0] for r in rows]

    def finalize(self, batch_id: str, *, step: int | None = STEP_LINES) -> dict:
        """-> finalizing -> the output file (2xx answers) and the error file (the rest), purpose
        "batch_output", in line order -> completed (cancelled from cancelling; expired past
        expires_at). A line not done by then fails. One call writes `step` lines (None: all); the
        batch is listed by finish_ready() until it ends (each step one transaction: a kill -9
        resumes). The files appear, whole, at the end. Idempotent: a finished batch is returned as it is."""
        row = self._batch_row(batch_id)
        if row["status"] in TERMINAL:
            return _batch_object(row)
        if row["status"] == Status.IN_PROGRESS:
            with self._tx() as db:
                row = self._batch_row(batch_id)
                if row["status"] == Status.IN_PROGRESS:
                    ending = Status.EXPIRED if self._now() >= row["expires_at"] else Status.COMPLETED
                    self._move(db, batch_id, Status.IN_PROGRESS, Status.FINALIZING, ending=ending.value)
        while True:
            with self._tx() as db:
                row = self._batch_row(batch_id)
                status = Status(row["status"])
                if status in TERMINAL:
                    return _batch_object(row)
                ending = Status.CANCELLED if status == Status.CANCELLING else Status(row["ending"] or Status.COMPLETED)
                check(status, ending)  # (a validating batch cannot be finalized)
                if row["out_id"] is None:  # the first step: nothing may run or wait any more
                    code, message = _LEFT[ending]
                    for line_model, state, n in db.execute(
                            "SELECT model, state, COUNT(*) FROM lines WHERE batch_id = ? AND state != 'done' "
                            "GROUP BY model, state", (batch_id,)).fetchall():
                        self._count(line_model, "failed", n)  # (a running line's late answer is refused)
                        if state == "running":
                            self._count(line_model, RUNNING, -n)
                    left = db.execute("UPDATE lines SET state = 'done', error = ? WHERE batch_id = ? AND state != 'done'",
                                      (json.dumps({"code": code, "message": message}), batch_id)).rowcount
                    db.execute("UPDATE batches SET failed = failed + ?, out_id = ?, err_id = ? WHERE id = ?",
                               (left, "file-" + secrets.token_hex(16), "file-" + secrets.token_hex(16), batch_id))
                    row = self._batch_row(batch_id)
                if self._finalize_step(db, row, status, ending, step):
                    return self.batch(batch_id, None)
            if step is not None:
                return self.batch(batch_id, None)

    def _finalize_step(self, db: sqlite3.Connection, row: sqlite3.Row, status: Status, ending: Status,
                       step: int | None) -> bool:
        """Append the next `step` lines to the output and error files; at the last, the files and
        the end. True when the batch has ended."""
        batch_id = row["id"]
        writers = {True: _Writer(db, row["out_id"], row["out_pieces"], row["out_bytes"]),
                   False: _Writer(db, row["err_id"], row["err_pieces"], row["err_bytes"])}
        sql = ("SELECT number, custom_id, status_code, response, request_id, error FROM lines WHERE batch_id = ? "
               "AND number > ? ORDER BY number")
        cursor = db.execute(sql, (batch_id, row["written"]))
        last, count, more = row["written"], 0, False
        start = writers[True].size + writers[False].size
        for line in cursor:
            # a step ends after `step` lines or FINAL_BYTES written (an embedding's answer is large),
            # and is the last when no line is left after them (not one more step with nothing to write)
            if step is not None and (count >= step or writers[True].size + writers[False].size - start >= FINAL_BYTES):
                more = True
                break
            ok = line["error"] is None and line["status_code"] is not None and 200 <= line["status_code"] < 300
            writers[ok].write(_result_line(line))
            last, count = line["number"], count + 1
        cursor.close()
        for writer in writers.values():
            writer.close()
        db.execute("DELETE FROM lines WHERE batch_id = ? AND number > ? AND number <= ?", (batch_id, row["written"], last))
        if more:
            db.execute("UPDATE batches SET written = ?, out_pieces = ?, out_bytes = ?, err_pieces = ?, err_bytes = ? "
                       "WHERE id = ?", (last, writers[True].pieces, writers[True].size, writers[False].pieces,
                                        writers[False].size, batch_id))
            return False
        if db.execute("SELECT 1 FROM lines WHERE batch_id = ? LIMIT 1", (batch_id,)).fetchone():
            # every line is written before the batch ends, or it does not end (a bug, never a lost result)
            raise BatchStateError(f"{batch_id}: lines left unwritten at the end of finalize")
        ids: dict[bool, str | None] = {}
        for ok, writer in writers.items():
            ids[ok] = writer.file_id if writer.size else None
            if writer.size:
                db.execute("INSERT INTO files (id, owner, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                           (writer.file_id, row["owner"], f"{batch_id}_{'output' if ok else 'error'}.jsonl",
                            "batch_output", writer.size, self._now()))
        self._move(db, batch_id, status, ending, output_file_id=ids[True], error_file_id=ids[False], held=0,
                   written=last, out_pieces=writers[True].pieces, out_bytes=writers[True].size,
                   err_pieces=writers[False].pieces, err_bytes=writers[False].size)
        return True

    def expire(self) -> list[str]:
        """In_progress batches past expires_at: their pending lines fail (batch_expired), then finalize."""
        ids = [r[0] for r in self._all("SELECT id FROM batches WHERE status = 'in_progress' AND expires_at <= ? ORDER BY n",
                                       (self._now(),))]
        for batch_id in ids:
            self.fail_pending(batch_id, None, *_LEFT[Status.EXPIRED])
            self.finalize(batch_id)  # (a large batch ends in later steps: finish_ready lists it)
        return ids

    def purge(self) -> int:
        """Files and finished batches past batch.retention deleted (a file an unfinished batch reads
        stays); the bytes freed."""
        retention = self.limits.retention
        if retention <= 0:
            return 0
        cutoff = self._now() - retention
        terminal = tuple(s.value for s in TERMINAL)
        freed = 0
        with self._tx() as db:
            old = db.execute(
                f"SELECT id, held FROM batches WHERE status IN ({_marks(terminal)}) AND "
                "COALESCE(completed_at, failed_at, expired_at, cancelled_at, created_at) < ?", (*terminal, cutoff)).fetchall()
            for batch in old:
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch["id"],))
                db.execute("DELETE FROM batches WHERE id = ?", (batch["id"],))
                freed += batch["held"]
            files = db.execute(
                f"SELECT id, bytes FROM files f WHERE created_at < ? AND NOT EXISTS (SELECT 1 FROM batches b WHERE "
                f"b.input_file_id = f.id AND b.status IN ({_marks(_UNFINISHED)}))", (cutoff, *_UNFINISHED)).fetchall()
            for file in files:
                db.execute("DELETE FROM blobs WHERE file_id = ?", (file["id"],))
                db.execute("DELETE FROM files WHERE id = ?", (file["id"],))
                freed += file["bytes"]
        return freed

    def recover(self) -> None:
        """After a crash: running lines back to pending with attempt+1 (the interrupted attempt's
        answer is refused by record()), an upload cut short removed, and finalizing batches
        finalized (to the end: this runs before anything is served)."""
        with self._tx() as db:
            for line_model, n in db.execute("SELECT model, COUNT(*) FROM lines WHERE state = 'running' GROUP BY model").fetchall():
                self._count(line_model, RUNNING, -n)  # (not an outcome: the attempt is put back, not answered)
            db.execute("UPDATE lines SET state = 'pending', attempt = attempt + 1 WHERE state = 'running'")
            db.execute("DELETE FROM blobs WHERE file_id IN (SELECT file_id FROM uploads)")
            db.execute("DELETE FROM uploads")
        for row in self._all("SELECT id FROM batches WHERE status = 'finalizing' ORDER BY n"):
            self.finalize(row[0], step=None)


def _read_piece(source: BinaryIO, n: int) -> bytes:
    """Up to n bytes of `source` (fewer only at its end: a pipe or socket may give less per read)."""
    parts: list[bytes] = []
    while n > 0:
        data = source.read(n)
        if not data:
            break
        parts.append(data)
        n -= len(data)
    return b"".join(parts)


def _lines_from(pieces: Iterator[bytes], offset: int, number: int) -> Iterator[tuple[int, bytes, int]]:
    """(line number, bytes, the offset after it) of each line from `offset` (the start of a line)
    on; `pieces` start at the piece that holds `offset` (an input file's pieces are all PIECE long
    but its last)."""
    skip = offset % PIECE
    head: list[bytes] = []
    base = offset - skip  # the file offset of the current piece's first byte
    for piece in pieces:
        start = skip
        skip = 0
        while (end := piece.find(b"\n", start)) >= 0:
            raw = piece[start:end]
            if head:
                raw = b"".join([*head, raw])
                head = []
            number += 1
            yield number, raw, base + end + 1
            start = end + 1
        if start < len(piece):
            head.append(piece[start:])
        base += len(piece)
    if head:
        yield number + 1, b"".join(head), base


def _marks(values: tuple) -> str:
    return ", ".join("?" * len(values))


def _result_line(line: sqlite3.Row) -> bytes:
    """One line of an output or error file, in OpenAI's format. The instance's answer goes in as it
    came (msgspec.Raw: checked to be one JSON value, never turned into Python objects and back:
    an embedding's floats made that most of a big batch's finalize)."""
    response = None
    if line["status_code"] is not None:
        raw = line["response"]
        body: Any = None
        if raw is not None:
            try:
                body = msgspec.json.decode(raw, type=msgspec.Raw)
            except msgspec.DecodeError:
                body = bytes(raw).decode("utf-8", "replace")  # not JSON (a proxy's plain-text error): kept as text
        response = {"status_code": line["status_code"], "request_id": line["request_id"], "body": body}
    error = json.loads(line["error"]) if line["error"] else None
    item = {"id": "batch_req_" + secrets.token_hex(16), "custom_id": line["custom_id"], "response": response, "error": error}
    return msgspec.json.encode(item) + b"\n"
