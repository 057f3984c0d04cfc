"""kv_aware against an oracle that knows every instance's prefix cache, on multi-turn chats that
diverge after a shared system prompt (issue 22 §3: kv_aware reaches >= 90 % of the oracle's
prefix-cache hit rate).

    .venv/bin/python bench/kv_bench.py                     # fake vLLM (tests/fakevllm), 2 instances
    .venv/bin/python bench/kv_bench.py --quick             # a smoke run
    .venv/bin/python bench/kv_bench.py --upstream unix:/run/vsup/instances-8000/0.sock=ipc:///run/vsup/instances-8000/0.kv \\
        --upstream unix:/run/vsup/instances-8000/1.sock=ipc:///run/vsup/instances-8000/1.kv --model NAME --block-size 128 \\
        --cache-blocks N               # real vLLM instances already running with KV events (docs/kv-events.md)

Workload: one system prompt of --system-words words (salted per phase: no phase meets a cache
another filled), --conversations chats of --turns turns each; turn t sends the system prompt, the
conversation so far (the instance's real answers included) and a new question of its own, so the
chats share the system prompt and diverge right after it. --concurrency turns are in flight at a
time (a conversation's next turn waits for its answer); the conversations start in a seeded
shuffled order.

Policies, each in its own phase over the same instances: round_robin, prefix_affinity, kv_aware
(each an in-process vsup ProxyServer in front of the instances) and the oracle: the bench routes
each turn itself to the instance whose cache holds the most leading blocks of it, from an exact
mirror of every instance's cache (an LRU of chained block hashes of --cache-blocks blocks, fed
with every request sent to it in order: what the fake's prefix cache does; for real vLLM an
approximation, vLLM's eviction order is its free list's), ties to the fewer in flight.

The hit rate is the instances' own: the change of vllm:prefix_cache_hits_total over
vllm:prefix_cache_queries_total on their /metrics during the phase (prompt tokens). Written to
docs/bench/kv_bench.json (bench/result.py); the goal is kv_aware / oracle >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result import Recorder  # noqa: E402
from vsup.config.schema import ProxyConfig  # noqa: E402
from vsup.proxy import ProxyServer  # noqa: E402
from vsup.proxy.address import Sessions  # noqa: E402
from vsup.proxy.backends import Backend, BackendPool  # noqa: E402

POLICIES = ("round_robin", "prefix_affinity", "kv_aware")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


# ---------------------------------------------------------------------------------- the mirror

class Mirror:
    """One instance's prefix cache as the oracle sees it: whole leading blocks, chained, LRU."""

    def __init__(self, capacity: int, block: int) -> None:
        self.capacity, self.block = capacity, block
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def hashes(self, tokens: list[int]) -> list[int]:
        out, chained = [], 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            chained = hash((chained, tuple(tokens[start:start + self.block])))
            out.append(chained)
        return out

    def held(self, tokens: list[int]) -> int:
        count = 0
        for block in self.hashes(tokens):
            if block not in self.blocks:
                break
            count += 1
        return count

    def add(self, tokens: list[int]) -> None:
        for block in self.hashes(tokens):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


# ---------------------------------------------------------------------------------- instances

def start_fakes(count: int, cache_blocks: int, workdir: Path, prefill_delay: float) -> tuple[list, list[Backend]]:
    from tests.fakevllm.fixtures import start_fake

    fakes, backends = [], []
    for i in range(count):
        endpoint = f"ipc://{workdir}/{i}.kv"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                  "replay_endpoint": endpoint + "r", "topic": "kv"}
        env = {"FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0", "FAKE_VLLM_ACCESS_LOG": "0", "FAKE_VLLM_TOKEN_DELAY": "0.001",
               "FAKE_VLLM_PREFIX_CACHE_BLOCKS": str(cache_blocks), "FAKE_VLLM_PREFILL_DELAY": str(prefill_delay),
               "FAKE_VLLM_EVENTS": ""}
        fake = start_fake(name=f"i{i}", env=env, args=["--kv-events-config", json.dumps(config)])
        fakes.append(fake)
        backends.append(Backend(fake.name, fake.url, kv_events=endpoint))
    for fake in fakes:
        fake.wait_ready()
    return fakes, backends


