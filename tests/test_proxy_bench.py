"""bench/proxy_bench.py's before/after: the baseline is a git ref's own vsup package, measured in
turn with this tree in one run (real proxies, real upstream processes), and its figures per small
request, per chunk and per streamed request reach the result file and docs/measured.md's block."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "proxy_bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("proxy_bench", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["proxy_bench"] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def test_the_baseline_is_the_refs_own_vsup_package(tmp_path):
    # the package as committed at the ref, not this working tree's
    tree, commit = bench.baseline_tree("HEAD", tmp_path)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    assert commit == head.stdout.strip()
    archived = (tree / "vsup" / "proxy" / "forward.py").read_bytes()
    committed = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:vsup/proxy/forward.py"], capture_output=True, check=True)
    assert archived == committed.stdout
    assert not (tree / "tests").exists()  # only the package: the proxy that runs is the ref's


def test_a_directory_is_taken_as_a_source_tree(tmp_path):
    assert bench.baseline_tree(str(tmp_path), tmp_path / "unused") == (tmp_path.resolve(), str(tmp_path.resolve()))


def test_a_baseline_that_is_no_commit_is_one_line_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit, match=r"^--baseline 'no-such-ref': neither a directory nor a commit .*none\)$"):
        bench.baseline_tree("no-such-ref", tmp_path)


def test_a_small_run_measures_this_tree_against_its_baseline_in_turn(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH), "--pin", "--runs", "2", "--requests", "100", "--streams", "16", "--chunks", "3",
         "--baseline", "HEAD", "--peers", "none", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads((tmp_path / "proxy_bench-pin.json").read_text())
    figures = data["figures"]
    (tmp_path / "again").mkdir()
    assert figures["settings"]["baseline"] == bench.baseline_tree("HEAD", tmp_path / "again")[1]
    assert [r["target"] for r in figures["summary"]] == ["direct", "vsup proxy", "vsup (baseline)", "vsup proxy, unix"]
    # the second run measured the proxies in the other order
    assert [r["target"] for r in figures["runs"][1]] == ["direct", "vsup proxy, unix", "vsup (baseline)", "vsup proxy"]
    for row in figures["summary"][1:]:
        assert row["us_per_stream"] > 0 and row["us_per_request"] > 0 and row["chunks_read"] > 0
    ratios = figures["ratios"]["this tree / baseline"]
    assert set(ratios) == {"us_per_request", "us_per_chunk", "us_per_stream"} and len(ratios["us_per_stream"]["runs"]) == 2
    assert len(figures["ratios"]["unix / tcp"]["us_per_stream"]["runs"]) == 2
    # the unix row reached the upstreams over their Unix sockets only, the others over TCP
    rows = {r["target"]: r for r in figures["summary"]}
    assert rows["vsup proxy, unix"]["upstream_tcp_connections"] == 0
    assert rows["vsup proxy"]["upstream_tcp_connections"] > 0 and rows["vsup (baseline)"]["upstream_tcp_connections"] > 0
    assert figures["settings"]["unix"] is True


def test_an_upstream_answers_on_its_unix_socket_too(tmp_path):
    # the bench's upstream process, as the unix row's proxy reaches it
    path = str(tmp_path / "u.sock")
    port = bench.free_port()
    proc = subprocess.Popen([sys.executable, str(BENCH), "upstream", "--port", str(port), "--chunks", "2", "--pace", "0",
                             "--socket", path])
    try:
        bench.wait_unix(path)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            body = b'{"stream": true}'
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            answer = b""
            while piece := s.recv(65536):
                answer += piece
        assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"data: ") == 3 and b"data: [DONE]" in answer
        bench.wait_http(port)  # and still on its TCP port
    finally:
        proc.terminate()
        proc.wait(10)


def test_no_unix_drops_the_unix_row(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH), "--runs", "1", "--requests", "50", "--streams", "4", "--chunks", "2",
         "--baseline", "none", "--peers", "none", "--no-unix", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads((tmp_path / "proxy_bench.json").read_text())["figures"]
    assert [r["target"] for r in figures["summary"]] == ["direct", "vsup proxy"]
    assert "unix / tcp" not in figures["ratios"] and figures["settings"]["unix"] is False
