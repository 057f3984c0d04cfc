"""An instance's output: bytes from its pipes cut into lines, written to a rotating file, echoed.

`LineSplitter` turns the raw chunks a pipe delivers into lines without ever holding more than one
capped line per stream (a child may write 200 KiB without a newline, or gigabytes of it).
`InstanceLog` writes each line as `<local time with ms> <stream> <text>` to `<dir>/<name>.log`,
rotates it at `max_bytes` keeping `backups` old files (`.1` newest), and copies it to vsup's own
logger as `[<name>] <text>` (there with control characters and ESC as visible `\\x1b` escapes:
the file keeps the child's text as it came, the echo must not steer a terminal). Writing is
synchronous and the file is flushed once per chunk, so a burst costs one write per pipe read and
memory stays flat; a failing disk never stops the caller (the drain must keep reading, or the
child blocks on a full pipe).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import IO, Literal

from vsup.errors import VsupError
from vsup.ownfiles import modes, open_binary, own_folder, why
from vsup.safetext import printable

MAX_LINE = 64 * 1024
REOPEN_AFTER = 10.0  # seconds before retrying a log file that failed to open or write

# "\r\n", "\n" and a lone "\r" all end a line: tqdm progress bars (vLLM's weight loading) redraw
# with "\r"; as separate lines they stay readable instead of piling up into one giant line.
_LINE_END = re.compile(rb"\r\n|\r|\n")


class LineSplitter:
    """Bytes in, complete lines out; a line longer than `max_line` bytes keeps its head and ends
    with `…[truncated N bytes]` once its end (or EOF) arrives."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        if max_line < 1:
            raise ValueError(f"max_line must be at least 1 byte, got {max_line}")
        self.max_line = max_line
        self._head = bytearray()
        self._dropped = 0
        self._after_cr = False  # the previous chunk ended in "\r": a "\n" starting the next one is its pair

    def feed(self, data: bytes) -> list[str]:
        if not data:
            return []
        if self._after_cr and data[:1] == b"\n":
            data = data[1:]
        self._after_cr = data[-1:] == b"\r"
        lines: list[str] = []
        start = 0
        for match in _LINE_END.finditer(data):
            self._keep(data, start, match.start())
            lines.append(self._take())
            start = match.end()
        self._keep(data, start, len(data))
        return lines

    def flush(self) -> list[str]:
        """At EOF: the unterminated rest, if any, as a last line."""
        if not self._head and not self._dropped:
            return []
        return [self._take()]

    def _keep(self, data: bytes, start: int, end: int) -> None:
        room = self.max_line - len(self._head)
        take = min(room, end - start)
        if take > 0:
            self._head += data[start : start + take]
        self._dropped += (end - start) - max(take, 0)

    def _take(self) -> str:
        text = self._head.decode("utf-8", "replace")
        if self._dropped:
            text += f"…[truncated {self._dropped} bytes]"
        self._head = bytearray()
        self._dropped = 0
        return text