async def counters(sessions: Sessions, backend: Backend) -> tuple[float, float]:
    session, base = sessions.get(backend.url)
    async with session.get(base + "/metrics") as response:
        text = await response.text()
    found = {HITS: 0.0, QUERIES: 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found[HITS], found[QUERIES]


# ---------------------------------------------------------------------------------- the workload

def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


class Phase:
    def __init__(self, args, name: str, salt: str) -> None:
        self.args, self.name, self.salt = args, name, salt
        self.ttft: list[float] = []
        self.served: dict[str, int] = {}

    def system(self) -> str:
        return words(f"sys{self.salt}w", self.args.system_words)

    def question(self, conv: int, turn: int) -> str:
        return words(f"q{self.salt}c{conv}t{turn}w", self.args.question_words)


async def run_phase(args, phase: Phase, send) -> float:
    """Every conversation's turns through `send(messages) -> (instance, answer)`; the wall time."""
    slots = asyncio.Semaphore(args.concurrency)
    order = list(range(args.conversations))
    random.Random(args.seed).shuffle(order)

    async def conversation(conv: int) -> None:
        messages = [{"role": "system", "content": phase.system()}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": phase.question(conv, turn)})
            async with slots:
                started = time.perf_counter()
                instance, answer = await send(messages)
                phase.ttft.append(time.perf_counter() - started)
            phase.served[instance] = phase.served.get(instance, 0) + 1
            messages.append({"role": "assistant", "content": answer})

    started = time.perf_counter()
    tasks = []
    for conv in order:  # staggered: a conversation starts when one of the first turns is under way
        tasks.append(asyncio.create_task(conversation(conv)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return time.perf_counter() - started


async def chat(session: aiohttp.ClientSession, base: str, model: str, messages, max_tokens: int) -> tuple[str, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    async with session.post(base + "/v1/chat/completions", json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {text[:300]}")
        answer = json.loads(text)["choices"][0]["message"]["content"] or ""
        return response.headers.get("X-Fake-Instance", "?"), answer


async def tokens_of(sessions: Sessions, backend: Backend, model: str, messages) -> list[int]:
    session, base = sessions.get(backend.url)
    async with session.post(base + "/tokenize", json={"model": model, "messages": messages}) as response:
        return (await response.json())["tokens"]


async def measure(args, backends: list[Backend]) -> dict:
    sessions = Sessions(timeout=aiohttp.ClientTimeout(total=120))
    results: dict[str, dict] = {}
    try:
        for round_no in range(args.rounds):
            for name in (*POLICIES, "oracle"):
                phase = Phase(args, name, f"{round_no}{name[:2]}")
                before = [await counters(sessions, b) for b in backends]
                if name == "oracle":
                    wall = await oracle_phase(args, phase, backends, sessions)
                else:
                    wall = await proxy_phase(args, phase, backends, name)
                await asyncio.sleep(0.2)
                after = [await counters(sessions, b) for b in backends]
                hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
                queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
                entry = results.setdefault(name, {"hit_rates": [], "ttft_p50_ms": [], "wall_s": [], "served": []})
                entry["hit_rates"].append(round(hits / queries, 4) if queries else None)
                entry["ttft_p50_ms"].append(round(statistics.median(phase.ttft) * 1e3, 2))
                entry["wall_s"].append(round(wall, 2))
                entry["served"].append(dict(sorted(phase.served.items())))
                if "decisions" in phase.__dict__:
                    entry["decisions"] = phase.decisions  # type: ignore[attr-defined]
                print(f"round {round_no} {name:16s} hit rate {entry['hit_rates'][-1]}  TTFT p50 "
                      f"{entry['ttft_p50_ms'][-1]} ms  served {entry['served'][-1]}", file=sys.stderr)
    finally:
        await sessions.close()
    for entry in results.values():
        rates = [r for r in entry["hit_rates"] if r is not None]
        entry["hit_rate"] = round(statistics.mean(rates), 4) if rates else None
    return results


async def proxy_phase(args, phase: Phase, backends: list[Backend], policy: str) -> float:
    pool = BackendPool()
    for backend in backends:
        pool.add(backend)
        pool.set_state(backend.name, "ready", True)
    proxy = ProxyServer(ProxyConfig(port=0, policy=policy), pool)  # type: ignore[arg-type]
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{proxy.port}"

            async def send(messages):
                return await chat(session, base, args.model, messages, args.max_tokens)

            if policy == "kv_aware":  # its subscriptions start at its first request: let them connect first
                await send([{"role": "user", "content": "warm"}])
                await asyncio.sleep(0.5)
            wall = await run_phase(args, phase, send)
            phase.decisions = dict(proxy._balancer.decisions)  # type: ignore[attr-defined]
            return wall
    finally:
        await proxy.drain_and_stop(0)


async def oracle_phase(args, phase: Phase, backends: list[Backend], sessions: Sessions) -> float:
    mirrors = {b.name: Mirror(args.cache_blocks, args.block_size) for b in backends}
    in_flight = {b.name: 0 for b in backends}
    turn = [0]
    http = aiohttp.ClientSession()

    async def send(messages):
        tokens = await tokens_of(sessions, backends[0], args.model, messages)
        held = {b.name: mirrors[b.name].held(tokens) for b in backends}
        turn[0] += 1
        rotation = {b.name: (i + turn[0]) % len(backends) for i, b in enumerate(backends)}
        best = max(backends, key=lambda b: (held[b.name], -in_flight[b.name], -rotation[b.name]))
        mirrors[best.name].add(tokens)
        in_flight[best.name] += 1
        try:
            session, base = sessions.get(best.url)
            instance, answer = await chat(session, base, args.model, messages, args.max_tokens)
        finally:
            in_flight[best.name] -= 1
        return best.name if instance == "?" else instance, answer

    try:
        return await run_phase(args, phase, send)
    finally:
        await http.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=256, help="the shared system prompt (fake: 16 blocks)")
    parser.add_argument("--question-words", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cache-blocks", type=lambda v: [int(x) for x in v.split(",")], default=[96, 2048],
                        help="each instance's prefix cache in blocks, one scenario per value (default: 96, too small for"
                             " every chat on one instance; 2048, room for all)")
    parser.add_argument("--block-size", type=int, default=16, help="the instances' block size (the fake's: 16)")
    parser.add_argument("--prefill-delay", type=float, default=0.0005, help="fake: seconds per uncached prompt token")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--upstream", action="append", default=[], metavar="URL=KV_ENDPOINT",
                        help="a running instance and its KV-events endpoint (none started then)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, help="the result file (default docs/bench/kv_bench.json)")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.rounds = 6, 3, 1
    recorder = Recorder("kv_bench")
    scenarios = []
    for cache_blocks in args.cache_blocks:
        run = argparse.Namespace(**{**vars(args), "cache_blocks": cache_blocks})
        fakes: list = []
        workdir = Path(tempfile.mkdtemp(prefix="kv-bench-"))
        os.chmod(workdir, 0o700)
        try:
            if args.upstream:
                backends = []
                for i, item in enumerate(args.upstream):
                    address, _, endpoint = item.partition("=")
                    backends.append(Backend(str(i), address, kv_events=endpoint))
            else:
                fakes, backends = start_fakes(args.instances, cache_blocks, workdir, args.prefill_delay)
            print(f"-- each instance's cache: {cache_blocks} blocks of {args.block_size}", file=sys.stderr)
            results = asyncio.run(measure(run, backends))
        finally:
            for fake in fakes:
                fake.cleanup()
        oracle, kv = results["oracle"]["hit_rate"], results["kv_aware"]["hit_rate"]
        ratio = round(kv / oracle, 4) if oracle and kv is not None else None
        scenarios.append({"cache_blocks": cache_blocks, "policies": results, "kv_aware_over_oracle_hit_rate": ratio,
                          "goal_met": ratio is not None and ratio >= 0.9})
        print(json.dumps({"cache_blocks": cache_blocks, "kv_aware_over_oracle_hit_rate": ratio,
                          **{p: r["hit_rate"] for p, r in results.items()}}))
    figures = {
        "instances": "fake vLLM (tests/fakevllm)" if not args.upstream else args.upstream,
        "settings": {k: getattr(args, k) for k in ("instances", "conversations", "turns", "system_words", "question_words",
                                                   "max_tokens", "concurrency", "block_size", "prefill_delay", "rounds",
                                                   "seed")},
        "scenarios": scenarios,
        "goal": "kv_aware_over_oracle_hit_rate >= 0.9 in every scenario",
        "goal_met": all(s["goal_met"] for s in scenarios),
    }
    recorder.write(figures, out_dir=args.out.parent if args.out else None, file_name=args.out.name if args.out else None)


if __name__ == "__main__":
    main()
