"""usage.py: asking a stream for its usage chunk without touching the client's bytes, and finding
(and for a client that did not ask, dropping) that chunk however the events are cut into pieces."""

from __future__ import annotations

import json

from vsup.proxy import usage
from vsup.proxy.bodyparse_worker import routing_view

USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}\n\n'
EVENTS = b'data: {"id":"c","choices":[{"delta":{"content":"usage"}}]}\n\n' + USAGE + b"data: [DONE]\n\n"


class Sink:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.ended = False

    def write(self, data: bytes) -> bool:
        self.out.append(data)
        return False

    def end(self, data: bytes) -> None:
        self.out.append(data)
        self.ended = True

    async def drain(self) -> None:
        pass


def relay(pieces: list[bytes], strip: bool) -> tuple[bytes, int | None]:
    sink = Sink()
    counted = usage.UsageSink(sink, strip)
    for piece in pieces[:-1]:
        counted.write(piece)
    counted.end(pieces[-1])
    assert sink.ended
    return b"".join(sink.out), counted.usage


def test_the_usage_chunk_is_found_in_any_cut_and_dropped_only_when_asked():
    for cut in range(1, len(EVENTS)):
        pieces = [EVENTS[:cut], EVENTS[cut:]]
        assert relay(pieces, True) == (EVENTS.replace(USAGE, b""), 8)
        assert relay(pieces, False) == (EVENTS, 8)
    crlf = EVENTS.replace(b"\n\n", b"\r\n\r\n")
    assert relay([crlf[:50], crlf[50:], b""], False) == (crlf, 8)
    # a chunk that carries usage beside its choices (continuous_usage_stats) is the client's
    continuous = b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
    assert relay([continuous, b"data: [DONE]\n\n"], True) == (continuous + b"data: [DONE]\n\n", None)
    responses = b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":{"input_tokens":4,"output_tokens":6,"total_tokens":10}}}\n\n'
    assert relay([responses, b""], True) == (responses, 10)


def test_the_stream_request_adds_include_usage_as_the_last_member():
    body = b'{"model": "m", "stream": true, "stream_options": {"continuous_usage_stats": true}}\n'
    new, asked = usage.stream_request(json.loads(body), body)  # type: ignore[misc]
    assert not asked and new.startswith(body.rstrip()[:-1])  # the client's bytes, then the new member
    assert json.loads(new)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    asked_body = b'{"stream": true, "stream_options": {"include_usage": "true"}}'
    assert usage.stream_request(json.loads(asked_body), asked_body) == (asked_body, True)  # vLLM's bool("true")
    assert usage.stream_request({"stream_options": "x"}, b'{"stream_options": "x"}') is None  # vLLM refuses it anyway
    assert usage.stream_request({"stream_options": {"include_usage": "maybe"}}, b"{}") is None
    # a large body's view with its stream_options cut short is left as it is
    view, trimmed, _ = routing_view({"stream_options": {"x": "y" * 100_000}}, 1000)
    assert trimmed == ["stream_options"]


def test_the_usage_of_a_json_answer():
    assert usage.of_body(b'{"usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}') == 5
    assert usage.of_body(b'{"usage": {"input_tokens": 2, "output_tokens": 3}}') == 5
    assert usage.of_body(b'{"error": {"message": "no"}}') is None
    assert usage.of_body(b'{"usage": "lots"}') is None
    assert usage.of_body(b"not json, \"usage\"") is None
