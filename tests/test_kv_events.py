"""kv_events + kv_aware over real ZMQ sockets: the fake vLLM's publisher (tests/fakevllm/kv_events.py,
vLLM 0.32's wire format), the subscriber's replay of a missed batch, the clears that replay
cannot avoid (no buffer, a restarted publisher, an instance out of the rotation), and kv_aware
end to end in front of fake vLLM processes that publish their prefix cache's events."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.fakevllm.kv_events import KvEventPublisher
from tests.proxy_support import LEAN, running_proxy, url, wait_for
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.kv_aware import KvAware, Tokens, tokenize_body
from vsup.proxy.kv_events import KvEvents
from vsup.proxy.kv_index import InstanceIndex, block_keys
from vsup.proxy.load import Prefill

BS = 4


def stored(hashes, tokens, parent=None):
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "token_ids": list(tokens),
            "block_size": BS, "extra_keys": None, "group_idx": 0}


def endpoint(tmp_path: Path, name: str = "0") -> str:
    return f"ipc://{tmp_path}/{name}.kv"


def publisher(tmp_path: Path, name: str = "0") -> KvEventPublisher:
    ep = endpoint(tmp_path, name)
    return KvEventPublisher({"endpoint": ep, "replay_endpoint": ep + "r", "topic": "kv"})


def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def connected(events: KvEvents, pub: KvEventPublisher, name: str = "0") -> None:
    """PUB/SUB drops what is sent before the subscription reached the publisher: send a probe
    until one arrives (a block of its own: tests look only at theirs)."""
    seen = events.received
    deadline = time.monotonic() + 10
    while events.received == seen:
        assert time.monotonic() < deadline, "the subscriber never received a batch"
        pub.publish([stored([1], [0] * BS)])
        time.sleep(0.1)


def held(events: KvEvents, tokens, name: str = "0") -> int:
    return events.matched(name, block_keys(tokens, BS))


A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]


def test_a_missed_batch_is_filled_from_the_replay_socket(tmp_path):
    pub = publisher(tmp_path)
    events = KvEvents()
    try:
        events.watch("0", endpoint(tmp_path))
        connected(events, pub)
        until(lambda: pub.seq == (events.indexes["0"].last_seq or 0) + 1, what="the probes delivered")
        pub.drop = {pub.seq, pub.seq + 1, pub.seq + 2}  # the next three never arrive live
        pub.publish([stored([10], A)])
        pub.publish([stored([11], B, parent=10)])
        pub.publish([{"type": "BlockRemoved", "block_hashes": [11], "group_idx": 0}])
        pub.publish([stored([12], C)])  # a gap before it, filled by replay
        until(lambda: held(events, C) == 1, what="the batch after the gap")
        assert held(events, A) == 1 and held(events, A + B) == 1  # stored and then removed: both replayed
        assert events.replayed >= 3 and events.indexes["0"].cleared == 0
    finally:
        events.close()
        pub.close()


def test_a_gap_replay_cannot_fill_clears_the_instance(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_KV_EVENTS_BUFFER", "0")  # nothing kept for replay
    pub = publisher(tmp_path)
    events = KvEvents()
    try:
        events.watch("0", endpoint(tmp_path))
        connected(events, pub)
        until(lambda: pub.seq == (events.indexes["0"].last_seq or 0) + 1, what="the probes delivered")
        pub.publish([stored([10], A)])
        until(lambda: held(events, A) == 1, what="A")
        pub.drop = {pub.seq}
        pub.publish([{"type": "BlockRemoved", "block_hashes": [10], "group_idx": 0}])  # lost, and not replayable
        pub.publish([stored([12], C)])
        until(lambda: held(events, C) == 1, what="C")
        assert held(events, A) == 0  # A may be gone: it is not claimed
        assert events.indexes["0"].cleared == 1
    finally:
        events.close()
        pub.close()


def test_a_restarted_publisher_clears_what_the_old_one_said(tmp_path):
    """A dropped connection forgets the instance's blocks at once; a new publisher's batches are
    never read as the old one's, even when its sequence seems to follow on."""
    pub = publisher(tmp_path)
    events = KvEvents()
    try:
        events.watch("0", endpoint(tmp_path))
        connected(events, pub)
        pub.publish([stored([10], A)])
        until(lambda: held(events, A) == 1, what="A")
        for _ in range(5):  # the old publisher goes on so its sequence is ahead of what the new one will send
            pub.publish([stored([1], [0] * BS)])
        until(lambda: events.indexes["0"].last_seq == pub.seq - 1, what="the old batches")
        pub.close()  # the process dies: its connection drops, and the index forgets at once
        until(lambda: held(events, A) == 0, what="A forgotten when the publisher went away")
        assert events.disconnects >= 1
        old_next = pub.seq
        pub = publisher(tmp_path)  # the same endpoint, a new process
        pub.seq = old_next  # the worst case: its sequence happens to go on where the old one's stopped
        deadline = time.monotonic() + 15
        while held(events, C) == 0:  # the subscriber reconnects by itself; what it missed comes by replay
            assert time.monotonic() < deadline, "nothing from the new publisher"
            pub.publish([stored([12], C)])
            time.sleep(0.1)
        assert held(events, A) == 0  # the old process's blocks: gone with it
    finally:
        events.close()
        pub.close()


