"""bench/flood_bench.py's cases for issue 29 items 3 and 4 (bodies, json) at tiny sizes: a run of
this tree, with this tree again as its baseline, writes a result file with every figure the bars
and the comparison read, each bar's verdict follows from its figures, and the pieces the bench
measures with (its HTTP client, percentiles, the case list and file names) do what they say."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "flood_bench.py"

pytestmark = pytest.mark.timeout(180)


def _bench():
    spec = importlib.util.spec_from_file_location("flood_bench", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fb = _bench()


def ordered(stats: dict) -> bool:
    return 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"] <= stats["max_ms"]


def test_a_tiny_run_of_bodies_and_json_writes_its_figures(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH), "--cases", "json,bodies", "--bodies", "3", "--body-kib", "64", "--hold", "0.5",
         "--chunked-after-mib", "2", "--json-seconds", "1", "--json-mib", "1", "--baseline", str(ROOT),
         "--baseline-label", "this tree again", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads((tmp_path / "flood_bench-bodies-json.json").read_text())
    assert data["command"].startswith(".venv/bin/python bench/flood_bench.py --cases json,bodies")
    figures = data["figures"]
    assert figures["cases"] == ["bodies", "json"] and figures["baseline_label"] == "this tree again"
    for name in ("this", "baseline"):
        measured = figures[name]
        assert set(measured) == {"bodies", "chunked_413", "json"}, name

        bodies = measured["bodies"]
        assert bodies["proxy_settings"] == {"body_timeout": 600.0}
        assert bodies["connections"] == 3 and bodies["declared_bytes"] == 64 * 1024 and bodies["body_bytes_each"] == 64 * 1024 - 1
        assert sum(bodies["answers"].values()) == 3 and sum(bodies["sending_ended"].values()) == 3
        assert bodies["bytes_sent"] <= 3 * (64 * 1024 - 1)
        if bodies["sent_whole"] == 3:
            assert bodies["bytes_sent"] == 3 * (64 * 1024 - 1)
        assert 0 < bodies["rss_mib_before"] <= bodies["rss_mib_peak"]
        assert bodies["rss_mib_rise_peak"] == pytest.approx(bodies["rss_mib_peak"] - bodies["rss_mib_before"], abs=0.11)
        assert bodies["met"] is (bodies["rss_mib_rise_peak"] < 100)

        chunked = measured["chunked_413"]
        assert chunked["status"] == "413" and chunked["limit_bytes"] == 8 * 2**20
        assert chunked["bytes_sent_before_answer"] > chunked["limit_bytes"]  # it was past the limit when answered
        assert chunked["ended"] in ("closed", "read on", "stalled"), chunked
        if chunked["ended"] == "read on":
            assert chunked["bytes_sent_after_answer"] == chunked["cap_after_answer_bytes"] == 2 * 2**20
        assert chunked["met"] is (chunked["ended"] == "closed" and chunked["bytes_sent_after_answer"] <= 2**20 + chunked["socket_buffers_bytes"]
                                  and chunked["seconds_after_answer"] <= 2.5)

        case = measured["json"]
        assert case["seconds_per_phase"] == 1 and case["every_s"] == 0.05
        for phase in ("unloaded", "loaded"):
            for probe in ("health", "small"):
                stats = case[phase][probe]
                assert stats["count"] >= 3 and ordered(stats), (phase, probe, stats)
        assert case["unloaded"]["health"]["not_200"] == 0 and case["unloaded"]["small"]["not_200"] == 0
        client = case["json_client"]
        assert client["objects"] == 2**20 // 10 and client["body_bytes"] == 10 * client["objects"]
        assert client["posts_answered"] >= 1 and sum(client["statuses"].values()) >= client["posts_answered"]
        loaded, unloaded = case["loaded"], case["unloaded"]
        assert case["met"] is (loaded["health"]["p99_ms"] <= 50 and loaded["small"]["p95_ms"] <= 2 * unloaded["small"]["p95_ms"])
        assert f"{name}: bodies: {'met' if bodies['met'] else 'MISSED'}" in run.stdout
        assert f"{name}: json: {'met' if case['met'] else 'MISSED'}" in run.stdout

    ratios = figures["ratios_this_over_baseline"]
    assert {"bodies.rss_mib_rise_peak", "json.loaded.health.p99_ms", "json.loaded.small.p95_ms"} <= set(ratios)
    p99 = figures["this"]["json"]["loaded"]["health"]["p99_ms"] / figures["baseline"]["json"]["loaded"]["health"]["p99_ms"]
    assert ratios["json.loaded.health.p99_ms"] == pytest.approx(p99, abs=0.001)
    assert "this / baseline, json.loaded.health.p99_ms: " in run.stdout


async def test_the_bench_client_reads_sized_and_chunked_answers_and_reconnects_after_a_close(unused_tcp_port):
    async def sized(request):
        return web.json_response({"ok": True})

    async def chunked(request):
        response = web.StreamResponse(status=201)
        response.enable_chunked_encoding()
        await response.prepare(request)
        for piece in (b"a" * 10, b"b" * 3000):
            await response.write(piece)
        await response.write_eof()
        return response

    async def closing(request):
        return web.Response(status=202, text="bye", headers={"Connection": "close"})

    app = web.Application()
    app.router.add_get("/sized", sized)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/closing", closing)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    conn = fb.Conn(unused_tcp_port)
    try:
        def get(path: str) -> bytes:
            return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()

        assert await conn.request(get("/chunked")) == 201
        first = conn.writer
        assert await conn.request(get("/sized")) == 200 and conn.writer is first  # the chunked answer was read whole
        assert await conn.request(get("/closing")) == 202 and conn.writer is None
        assert await conn.request(get("/sized")) == 200 and conn.writer is not None
    finally:
        conn.close()
        await runner.cleanup()


def test_the_published_flood_block_shows_the_new_cases_when_its_file_has_them(tmp_path, monkeypatch):
    """scripts/published_numbers.py's flood block: the bodies and json rows and the bars' verdicts
    from a file that has them (docs/bench/flood_bench.json once every case ran); none without."""
    spec = importlib.util.spec_from_file_location("published_numbers_flood", ROOT / "scripts" / "published_numbers.py")
    assert spec and spec.loader
    pn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pn)
    data = json.loads((ROOT / "docs" / "bench" / "flood_bench.json").read_text())
    for figures in data["figures"].values():  # a file of the older cases alone
        for case in ("bodies", "chunked_413", "json"):
            if isinstance(figures, dict):
                figures.pop(case, None)
    monkeypatch.setattr(pn, "BENCH_DIR", tmp_path)
    (tmp_path / "flood_bench.json").write_text(json.dumps(data))
    assert "JSON" not in pn.flood("docs/bench") and "bars" not in pn.flood("docs/bench")
    new = json.loads((ROOT / "docs" / "bench" / "flood_bench-before.json").read_text())["figures"]["this"]
    for run in ("this", "baseline"):
        data["figures"][run].update(new)
    data["figures"]["this"]["json"] = dict(new["json"], met=True)
    (tmp_path / "flood_bench.json").write_text(json.dumps(data))
    block = pn.flood("docs/bench")
    bodies, json_case = new["bodies"], new["json"]
    assert f"| {bodies['rss_mib_peak']:.0f} MiB (+{bodies['rss_mib_rise_peak']:.0f}) |" in block
    assert f"| {json_case['loaded']['health']['p99_ms']:.0f} / {json_case['loaded']['health']['max_ms']:.0f} ms |" in block
    assert "bodies: missed" in block and "json: met" in block and "chunked_413: missed" in block


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert fb.pct(values, 50) == 50 and fb.pct(values, 95) == 95 and fb.pct(values, 99) == 99 and fb.pct(values, 100) == 100
    assert fb.pct([7.0], 99) == 7.0
    stats = fb.latency([0.001, 0.002, 0.010], [200, 200, 503])
    assert stats == {"count": 3, "not_200": 1, "p50_ms": 2.0, "p95_ms": 10.0, "p99_ms": 10.0, "max_ms": 10.0}


def test_the_cases_and_the_result_file_they_write():
    parser_cases = fb.cases_arg("json, bodies")
    assert parser_cases == ["bodies", "json"]
    with pytest.raises(Exception, match="unknown case"):
        fb.cases_arg("bodies,nope")

    class Args:
        variant = None
        cases = list(fb.CASES)

    assert fb.result_name(Args) == "flood_bench.json"  # the file README's flood block reads: every case in it
    Args.cases = ["bodies", "json"]
    assert fb.result_name(Args) == "flood_bench-bodies-json.json"
    Args.variant = "before"
    assert fb.result_name(Args) == "flood_bench-before.json"


def test_the_held_body_is_a_json_object_missing_only_its_last_byte():
    body = fb.held_body(4096)
    assert len(body) == 4096 and json.loads(body)["messages"][0]["content"].startswith("aaa")
    with pytest.raises(ValueError):
        json.loads(body[:-1])
    array = fb.json_array(1)
    assert len(array) == 10 * (2**20 // 10) and json.loads(array) == [{"a": 1}] * (2**20 // 10)
    assert fb.json_body(1, "array") == array
    chat = fb.json_body(1, "object")
    document = json.loads(chat)
    assert 2**20 - 10 <= len(chat) <= 2**20 and document["model"] == "bench" and document["messages"][0]["role"] == "user"
    assert document["pad"] == [{"a": 1}] * chat.count(b'{"a": 1}')


def test_the_object_shape_is_parsed_and_forwarded_whole(tmp_path):
    """--json-shape object: a chat completion holding the array, which the proxy must read and the
    upstream answers (a body the bench's upstream refused would come back as its 413)."""
    run = subprocess.run([sys.executable, str(BENCH), "--cases", "json", "--json-seconds", "1", "--json-mib", "2",
                          "--json-shape", "object", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    case = json.loads((tmp_path / "flood_bench-json.json").read_text())["figures"]["this"]["json"]
    client = case["json_client"]
    assert case["json_shape"] == "object" and client["objects"] == (2 * 2**20 - len(fb.CHAT_HEAD) - 1) // 10
    assert set(client["statuses"]) == {"200"} and client["posts_answered"] >= 1, client
