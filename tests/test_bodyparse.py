"""vsup/proxy/bodyparse.py: large request bodies parsed in a worker process while the loop runs, with
the inline path's errors, and a routing view from which the consumers (affinity's key, the rate
limits' estimate, kv_aware's /tokenize body) read what they read from the whole body."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vsup.proxy import bodyparse_worker as worker
from vsup.proxy.affinity import routing_key
from vsup.proxy.bodyparse import INLINE_BYTES, BodyParser, NotAnObject, ParserUnavailable, RoutingView
from vsup.proxy.codec import parse_json
from vsup.proxy.kv_aware import tokenize_body
from vsup.proxy.ratelimit import estimate_tokens

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_leaks():
    """No worker process outlives its test, and nothing is left to the garbage collector."""
    me = psutil.Process()
    before = {child.pid for child in me.children()}
    yield
    gc.collect()  # an unclosed transport or pipe warns now, in this test (and the warning is an error)
    left = [child.pid for child in me.children() if child.pid not in before and child.status() != psutil.STATUS_ZOMBIE]
    assert left == [], "worker processes left running"

CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": "Hello, how are you?"}], "max_tokens": 32, "stream": True}
NORMAL = [
    CHAT,
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                                              {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBO" * 200}}]}],
     "max_completion_tokens": 100},
    {"model": "m", "messages": [{"role": "user", "content": "weather?"},
                                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
     "tools": [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": {"type": "object", "properties": {}}}}],
     "cache_salt": "s1", "n": 2},
    {"model": "m", "prompt": "Once upon a time " * 50, "max_tokens": 16},
    {"model": "m", "prompt": list(range(3000)), "max_tokens": 1},
    {"model": "m", "prompt": ["first prompt", "second prompt"]},
    {"model": "m", "prompt": ["only one"], "add_special_tokens": False},
    {"model": "m", "prompt": [[1, 2, 3], [4, 5]]},
    {"model": "m", "instructions": "Be brief.", "input": "Tell me a joke", "max_output_tokens": 50},
    {"model": "m", "input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"model": "e", "input": ["embed me", "and me"]},
    {"model": "m", "user": "session-42", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": float("nan"), "top_p": float("inf"),
     "seed": 10**40, "metadata": {"tag": "\ud800 lone surrogate", "nested": [[{"a": [1, 2.5, None, True]}]]}},
]


def _same(a: object, b: object) -> bool:
    return repr(a) == repr(b)  # NaN is not equal to itself; its repr is


def _consumers(document: dict, prefix_chars: int) -> tuple:
    return (routing_key(document, None, prefix_chars), routing_key(document, {"X-Session-ID": "s"}, prefix_chars),
            estimate_tokens("/v1/chat/completions", document, 1000, 10**6), document.get("model"), document.get("stream"))


async def test_normal_bodies_come_back_whole_and_the_consumers_read_the_same():
    parser = BodyParser(inline_bytes=0)  # everything through the worker
    try:
        for document in NORMAL:
            body = json.dumps(document).encode()
            view = await parser.parse(body)
            inline = parse_json(body)
            assert isinstance(view, RoutingView) and view.trimmed == frozenset() and view.dropped == 0
            assert _same(view, inline) and list(view) == list(inline)
            for prefix in (16, 2048):
                assert _consumers(view, prefix) == _consumers(inline, prefix)
            assert _same(tokenize_body(view), tokenize_body(inline))
        assert parser.started == 1 and parser.offloaded == len(NORMAL) and parser.inline == 0
    finally:
        await parser.aclose()


async def test_small_bodies_stay_inline_and_return_what_parse_json_does():
    parser = BodyParser()
    body = json.dumps(CHAT).encode()
    assert await parser.parse(body) == CHAT and type(await parser.parse(body)) is dict
    assert await parser.parse(b"[1, 2]") == [1, 2]  # not an object: the caller's 400, as today
    with pytest.raises(json.JSONDecodeError, match="Expecting value"):
        await parser.parse(b"")
    assert parser.inline == 4 and parser.started == 0 and parser.workers == 0
    await parser.aclose()


def _pad(text: bytes) -> bytes:
    return text + b" " * (INLINE_BYTES + 1 - len(text)) if len(text) <= INLINE_BYTES else text


BAD = [
    b'{"a": 1,}',
    b'{"a": tru}',
    b'{"a": 1} x',
    b'{\n\n  "a":\n}',
    b'{"a": "\xff"}',
    b'{"a": "' + b"x" * 40000,
    b'{"a": ' + b"1" * 5000 + b"}",  # over int_max_str_digits: ValueError
    b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}",  # RecursionError
    b"\xef\xbb\xbf" + b'{"a": }',  # UTF-8 with a BOM
    '{"a": }'.encode("utf-16"),
    b" " * 40000,  # only blanks
]


@pytest.mark.parametrize("body", BAD, ids=range(len(BAD)))
async def test_errors_are_the_inline_paths_type_and_message(body):
    body = _pad(body)
    with pytest.raises((ValueError, RecursionError)) as inline:
        parse_json(body)
    parser = BodyParser()
    try:
        with pytest.raises((ValueError, RecursionError)) as offloaded:
            await parser.parse(body)
    finally:
        await parser.aclose()
    assert type(offloaded.value) is type(inline.value) and str(offloaded.value) == str(inline.value)
    assert parser.offloaded == 1


async def test_json_decode_errors_keep_their_fields():
    body = _pad(b'{\n  "a": 1,\n  "b": }')
    parser = BodyParser()
    try:
        with pytest.raises(json.JSONDecodeError) as offloaded:
            await parser.parse(body)
    finally:
        await parser.aclose()
    error = offloaded.value
    assert (error.msg, error.lineno, error.colno, error.pos) == ("Expecting value", 3, 8, 19)


@pytest.mark.parametrize("body, kind", [
    (b"[" + b",".join([b'{"a":1}'] * 1_000_000) + b"]", "list"),  # 8 MiB: the flood
    (b"\r\n  \t" + _pad(b"[1]"), "list"),
    (b"\xef\xbb\xbf" + _pad(b"[1]"), "list"),
    (_pad(b'"text"'), "str"),
    (_pad(b"-12"), "number"),
    (_pad(b"null"), "NoneType"),
    (_pad(b"xyz"), ""),
])
async def test_a_large_body_that_is_not_an_object_is_refused_at_once(body, kind):
    parser = BodyParser()
    started = time.perf_counter()
    with pytest.raises(NotAnObject) as refused:
        await parser.parse(body)
    assert time.perf_counter() - started < 0.1  # no parse: the 8 MiB array costs json.loads ~2 s
    assert isinstance(refused.value, ValueError) and refused.value.kind == kind
    assert str(refused.value) == ("the request body must be a JSON object, " + (f"got {kind}" if kind else "it starts with 'xyz             '"))
    assert parser.started == 0 and parser.refused == 1
    await parser.aclose()


async def test_a_large_non_object_the_worker_decodes_is_refused_the_same_way():
    parser = BodyParser()
    try:
        with pytest.raises(NotAnObject, match="must be a JSON object, got list"):
            await parser.parse(json.dumps(["x" * 40000]).encode("utf-16"))  # UTF-16: told after decoding
    finally:
        await parser.aclose()


async def test_huge_prompt_fields_are_cut_to_what_routing_reads():
    document = {"model": "m", "stream": False, "max_tokens": 7,
                "messages": [{"role": "system", "content": "policy " * 20000}, {"role": "user", "content": "question"}],
                "tools": [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 100}} for i in range(2000)],
                "metadata": {"k": "v"}}
    body = json.dumps(document).encode()
    parser = BodyParser(prefix_limit=4096)
    try:
        view = await parser.parse(body)
        assert view.trimmed == {"messages", "tools"} and view.dropped == 0
        assert view["model"] == "m" and view["stream"] is False and view["metadata"] == {"k": "v"}
        assert list(view) == list(document)  # the body's key order
        assert view["messages"] == [{"role": "system", "content": ("policy " * 20000)[:4096]}]
        assert len(pickle.dumps(dict(view))) < 100_000 and len(body) > 400_000
        for prefix in (16, 2048, 4096):
            assert _consumers(view, prefix) == _consumers(document, prefix)
        parser.prefix_limit = 100  # applies from the next parse
        assert (await parser.parse(body))["messages"][0]["content"] == ("policy " * 20000)[:100]
    finally:
        await parser.aclose()


# -- the view, in-process: what affinity, the gate and kv_aware read is what they read of the body

_text = st.text(alphabet="ab \u00e9\x1f", max_size=120)
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _text})}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "image_url", "x" * 30]), "input_audio": _text}),
    _text, st.integers(0, 9))
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "", "user" * 20]),
                           "content": st.one_of(_text, st.lists(_part, max_size=4), st.none())},
                          optional={"name": _text, "tool_calls": st.lists(st.dictionaries(st.sampled_from("abc"), _text), max_size=2)}),
    st.fixed_dictionaries({"content": _text, "role": st.sampled_from(["user", "tool"])}),
    st.integers(), _text)
_ids = st.lists(st.integers(0, 50000), max_size=200)
_prompt = st.one_of(_text, _ids, st.lists(_text, max_size=3), st.lists(_ids, max_size=3),
                    st.lists(st.one_of(st.integers(0, 9), _text), max_size=60), st.integers())
_document = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["m", "other"]), "stream": st.booleans(), "max_tokens": st.integers(0, 99),
    "user": st.sampled_from(["", "u1"]), "messages": st.lists(_message, max_size=8), "prompt": _prompt,
    "instructions": st.one_of(_text, st.integers()), "input": st.one_of(_prompt, st.lists(_message, max_size=4)),
    "cache_salt": _text, "tools": st.lists(st.dictionaries(st.sampled_from("xyz"), _text), max_size=3)})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=_document, limit=st.integers(1, 300), data=st.data())
def test_the_view_keeps_what_the_consumers_read(document, limit, data):
    view, trimmed, dropped = worker.routing_view(document, limit)
    prefix = data.draw(st.integers(1, limit))
    assert _consumers(view, prefix) == _consumers(document, prefix)
    assert dropped == 0 and list(view) == list(document)
    if not trimmed:
        assert _same(view, document) and _same(tokenize_body(view), tokenize_body(document))
    # kv_aware asks /tokenize or not alike (a cut batch is still a batch, cut ids still not all
    # ids); cut messages are asked for even if an image comes after the cut (their leading blocks)
    if "messages" not in trimmed:
        assert (tokenize_body(view) is None) == (tokenize_body(document) is None)


def test_the_view_is_bounded_however_the_body_is_made():
    many_keys = {f"k{i}": i for i in range(200_000)} | {"model": "m"}
    view, trimmed, dropped = worker.routing_view(many_keys, 65536)
    assert view["model"] == "m" and dropped > 150_000 and len(pickle.dumps(view)) < worker.VIEW_BUDGET
    tiny = {"model": "m", "messages": [{"a": 1}] * 300_000, "prompt": [7] * 1_000_000, "input": ["é" * 100_000] * 50}
    view, trimmed, dropped = worker.routing_view(tiny, 65536)
    assert set(trimmed) == {"messages", "prompt", "input"} and len(pickle.dumps(view)) < 2 * worker.VIEW_BUDGET
    assert 2048 // 4 < len(view["prompt"]) <= 65536 // 4  # what affinity reads at the default prefix, within the field's cut
    assert routing_key(view, None, 2048) == routing_key(tiny, None, 2048)  # the default prefix: exact even so
    bare = {"messages": [{"role": "tool", "content": ""}] * 5000}  # 6 characters each, as affinity counts
    assert routing_key(worker.routing_view(bare, 65536)[0], None, 2048) == routing_key(bare, None, 2048)


# -- the worker process


async def test_the_loop_runs_while_a_large_body_parses():
    body = b'{"model":"m","messages":[' + b",".join([b'{"a":1}'] * 800_000) + b"]}"  # 6.1 MiB of tiny objects
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    ticking = True

    def tick(last: float) -> None:
        now = loop.time()
        gaps.append(now - last)
        if ticking:
            loop.call_later(0.01, tick, now)

    async def timed(parse) -> float:
        gaps.clear()
        loop.call_later(0.01, tick, loop.time())
        started = loop.time()
        result = parse()
        if asyncio.iscoroutine(result):
            result = await result
        elapsed = loop.time() - started
        await asyncio.sleep(0.03)  # the tick that was due during an inline parse
        assert result["model"] == "m"
        return elapsed

    parser = BodyParser()
    gc.disable()  # the collector's own pauses are not the parser's
    try:
        await parser.parse(_pad(b'{"warm": 1}'))  # the worker's start is not what is measured
        offloaded = await timed(lambda: parser.parse(body))
        offloaded_gaps = list(gaps)
        inline = await timed(lambda: parse_json(body))  # the same body on the loop, for contrast
        inline_gaps = list(gaps)
    finally:
        ticking = False
        gc.enable()
        await parser.aclose()
    # 0.1 s: ten ticks, well clear of the ticker's 10 ms (a fast CPU parses this body inline in ~0.2 s)
    assert offloaded > 0.1 and max(offloaded_gaps) < min(0.25, offloaded / 2), (offloaded, max(offloaded_gaps))
    assert len(offloaded_gaps) > offloaded / 0.01 / 4  # it ticked all along
    assert max(inline_gaps) > 0.9 * inline > 0.1  # what the ticker sees when the loop does stall


async def test_a_worker_killed_mid_parse_fails_that_parse_and_the_next_starts_another(caplog):
    body = b'{"model":"m","messages":[' + b",".join([b'{"a":1}'] * 500_000) + b"]}"
    parser = BodyParser()
    try:
        await parser.parse(_pad(b'{"warm": 1}'))
        (first,) = parser._idle
        parse = asyncio.ensure_future(parser.parse(body))
        await asyncio.sleep(0.1)
        os.kill(first.process.pid, signal.SIGKILL)
        started = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="vsup.proxy.bodyparse"):
            # Python 3.11's ThreadedChildWatcher reports 255 when something else in the process
            # reaped the pid first (subprocess._cleanup() polling a dropped Popen whose pid was
            # reused: pid_max is 32768 in CI); the parse still fails at once and says so
            with pytest.raises(ParserUnavailable, match="killed by signal 9|exited with code 255"):
                await parse
        assert time.perf_counter() - started < 2
        ours = [(r.levelname, r.exc_info) for r in caplog.records if r.name == "vsup.proxy.bodyparse"]
        assert ours == [("WARNING", None)]  # one line, no traceback (asyncio may add its "Unknown child" line)
        assert (await parser.parse(_pad(b'{"model": "again"}')))["model"] == "again"
        assert parser.started == 2 and parser.workers == 1 and parser.failed == 1
    finally:
        await parser.aclose()


async def test_a_worker_that_died_idle_is_replaced_without_failing_the_body():
    parser = BodyParser()
    try:
        await parser.parse(_pad(b'{"warm": 1}'))
        for _ in range(2):  # killed, then used at once: its death may not be noticed yet
            os.kill(parser._idle[0].process.pid, signal.SIGKILL)
            assert (await parser.parse(_pad(b'{"model": "m"}')))["model"] == "m"
        assert parser.started == 3 and parser.failed == 0 and parser.workers == 1
    finally:
        await parser.aclose()


async def test_a_round_trip_over_the_timeout_is_unavailable_not_a_hang():
    body = b'{"model":"m","messages":[' + b",".join([b'{"a":1}'] * 300_000) + b"]}"
    parser = BodyParser(timeout=0.05)
    try:
        with pytest.raises(ParserUnavailable, match=r"took more than 0\.05 s"):
            await parser.parse(body)
        assert parser.workers == 0
        parser.timeout = 30
        assert (await parser.parse(body))["model"] == "m"
    finally:
        await parser.aclose()


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_parses_are_bounded_and_clients_take_turns(concurrency):
    medium = b'{"model":"%s","messages":[' + b",".join([b'{"a":1}'] * 30_000) + b"]}"
    parser = BodyParser(concurrency=concurrency)
    busy: list[int] = []
    sampling = True
    done: list[str] = []
    started: list[str] = []  # the order the parses got a worker's slot (two at once finish in either order)
    exchange = parser._exchange

    async def recorded(body: bytes, limit: int) -> tuple[int, bytes]:
        started.append(body[len(b'{"model":"'):].split(b'"', 1)[0].decode())
        return await exchange(body, limit)

    parser._exchange = recorded  # type: ignore[method-assign]

    async def sample() -> None:
        while sampling:
            busy.append(len(parser._busy))
            await asyncio.sleep(0.002)

    async def one(client: str, name: str) -> None:
        assert (await parser.parse(medium % name.encode(), client))["model"] == name
        done.append(name)

    sampler = asyncio.ensure_future(sample())
    try:
        # a1 starts; a2 and a3 queue, then b1: b1 goes before a's second body
        jobs = [asyncio.ensure_future(one("a", "a1")), asyncio.ensure_future(one("a", "a2")),
                asyncio.ensure_future(one("a", "a3"))]
        await asyncio.sleep(0)
        jobs.append(asyncio.ensure_future(one("b", "b1")))
        await asyncio.gather(*jobs)
    finally:
        sampling = False
        await sampler
        await parser.aclose()
    assert max(busy) == concurrency and parser.started == concurrency and parser.waiting == 0
    if concurrency == 1:
        assert started == done == ["a1", "b1", "a2", "a3"]
    else:  # a1 and a2 start at once; b1 takes the first slot to come free (and a3 the next)
        assert sorted(started[:2]) == ["a1", "a2"] and started[2:] == ["b1", "a3"], started


async def test_a_caller_that_goes_away_leaves_the_worker_to_finish():
    body = b'{"model":"m","messages":[' + b",".join([b'{"a":1}'] * 100_000) + b"]}"
    parser = BodyParser()
    try:
        await parser.parse(_pad(b'{"warm": 1}'))
        parse = asyncio.ensure_future(parser.parse(body))
        await asyncio.sleep(0.02)
        parse.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parse
        assert (await parser.parse(_pad(b'{"model": "next"}')))["model"] == "next"  # after the cancelled one
        assert parser.started == 1 and parser.failed == 0
    finally:
        await parser.aclose()


async def test_aclose_ends_parses_in_flight_and_leaves_no_process():
    me = psutil.Process()
    before = {child.pid for child in me.children()}
    body = b'{"model":"m","messages":[' + b",".join([b'{"a":1}'] * 300_000) + b"]}"
    parser = BodyParser(concurrency=2)
    await parser.parse(_pad(b'{"warm": 1}'))
    parses = [asyncio.ensure_future(parser.parse(body)) for _ in range(3)]
    await asyncio.sleep(0.05)
    await parser.aclose()
    for parse in parses:
        with pytest.raises(ParserUnavailable, match="closed"):
            await parse
    assert {child.pid for child in me.children()} == before and parser.workers == 0
    with pytest.raises(ParserUnavailable):
        await parser.parse(body)
    assert await parser.parse(b'{"small": true}') == {"small": True}  # inline still parses


def test_the_worker_exits_when_the_proxy_dies():
    script = (
        "import asyncio, os\n"
        "from vsup.proxy.bodyparse import BodyParser\n"
        "async def main():\n"
        "    parser = BodyParser(inline_bytes=0)\n"
        "    await parser.parse(b'{}')\n"
        "    print(parser._idle[0].process.pid, flush=True)\n"
        "    os._exit(0)\n"  # no cleanup: as if killed
        "asyncio.run(main())\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    pid = int(result.stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break  # exited; its new parent has not reaped it
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the worker outlived the proxy")


def test_the_worker_runs_alone_from_its_file_with_the_standard_library_only():
    body = json.dumps(CHAT).encode()
    request = worker.REQUEST.pack(len(body), 2048) + body
    result = subprocess.run([sys.executable, "-I", "-S", worker.__file__], input=request,
                            capture_output=True, timeout=60, cwd=ROOT)
    received, reply = result.stdout[:1], result.stdout[1:]
    kind, size = worker.REPLY.unpack(reply[:worker.REPLY.size])
    assert result.returncode == 0 and result.stderr == b"" and received == worker.RECEIVED
    assert kind == worker.OK and pickle.loads(reply[worker.REPLY.size:]) == (CHAT, [], 0)


def test_on_uvloop_as_the_proxy_runs():
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        me = psutil.Process()
        before = {child.pid for child in me.children()}
        parser = BodyParser()
        try:
            assert _same(await parser.parse(_pad(json.dumps(NORMAL[2]).encode())), NORMAL[2])
            with pytest.raises(json.JSONDecodeError, match="Expecting value: line 1 column 7"):
                await parser.parse(_pad(b'{"a": }'))
            os.kill(parser._idle[0].process.pid, signal.SIGKILL)
            assert (await parser.parse(_pad(b'{"model": "m"}')))["model"] == "m"
            assert parser.started == 2 and parser.failed == 0
        finally:
            await parser.aclose()
        assert {child.pid for child in me.children()} == before

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
