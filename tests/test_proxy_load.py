"""least_loaded and the load term of prefix_affinity (vsup/proxy/load.py, balancer.py, affinity.py):
the gauges read out of vLLM's /metrics text, the load estimate on synthetic sample timelines, the
fallback to in-flight counts, bounded-load hashing's bound and stability (hypothesis), and the
probe against real fake-vLLM processes whose queue comes from clients the proxy never sees."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakevllm.metrics import VllmMetrics
from tests.proxy_support import client, metric_value, metrics_text, ready_pool, running_proxy, start_fakes
from vsup.config.schema import ProxyConfig
from vsup.proxy import load
from vsup.proxy.affinity import Key, PrefixAffinity, within_bound
from vsup.proxy.backends import Backend
from vsup.proxy.balancer import LeastLoaded, make_balancer
from vsup.proxy.load import Sample

pytestmark = pytest.mark.timeout(120)


def backends(*names: str) -> tuple[Backend, ...]:
    return tuple(Backend(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names))


class Probe:
    """A load source with samples set by the test (what LoadProbe holds)."""

    def __init__(self, samples: dict[str, Sample], max_age: float = 3.0, interval: float = 1.0) -> None:
        self.samples = samples
        self.max_age = max_age
        self.interval = interval
        self.prefill = load.Prefill()


# ---------------------------------------------------------------------------------- the gauges

def test_the_gauges_are_read_from_vllm_shaped_text():
    running, waiting = 3, 2
    text = VllmMetrics("/srv/models/a model {x}", lambda: running, lambda: waiting).render()
    assert load.parse(text) == (5.0, 3 / 64, 2.0)
    # two engines (data parallel) add up; KV usage is the fuller one's; _by_reason is not counted twice
    text = (b'# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            b'vllm:num_requests_running{engine="0",model_name="m"} 2.0\nvllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\nvllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
            b'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 4.0\n'
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\nvllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n')
    assert load.parse(text) == (7.0, 0.5, 4.0)
    old = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.9\n"
    assert load.parse(old) == (1.0, 0.9, 0.0)  # vLLM before 0.10 named the KV gauge gpu_cache_usage_perc
    assert load.parse(b"vllm:num_requests_running 1\n") is None  # no waiting: not trusted
    assert load.parse(b"process_cpu_seconds_total 3\n") is None  # not a vLLM
    assert load.parse(b"vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n") is None


# ---------------------------------------------------------------------------------- the estimate

def test_requests_sent_and_finished_since_the_sample_count_on_top_of_it():
    sample = Sample(at=100.0, requests=4.0, kv=0.25, in_flight=1)  # 4 in the engine, 1 of them ours
    assert load.estimate(sample, 1, 100.5, 3.0) == 4.25
    assert load.estimate(sample, 4, 100.5, 3.0) == 7.25  # 3 more sent since: not yet in the figures
    assert load.estimate(sample, 0, 100.5, 3.0) == 3.25  # ours finished: one less
    # never below our own in-flight count (the engine may not have seen them yet)
    assert load.estimate(Sample(100.0, 0.0, 0.0, 3), 2, 100.5, 3.0) == 2.0
    assert load.estimate(sample, 1, 103.5, 3.0) is None  # stale
    assert load.estimate(None, 1, 100.5, 3.0) is None  # failed / none yet


def test_one_missing_figure_puts_every_candidate_on_in_flight_counts():
    fresh = {"a": Sample(10.0, 6.0, 0.0, 0), "b": Sample(10.0, 1.0, 0.0, 0)}
    assert load.loads(["a", "b"], fresh, {}, 10.5, 3.0) == ({"a": 6.0, "b": 1.0}, True)
    for flights in ({"a": 2}, {"a": 0, "b": 5}):  # loads() inlines estimate(): the same figures
        values, _ = load.loads(["a", "b"], fresh, flights, 10.5, 3.0)
        assert values == {n: load.estimate(fresh[n], flights.get(n, 0), 10.5, 3.0) for n in "ab"}
    # b's scrape failed: b is not "idle", and a is not judged by figures b lacks
    assert load.loads(["a", "b"], {"a": fresh["a"]}, {"a": 1, "b": 2}, 10.5, 3.0) == ({"a": 1.0, "b": 2.0}, False)
    assert load.loads(["a", "b"], fresh, {"b": 2}, 20.0, 3.0) == ({"a": 0.0, "b": 2.0}, False)  # both stale


def test_least_loaded_avoids_a_queue_it_did_not_send():
    balancer = LeastLoaded()
    ready = backends("a", "b")
    now = time.monotonic()
    balancer.probe = Probe({"a": Sample(now, 5.0, 0.1, 0), "b": Sample(now, 0.0, 0.0, 0)})  # a's queue: other clients
    in_flight: dict[str, int] = {}
    picks = []
    for _ in range(8):  # a burst before the next sample: each pick counts on top of the figures
        name = balancer.choose(ready, in_flight).name
        in_flight[name] = in_flight.get(name, 0) + 1
        picks.append(name)
    assert picks[:6] == ["b"] * 6 and picks[6:] == ["a", "b"]  # b while below a's 5.1, then whichever is lighter
    assert balancer.decisions == {"engine_load": 8}
    # least_outstanding sees none of a's queue
    outstanding = make_balancer("least_outstanding")
    assert Counter(outstanding.choose(ready, {}).name for _ in range(4)) == {"a": 2, "b": 2}


def test_a_burst_between_two_samples_is_spread():
    balancer = LeastLoaded()
    ready = backends("a", "b", "c")
    now = time.monotonic()
    balancer.probe = Probe({n: Sample(now, 0.0, 0.0, 0) for n in "abc"})
    in_flight: dict[str, int] = {}
    for _ in range(9):
        name = balancer.choose(ready, in_flight).name
        in_flight[name] = in_flight.get(name, 0) + 1
    assert in_flight == {"a": 3, "b": 3, "c": 3}


def test_a_failed_or_stale_sample_falls_back_to_in_flight_never_to_idle():
    balancer = LeastLoaded()
    ready = backends("a", "b")
    now = time.monotonic()
    # a's scrape failed (no sample) while 3 of ours run there; b's figures say 1 request
    balancer.probe = Probe({"b": Sample(now, 1.0, 0.0, 0)})
    assert balancer.choose(ready, {"a": 3}).name == "b"
    # a's last sample said idle but is old: it does not count
    balancer.probe = Probe({"a": Sample(now - 60, 0.0, 0.0, 0), "b": Sample(now, 9.0, 0.0, 2)})
    assert balancer.choose(ready, {"a": 3, "b": 2}).name == "b"
    assert balancer.decisions == {"in_flight": 2}
    balancer.probe = None  # no source at all: least_outstanding's choice
    assert balancer.choose(ready, {"a": 1}).name == "b"


def test_weights_divide_the_load():
    balancer = LeastLoaded()
    ready = backends("a", "b")
    now = time.monotonic()
    balancer.probe = Probe({"a": Sample(now, 6.0, 0.0, 0), "b": Sample(now, 4.0, 0.0, 0)})
    assert balancer.choose(ready, {}).name == "b"
    balancer.set_weight("a", 2)  # 6 over 2 is 3 per unit, below b's 4
    assert balancer.choose(ready, {}).name == "a"


def test_prefix_affinity_uses_the_engines_waiting_in_its_bound():
    balancer = PrefixAffinity(load_factor=0.25)
    ready = backends("a", "b")
    key = Key(12345, "affinity")
    first = balancer.choose(ready, {}, (), key).name
    other = "b" if first == "a" else "a"
    now = time.monotonic()
    # the engine of `first` has 3 requests from elsewhere waiting: 3 + 1 is over ceil(1.25 * 4 / 2) = 3
    balancer.probe = Probe({first: Sample(now, 3.0, 0.5, 0, 3.0), other: Sample(now, 0.0, 0.0, 0)})
    assert balancer.choose(ready, {}, (), key).name == other
    # the same 3 running, in decode: a half each, 1 in whole requests, 1 + 1 within 2: it stays
    balancer.probe = Probe({first: Sample(now, 3.0, 0.5, 0, 0.0), other: Sample(now, 0.0, 0.0, 0)})
    assert balancer.choose(ready, {}, (), key).name == first
    # 3 waiting, but sampled two intervals ago: a quarter of them is left, 0 whole: it stays
    balancer.probe = Probe({first: Sample(now - 2.0, 3.0, 0.5, 0, 3.0), other: Sample(now - 2.0, 0.0, 0.0, 0)})
    assert balancer.choose(ready, {}, (), key).name == first
    assert balancer.decisions == {"placed": 1, "affinity": 2, "escaped": 1}


def test_prefix_affinity_counts_the_proxys_own_prefill_not_its_decoding_streams():
    balancer = PrefixAffinity(load_factor=0.25)
    ready = backends("a", "b")
    key = Key(12345, "affinity")
    home = balancer.choose(ready, {}, (), key).name
    other = "b" if home == "a" else "a"
    probe = balancer.probe = Probe({})  # no engine figures: the proxy's own alone
    size = 4000  # body bytes: 1000 tokens
    # 3 streams in decode there, none elsewhere: 3/2 = 1 whole, 1 + 1 within ceil(1.25 * 2 / 2) = 2
    assert balancer.choose(ready, {home: 3}, (), key, size).name == home
    # 2 of them still without a first byte, each of this request's size: 2 + 1/2 = 2 whole, 3 over 2: moved
    probe.prefill.add(home, 1000.0)
    probe.prefill.add(home, 1000.0)
    assert balancer.choose(ready, {home: 3}, (), key, size).name == other
    # the same 2 are small prompts (a tenth of this one's): 0.2 + 1/2 = 0 whole: it stays
    probe.prefill.done(home, 1000.0)
    probe.prefill.done(home, 1000.0)
    probe.prefill.add(home, 100.0)
    probe.prefill.add(home, 100.0)
    assert balancer.choose(ready, {home: 3}, (), key, size).name == home


def test_the_work_before_a_first_token():
    # prefill in units of the new request's prompt; decode a quarter each; others as counted
    assert load.work(2000.0, 2, 6, 0.0, 0.0, 1000.0) == 2.0 + 4 * load.DECODE_WEIGHT
    assert load.work(0.0, 0, 0, 1.5, 2.0, 1000.0) == 1.5 + 2.0 * load.DECODE_WEIGHT
    assert load.work(300.0, 3, 3, 0.0, 0.0, 0.0) == 3.0  # no size given: each pending request one
    assert load.work(0.0, 0, 0, 0.0, 0.0, 0.0) == 0.0


def test_the_engines_others_are_what_the_proxy_did_not_send_and_age():
    # 6 running + 4 waiting; the proxy had 5 in flight, 2 of them without a first byte
    sample = Sample(0.0, 10.0, 0.0, 5, 4.0, 2)
    assert load.others(sample, 0.0, 1.0) == (2.0, 3.0)  # 5 foreign: 2 waiting (4 - the proxy's 2), 3 decoding
    assert load.others(sample, 1.0, 1.0) == (1.0, 1.5)  # one interval later: halved
    assert load.others(sample, 2.0, 0.5) == (2.0 / 16, 3.0 / 16)
    # all the engine's requests are the proxy's: nothing foreign, whatever waits
    assert load.others(Sample(0.0, 4.0, 0.0, 4, 4.0, 0), 0.0, 1.0) == (0.0, 0.0)
    # foreign waiting is at most what is foreign
    assert load.others(Sample(0.0, 5.0, 0.0, 4, 5.0, 0), 0.0, 1.0) == (1.0, 0.0)


def test_works_drop_the_engines_figures_when_one_is_missing():
    now = 100.0
    samples = {"a": Sample(now, 4.0, 0.0, 0, 4.0), "b": Sample(now, 0.0, 0.0, 0)}
    assert load.works(["a", "b"], samples, {}, {}, {}, 0.0, now, 1.0, 3.0) == {"a": 4.0, "b": 0.0}
    stale = {"a": samples["a"], "b": Sample(now - 10, 0.0, 0.0, 0)}
    assert load.works(["a", "b"], stale, {"a": 1}, {}, {}, 0.0, now, 1.0, 3.0) == {"a": load.DECODE_WEIGHT, "b": 0.0}


def test_the_prefill_count_adds_and_takes_off():
    prefill = load.Prefill()
    prefill.add("a", 100.0)
    prefill.add("a", 50.0)
    prefill.done("a", 100.0)
    assert (prefill.tokens, prefill.requests) == ({"a": 50.0}, {"a": 1})
    prefill.done("a", 50.0)
    assert (prefill.tokens, prefill.requests) == ({}, {})
    assert load.Prefill.estimate(4000) == 1000.0 and load.Prefill.estimate(0) == 1.0


# ---------------------------------------------------------------------------------- bounded-load hashing (hypothesis)

NAMES = [f"i{n}" for n in range(8)]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), factor=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
       events=st.lists(st.tuples(st.booleans(), st.integers(0, 2**64 - 1)), min_size=1, max_size=120))
def test_the_bound_holds_at_every_assignment(n, factor, events):
    """A random timeline of arrivals (a key) and completions: after each arrival the chosen
    instance holds at most ceil((1 + ε) * mean load), the mean over the instances with it counted."""
    balancer = PrefixAffinity(load_factor=factor)
    ready = backends(*NAMES[:n])
    in_flight: dict[str, int] = {}
    for arrive, digest in events:
        if arrive or not in_flight:
            name = balancer.choose(ready, in_flight, (), Key(digest, "affinity")).name
            in_flight[name] = in_flight.get(name, 0) + 1
            mean = sum(in_flight.values()) / n
            assert in_flight[name] <= math.ceil((1 + factor) * mean - 1e-9)
        else:  # a request ends somewhere
            done = sorted(in_flight)[digest % len(in_flight)]
            in_flight[done] -= 1
            if not in_flight[done]:
                del in_flight[done]


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.integers(1, 5), min_size=2, max_size=5), factor=st.sampled_from([0.0, 0.25, 1.0]),
       digests=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=60))
def test_the_bound_holds_by_share_with_weights(weights, factor, digests):
    balancer = PrefixAffinity(load_factor=factor)
    ready = backends(*NAMES[:len(weights)])
    for backend, weight in zip(ready, weights, strict=True):
        balancer.set_weight(backend.name, weight)
    in_flight: dict[str, int] = {}
    for digest in digests:
        name = balancer.choose(ready, in_flight, (), Key(digest, "session")).name
        in_flight[name] = in_flight.get(name, 0) + 1
        share = balancer.weight(name) / sum(weights)
        assert in_flight[name] <= math.ceil((1 + factor) * sum(in_flight.values()) * share - 1e-9)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 7), leaving=st.integers(0, 6), factor=st.sampled_from([0.0, 0.25, 1.0]),
       digests=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=80, unique=True))
def test_only_a_leaving_or_joining_instances_keys_move(n, leaving, factor, digests):
    """Unloaded instances: removing one moves only the keys it held; adding one moves only the
    keys that now hash to it."""
    balancer = PrefixAffinity(load_factor=factor)
    ready = backends(*NAMES[:n + 1])
    smaller = tuple(b for b in ready if b.name != ready[leaving % len(ready)].name)
    gone = ready[leaving % len(ready)].name
    for digest in digests:
        key = Key(digest, "affinity")
        before = balancer.choose(ready, {}, (), key).name
        after = balancer.choose(smaller, {}, (), key).name
        if before != gone:
            assert after == before  # removal: only the leaving instance's keys move
        else:
            assert after != gone
        # the other way round, the same pair: the newcomer takes keys, nothing moves elsewhere
        assert before in (after, gone)


@settings(max_examples=200, deadline=None)
@given(factor=st.sampled_from([0.0, 0.25, 1.0]),
       events=st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "end", "toggle"]), st.integers(0, 11)),
                       min_size=1, max_size=150))
def test_new_keys_go_to_the_least_loaded_and_placed_keys_stay(factor, events):
    """A random timeline over 4 instances of arrivals (12 keys, so they repeat), completions and
    instances leaving or coming back: a key new to the proxy, or whose instance is not ready, goes
    to a least loaded instance and is placed there; a placed key goes back to its instance whenever
    that is within its bound, and elsewhere (within the bound) only when it is not. Nothing else
    moves a key: not another instance leaving or joining, not an escape."""
    balancer = PrefixAffinity(load_factor=factor)
    names = NAMES[:4]
    up = set(names)
    in_flight: dict[str, int] = {}
    placed: dict[int, str] = {}
    for kind, value in events:
        if kind == "toggle":
            name = names[value % 4]
            if name in up and len(up) > 1:
                up.discard(name)
            else:
                up.add(name)
            continue
        if kind == "end":
            busy = sorted(n for n, count in in_flight.items() if count)
            if busy:
                in_flight[busy[value % len(busy)]] -= 1
            continue
        ready = backends(*[n for n in names if n in up])
        loads = {b.name: in_flight.get(b.name, 0) for b in ready}
        total = sum(loads.values())
        chosen = balancer.choose(ready, in_flight, (), Key(value, "affinity")).name
        home = placed.get(value)
        if home not in up:
            assert loads[chosen] == min(loads.values())  # new, or its instance gone: the least loaded
            placed[value] = chosen
        elif within_bound(loads[home], total, 1, len(ready), factor):
            assert chosen == home
        else:
            assert chosen != home and within_bound(loads[chosen], total, 1, len(ready), factor)
        assert balancer.placed(Key(value, "affinity")) == placed[value]
        in_flight[chosen] = in_flight.get(chosen, 0) + 1


def test_the_placement_table_is_bounded_least_recently_used_out():
    balancer = PrefixAffinity(placed_max=3)
    ready = backends("a", "b")
    for digest in (1, 2, 3):
        balancer.choose(ready, {}, (), Key(digest, "affinity"))
    balancer.choose(ready, {}, (), Key(1, "affinity"))  # used again: the most recent
    balancer.choose(ready, {}, (), Key(4, "affinity"))  # a fourth: 2, the least recent, goes
    assert [balancer.placed(Key(d, "affinity")) is not None for d in (1, 2, 3, 4)] == [True, False, True, True]


def test_within_bound_is_the_paper_s_capacity():
    # 2 instances, 3 in flight + this one: mean 2, at most ceil(1.25 * 2) = 3 each
    assert within_bound(2, 3, 1, 2, 0.25) and not within_bound(3, 3, 1, 2, 0.25)
    assert within_bound(0, 0, 1, 2, 0.0)  # the first request: ceil(1 / 2) = 1
    assert not within_bound(1, 1, 1, 2, 0.0) and within_bound(0, 1, 1, 2, 0.0)


# ---------------------------------------------------------------------------------- with fake vLLM processes

@pytest.fixture(scope="module")
def queued_fakes():
    # one generation at a time per instance: more queue (vllm:num_requests_waiting), like --max-num-seqs 1
    started = start_fakes(["a", "b"], env={"FAKE_VLLM_MAX_NUM_SEQS": "1"})
    yield started
    for fake in started:
        fake.cleanup()


async def _hold(session: aiohttp.ClientSession, url: str, count: int) -> list[asyncio.Task]:
    """`count` slow streamed requests straight to an instance (not through the proxy)."""
    body = {"model": "fake-model", "prompt": "busy elsewhere", "max_tokens": 400, "stream": True, "fake": {"token_delay": 0.02}}

    async def one() -> None:
        async with session.post(url + "/v1/completions", json=body) as response:
            await response.read()

    return [asyncio.ensure_future(one()) for _ in range(count)]


async def test_least_loaded_routes_around_a_queue_from_other_clients(queued_fakes):
    busy, idle = queued_fakes
    async with aiohttp.ClientSession() as session:
        held = await _hold(session, busy.url, 3)  # 1 running, 2 waiting on `busy`
        try:
            async with running_proxy(ready_pool(queued_fakes), policy="least_loaded", load_interval=0.1) as proxy:
                probe = proxy._probe
                await asyncio.wait_for(_until(lambda: probe.samples.get(busy.name, Sample(0, 0, 0, 0)).requests >= 3), 10)
                c = client(proxy)
                names = []
                for _ in range(4):
                    raw = await c.completions.with_raw_response.create(model="fake-model", prompt="hi", max_tokens=1)
                    names.append(raw.headers["x-fake-instance"])
                assert names == [idle.name] * 4
                text = await metrics_text(proxy)
                assert metric_value(text, "vsup_proxy_policy_decisions_total", policy="least_loaded", decision="engine_load") == 4
            async with running_proxy(ready_pool(queued_fakes), policy="least_outstanding") as proxy:
                c = client(proxy)  # the same queue, unseen: the requests alternate
                names = [(await c.completions.with_raw_response.create(model="fake-model", prompt="hi", max_tokens=1))
                         .headers["x-fake-instance"] for _ in range(2)]
                assert sorted(names) == sorted([busy.name, idle.name])
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


async def test_an_upstream_without_vllm_figures_counts_in_flight(queued_fakes):
    """An upstream whose /metrics has no scheduler gauges (not a vLLM) gives no sample: the probe
    counts a failure and the policy scores by in-flight counts."""
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="process_cpu_seconds_total 1\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    pool = ready_pool(queued_fakes[:1])
    pool.add(Backend("plain", f"http://127.0.0.1:{port}"))
    pool.set_state("plain", "ready", True)
    try:
        async with running_proxy(pool, policy="least_loaded", load_interval=0.1) as proxy:
            probe = proxy._probe
            await asyncio.wait_for(_until(lambda: probe.failures.get("plain", 0) >= 2 and queued_fakes[0].name in probe.samples), 10)
            assert "plain" not in probe.samples
            balancer = proxy._balancer
            assert balancer.choose(pool.ready(), {"plain": 1}).name == queued_fakes[0].name
            assert balancer.decisions == {"in_flight": 1}
    finally:
        await runner.cleanup()


async def test_a_reload_changes_the_interval_and_a_policy_without_load_stops_sampling(queued_fakes):
    async with running_proxy(ready_pool(queued_fakes), policy="least_loaded", load_interval=0.1) as proxy:
        assert proxy._probe_task is not None and proxy._balancer.probe is proxy._probe
        proxy.reconfigure(ProxyConfig(port=0, policy="prefix_affinity", load_interval=0.5), None)
        assert proxy._probe.interval == 0.5 and proxy._balancer.probe is proxy._probe and proxy._probe_task is not None
        proxy.reconfigure(ProxyConfig(port=0, policy="round_robin"), None)
        assert proxy._probe_task is None and proxy._probe.samples == {}


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


def test_a_request_to_its_keys_instance_counts_only_what_it_adds_as_prefill():
    balancer = PrefixAffinity(load_factor=0.25)
    ready = backends("a", "b")
    key = Key(777, "session")
    home = balancer.choose(ready, {}, (), key, 4000).name
    assert balancer.prefill_bytes(4000) == 4000  # placed: nothing cached yet
    assert balancer.choose(ready, {}, (), key, 4800).name == home
    assert balancer.prefill_bytes(4800) == 800  # the next turn: its history is cached there
    probe = balancer.probe = Probe({})
    for _ in range(3):  # three misses of this size queued there: over its bound, it escapes
        probe.prefill.add(home, load.Prefill.estimate(5000))
    assert balancer.choose(ready, {home: 3}, (), key, 5000).name != home
    assert balancer.prefill_bytes(5000) == 5000  # a miss where it went
    assert LeastLoaded().prefill_bytes(5000) == 5000
