"""LineSplitter (bytes -> capped lines) and InstanceLog (rotating file + echo), on real files."""

from __future__ import annotations

import logging
import re
import resource
import signal
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vsup.errors import VsupError
from vsup.supervisor.logs import InstanceLog, LineSplitter

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}"


def split_all(splitter: LineSplitter, chunks) -> list[str]:
    out = []
    for chunk in chunks:
        out += splitter.feed(chunk)
    return out + splitter.flush()


# -- LineSplitter ------------------------------------------------------------------------------


def test_lines_across_chunks_and_all_line_ends():
    chunks = [b"one\ntw", b"o\r\nthree\r", b"\nfour\rfive", b"\n", b"tail"]
    assert split_all(LineSplitter(), chunks) == ["one", "two", "three", "four", "five", "tail"]


def test_progress_bar_redraws_become_lines():
    data = b"Loading:  0%\rLoading: 50%\rLoading: 100%\n"
    assert split_all(LineSplitter(), [data]) == ["Loading:  0%", "Loading: 50%", "Loading: 100%"]


def test_long_line_keeps_its_head_and_counts_what_was_dropped():
    splitter = LineSplitter(max_line=10)
    assert splitter.feed(b"0123456789abc") == []
    assert splitter.feed(b"def\nshort\n") == ["0123456789…[truncated 6 bytes]", "short"]
    assert splitter.feed(b"x" * 25) == []
    assert splitter.flush() == ["xxxxxxxxxx…[truncated 15 bytes]"]
    assert splitter.flush() == []


def test_invalid_utf8_is_replaced_not_fatal():
    assert split_all(LineSplitter(), [b"caf\xc3", b"\xa9 \xff\n"]) == ["café \ufffd"]


def test_max_line_must_be_positive():
    with pytest.raises(ValueError, match="max_line must be at least 1"):
        LineSplitter(0)


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=300) | st.text(alphabet="ab\r\n", max_size=60).map(str.encode),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=8),
    cap=st.integers(min_value=1, max_value=20),
)
def test_chunking_never_changes_the_lines(data, cuts, cap):
    """However the pipe happens to cut the bytes, the same lines come out."""
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    chunks = [data[a:b] for a, b in pairwise(bounds)]
    assert split_all(LineSplitter(cap), chunks) == split_all(LineSplitter(cap), [data])
    if cap >= len(data):  # no capping: exactly Python's own idea of lines
        expected = [line.decode("utf-8", "replace") for line in re.split(rb"\r\n|\r|\n", data)]
        if expected and expected[-1] == "":
            expected.pop()
        assert split_all(LineSplitter(cap), [data]) == expected


# -- InstanceLog -------------------------------------------------------------------------------


def make_log(directory, **kwargs) -> InstanceLog:
    options = dict(max_bytes=4096, backups=2, echo=False, logger=logging.getLogger("test.logs"))
    options.update(kwargs)
    return InstanceLog("i3", directory, **options)


def test_file_lines_have_timestamp_stream_and_text(tmp_path):
    log = make_log(tmp_path / "nested" / "dir")
    log.line("stdout", "INFO 12:00 Starting vLLM API server")
    log.lines("stderr", ["warn 1", "warn 2"])
    log.close()
    lines = (tmp_path / "nested" / "dir" / "i3.log").read_text().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(STAMP + r" stdout INFO 12:00 Starting vLLM API server", lines[0])
    assert re.fullmatch(STAMP + r" stderr warn 2", lines[2])


def test_reopening_appends(tmp_path):
    for text in ("first run", "second run"):
        log = make_log(tmp_path)
        log.line("stdout", text)
        log.close()
    assert [line.split(" ", 2)[2] for line in (tmp_path / "i3.log").read_text().splitlines()] == ["first run", "second run"]


def test_rotation_keeps_backups_and_bounds_every_file(tmp_path):
    log = make_log(tmp_path, max_bytes=2048, backups=2)
    for i in range(400):
        log.line("stdout", f"line {i:04d} " + "x" * 40)
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["i3.log", "i3.log.1", "i3.log.2"]
    assert all((tmp_path / n).stat().st_size <= 2048 for n in names)
    newest = (tmp_path / "i3.log").read_text().splitlines()
    older = (tmp_path / "i3.log.1").read_text().splitlines()
    assert newest[-1].split(" ")[3] == "0399"
    assert int(older[-1].split(" ")[3]) + 1 == int(newest[0].split(" ")[3])  # .1 is the one just before


def test_no_backups_means_the_file_starts_over(tmp_path):
    log = make_log(tmp_path, max_bytes=1024, backups=0)
    for i in range(100):
        log.line("stdout", f"line {i} " + "y" * 30)
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["i3.log"]
    assert (tmp_path / "i3.log").stat().st_size <= 1024
    assert "line 99 " in (tmp_path / "i3.log").read_text()


def test_echo_goes_to_the_logger_with_the_instance_prefix(caplog):
    logger = logging.getLogger("test.logs.echo")
    log = InstanceLog("i3", None, max_bytes=4096, backups=1, echo=True, logger=logger)
    with caplog.at_level(logging.INFO, logger="test.logs.echo"):
        log.line("stderr", "engine ready")
        log.note("started pid 1: vllm serve")  # file only: vsup's own log says it already
    assert [r.getMessage() for r in caplog.records] == ["[i3] engine ready"]
    assert log.path is None


def test_no_echo_and_no_directory_writes_nothing(tmp_path, caplog):
    log = InstanceLog("i3", None, max_bytes=4096, backups=1, echo=False, logger=logging.getLogger("test.logs.quiet"))
    with caplog.at_level(logging.DEBUG):
        log.line("stdout", "nothing to see")
    assert caplog.records == [] and list(tmp_path.iterdir()) == []


def test_write_failures_are_reported_once_and_never_raise(tmp_path, caplog):
    logger = logging.getLogger("test.logs.full")
    log = InstanceLog("i3", tmp_path, max_bytes=4096, backups=1, echo=True, logger=logger)
    # every write fails (EFBIG: files of this process may not grow), as on a full disk
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
    try:
        with caplog.at_level(logging.INFO, logger="test.logs.full"):
            for i in range(5):
                log.line("stdout", f"still echoed {i}")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "cannot write" in m and "File too large" in m] == [messages[1]]
    assert [m for m in messages if m.startswith("[i3] still echoed")] == [f"[i3] still echoed {i}" for i in range(5)]
    log.close()


def test_bad_settings_and_unwritable_directory_are_clear_errors(tmp_path):
    with pytest.raises(VsupError, match=r"log.max_bytes 10 is too small"):
        make_log(tmp_path, max_bytes=10)
    with pytest.raises(VsupError, match=r"log.backups -1 is negative"):
        make_log(tmp_path, backups=-1)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(VsupError, match=r"log.dir '.*/file/logs' cannot be created"):
        make_log(blocker / "logs")