def test_an_instance_out_of_the_rotation_is_forgotten(tmp_path):
    pub = publisher(tmp_path)
    pool = BackendPool([Backend("0", "http://127.0.0.1:9", kv_events=endpoint(tmp_path))])
    pool.set_state("0", "ready", True)
    policy = KvAware()
    policy.attach(pool)
    try:
        asyncio.run(policy.prepare(None, pool.ready(), {}))  # the first request starts following the pool
        connected(policy.events, pub)
        pub.publish([stored([10], A)])
        until(lambda: held(policy.events, A) == 1, what="A")
        pool.set_state("0", "restarting", False)
        assert held(policy.events, A) == 0  # at once, not at the next event
        pool.set_state("0", "ready", True)  # back (it was only ejected, say): followed again
        deadline = time.monotonic() + 10
        while held(policy.events, C) == 0:
            assert time.monotonic() < deadline, "not followed again"
            pub.publish([stored([12], C)])
            time.sleep(0.1)
        # (A may come back too: the replay from 0 of this same, live publisher says it still holds it)
        pool.remove("0")
        assert "0" not in policy.events.indexes
    finally:
        policy.close()
        pub.close()


def test_the_choice_weighs_cached_blocks_against_load():
    events = KvEvents()
    policy = KvAware(load_factor=0.5, events=events)  # at most ceil(1.5 x the mean), this request counted
    ready = (Backend("a", "http://a"), Backend("b", "http://b"))
    for name in ("a", "b"):
        events.indexes[name] = InstanceIndex()
    events.indexes["b"].apply(0, [stored([1, 2], A + B)])
    tokens = Tokens(A + B + C, [])
    assert policy.choose(ready, {}, (), tokens).name == "b"
    assert policy.choose(ready, {"b": 2}, (), tokens).name == "b"  # 3 <= ceil(1.5 x 3/2): within the bound
    assert policy.choose(ready, {"b": 3}, (), tokens).name == "a"  # 4 > ceil(1.5 x 4/2): the least loaded
    assert policy.choose(ready, {}, ("b",), tokens).name == "a"  # a retry goes elsewhere
    assert policy.choose(ready, {"a": 1}, (), Tokens(C, [])).name == "b"  # held nowhere: the least loaded
    assert policy.choose(ready, {"b": 1}, (), None).name == "a"  # no tokens: the least loaded
    assert policy.decisions == {"hit": 2, "miss": 2, "escaped": 1, "no_tokens": 1}  # the retry: a miss among those left
    events.close()


def test_the_bound_counts_prefill_not_decode():
    """With the proxy's load probe, kv_aware's bound is prefix_affinity's work before a first token
    (load.work): decoding streams weigh half a prefill each, requests without a first byte whole."""
    events = KvEvents()
    policy = KvAware(load_factor=0.25, events=events)
    probe = SimpleNamespace(samples={}, interval=1.0, max_age=3.0, prefill=Prefill())  # what LoadProbe holds
    policy.probe = probe  # type: ignore[assignment]
    ready = (Backend("a", "http://a"), Backend("b", "http://b"))
    for name in ("a", "b"):
        events.indexes[name] = InstanceIndex()
    events.indexes["b"].apply(0, [stored([1, 2], A + B)])
    tokens = Tokens(A + B + C, [])
    size = 4000  # body bytes: 1000 prompt tokens
    assert policy.choose(ready, {"b": 3}, (), tokens, size).name == "b"  # 3 decoding: 1 whole, 2 <= ceil(1.25 x 2/2)
    probe.prefill.add("b", 1000.0)
    probe.prefill.add("b", 1000.0)
    assert policy.choose(ready, {"b": 3}, (), tokens, size).name == "a"  # 2 of them queued for prefill: 3 > 2
    assert policy.decisions["hit"] == 1 and policy.decisions["escaped"] == 1
    events.close()


