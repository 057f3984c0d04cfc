"""prefix_affinity: the routing key (prefix of chat messages and prompts, session header, `user`),
rendezvous hashing (stable when instances leave and join, weighted), the load escape, and the
policy end to end with the `openai` SDK in front of fake vLLM processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from tests.proxy_support import client, metric_value, metrics_text, ready_pool, running_proxy, start_fakes, url
from vsup.config.schema import ProxyConfig
from vsup.proxy.affinity import PrefixAffinity, prefix_text, routing_key
from vsup.proxy.backends import Backend
from vsup.proxy.balancer import make_balancer
from vsup.proxy.codec import parse_json

LIMIT = 2048
LONG_SYSTEM = "You answer questions about the attached manual. " * 60  # ~2900 characters


def chat(*turns: tuple[str, object], **extra) -> dict:
    return {"model": "m", "messages": [{"role": role, "content": content} for role, content in turns], **extra}


def key(document, headers=None, limit: int = LIMIT):
    return routing_key(document, headers, limit)


def backends(*names: str) -> tuple[Backend, ...]:
    return tuple(Backend(name, f"http://{name}:8000") for name in names)


def winner(balancer: PrefixAffinity, ready, text: str, in_flight=None, tried=()) -> str:
    chosen = balancer.choose(ready, in_flight or {}, tried, key({"prompt": text}))
    return chosen.name


# ---------------------------------------------------------------------------------- the key


def test_a_conversation_keeps_its_key_as_it_grows():
    first = chat(("system", "Be brief."), ("user", "What is NUMA?"))
    later = chat(("system", "Be brief."), ("user", "What is NUMA?"), ("assistant", "Memory per socket."),
                 ("user", "And SMT?"))
    assert key(first) == key(later)
    # another conversation with the same short system prompt is another key (it spreads)
    assert key(chat(("system", "Be brief."), ("user", "What is SMT?"))) != key(first)


def test_a_system_prompt_longer_than_the_limit_is_the_whole_key():
    one = chat(("system", LONG_SYSTEM), ("user", "question one"))
    two = chat(("system", LONG_SYSTEM), ("user", "question two"))
    assert key(one) == key(two)
    assert key(one, limit=len(LONG_SYSTEM) + 50) != key(two, limit=len(LONG_SYSTEM) + 50)
    # a different system prompt, or another model, is another key
    assert key(chat(("system", LONG_SYSTEM.upper()), ("user", "question one"))) != key(one)
    assert key({**one, "model": "other"}) != key(one)


def test_prefix_text_stops_at_the_first_user_message_and_the_limit():
    few_shot = [("system", "Translate."), ("user", "cat"), ("assistant", "chat"), ("user", "dog")]
    text = prefix_text(chat(*few_shot), LIMIT)
    assert "cat" in text and "chat" not in text and "dog" not in text
    assert len(prefix_text(chat(("system", "x" * 10_000), ("user", "y")), 100)) == 100
    assert prefix_text(chat(("user", "x" * 50)), 10) == "user\x1f" + "x" * 5


def test_tricky_json_is_read_as_json_not_scanned():
    # Escaped quotes that spell out a user message inside the system prompt: a scanner looking for
    # "role": "user" would stop there and give both bodies the same key.
    decoy = 'Quote: {\\"role\\": \\"user\\", \\"content\\": \\"decoy\\"} and a backslash \\\\ end'
    one = parse_json(('{"model": "m", "messages": [{"role": "system", "content": "%s"}, '
                      '{"role": "user", "content": "first"}]}' % decoy).encode())
    two = parse_json(('{"model": "m", "messages": [{"role": "system", "content": "%s"}, '
                      '{"role": "user", "content": "second"}]}' % decoy).encode())
    assert one["messages"][0]["content"].count('"role": "user"') == 1
    assert key(one) != key(two)
    # the same text escaped (\u00e9, \ud83d\ude00) or not, spaced and ordered differently: one key
    escaped = parse_json(b'{"messages":[{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00"}],"model":"m"}')
    plain = parse_json('{ "model" : "m", "messages" : [ { "content" : "café 😀", "role" : "user" } ] }'.encode())
    assert key(escaped) == key(plain)
    # a lone surrogate is valid JSON and must not break the hash
    lone = parse_json(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800 alone"}]}')
    assert key(lone) is not None and key(lone) != key(plain)


def test_content_parts_text_and_images():
    def parts(*items):
        return chat(("user", list(items)))

    text = {"type": "text", "text": "describe"}
    cat = {"type": "image_url", "image_url": {"url": "data:image/png;base64,CAT"}}
    dog = {"type": "image_url", "image_url": {"url": "data:image/png;base64,DOG"}}
    assert key(parts(text, cat)) == key(parts(text, cat))
    assert key(parts(text, cat)) != key(parts(text, dog))
    assert key(parts(text, cat)) != key(parts(cat, text))
    assert "describe" in prefix_text(parts(text, cat), LIMIT)
    # an image-only message still has a key; a part of an unknown shape is skipped, not an error
    assert key(parts(cat)) is not None
    assert key(parts(5, None, {"type": 7})) is not None


def test_completion_prompts_strings_batches_and_token_ids():
    long_doc = "word " * 1000
    assert key({"prompt": long_doc + "first?"}) == key({"prompt": long_doc + "second?"})
    assert key({"prompt": "short first?"}) != key({"prompt": "short second?"})
    assert key({"prompt": ["same start", "x"]}) == key({"prompt": ["same start", "y"]})
    ids = list(range(1000))
    assert key({"prompt": ids + [1]}) == key({"prompt": ids + [2]})  # LIMIT / 4 = 512 ids decide
    assert key({"prompt": [ids + [1], [7]]}) == key({"prompt": ids})
    assert key({"prompt": [1, 2, 3]}) != key({"prompt": [1, 2, 4]})
    # the Responses API: instructions, then the input
    assert key({"instructions": "Be brief.", "input": "hi"}) != key({"instructions": "Be brief.", "input": "ho"})


@pytest.mark.parametrize("document", [
    None, [], "text", {}, {"model": "m"}, {"messages": []}, {"messages": "not a list"}, {"messages": [5]},
    {"prompt": []}, {"prompt": [1.5, 2]}, {"prompt": [True, False]}, {"prompt": ""}, {"tokens": [1, 2, 3]},
])
def test_requests_without_a_prefix_have_no_key(document):
    assert key(document) is None


def test_a_session_pins_whatever_the_prompt():
    a = chat(("user", "first question"))
    b = chat(("user", "something else entirely"))
    assert key(a, {"X-Session-ID": "s1"}) == key(b, {"X-Session-ID": "s1"})
    assert key(a, {"X-Session-ID": "s1"}).kind == "session"
    assert key(a, {"X-Session-ID": "s1"}) != key(a, {"X-Session-ID": "s2"})
    assert key({**a, "user": "ann"}) == key({**b, "user": "ann"})
    assert key({**a, "user": "ann"}).kind == "session"
    # the header wins over `user`; empty values are no session
    assert key({**a, "user": "ann"}, {"X-Session-ID": "s1"}) == key(b, {"X-Session-ID": "s1"})
    assert key({**a, "user": ""}, {"X-Session-ID": ""}) == key(a)
    assert key(None, {"X-Session-ID": "s1"}) == key(b, {"X-Session-ID": "s1"})


# ---------------------------------------------------------------------------------- the choice

TEXTS = [f"conversation {i} opening" for i in range(10_000)]


def assignment(balancer: PrefixAffinity, ready) -> dict[str, str]:
    return {text: winner(balancer, ready, text) for text in TEXTS}


def test_keys_spread_evenly():
    shares = Counter(assignment(PrefixAffinity(), backends(*"abcd")).values())
    assert all(abs(count / len(TEXTS) - 0.25) < 0.02 for count in shares.values()), shares


def test_an_instance_leaving_moves_only_its_own_keys():
    balancer = PrefixAffinity()
    before = assignment(balancer, backends(*"abcde"))
    after = assignment(balancer, backends(*"abde"))  # c leaves
    moved = {text for text in TEXTS if before[text] != after[text]}
    assert moved == {text for text in TEXTS if before[text] == "c"}
    assert abs(len(moved) / len(TEXTS) - 0.2) < 0.02
    # c's keys are shared out among the others, not dumped on one
    assert all(abs(count / len(moved) - 0.25) < 0.05 for count in Counter(after[t] for t in moved).values())
    # c back: its old keys stay where they went (their prefixes are cached there now)
    assert assignment(balancer, backends(*"abcde")) == after


def test_an_instance_joining_takes_new_keys_and_moves_none_that_are_placed():
    balancer = PrefixAffinity()
    before = assignment(balancer, backends(*"abcd"))
    # placed keys stay where their prefixes are cached: e and f take none of them
    assert assignment(balancer, backends(*"abcdef")) == before
    # new keys spread over all six, e and f included
    fresh = Counter(winner(balancer, backends(*"abcdef"), f"new {i}") for i in range(6000))
    assert len(fresh) == 6 and all(abs(count / 6000 - 1 / 6) < 0.02 for count in fresh.values()), fresh
    # at rest placement is rendezvous hashing: a proxy that never saw the keys (restarted, or a
    # second one) gives e and f exactly the keys they win, and moves nothing else
    rest = assignment(PrefixAffinity(), backends(*"abcdef"))
    moved = [text for text in TEXTS if before[text] != rest[text]]
    assert {rest[text] for text in moved} == {"e", "f"}
    assert abs(len(moved) / len(TEXTS) - 2 / 6) < 0.02


def test_weights_give_proportional_shares_and_move_only_the_reweighted_keys():
    balancer = PrefixAffinity()
    balancer.set_weight("a", 3)
    before = assignment(balancer, backends("a", "b"))
    assert abs(Counter(before.values())["a"] / len(TEXTS) - 0.75) < 0.02
    # at rest (a proxy that placed nothing yet) the weight 1 gives a half, moving keys only off a
    after = assignment(PrefixAffinity(), backends("a", "b"))
    assert abs(Counter(after.values())["a"] / len(TEXTS) - 0.5) < 0.02
    assert all(before[t] == "a" and after[t] == "b" for t in TEXTS if before[t] != after[t])
    # a host's ready instances drop: its placed keys stay where they are cached (the bound, per
    # unit of weight, sheds its load), and new keys follow the new weights
    balancer.set_weight("a", 1)
    assert assignment(balancer, backends("a", "b")) == before
    fresh = Counter(winner(balancer, backends("a", "b"), f"new {i}") for i in range(4000))
    assert abs(fresh["a"] / 4000 - 0.5) < 0.03


def test_a_retry_goes_to_the_keys_next_choice():
    balancer = PrefixAffinity()
    ready = backends(*"abcd")
    for text in TEXTS[:200]:
        first = winner(balancer, ready, text)
        second = winner(balancer, ready, text, tried=[first])
        assert second != first
        assert second == winner(balancer, tuple(b for b in ready if b.name != first), text)
    assert balancer.choose(ready, {}, list("abcd"), key({"prompt": "x"})) is None
    assert balancer.choose((), {}, (), key({"prompt": "x"})) is None


def test_the_load_bound():
    ready = backends(*"abc")
    text = next(t for t in TEXTS if winner(PrefixAffinity(), ready, t) == "a")
    second = winner(PrefixAffinity(), backends("b", "c"), text)  # the key's next choice
    balancer = PrefixAffinity(load_factor=0.25)
    assert winner(balancer, ready, text) == "a"  # placed on a, its best score (nothing in flight)
    # 12 in flight + this one: at most ceil(1.25 * 13 / 3) = 6 each; a with 5 + 1 stays within
    assert winner(balancer, ready, text, {"a": 5, "b": 3, "c": 4}) == "a"
    # 13 + 1: at most ceil(1.25 * 14 / 3) = 6; a with 6 + 1 is over: the key's next instance
    assert winner(balancer, ready, text, {"a": 6, "b": 3, "c": 4}) == second
    assert balancer.placed(key({"prompt": text})) == "a"  # an escape leaves the key where its cache is
    assert balancer.decisions == {"placed": 1, "affinity": 1, "escaped": 1}
    # a new key: the least loaded instance, whatever its score; among equally least loaded
    # instances, the key's higher-scored one
    assert winner(PrefixAffinity(), ready, text, {"a": 1, "b": 2}) == "c"
    tied = winner(PrefixAffinity(), ready, text, {"a": 9})
    assert tied == second
    # per unit of weight: a with weight 4 and 8 in flight is as loaded as b with 2
    balancer.set_weight("a", 4)
    heavy = next(t for t in TEXTS if winner(balancer, ready, t) == "a")
    assert winner(balancer, ready, heavy, {"a": 8, "b": 2, "c": 2}) == "a"
    # a's share of 35 (34 + 1) is 4/6: at most ceil(1.25 * 35 * 4 / 6) = 30, and 30 + 1 is over
    assert winner(balancer, ready, heavy, {"a": 29, "b": 3, "c": 2}) == "a"
    assert winner(balancer, ready, heavy, {"a": 30, "b": 2, "c": 2}) != "a"


def test_decisions_are_counted_and_requests_without_a_key_go_to_the_least_loaded():
    balancer = make_balancer("prefix_affinity", ProxyConfig(affinity_load_factor=0, affinity_prefix_chars=64))
    assert isinstance(balancer, PrefixAffinity) and balancer.prefix_chars == 64 and balancer.load_factor == 0
    ready = backends("a", "b")
    assert balancer.choose(ready, {"a": 1}, (), None).name == "b"
    assert {balancer.choose(ready, {}, (), None).name for _ in range(4)} == {"a", "b"}  # ties rotate
    text_key = key({"prompt": "hello"})
    chosen = balancer.choose(ready, {}, (), text_key).name  # new: placed
    balancer.choose(ready, {chosen: 1}, (), text_key)  # load factor 0: at most ceil(2 / 2) = 1 each, escapes
    assert balancer.choose(ready, {}, (), text_key).name == chosen  # back to its instance
    for _ in range(2):
        balancer.choose(ready, {}, (), key(None, {"X-Session-ID": "s"}))  # placed, then the session's
    assert balancer.decisions == {"no_prefix": 5, "placed": 2, "affinity": 1, "escaped": 1, "session": 1}


@pytest.mark.parametrize("setting, message", [
    ("affinity_load_factor: -1", "proxy.affinity_load_factor"),
    # the key it replaced: refused, naming the new one, not run with a meaning it did not ask for
    ("affinity_max_imbalance: 4", "proxy.affinity_max_imbalance: replaced by proxy.affinity_load_factor"),
    ("affinity_prefix_chars: 8", "proxy.affinity_prefix_chars"),
    ("affinity_prefix_chars: 2048.5", "proxy.affinity_prefix_chars"),
])
def test_bad_affinity_settings_are_one_line_naming_the_key(tmp_path, setting, message):
    config = tmp_path / "proxy.yaml"
    config.write_text(f"proxy:\n  policy: prefix_affinity\n  {setting}\n")
    vsup = str(Path(sys.executable).parent / "vsup")
    result = subprocess.run([vsup, "proxy", "--upstream", "http://127.0.0.1:9", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"vsup: error: {config}:3: {message}") and result.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def fakes():
    started = start_fakes(["a", "b", "c"])
    yield started
    for fake in started:
        fake.cleanup()


async def test_openai_client_conversations_stick_to_one_instance(fakes):
    async with running_proxy(ready_pool(fakes), policy="prefix_affinity") as proxy:
        c = client(proxy)
        seen: dict[int, set[str]] = {}
        for session in range(12):
            system = f"Manual number {session}. " + LONG_SYSTEM
            for question in range(3):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {question}?"}]
                if question == 1:  # streamed: the same routing
                    stream = await c.chat.completions.with_raw_response.create(
                        model="fake-model", messages=messages, max_tokens=2, stream=True)
                    name = stream.headers["x-fake-instance"]
                    async for _ in stream.parse():
                        pass
                else:
                    raw = await c.chat.completions.with_raw_response.create(model="fake-model", messages=messages, max_tokens=2)
                    name = raw.headers["x-fake-instance"]
                seen.setdefault(session, set()).add(name)
        assert all(len(names) == 1 for names in seen.values()), seen
        assert len(set().union(*seen.values())) >= 2  # 12 sessions over 3 instances: spread
        # completions sharing a long document do the same
        document = "Chapter one. " * 400
        names = set()
        for question in range(4):
            raw = await c.completions.with_raw_response.create(model="fake-model", prompt=f"{document} Q{question}:", max_tokens=2)
            names.add(raw.headers["x-fake-instance"])
        assert len(names) == 1
        text = await metrics_text(proxy)
        # 13 keys placed (12 sessions, 1 document), each later request sent back to its instance
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="placed") == 13
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="affinity") == 27
        # the instances' own prefix caches saw the repeats (the fake counts like vLLM)
        hits = 0
        async with aiohttp.ClientSession() as session:
            for fake in fakes:
                async with session.get(f"{fake.url}/metrics") as response:
                    hits += metric_value(await response.text(), "vllm:prefix_cache_hits_total")
        assert hits > 0


async def test_an_instance_leaving_moves_only_its_sessions_which_stay_where_they_went(fakes):
    pool = ready_pool(fakes)
    async with running_proxy(pool, policy="prefix_affinity") as proxy:
        c = client(proxy)

        async def where() -> dict[int, str]:
            out = {}
            for session in range(24):
                raw = await c.chat.completions.with_raw_response.create(
                    model="fake-model", max_tokens=1, messages=[{"role": "user", "content": f"session {session} opens"}])
                out[session] = raw.headers["x-fake-instance"]
            return out

        before = await where()
        gone = Counter(before.values()).most_common(1)[0][0]
        pool.set_state(gone, "unhealthy", False)
        during = await where()
        assert {s for s in before if before[s] != during[s]} == {s for s in before if before[s] == gone}
        assert gone not in during.values()
        pool.set_state(gone, "ready", True)
        assert await where() == during  # back: the moved sessions' prefixes are cached where they went
        # and it takes new sessions again
        new = []
        for session in range(24):
            raw = await c.chat.completions.with_raw_response.create(
                model="fake-model", max_tokens=1, messages=[{"role": "user", "content": f"new session {session} opens"}])
            new.append(raw.headers["x-fake-instance"])
        assert gone in new


async def test_a_session_stays_beside_decoding_streams_and_moves_from_a_prefill_queue(fakes):
    """The bound counts the work before a new first token (load.work): streams in decode weigh a
    half each, requests still without their first byte one prefill each (issue 34)."""
    async with running_proxy(ready_pool(fakes[:2]), policy="prefix_affinity", load_interval=0.05) as proxy:
        # the bound alone: one key stands for the session here, so its requests in flight would make
        # it a hot key and spread (the next test)
        proxy._forwarder.balancer.hot_in_flight = 99
        c = client(proxy)
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "hold on"}]
        streams, names = [], []
        for _ in range(3):  # three streams decoding on the session's instance, the other idle
            raw = await c.chat.completions.with_raw_response.create(
                model="fake-model", messages=messages, max_tokens=50, stream=True, extra_body={"fake": {"token_delay": 0.2}})
            names.append(raw.headers["x-fake-instance"])
            stream = raw.parse()
            await anext(aiter(stream))  # its first token is out: decoding
            streams.append(stream)
        home = names[0]
        assert set(names) == {home}  # 3 x 1/2 = 1 whole + 1 within ceil(1.25 * 2 / 2) = 2 (in whole requests: 4 > 3, escaped)
        await asyncio.sleep(0.2)  # the engines' samples agree: their 3 running are the proxy's own
        raw = await c.chat.completions.with_raw_response.create(model="fake-model", messages=messages, max_tokens=1)
        assert raw.headers["x-fake-instance"] == home
        for stream in streams:
            await stream.close()
        while proxy.in_flight():  # the proxy sees the closed streams end
            await asyncio.sleep(0.01)

        # Two new turns of the conversation, each adding 1.2x the size of a whole first request (the
        # prefill they need: the rest is cached there), whose first tokens are long in coming.
        turn = "more " * (len(json.dumps({"model": "fake-model", "messages": messages, "max_tokens": 1})) * 24 // 100)
        grown = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": turn}]

        async def waiting(history: list) -> str:
            raw = await c.chat.completions.with_raw_response.create(
                model="fake-model", messages=history, max_tokens=1, extra_body={"fake": {"first_token_delay": 3.0}})
            return raw.headers["x-fake-instance"]

        queued = [asyncio.ensure_future(waiting(grown))]
        while sum(proxy.in_flight().values()) < 1:
            await asyncio.sleep(0.01)
        # within the bound: 1.2 / 3.4 of its own size (3.4x the first) is 0 whole
        queued.append(asyncio.ensure_future(waiting([*grown, {"role": "assistant", "content": "ok"}, {"role": "user", "content": turn + "!"}])))
        while sum(proxy.in_flight().values()) < 2:
            await asyncio.sleep(0.01)
        assert proxy.in_flight() == {home: 2}
        raw = await c.chat.completions.with_raw_response.create(model="fake-model", messages=messages, max_tokens=1)
        assert raw.headers["x-fake-instance"] != home  # 1.2 + 1.2 = 2 of its size queued there, 2 + 1 over ceil(1.25 * 3 / 2) = 2: moved
        assert await asyncio.gather(*queued) == [home, home]
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="escaped") == 1


async def test_a_hot_key_spreads_to_an_idle_instance_and_stays_placed(fakes):
    """One prompt in front of every request (a shared system prompt): its streams in decode weigh
    little against the bound, yet all of them on one instance leave the other idle (issue 34's
    hot key). With two in flight at its instance the next goes where fewer are, the same instance
    each time; the key stays placed at home."""
    async with running_proxy(ready_pool(fakes[:2]), policy="prefix_affinity", load_interval=0.05) as proxy:
        c = client(proxy)
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "hot"}]
        streams, names = [], []
        for _ in range(5):
            raw = await c.chat.completions.with_raw_response.create(
                model="fake-model", messages=messages, max_tokens=50, stream=True, extra_body={"fake": {"token_delay": 0.2}})
            names.append(raw.headers["x-fake-instance"])
            stream = raw.parse()
            await anext(aiter(stream))  # decoding
            streams.append(stream)
        home = names[0]
        other = ({"a", "b"} - {home}).pop()
        # 1 in flight: home; 2: hot, the idle one; then 2 : 1, the same one; at 2 : 2 none has fewer: home
        assert names == [home, home, other, other, home]
        balancer = proxy._forwarder.balancer
        assert balancer._flights == {(home, balancer._digest): 3, (other, balancer._digest): 2}
        for stream in streams:
            await stream.close()
        while proxy.in_flight():
            await asyncio.sleep(0.01)
        assert balancer._flights == {}  # every request released what it held
        raw = await c.chat.completions.with_raw_response.create(model="fake-model", messages=messages, max_tokens=1)
        assert raw.headers["x-fake-instance"] == home  # still placed where it was
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="spread") == 2
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="escaped") == 0


async def test_session_header_and_user_field_pin_a_conversation(fakes):
    async with running_proxy(ready_pool(fakes), policy="prefix_affinity") as proxy:
        c = client(proxy)
        for session in ("s1", "s2", "s3"):
            names = set()
            for question in range(4):
                raw = await c.chat.completions.with_raw_response.create(
                    model="fake-model", max_tokens=1, messages=[{"role": "user", "content": f"unrelated {question}"}],
                    extra_headers={"X-Session-ID": session})
                names.add(raw.headers["x-fake-instance"])
            assert len(names) == 1
        names = set()
        for question in range(4):
            raw = await c.chat.completions.with_raw_response.create(
                model="fake-model", max_tokens=1, user="ann", messages=[{"role": "user", "content": f"other {question}"}])
            names.add(raw.headers["x-fake-instance"])
        assert len(names) == 1
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="placed") == 4
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="session") == 12


async def test_requests_without_a_prefix_are_spread_like_least_outstanding(fakes):
    async with running_proxy(ready_pool(fakes), policy="prefix_affinity") as proxy:
        async with aiohttp.ClientSession() as session:
            names = []
            for _ in range(6):
                async with session.post(url(proxy, "/detokenize"), json={"tokens": [1, 2]}) as response:
                    assert response.status == 200
                    names.append(response.headers["X-Fake-Instance"])
            async with session.post(url(proxy, "/v1/completions"), data=b"not json", headers={"Content-Type": "text/plain"}) as response:
                await response.read()
        assert Counter(names) == {"a": 2, "b": 2, "c": 2}
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="prefix_affinity", decision="no_prefix") == 7


async def test_round_robin_reports_no_policy_decisions(fakes):
    async with running_proxy(ready_pool(fakes)) as proxy:
        await client(proxy).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=1)
        assert "vsup_proxy_policy_decisions_total{" not in await metrics_text(proxy)


def test_vsup_run_with_prefix_affinity_and_the_instances_cache_hits_in_its_metrics(tmp_path):
    """The whole chain: proxy.policy in the YAML, `vsup run` over two fake instances, sessions that
    share long system prompts, and each instance's prefix-cache counters re-exported on the proxy's
    /metrics beside the policy's decisions."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.vsup_harness import VsupRun, instance_get, make_config

    config = make_config(tmp_path, proxy={"policy": "prefix_affinity"}, metrics={"interval": 0.3, "timeout": 1.0},
                         vllm={"env": {"FAKE_VLLM_TOKEN_DELAY": "0.001", "FAKE_VLLM_ACCESS_LOG": "0",
                                       "FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0"}})
    run = VsupRun(tmp_path, config)
    try:
        run.wait_ready()
        sessions = 5  # odd: round robin, alternating, would send each session to both instances
        for question in range(3):
            for session in range(sessions):
                body = chat(("system", f"Manual {session}. " + LONG_SYSTEM), ("user", f"question {question}"), max_tokens=1)
                body["model"] = "fake-model"
                request = urllib.request.Request(f"http://127.0.0.1:{run.proxy_port}/v1/chat/completions",
                                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    assert response.status == 200

        def families(address: str) -> dict:  # an instance's socket, or the proxy's host:port
            status, body = instance_get(address, "/metrics", timeout=10)
            assert status == 200
            return {f.name: f for f in text_string_to_metric_families(body.decode())}

        def per_instance(found: dict, name: str) -> dict[str, float]:
            family = found.get(name)
            return {s.labels.get("instance", ""): s.value for s in family.samples if s.name == name + "_total"} if family else {}

        # what the instances count now, all requests answered; the collector re-exports every 0.3 s
        addresses = [inst["address"] for inst in run.status()["instances"]]
        final = {str(i): per_instance(families(addresses[i]), "vllm:prefix_cache_queries")[""] for i in range(2)}
        deadline = time.monotonic() + 30
        while True:
            found = families(f"127.0.0.1:{run.proxy_port}")
            queries = per_instance(found, "vllm:prefix_cache_queries")
            if queries == final or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        hits = per_instance(found, "vllm:prefix_cache_hits")
        assert queries == final, (queries, final)
        # every session's second and third question found its system prompt cached: 2 of 3 hit
        assert sum(hits.values()) / sum(queries.values()) > 0.6
        decisions = {s.labels["decision"]: s.value for s in found["vsup_proxy_policy_decisions"].samples}
        assert decisions == {"placed": sessions, "affinity": 2 * sessions}
    finally:
        run.close()


def test_reconfigure_applies_affinity_settings_and_policy():
    """`vsup reload`: a changed affinity setting reaches the running balancer (counts kept), and a
    switch to prefix_affinity builds it with the new config's settings, not the defaults."""
    from vsup.config.schema import ProxyConfig
    from vsup.proxy.backends import BackendPool
    from vsup.proxy.server import ProxyServer

    proxy = ProxyServer(ProxyConfig(policy="prefix_affinity"), BackendPool())
    before = proxy._balancer
    proxy.reconfigure(ProxyConfig(policy="prefix_affinity", affinity_prefix_chars=512, affinity_load_factor=0.5), None)
    assert proxy._balancer is before and (before.prefix_chars, before.load_factor) == (512, 0.5)
    proxy = ProxyServer(ProxyConfig(policy="round_robin"), BackendPool())
    proxy.reconfigure(ProxyConfig(policy="prefix_affinity", affinity_prefix_chars=300), None)
    assert proxy._balancer.prefix_chars == 300 and proxy.metrics.policy == "prefix_affinity"
