"""Reading a batch's input JSONL (vsup/batch/lines.py): each kind of bad line gives OpenAI's error
with its 1-based line number, good lines come back in order, and reading in pieces changes nothing."""

from __future__ import annotations

import json

import pytest

from vsup.batch import lines
from vsup.batch.lines import ENDPOINTS, MAX_ERRORS, Line, parse, scan
from vsup.config.proxy_routes import SERVING

CHAT = "/v1/chat/completions"


def row(custom_id="a", method="POST", url=CHAT, body=None, **extra) -> bytes:
    item = {"custom_id": custom_id, "method": method, "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if body is None else body, **extra}
    return json.dumps(item).encode()


def served(name: str) -> bool:
    return name == "m"


def test_good_lines_in_order_with_their_bodies():
    data = row("a") + b"\n" + row("b", body={"model": "m", "input": "x"}) + b"\n"
    good, bad = parse(data, CHAT, served)
    assert bad == []
    assert [(g.number, g.custom_id, g.model) for g in good] == [(1, "a", "m"), (2, "b", "m")]
    assert json.loads(good[1].body) == {"model": "m", "input": "x"}


BAD = [
    (b"{not json", "invalid_json_line", None),
    (b"[1, 2]", "invalid_json_line", None),
    (b"\xff\xfe{}", "invalid_json_line", None),
    (json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}).encode(), "missing_required_parameter", "custom_id"),
    (row(custom_id=""), "missing_required_parameter", "custom_id"),
    (row(custom_id=7), "missing_required_parameter", "custom_id"),
    (row(custom_id="first"), "duplicate_custom_id", "custom_id"),
    (row(method="GET"), "invalid_method", "method"),
    (row(url="/v1/embeddings"), "invalid_url", "url"),
    (row(body={"messages": []}), "missing_required_parameter", "body.model"),
    (row(body={"model": "nobody-serves-this"}), "model_not_found", "body.model"),
    (row(body={"model": "m", "stream": True}), "invalid_request", "body.stream"),
    (row(body=["not", "an", "object"]), "invalid_request", "body"),
    (row(body="text"), "invalid_request", "body"),
    (b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}',
     "invalid_request", "custom_id"),
]


@pytest.mark.parametrize("bad_line,code,param", BAD)
def test_each_bad_line_is_named_with_its_number(bad_line, code, param):
    # line 1 good, line 2 blank (still counted), line 3 the bad one, line 4 good
    data = row("first") + b"\n\n" + bad_line + b"\n" + row("last")
    good, bad = parse(data, CHAT, served)
    assert len(bad) == 1, bad
    assert bad[0]["line"] == 3 and bad[0]["code"] == code and bad[0]["param"] == param
    assert bad[0]["message"]
    assert [g.custom_id for g in good] == ["first", "last"]


def test_stream_false_is_fine_and_models_none_checks_no_names():
    good, bad = parse(row(body={"model": "anything", "stream": False}), CHAT, None)
    assert bad == [] and good[0].model == "anything"


def test_an_empty_file_is_an_error():
    for data in (b"", b"\n\n  \n"):
        good, bad = parse(data, CHAT, served)
        assert good == [] and [e["code"] for e in bad] == ["empty_file"]


def test_errors_are_capped():
    data = b"\n".join(b"nope" for _ in range(MAX_ERRORS + 50))
    good, bad = parse(data, CHAT, served)
    assert len(bad) == MAX_ERRORS and bad[-1]["line"] == MAX_ERRORS


def test_reading_in_pieces_gives_the_same_as_whole():
    data = b"\r\n".join(row(f"id-{i}") for i in range(20)) + b"\n" + row(method="GET", custom_id="x") + b"\n"
    whole = parse(data, CHAT, served)
    for size in (1, 7, 64, len(data)):
        pieces = [data[i:i + size] for i in range(0, len(data), size)]
        items = list(scan(pieces, CHAT, served))
        assert [i for i in items if isinstance(i, Line)] == whole[0]
        assert [i for i in items if not isinstance(i, Line)] == whole[1]
    assert whole[1][0]["line"] == 21


def test_a_file_without_a_final_newline_keeps_its_last_line():
    good, _ = parse(row("a") + b"\n" + row("b"), CHAT, served)
    assert [g.number for g in good] == [1, 2]


def test_every_batch_endpoint_is_a_route_the_proxy_forwards():
    assert set(ENDPOINTS) <= set(SERVING)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"} <= set(ENDPOINTS)
    assert lines.error("c", "m", None, 1) == {"code": "c", "message": "m", "param": None, "line": 1}
