"""The fake vLLM's prefix cache: blocks of 16 words, chained, LRU; its vLLM-named counters; and the
prefill delay that makes a cache hit show in the time to first token."""

from __future__ import annotations

import json
import time
import urllib.request

from tests.fakevllm.fixtures import start_fake
from tests.fakevllm.prefix_cache import BLOCK, PrefixCache
from tests.proxy_support import LEAN, metric_value


def words(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def test_leading_full_blocks_hit_and_a_change_breaks_the_chain():
    cache = PrefixCache(capacity_blocks=100)
    shared = words("s", 3 * BLOCK)
    assert cache.lookup(shared + ["q1"]) == 0
    assert cache.lookup(shared + ["q2", "more"]) == 3 * BLOCK  # the last, partial block is never cached
    changed = list(shared)
    changed[BLOCK + 3] = "other"
    assert cache.lookup(changed) == BLOCK  # blocks after a changed one do not hit, as the hashes chain
    assert cache.lookup(words("x", BLOCK - 1)) == 0


def test_least_recently_used_blocks_are_evicted():
    cache = PrefixCache(capacity_blocks=4)
    a, b, c = words("a", 2 * BLOCK), words("b", 2 * BLOCK), words("c", 2 * BLOCK)
    cache.lookup(a)
    cache.lookup(b)
    assert cache.lookup(a) == 2 * BLOCK  # a is now the most recent
    cache.lookup(c)  # evicts b
    assert cache.lookup(b) == 0
    assert cache.lookup(c) == 2 * BLOCK


def post(url: str, body: dict) -> float:
    """Seconds to the answer of a (non-streaming) request."""
    began = time.monotonic()
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        response.read()
    return time.monotonic() - began


def test_counters_and_prefill_delay_of_a_running_fake():
    fake = start_fake(name="p", env={**LEAN, "FAKE_VLLM_TOKEN_DELAY": "0", "FAKE_VLLM_PREFILL_DELAY": "0.002"})
    try:
        fake.wait_ready()
        document = " ".join(words("w", 256))
        system = {"role": "system", "content": document}
        cold = post(f"{fake.url}/v1/chat/completions",
                    {"messages": [system, {"role": "user", "content": "first"}], "max_tokens": 1})
        warm = post(f"{fake.url}/v1/chat/completions",
                    {"messages": [system, {"role": "user", "content": "second"}], "max_tokens": 1})
        post(f"{fake.url}/v1/completions", {"prompt": document, "max_tokens": 1})
        with urllib.request.urlopen(f"{fake.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        # chat: <|system|> + 256 words + <|user|> + 1 word = 259, twice; completion: 256
        assert metric_value(text, "vllm:prefix_cache_queries_total") == 2 * 259 + 256
        assert metric_value(text, "vllm:prefix_cache_hits_total") == 256  # 16 full blocks of the second chat
        assert cold >= 0.5 and warm < cold / 2  # 259 words at 2 ms, then 3
    finally:
        fake.cleanup()
