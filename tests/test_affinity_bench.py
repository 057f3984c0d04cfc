"""bench/affinity_bench.py's pieces with the fake vLLM (whose prefix cache counts like vLLM's): the
workloads, the token calibration, the metrics it scrapes, and a whole small run against two fakes
through three real `vsup proxy` processes. The real-vLLM run is the lead's (see docs/proxy.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from tests.proxy_support import start_fakes

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "affinity_bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("affinity_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["affinity_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = load_bench()


@pytest.fixture(scope="module")
def fakes():
    # each prompt word the prefix cache does not hold costs 2 ms, one prefill at a time per instance
    started = start_fakes(["a", "b"], env={"FAKE_VLLM_PREFILL_DELAY": "0.002", "FAKE_VLLM_TOKEN_DELAY": "0.002"})
    yield started
    for fake in started:
        fake.cleanup()


def test_texts_reach_their_token_count(fakes):
    tokens = bench.Tokens(fakes[0].url, "fake-model")
    rng = bench.random.Random("x")
    for target in (10, 200, 1000):
        text, count = tokens.text(rng, target)
        assert count == tokens.count(text) >= target and count < target * 1.2


def test_the_shared_workload_interleaves_sessions_in_shuffled_rounds(fakes):
    tokens = bench.Tokens(fakes[0].url, "fake-model")
    order, shortest = bench.shared_workload(tokens, "salt", sessions=5, questions=4, prefix_tokens=100)
    assert shortest >= 100 and len(order) == 20
    rounds = [order[i:i + 5] for i in range(0, 20, 5)]
    assert all(sorted(r.session for r in chunk) == [0, 1, 2, 3, 4] for chunk in rounds)  # every session each round
    assert len({tuple(r.session for r in chunk) for chunk in rounds}) > 1  # in shuffled orders
    assert all(len({r.prefix for r in order if r.session == s}) == 1 for s in range(5))  # one prefix per session
    assert len({r.question for r in order}) == 20 and len({r.prefix for r in order}) == 5
    again, _ = bench.shared_workload(tokens, "salt", sessions=5, questions=4, prefix_tokens=100)
    assert again == order  # the salt decides it all
    other, _ = bench.shared_workload(tokens, "other salt", sessions=5, questions=4, prefix_tokens=100)
    assert not {r.prefix for r in other} & {r.prefix for r in order}  # another phase meets no cached prefix


def test_payloads_put_the_prefix_first():
    request = bench.Request(0, "the shared document", "what about it?")
    path, body = bench.payload("chat", request, 8, "m")
    assert path == "/v1/chat/completions" and body["messages"][0] == {"role": "system", "content": "the shared document"}
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    path, body = bench.payload("completions", request, 8, "m")
    assert path == "/v1/completions" and body["prompt"].startswith("the shared document")
    _, body = bench.payload("chat", bench.Request(0, "", "alone"), 8, "m")
    assert body["messages"] == [{"role": "user", "content": "alone"}]


def test_scrape_reads_the_prefix_cache_counters(fakes):
    fake = fakes[1]
    before, capacity = bench.scrape(fake.url)
    assert set(before) == {"queries", "hits", "requests"} and capacity == "?"
    tokens = bench.Tokens(fake.url, "fake-model")
    document = tokens.text(bench.random.Random("doc"), 64)[0]
    args = type("Args", (), {"concurrency": 1, "api": "completions", "max_tokens": 2, "model_name": "fake-model",
                             "load_interval": 0.05})()
    phase = bench.measure(bench.Phase("shared", "direct", 1), fake.url, [fake.url],
                          [bench.Request(0, document, "one?"), bench.Request(0, document, "two?")], args)
    assert phase.requests == 2 and phase.errors == 0 and phase.tokens == 4 and len(phase.ttfts) == 2
    changes = phase.instances[fake.url]
    assert changes["requests"] == 2 and changes["hits"] == 64  # the second prompt's 4 full blocks
    assert phase.hit_rate() == changes["hits"] / changes["queries"]


def test_settle_waits_for_an_idle_engine_and_one_probe_interval(fakes):
    """Between phases: the engines idle (the fake reports vLLM's scheduler gauges), then 1.5
    load intervals for every proxy's probe to see it."""
    from vsup.proxy import load

    with urllib.request.urlopen(f"{fakes[0].url}/metrics", timeout=10) as response:
        assert load.parse(response.read()) is not None  # the gauges settle() reads
    args = type("Args", (), {"load_interval": 0.4})()
    began = time.monotonic()
    bench.settle([fake.url for fake in fakes], args)
    assert 0.8 <= time.monotonic() - began < 10


def test_percentile_and_ratios():
    assert bench.percentile([3.0], 0.5) == 3.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert bench.percentile([], 0.5) != bench.percentile([], 0.5)  # nan
    assert "meets" in bench.check("x", 1.6, 1.5) and "MISSES" in bench.check("x", 1.4, 1.5)


def test_options():
    quick = bench.parse_args(["--quick", "--upstream", "http://127.0.0.1:1"])
    assert (quick.sessions, quick.questions, quick.concurrency, quick.max_tokens) == (4, 3, 2, 16)
    full = bench.parse_args(["--sessions", "3"])
    assert (full.sessions, full.questions, full.concurrency, full.max_tokens) == (3, 4, 4, 32)
    assert full.policies == ["round_robin", "least_outstanding", "prefix_affinity", "least_loaded"] and full.seed
    assert full.few_sessions == 8 and quick.few_sessions == 2 and full.affinity_load_factor == 0.25
    variants = bench.parse_args(["--policies", "round_robin,prefix_affinity,prefix_affinity@1"])
    assert variants.policies == ["round_robin", "prefix_affinity", "prefix_affinity@1"]
    assert [bench.split_policy(p, 0.25) for p in variants.policies] == [("round_robin", 0.25), ("prefix_affinity", 0.25), ("prefix_affinity", 1.0)]
    for bad in (["--prefix-tokens", "2000"], ["--policies", "round_robin,random"], ["--questions", "0"],
                ["--policies", "round_robin@1"], ["--policies", "prefix_affinity@x"], ["--policies", "prefix_affinity@11"]):
        result = subprocess.run([sys.executable, str(BENCH), *bad], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "error:" in result.stderr and "Traceback" not in result.stderr


def test_a_whole_run_against_fakes_shows_prefix_affinity_hitting_the_cache(fakes, tmp_path):
    out = tmp_path / "phases.json"
    # One request at a time: round robin alternates strictly, and with 3 sessions x 3 questions
    # (5 even and 4 odd positions) some session must meet both instances; the prefixes (200 words,
    # ~1,100 characters) are longer than the 512 characters prefix_affinity keys on.
    result = subprocess.run(
        [sys.executable, str(BENCH), "--upstream", fakes[0].url, "--upstream", fakes[1].url, "--sessions", "3",
         "--questions", "3", "--prefix-tokens", "200", "--distinct-tokens", "40", "--concurrency", "1",
         "--max-tokens", "3", "--affinity-prefix-chars", "512", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    phases = json.loads(out.read_text())
    policies = ("round_robin", "least_outstanding", "prefix_affinity", "least_loaded")  # every policy of the schema
    assert Counter((p["workload"], p["policy"]) for p in phases) == {
        (w, p): 1 for w in ("shared", "few", "distinct") for p in policies}
    assert all(p["requests"] == 9 and p["errors"] == 0 and p["tokens"] == 27 for p in phases)
    # the proxy's own decisions are recorded per phase: prefix_affinity's keyed ones, least_loaded's by the engines' figures
    decisions = {(p["workload"], p["policy"]): p["decisions"] for p in phases}
    assert sum(decisions[("shared", "prefix_affinity")].get(k, 0) for k in ("placed", "affinity", "escaped")) == 9
    assert sum(decisions[("shared", "least_loaded")].values()) == 9 and decisions[("shared", "round_robin")] == {}

    def hits(workload: str, policy: str) -> float:
        phase = next(p for p in phases if p["workload"] == workload and p["policy"] == policy)
        return sum(i["hits"] for i in phase["instances"].values()) / sum(i["queries"] for i in phase["instances"].values())

    # prefix_affinity: one miss per session (2 of 3 questions hit); the others: more misses
    assert hits("shared", "prefix_affinity") > hits("shared", "round_robin")
    assert hits("shared", "prefix_affinity") > hits("shared", "least_outstanding")
    assert all(hits("distinct", policy) == 0 for policy in policies)
    table = result.stdout
    assert "| shared | prefix_affinity | 9 | 0 |" in table and "The issue's bar" in table
    assert "few: TTFT p90 policy / round_robin (prefix_affinity)" in table and "i0 " in table and "i1 " in table


def test_the_few_workload_splits_its_sessions_3_to_1_by_hashing(fakes):
    """The 6 : 2 split made deliberate: the sessions' prefixes are drawn so that the proxy's own
    hashing (unloaded) puts 3 of 4 on the first instance."""
    from vsup.proxy.affinity import PrefixAffinity, routing_key
    from vsup.proxy.backends import Backend

    tokens = bench.Tokens(fakes[0].url, "fake-model")
    args = type("Args", (), {"affinity_prefix_chars": 256, "api": "chat", "max_tokens": 2, "model_name": "fake-model"})()
    urls = [fakes[0].url, fakes[1].url]
    order, shortest = bench.few_workload(tokens, "salt", 4, 10, 80, urls, args)
    assert len(order) == 10 and shortest >= 80 and {r.session for r in order} == {0, 1, 2, 3}
    hasher = PrefixAffinity(256)
    upstreams = tuple(Backend(u, u) for u in urls)
    winners = Counter()
    for session in range(4):
        request = next(r for r in order if r.session == session)
        _, body = bench.payload("chat", request, 2, "fake-model")
        winners[hasher.choose(upstreams, {}, (), routing_key(body, {}, 256)).name] += 1
    assert winners == {urls[0]: 3, urls[1]: 1}
