"""The Batch API beyond one box, on real sockets: a front ProxyServer holding the batch store over
two node ProxyServers (the per-node vsups of an export: their own Batch API off), each over a real
fake vLLM process. The front's lines carry `X-Vsup-Batch: line`, so each node places them as its
own batch lines (below its interactive requests, stopped for one that needs the slot, never queued); a node's busy
answer is no failure of the node at the front; a client that sends the header itself only gets
less (its key's rate limit still applies); with --forward-key the lines go with an admin key."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import openai
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, client, close_clients, url, wait_for
from vsup.batch.runner import Busy
from vsup.config.schema import ApiKeyConfig, BatchConfig, ProxyConfig
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool

ENDPOINT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fakes():
    started = [start_fake(name=name, served_model_names=["chat"], env=LEAN) for name in ("a0", "b0")]
    try:
        for fake in started:
            fake.wait_ready()
        yield started
    finally:
        for fake in started:
            fake.cleanup()


@contextlib.asynccontextmanager
async def node(fake, slots: int, **proxy):
    """A per-node vsup's proxy as the exports run it: its Batch API off, its share figures on."""
    pool = BackendPool()
    pool.add(Backend(fake.name, fake.url, "chat"))
    pool.set_state(fake.name, "ready", True)
    server = ProxyServer(ProxyConfig(port=0, **proxy), pool, models={"chat": ProxyConfig()},
                         batch=BatchConfig(enabled=False, slots_per_instance=slots))
    await server.start()
    try:
        yield server
    finally:
        await server.drain_and_stop(0)


@contextlib.asynccontextmanager
async def front(nodes: dict[str, ProxyServer], folder, slots: int = 8, forward_key: bool = False, **proxy):
    pool = BackendPool()
    for name, upstream in nodes.items():
        pool.add(Backend(name, f"http://127.0.0.1:{upstream.port}", "chat"))
        pool.set_state(name, "ready", True)
    server = ProxyServer(ProxyConfig(port=0, **proxy), pool, models={"chat": ProxyConfig()}, forward_key=forward_key,
                         batch=BatchConfig(slots_per_instance=slots), batch_dir=folder)
    await server.start()
    try:
        yield server
    finally:
        await close_clients(server)
        await server.drain_and_stop(0)


def chat(tokens: int = 3, delay: float | None = None) -> dict:
    body: dict = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    if delay is not None:
        body["fake"] = {"token_delay": delay}
    return body


def jsonl(ids: list[str], delay: float | None = None) -> bytes:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": ENDPOINT, "body": chat(3, delay)}) + "\n"
                   for cid in ids).encode()


async def run_batch(c: openai.AsyncOpenAI, ids: list[str], delay: float | None = None, timeout: float = 30.0):
    uploaded = await c.files.create(file=("in.jsonl", jsonl(ids, delay)), purpose="batch")
    batch = await c.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    deadline = asyncio.get_running_loop().time() + timeout
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert asyncio.get_running_loop().time() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        await asyncio.sleep(0.05)
        batch = await c.batches.retrieve(batch.id)
    return batch


def served(proxy: ProxyServer) -> int:
    """Chat requests a node's instances answered 200."""
    return sum(n for (route, status, instance, _), n in proxy.metrics.requests.items()
               if route == ENDPOINT and status == 200 and instance)


async def post(session, proxy, body, headers=None):
    async with session.post(url(proxy, ENDPOINT), data=json.dumps(body),
                            headers={"Content-Type": "application/json", **(headers or {})}) as response:
        return response.status, json.loads(await response.text()), response.headers


async def test_a_batch_through_the_front_completes_spread_over_both_nodes_within_their_shares(fakes, tmp_path):
    # each node takes 4 batch lines at once (2 slots, twice that while no interactive request comes);
    # the front would send all 16 at once (8 slots a node, twice that): the nodes' busy answers hold
    # the rest at the front, and are no failures of the nodes
    async with node(fakes[0], 2) as a, node(fakes[1], 2) as b, front({"a": a, "b": b}, tmp_path / "batches") as f:
        ids = [f"line-{i}" for i in range(16)]
        done = await run_batch(client(f), ids, delay=0.03)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 16, 0)
        output = [json.loads(line) for line in (await client(f).files.content(done.output_file_id)).text.splitlines()]
        assert sorted(entry["custom_id"] for entry in output) == sorted(ids)  # one result per custom_id
        assert all(entry["response"]["status_code"] == 200 for entry in output)
        assert served(a) > 0 and served(b) > 0 and served(a) + served(b) == 16  # spread over both nodes
        busy = sum(n for (route, status, instance, _), n in {**a.metrics.requests, **b.metrics.requests}.items()
                   if route == ENDPOINT and status == 503 and not instance)
        assert busy > 0  # the nodes did refuse lines past their share (the test would not show the cap otherwise)
        assert f.metrics.upstream_errors == {} and "busy" not in f.metrics.retries  # not failures of a node
        assert f.pool.is_ready("a") and f.pool.is_ready("b")  # nor ejected