class _Stamp:
    """Local time `YYYY-mm-ddTHH:MM:SS.mmm`, formatting the seconds part once per second."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self) -> str:
        now = time.time()  # wall clock on purpose: a log timestamp, not a duration
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(second))
        return f"{self._prefix}.{int((now - second) * 1000):03d}"


class InstanceLog:
    """Per-instance rotating log file + echo to vsup's logger with a `[name]` prefix.

    directory None: no file (echo only). backups 0: the file is emptied when it reaches max_bytes.
    The folder must be vsup's own (created 0700, or 0750 for `group`: a gid); files are 0600
    (0640 with a group), opened relative to the folder and never through a symlink.
    """

    def __init__(
        self,
        name: str,
        directory: Path | None,
        *,
        max_bytes: int,
        backups: int,
        echo: bool,
        logger: logging.Logger,
        group: int | None = None,
    ) -> None:
        if max_bytes < 1024:
            raise VsupError(f"log.max_bytes {max_bytes} is too small for a log file; use at least 1024 (the default is 50 MiB)")
        if backups < 0:
            raise VsupError(f"log.backups {backups} is negative; use 0 (no old files) or more")
        self.name = name
        self.max_bytes = max_bytes
        self.backups = backups
        self.echo = echo
        self.logger = logger
        self.path: Path | None = None
        self._file: IO[bytes] | None = None
        self._size = 0
        self._retry_at = 0.0
        self._warned = False
        self._failure = ""
        self._name = f"{name}.log"
        self._stamp = _Stamp()
        self._dir_fd: int | None = None
        self._mode = modes(group)[1]
        self._group = group
        if directory is not None:
            directory = own_folder(Path(directory), "log.dir", gid=group)
            try:
                self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise VsupError(f"log.dir {str(directory)!r} cannot be opened ({why(exc)})") from None
            self.path = directory / f"{name}.log"
            if self._open() is None:
                self.close()
                raise VsupError(f"log file {str(self.path)!r} cannot be opened for writing ({self._failure}); "
                                "choose a log.dir of vsup's own user")

    def line(self, stream: str, text: str) -> None:
        """One line (no trailing newline) from `stream` (stdout, stderr, or vsup's own notes)."""
        self.lines(stream, (text,))

    def note(self, text: str) -> None:
        """vsup's own remark (started/stopped) for the file only, as stream `vsup`: vsup's log
        already says it in its own words, so it is not echoed."""
        self.lines("vsup", (text,), echo=False)

    def lines(self, stream: str, texts, *, echo: bool = True) -> None:
        """Several lines from one stream, written with one flush (the drain calls this per chunk)."""
        if not texts:
            return
        if echo and self.echo and self.logger.isEnabledFor(logging.INFO):
            for text in texts:
                # the child's bytes reach vsup's stderr / the journal: no escape sequence gets through
                self.logger.info("[%s] %s", self.name, printable(text))
        path = self.path
        if path is None:
            return
        file = self._file or self._reopen(path)
        if file is None:
            return
        try:
            for text in texts:
                record = f"{self._stamp()} {stream} {text}\n".encode("utf-8", "replace")
                if self._size + len(record) > self.max_bytes and self._size > 0:
                    file = self._rotate(path, file)
                file.write(record)
                self._size += len(record)
            file.flush()
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        """The file and the folder let go of for good: later lines go to the echo only."""
        self._close_file()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    # -- file handling -------------------------------------------------------------------------
    # Every name is opened and renamed relative to the folder opened once (its descriptor), never
    # through a symlink: nobody else may write the folder (own_folder), and if someone did, a link
    # planted at a log's name is an error (the lines go to the echo), never a file written as root.

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def _open_name(self, name: str, how: Literal["a", "w"]) -> IO[bytes]:
        return open_binary(name, how, dir_fd=self._dir_fd, mode=self._mode, gid=self._group)

    def _open(self) -> IO[bytes] | None:
        """The log file opened for appending (also `self._file`); None when it cannot be."""
        try:
            self._file = self._open_name(self._name, "a")
            self._size = self._file.tell()
        except OSError as exc:
            self._fail(exc)
        return self._file

    def _reopen(self, path: Path) -> IO[bytes] | None:
        if self._dir_fd is None or time.monotonic() < self._retry_at:
            return None
        file = self._open()
        if file is not None and self._warned:
            self._warned = False
            self.logger.info("[%s] writing %s again", self.name, path)
        return file

    def _rotate(self, path: Path, file: IO[bytes]) -> IO[bytes]:
        """Close `file`, shift the backups, and return the new, empty log file."""
        file.close()
        self._file = None
        name, folder = self._name, self._dir_fd
        if self.backups == 0:
            self._file = self._open_name(name, "w")
        else:
            for index in range(self.backups - 1, 0, -1):
                try:  # rename acts on a link itself, never on what it points to
                    os.replace(f"{name}.{index}", f"{name}.{index + 1}", src_dir_fd=folder, dst_dir_fd=folder)
                except FileNotFoundError:
                    pass
            os.replace(name, f"{name}.1", src_dir_fd=folder, dst_dir_fd=folder)
            self._file = self._open_name(name, "a")
        self._size = 0
        return self._file

    def _fail(self, exc: OSError) -> None:
        # Lines are dropped from the file (still echoed) until a retry works; one warning per outage.
        self._close_file()
        self._failure = why(exc)
        self._retry_at = time.monotonic() + REOPEN_AFTER
        if not self._warned:
            self._warned = True
            self.logger.warning("[%s] cannot write %s (%s); output goes to the echo only, retrying every %gs",
                                self.name, self.path, self._failure, REOPEN_AFTER)