def test_what_is_tokenized():
    assert tokenize_body({"model": "m", "prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenize_body({"model": "m", "prompt": "hi", "max_tokens": 3}) == {"model": "m", "prompt": "hi"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [], "temperature": 0}
    assert tokenize_body(chat) == {"model": "m", "messages": chat["messages"], "tools": []}
    image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert tokenize_body(image) is None
    assert tokenize_body({"model": "m", "prompt": ["a", "b"]}) is None and tokenize_body(None) is None


# ------------------------------------------------------------------ end to end with fake vLLM processes

SYSTEM = " ".join(f"rule{i}" for i in range(64))  # four blocks of the fake's 16 words


def kv_fake(tmp_path: Path, name: str, env=None):
    ep = endpoint(tmp_path, name)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ep, "replay_endpoint": ep + "r", "topic": "kv"}
    return start_fake(name=name, env={**LEAN, **(env or {})}, args=["--kv-events-config", json.dumps(config)])


async def _chat(session, proxy, user: str) -> str:
    body = {"model": "fake-model", "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    async with session.post(url(proxy, "/v1/chat/completions"), json=body) as response:
        assert response.status == 200, await response.text()
        return response.headers["X-Fake-Instance"]


@pytest.mark.timeout(120)
def test_kv_aware_sends_a_shared_prefix_where_its_blocks_are(tmp_path):
    fakes = [kv_fake(tmp_path, name) for name in ("i0", "i1")]
    try:
        for fake in fakes:
            fake.wait_ready()
        pool = BackendPool()
        for fake in fakes:
            pool.add(Backend(fake.name, fake.url, kv_events=endpoint(tmp_path, fake.name)))
            pool.set_state(fake.name, "ready", True)

        async def scenario():
            async with running_proxy(pool, policy="kv_aware") as proxy, aiohttp.ClientSession() as session:
                policy = proxy._balancer
                first = await _chat(session, proxy, "question zero")
                await wait_for(lambda: len(policy.events.indexes.get(first) or ()) >= 4, what="the first chat's blocks")
                served = [await _chat(session, proxy, f"question {n} about something else") for n in range(1, 7)]
                assert served == [first] * 6, served  # every one to the instance that holds the system prompt
                assert policy.decisions["hit"] == 6
                other = next(f.name for f in fakes if f.name != first)
                assert len(policy.events.indexes[other]) == 0
                # the proxy's index is what the instance says: every block it claims is one the fake holds
                fake = next(f for f in fakes if f.name == first)
                assert fake.events("sigterm") == []
            return first

        asyncio.run(scenario())
    finally:
        for fake in fakes:
            fake.cleanup()


@pytest.mark.timeout(120)
def test_kv_aware_without_tokenize_routes_by_load(tmp_path):
    fakes = [kv_fake(tmp_path, name, {"FAKE_VLLM_TOKENIZE": "0"}) for name in ("j0", "j1")]
    try:
        for fake in fakes:
            fake.wait_ready()
        pool = BackendPool()
        for fake in fakes:
            pool.add(Backend(fake.name, fake.url, kv_events=endpoint(tmp_path, fake.name)))
            pool.set_state(fake.name, "ready", True)

        async def scenario():
            async with running_proxy(pool, policy="kv_aware") as proxy, aiohttp.ClientSession() as session:
                served = [await _chat(session, proxy, f"q{n}") for n in range(4)]
                assert sorted(set(served)) == ["j0", "j1"]  # spread: no tokens, no affinity, still served
                assert proxy._balancer.decisions["no_tokens"] == 4

        asyncio.run(scenario())
    finally:
        for fake in fakes:
            fake.cleanup()


def test_no_tokenize_call_when_no_instance_publishes_its_blocks():
    """A standalone `vsup proxy --policy kv_aware` in front of upstreams without KV events: every
    request would be a miss, so none costs a /tokenize."""
    from aiohttp import web

    calls = []

    async def tokenize(request):
        calls.append(request.path)
        return web.json_response({"tokens": [1, 2, 3, 4]})

    async def scenario():
        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        policy = KvAware()
        try:
            key = policy.key({"model": "m", "prompt": "a b c d"}, {})
            assert await policy.prepare(key, (Backend("u", f"http://127.0.0.1:{port}"),), {}) is None
            assert calls == []
            with_events = Backend("k", f"http://127.0.0.1:{port}", kv_events="ipc:///nonexistent/0.kv")
            tokens = await policy.prepare(key, (with_events,), {})
            assert isinstance(tokens, Tokens) and tokens.ids == [1, 2, 3, 4] and calls == ["/tokenize"]
        finally:
            await policy.aclose()
            await runner.cleanup()

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_vsup_run_with_kv_aware(tmp_path):
    """`vsup run` with proxy.policy: kv_aware over fake vLLM: the supervisor gives each instance its
    private events socket, the proxy follows them; chats sharing a system prompt meet the instance
    that holds it; an instance killed and restarted is forgotten (the next chat is a miss, not a
    hit on an empty cache), and routing goes on."""
    import os
    import signal
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.vsup_harness import VsupRun, instance_get, make_config

    config = make_config(tmp_path, proxy={"policy": "kv_aware"},
                         vllm={"env": {"FAKE_VLLM_TOKEN_DELAY": "0.001", "FAKE_VLLM_ACCESS_LOG": "0",
                                       "FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0"}})
    run = VsupRun(tmp_path, config)

    def ask(question: str) -> None:
        body = {"model": "fake-model", "max_tokens": 1,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
        request = urllib.request.Request(f"http://127.0.0.1:{run.proxy_port}/v1/chat/completions",
                                         json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200

    def value(address: str, name: str, **labels) -> float:
        _, text = instance_get(address, "/metrics", timeout=10)
        return sum(s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    proxy = f"127.0.0.1:{run.proxy_port}"
    try:
        status = run.wait_ready()
        addresses = [i["address"] for i in status["instances"]]
        folder = Path(addresses[0].removeprefix("unix:")).parent
        assert (folder / "0.kv").is_socket() and (folder / "1.kvr").is_socket()  # vsup's private folder
        assert folder.stat().st_mode & 0o077 == 0
        # The proxy subscribes to an instance's events once it is ready: a batch published before
        # that connection is up is lost until the next one reveals the gap (then replayed). On a
        # loaded box question zero's could be, and question one then missed (seen: 2 misses).
        time.sleep(2.0)
        ask("question zero")
        time.sleep(2.0)  # its events reach the proxy (0.5 s was too short on a loaded 2-CPU box)
        for n in range(1, 5):
            ask(f"question {n}")
        hits = [value(a, "vllm:prefix_cache_hits_total") for a in addresses]
        assert sorted(h > 0 for h in hits) == [False, True], hits  # every later chat met the one that holds it
        decisions = {d: value(proxy, "vsup_proxy_policy_decisions_total", decision=d) for d in ("hit", "miss", "escaped", "no_tokens")}
        # every later chat a hit; one whose /tokenize took over TOKENIZE_TIMEOUT (a loaded box) is
        # routed by load alone (no_tokens)
        assert decisions["escaped"] == 0 and decisions["hit"] >= 3 and decisions["hit"] + decisions["no_tokens"] >= 4, decisions
        misses = decisions["miss"]
        holder = next(i for i, h in enumerate(hits) if h > 0)
        pid = run.status()["instances"][holder]["pid"]
        os.kill(pid, signal.SIGKILL)  # the instance dies, its cache with it
        run.wait_for(lambda s: all(i["state"] == "ready" for i in s["instances"]) and
                     s["instances"][holder]["pid"] != pid, timeout=60, what="the restart")
        ask("after the restart")
        after = {d: value(proxy, "vsup_proxy_policy_decisions_total", decision=d) for d in ("hit", "miss", "escaped", "no_tokens")}
        # not a stale hit: the restarted instance's blocks were forgotten with it; a miss, or on a
        # loaded box a /tokenize past TOKENIZE_TIMEOUT (the restarted instance's first) routed by load
        assert after["hit"] == decisions["hit"] and after["escaped"] == 0, (decisions, after)
        assert after["miss"] + after["no_tokens"] == misses + decisions["no_tokens"] + 1, (decisions, after)
    finally:
        run.close()