async def test_a_front_line_never_takes_a_nodes_last_slot_from_interactive_traffic(fakes, tmp_path):
    # a node of 2 slots, one held by an interactive request: its other slot is kept for interactive
    # requests, so the front's line is answered busy by the node (without the header it would take it)
    async with node(fakes[0], 2) as a, front({"a": a}, tmp_path / "batches") as f, aiohttp.ClientSession() as session:
        held = asyncio.create_task(post(session, a, chat(20, 0.1)))
        await wait_for(lambda: a.in_flight().get("a0") == 1, what="the interactive request to hold its slot")
        with pytest.raises(Busy):  # the runner keeps the line, no attempt spent
            await f.send_line(ENDPOINT, json.dumps(chat()).encode(), "")
        assert a.in_flight() == {"a0": 1}  # the node's instance holds the interactive request alone
        assert f.metrics.upstream_errors == {} and f.pool.is_ready("a")
        assert f.batch_room("chat") == 0  # the node's busy answer caps the front's share there a while
        status, _, _ = await held
        assert status == 200
        await asyncio.sleep(1.1)  # (BUSY_HOLD)
        status, answer, _ = await f.send_line(ENDPOINT, json.dumps(chat()).encode(), "")
        assert status == 200 and json.loads(answer)["object"] == "chat.completion"


async def test_the_header_only_lowers_a_clients_request_its_rate_limit_still_applies(fakes):
    keys = [ApiKeyConfig(name="alice", key="k-alice", requests_per_minute=2)]
    async with node(fakes[0], 2, api_keys=keys) as a, aiohttp.ClientSession() as session:
        alice = {"Authorization": "Bearer k-alice"}
        marked = {**alice, "X-Vsup-Batch": "line"}
        # no key: refused as any request is
        status, _, _ = await post(session, a, chat(), {"X-Vsup-Batch": "line"})
        assert status == 401
        status, _, _ = await post(session, a, chat(), marked)
        assert status == 200
        status, _, _ = await post(session, a, chat(), marked)
        assert status == 200
        status, answer, headers = await post(session, a, chat(), marked)  # a batch line of hers is still charged
        assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded" and "Retry-After" in headers


async def test_a_marked_request_from_a_client_gets_no_slot_interactive_traffic_needs(fakes):
    async with node(fakes[0], 2) as a, aiohttp.ClientSession() as session:
        held = asyncio.create_task(post(session, a, chat(20, 0.1)))
        await wait_for(lambda: a.in_flight().get("a0") == 1, what="the interactive request to hold its slot")
        status, answer, headers = await post(session, a, chat(), {"X-Vsup-Batch": "line"})
        assert (status, headers.get("x-vsup-batch"), answer["error"]["code"]) == (503, "busy", "batch_busy")  # at once
        status, _, _ = await post(session, a, chat())  # the same request unmarked takes the slot
        assert status == 200
        assert (await held)[0] == 200


async def test_a_front_that_passes_keys_on_sends_lines_with_an_admin_key_not_charged_to_the_tenant(fakes, tmp_path):
    # alice may send 1 request a minute: her 3-line batch must not be charged to it at the node (as
    # it is not on one box); the front sends the lines with the admin key (proxy.api_key)
    keys = [ApiKeyConfig(name="alice", key="k-alice", requests_per_minute=1)]
    async with node(fakes[0], 4, api_key="k-admin", api_keys=keys) as a, \
            front({"a": a}, tmp_path / "batches", forward_key=True, api_key="k-admin", api_keys=keys) as f:
        done = await run_batch(client(f, "k-alice"), ["x", "y", "z"])
        assert (done.status, done.request_counts.completed) == ("completed", 3)
        assert a.metrics.requests.get((ENDPOINT, 429, "", "chat"), 0) == 0
        assert ("alice", "requests") not in a._gate.limited  # type: ignore[union-attr]


def test_a_nodes_busy_answer_caps_the_fronts_share_there_for_a_while():
    from tests.test_batch_share import Line
    from vsup.proxy.batch_share import BUSY_HOLD, BatchShare

    now = [0.0]
    in_flight: dict[str, int] = {}
    share = BatchShare(in_flight, lambda: now[0])
    share.configure({}, 10, {}, 0, quiet_after=30.0)
    share.interactive("chat")  # (recent interactive traffic: one slot kept)
    a = Backend("a", "http://127.0.0.1:1", "chat")
    lines = [Line() for _ in range(3)]
    for line in lines:
        in_flight["a"] = in_flight.get("a", 0) + 1
        share.started("a", line)
    assert share.room(a) == 6  # 10 slots, one kept, 3 lines there
    share.refused("a")  # the node said busy with 3 of ours: it takes 3 for now
    assert share.room(a) == 0
    in_flight["a"] -= 1
    share.ended("a", lines[0])
    assert share.room(a) == 1  # one ended: its slot is ours again, no more
    now[0] += BUSY_HOLD
    assert share.room(a) == 7  # then the whole share is tried again
