"""Cache-aware routing measured with real vLLM CPU: every proxy policy (round_robin,
least_outstanding, least_loaded, prefix_affinity, and any later one the schema lists) over the same
instances, in one run.

    .venv/bin/python bench/affinity_bench.py                 # 2 instances, 8 sessions x 4 questions, 1,000-token prefixes
    .venv/bin/python bench/affinity_bench.py --quick         # a smoke run: 4 sessions x 3 questions
    .venv/bin/python bench/affinity_bench.py --fake          # the fake vLLM (tests/fakevllm, its prefix cache and
                                                             # prefill delay) instead of vLLM: minutes, not hours;
                                                             # --fake-step-time 0.02: decode slows with the batch
    .venv/bin/python bench/affinity_bench.py --upstream http://127.0.0.1:8100 --upstream http://127.0.0.1:8101
                                                             # servers already running: none started here

Instances: `vsup run` starts --instances pinned vLLM instances once (the bench model of
bench/vllm_bench.py, --enable-prefix-caching); every policy gets its own `vsup proxy --policy P`
in front of the same instances, so the policies differ in routing only.

Workloads, measured per policy, the policies in turn (--rounds repeats the sequence):
  shared    S sessions (--sessions), each with its own prefix of at least --prefix-tokens tokens
            (counted by the instances' /tokenize), followed by a short question of its own; Q
            questions per session (--questions), interleaved: each round of questions visits the
            sessions in a seeded shuffled order (a fixed order would let round robin's alternation
            line up with the sessions and look like affinity). Chat: the prefix is the system
            prompt (--api completions: the prompt's start).
  few       the same number of requests from --few-sessions sessions (default 8, as many as shared),
            chosen so that plain rendezvous hashing puts 3 of 4 of them on one instance: the 6 : 2
            split of issue 22 made deliberate (the bench computes each prefix's unloaded winner with the
            proxy's own hashing over the upstreams' names), where a load escape must act.
  distinct  S x Q requests, each its own prompt of --distinct-tokens tokens: nothing to share, so
            prefix_affinity can only lose (its hashing spreads worse than a rotation).
Each phase uses fresh text (a salt per workload, policy and round): no policy meets a cache that
another filled; and it starts once the instances are idle and every proxy's load probe has seen
them so (`settle`): no policy inherits the load figures of the phase before. --concurrency requests are in flight at a time (closed loop), each streamed, with
--max-tokens tokens (ignore_eos).

Reported per workload and policy: TTFT p50/p90 (client side, through the proxy, first streamed
event), output tok/s (completion tokens / wall time of the phase), and per instance the requests it
served and its prefix-cache hit rate: the change of vllm:prefix_cache_hits_total over
vllm:prefix_cache_queries_total on the instance's own /metrics (vLLM counts both in prompt tokens).
Then issue 22's bar as ratios of the same run, per policy against round_robin: shared and few:
TTFT p50 round_robin / policy >= 3 and TTFT p90 policy / round_robin <= 1; distinct: tok/s policy /
round_robin >= 0.95.
A policy that needs more than its proxy.policy (kv_aware: vLLM's --kv-events-config, the proxy's
subscription) gets it from POLICY_HOOKS below: its extra proxy keys and vLLM arguments.

Why the defaults: with --kvcache-gib 0.5 the bench model (hidden 1024, 8 layers, fp32: 64 KiB of
KV per token) caches ~8,000 tokens per instance, and 8 sessions of ~1,050 tokens need ~8,400: under
round robin each instance would hold every session's prefix and runs out of room, under
prefix_affinity each holds about half — the N-copies effect the policy removes. With a cache that
fits every prefix on every instance, round robin pays N prefills per session instead of 1, and its
TTFT p50 is a miss only while N >= Q / 2 (raise --kvcache-gib and see). vLLM's CPU backend caches
in blocks of 128 tokens (platforms/cpu.py), so only whole 128-token blocks of a prefix are reused.
The KV cache each instance reports (vllm:cache_config_info: capacity, block size, whether prefix
caching is on) is printed with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)
from vllm_bench import VSUP, Layout, add_model_options, free_port, free_ports, resolve_model, stream_once  # noqa: E402

# Every policy the schema lists, in its order, but kv_aware (below).
from vsup.config.schema import ProxyConfig  # noqa: E402
from vsup.proxy import load  # noqa: E402
from vsup.proxy.affinity import PrefixAffinity, routing_key  # noqa: E402
from vsup.proxy.backends import Backend  # noqa: E402

# kv_aware needs each instance's KV-events socket, which only `vsup run`'s own proxy subscribes to,
# not the standalone proxy each policy gets here: bench/kv_bench.py measures it (against an oracle).
POLICIES: tuple[str, ...] = tuple(p for p in get_args(ProxyConfig.model_fields["policy"].annotation) if p != "kv_aware")
# What a policy needs besides proxy.policy: {"proxy": {key: value}, "vllm_args": [...]}; kv_aware's
# owner fills its entry (the events publisher on each instance, the proxy's subscription).
POLICY_HOOKS: dict[str, dict] = {}
WORKLOADS = ("shared", "few", "distinct")
SERVED_NAME = "bench-llama"
# Words of the bench model's tokenizer training text (scripts/build_tiny_model.py), so prompts
# tokenize into about one token per word, as prose does.
WORDS = (
    "the a of to in on for with by from at as is are was be this that it model server request response token "
    "stream core node memory cache process thread worker engine supervisor proxy instance health ready start stop "
    "restart signal port socket queue batch prompt answer question hello world cpu numa bind pin plan launch config "
    "value key error timeout retry fast slow small large first last next one two three four five six seven eight "
    "nine ten red green blue river mountain city window garden music paper light water stone bird tree road and or "
    "but if then when while because so not all any each every some many few more run send read write keep make"
).split()
COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
}


# ---- text -----------------------------------------------------------------------------------------

def words(rng: random.Random, count: int) -> str:
    out = []
    for i in range(count):
        word = rng.choice(WORDS)
        out.append(f"{word}." if i % 12 == 11 else word)
    return " ".join(out)


class Tokens:
    """Token counts from an instance's /tokenize (vLLM's and the fake's); prompts are grown to a
    target count in a few calls, using the words-per-token ratio seen so far."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.per_word = 1.0

    def count(self, text: str) -> int:
        body = json.dumps({"model": self.model, "prompt": text, "add_special_tokens": False}).encode()
        request = urllib.request.Request(f"{self.url}/tokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(json.load(response)["count"])

    def text(self, rng: random.Random, target: int) -> tuple[str, int]:
        """A text of at least `target` tokens (and not many more), with its count."""
        n = max(1, int(target / self.per_word))
        for _ in range(8):
            text = words(random.Random(rng.random()), n)
            count = self.count(text)
            self.per_word = count / n
            if count >= target:
                return text, count
            n = int(n * target / max(count, 1)) + 8
        raise RuntimeError(f"could not build a text of {target} tokens on {self.url}/tokenize")


@dataclass
class Request:
    session: int
    prefix: str  # shared by the session's requests ("" in the distinct workload)
    question: str


def shared_workload(tokens: Tokens, salt: str, sessions: int, questions: int, prefix_tokens: int) -> tuple[list[Request], int]:
    """S sessions x Q questions, interleaved in a shuffled order per round of questions; and the
    prefixes' smallest token count."""
    rng = random.Random(salt)
    prefixes = [tokens.text(rng, prefix_tokens) for _ in range(sessions)]
    order: list[Request] = []
    for q in range(questions):
        visit = list(range(sessions))
        rng.shuffle(visit)
        for s in visit:
            order.append(Request(s, prefixes[s][0], f"Question {q} of reader {s}: {words(rng, 8)}?"))
    return order, min(count for _, count in prefixes)


def few_workload(tokens: Tokens, salt: str, sessions: int, requests: int, prefix_tokens: int, instances: list[str],
                 args) -> tuple[list[Request], int]:
    """`requests` requests from `sessions` sessions, 3 in 4 of which hash (unloaded) to one instance."""
    rng = random.Random(salt)
    hasher = PrefixAffinity(args.affinity_prefix_chars)
    upstreams = tuple(Backend(url, url) for url in instances)  # `vsup proxy --upstream URL` names each by its URL
    hot = instances[0]
    want_hot = min(sessions, max(1, (3 * sessions + 3) // 4)) if len(instances) > 1 else sessions
    chosen: list[tuple[str, int]] = []
    hot_count = 0
    for _ in range(sessions * 40):
        if len(chosen) == sessions:
            break
        text, count = tokens.text(rng, prefix_tokens)
        _, body = payload(args.api, Request(0, text, "Question 0?"), args.max_tokens, args.model_name)
        winner = hasher.choose(upstreams, {}, (), routing_key(body, {}, args.affinity_prefix_chars)).name
        if (winner == hot and hot_count < want_hot) or (winner != hot and len(chosen) - hot_count < sessions - want_hot):
            chosen.append((text, count))
            hot_count += winner == hot
    if len(chosen) < sessions:
        raise RuntimeError(f"could not draw {sessions} prefixes split {want_hot} : {sessions - want_hot} by hashing")
    order: list[Request] = []
    q = 0
    while len(order) < requests:
        visit = list(range(sessions))
        rng.shuffle(visit)
        for s in visit[: requests - len(order)]:
            order.append(Request(s, chosen[s][0], f"Question {q} of reader {s}: {words(rng, 8)}?"))
        q += 1
    return order, min(count for _, count in chosen)


def distinct_workload(tokens: Tokens, salt: str, count: int, prompt_tokens: int) -> list[Request]:
    rng = random.Random(salt)
    return [Request(i, "", tokens.text(rng, prompt_tokens)[0]) for i in range(count)]


def payload(api: str, request: Request, max_tokens: int, model: str) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    if api == "chat":
        messages = [{"role": "system", "content": request.prefix}] if request.prefix else []
        messages.append({"role": "user", "content": request.question})
        return "/v1/chat/completions", {**common, "messages": messages}
    prompt = f"{request.prefix}\n\n{request.question}\nAnswer:" if request.prefix else request.question
    return "/v1/completions", {**common, "prompt": prompt}


# ---- load -----------------------------------------------------------------------------------------

@dataclass
class Phase:
    workload: str
    policy: str
    round: int
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    instances: dict[str, dict[str, float]] = field(default_factory=dict)  # url -> counter changes
    decisions: dict[str, float] = field(default_factory=dict)  # the proxy's policy decisions in the phase
    error_samples: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed else 0.0

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def hit_rate(self, url: str | None = None) -> float | None:
        rows = [self.instances[url]] if url else list(self.instances.values())
        queries = sum(r.get("queries", 0) for r in rows)
        return sum(r.get("hits", 0) for r in rows) / queries if queries else None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(round(q * 100)) - 1]


async def run_phase(phase: Phase, proxy_url: str, requests: list[Request], args) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    queue = iter(requests)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
        async def worker() -> None:
            for request in queue:
                path, body = payload(args.api, request, args.max_tokens, args.model_name)
                try:
                    ttft, tokens = await stream_once(session, proxy_url, path, body)
                except Exception as exc:  # counted and shown: a phase with errors says so in the table
                    phase.errors += 1
                    if len(phase.error_samples) < 3:
                        phase.error_samples.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                phase.ttfts.append(ttft)
                phase.tokens += tokens
                phase.requests += 1

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        phase.elapsed = time.monotonic() - began


def scrape(url: str) -> tuple[dict[str, float], str]:
    """An instance's prefix-cache and request counters (summed over label sets), and its KV cache
    as it reports it (vllm:cache_config_info: capacity, block size, prefix caching on), or "?"."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    wanted = {name: key for key, name in COUNTERS.items()}
    values: dict[str, float] = {}
    capacity = "?"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key:
                values[key] = values.get(key, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                labels = sample.labels
                try:
                    capacity = (f"{int(labels['block_size']) * int(labels['num_gpu_blocks'])} tokens in blocks of "
                                f"{labels['block_size']}, prefix caching {labels.get('enable_prefix_caching', '?')}")
                except (KeyError, ValueError):
                    pass
    return values, capacity


def decisions(proxy_url: str) -> dict[str, float]:
    """The proxy's vsup_proxy_policy_decisions_total by decision (affinity, session, escaped, ...)."""
    with urllib.request.urlopen(f"{proxy_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vsup_proxy_policy_decisions_total":
                out[sample.labels["decision"]] = out.get(sample.labels["decision"], 0.0) + sample.value
    return out


def settle(instances: list[str], args) -> None:
    """Wait until every instance's engine is idle (running + waiting 0), then for the proxies'
    load probes to sample that: a sample from the phase before (another proxy's requests, ended
    since) would otherwise count as load from elsewhere for up to proxy.load_interval and steer the
    next phase's first requests, a handicap only the policies that read the engines' figures pay."""
    deadline = time.monotonic() + 60
    for url in instances:
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
                figures = load.parse(response.read())
            if figures is None or figures[0] == 0:
                break
            time.sleep(0.1)
    time.sleep(1.5 * args.load_interval + 0.2)


def measure(phase: Phase, proxy_url: str, instances: list[str], requests: list[Request], args) -> Phase:
    settle(instances, args)
    before = {url: scrape(url)[0] for url in instances}
    chosen = decisions(proxy_url)
    asyncio.run(run_phase(phase, proxy_url, requests, args))
    after = {url: scrape(url)[0] for url in instances}
    for url in instances:
        phase.instances[url] = {key: after[url].get(key, 0.0) - before[url].get(key, 0.0) for key in after[url]}
    phase.decisions = {key: value - chosen.get(key, 0.0) for key, value in decisions(proxy_url).items() if value - chosen.get(key, 0.0)}
    return phase


# ---- processes ------------------------------------------------------------------------------------

def start_instances(args, layout: Layout, workdir: Path) -> list[str]:
    """`vsup run` with --instances pinned vLLM instances; their base URLs once all are ready."""
    base = free_ports(args.instances)
    port = free_port()
    config = {
        "model": str(args.model_dir),
        "served_model_name": SERVED_NAME,
        "instances": args.instances,
        "placement": {"reserve_cores": 0, "kvcache_gib": args.kvcache_gib},
        # listen: tcp: the `vsup proxy` processes below reach these instances directly, from outside
        # vsup (what vllm.listen: tcp is for; its owner check still guards the ports)
        "vllm": {"venv": str(args.venv), "listen": "tcp", "base_port": base, "env": {"HF_HUB_OFFLINE": "1"},
                 "args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(args.max_model_len),
                          "--max-num-seqs", str(max(args.concurrency, 8)), "--enable-prefix-caching",
                          *[a for p in args.policies for a in POLICY_HOOKS.get(split_policy(p, 0)[0], {}).get("vllm_args", [])]]},
        "proxy": {"port": port},
        "health": {"startup_timeout": args.startup_timeout},
        "start": {"mode": "parallel"},
        "log": {"dir": str(workdir / "logs"), "echo": False},
        "control": {"socket": str(workdir / "control.sock")},
    }
    path = workdir / "vsup.yaml"
    path.write_text(yaml.safe_dump(config))
    layout.spawn([VSUP, "run", "--config", str(path)], "vsup")
    layout.wait_ready(f"http://127.0.0.1:{port}", args.instances, args.startup_timeout)
    return [f"http://127.0.0.1:{base + i}" for i in range(args.instances)]


def start_fakes(args, layout: Layout) -> list[str]:
    """--fake: --instances fake vLLMs (their prefix cache counts like vLLM's; uncached prompt words
    cost --fake-prefill-delay each, one prefill at a time per instance); their base URLs."""
    root = Path(__file__).resolve().parents[1]
    urls = []
    base = free_ports(args.instances)
    for port in range(base, base + args.instances):
        env = {**os.environ, "PYTHONPATH": str(root), "FAKE_VLLM_PREFILL_DELAY": str(args.fake_prefill_delay),
               "FAKE_VLLM_TOKEN_DELAY": str(args.fake_token_delay), "FAKE_VLLM_PREFIX_CACHE_BLOCKS": str(args.fake_cache_blocks),
               "FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0", "FAKE_VLLM_ACCESS_LOG": "0",
               **({"FAKE_VLLM_STEP_TIME": str(args.fake_step_time), "FAKE_VLLM_SEQ_COST": str(args.fake_seq_cost),
                   "OMP_NUM_THREADS": "1"} if args.fake_step_time else {})}
        layout.spawn([sys.executable, "-m", "tests.fakevllm", "serve", SERVED_NAME, "--port", str(port),
                      "--max-num-seqs", str(max(args.concurrency, 8))], f"fake-{port}", env=env)
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fake vLLM at {url} did not start") from None
                time.sleep(0.1)
    return urls


def split_policy(entry: str, default_factor: float) -> tuple[str, float]:
    """A --policies entry: POLICY, or POLICY@EPSILON (that policy with its own
    proxy.affinity_load_factor, e.g. prefix_affinity@1 beside prefix_affinity in the same run)."""
    policy, _, factor = entry.partition("@")
    return policy, float(factor) if factor else default_factor


def start_proxies(args, layout: Layout, workdir: Path, instances: list[str]) -> dict[str, str]:
    """One `vsup proxy --policy P` per --policies entry, in front of the same instances."""
    urls = {}
    for n, entry in enumerate(args.policies):
        policy, factor = split_policy(entry, args.affinity_load_factor)
        port = free_port()
        config = workdir / f"proxy-{n}-{policy}.yaml"
        config.write_text(yaml.safe_dump({
            "proxy": {"affinity_prefix_chars": args.affinity_prefix_chars, "affinity_load_factor": factor,
                      "load_interval": args.load_interval, "first_byte_timeout": 900.0, "idle_timeout": 900.0,
                      **POLICY_HOOKS.get(policy, {}).get("proxy", {})},
            "health": {"interval": 1.0, "timeout": 5.0},
        }))
        layout.spawn([VSUP, "proxy", "--port", str(port), "--policy", policy, "--config", str(config),
                      *[a for url in instances for a in ("--upstream", url)]], f"proxy-{n}-{policy}")
        urls[entry] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        layout.wait_ready(url, len(instances), 60)
    return urls


def model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def warm_up(instances: list[str], args) -> None:
    """A short request straight to each instance, so first-request costs land in no phase."""
    async def go() -> None:
        async with aiohttp.ClientSession() as session:
            for url in instances:
                path, body = payload(args.api, Request(0, "", "warm up"), 2, args.model_name)
                await stream_once(session, url, path, body)
    asyncio.run(go())


# ---- report ---------------------------------------------------------------------------------------

def merged(phases: list[Phase], workload: str, policy: str) -> Phase:
    mine = [p for p in phases if p.workload == workload and p.policy == policy]
    out = Phase(workload, policy, 0, requests=sum(p.requests for p in mine), errors=sum(p.errors for p in mine),
                tokens=sum(p.tokens for p in mine), elapsed=sum(p.elapsed for p in mine),
                ttfts=[t for p in mine for t in p.ttfts])
    for p in mine:
        for url, counters in p.instances.items():
            row = out.instances.setdefault(url, {})
            for key, value in counters.items():
                row[key] = row.get(key, 0.0) + value
        out.error_samples += p.error_samples
        for key, value in p.decisions.items():
            out.decisions[key] = out.decisions.get(key, 0.0) + value
    return out


def bars(summary: dict[tuple[str, str], Phase], policies: list[str]) -> list[tuple[str, str, str, float, str, float]]:
    """Issue 22's bar, per policy against round_robin: (workload, policy, what, value, direction, bar)."""
    rr = "round_robin"
    out = []
    if rr not in policies:
        return out
    for policy in policies:
        if policy == rr:
            continue
        for workload in ("shared", "few"):
            base, mine = summary[(workload, rr)], summary[(workload, policy)]
            out.append((workload, policy, "TTFT p50 round_robin / policy", ratio(base.ttft(0.5), mine.ttft(0.5)), ">=", 3.0))
            out.append((workload, policy, "TTFT p90 policy / round_robin", ratio(mine.ttft(0.9), base.ttft(0.9)), "<=", 1.0))
        out.append(("distinct", policy, "output tok/s policy / round_robin",
                    ratio(summary[("distinct", policy)].tokens_per_s, summary[("distinct", rr)].tokens_per_s), ">=", 0.95))
    return out


def report(phases: list[Phase], instances: list[str], capacities: list[str], args) -> str:
    names = {url: f"i{n}" for n, url in enumerate(instances)}
    lines = [
        f"{len(instances)} instances (KV cache: {' / '.join(capacities)}); api {args.api}; shared: {args.sessions} sessions x "
        f"{args.questions} questions, prefixes >= {args.prefix_tokens_seen} tokens and {args.prefix_chars_seen} characters; "
        f"few: {args.few_sessions} sessions, {args.sessions * args.questions} requests, split 3 : 1 by hashing; distinct: "
        f"{args.sessions * args.questions} prompts of {args.distinct_tokens} tokens; {args.max_tokens} tokens per answer; "
        f"concurrency {args.concurrency}; {args.rounds} round(s); prefix_affinity: affinity_prefix_chars "
        f"{args.affinity_prefix_chars}, affinity_load_factor {args.affinity_load_factor}; load_interval {args.load_interval}; "
        f"--seed {args.seed}",
        "",
        "| workload | policy | requests | errors | TTFT p50 | TTFT p90 | output tok/s | prefix-cache hit rate | per instance: requests, hit rate | decisions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[tuple[str, str], Phase] = {}
    for workload in WORKLOADS:
        for policy in args.policies:
            m = summary[(workload, policy)] = merged(phases, workload, policy)
            rate = m.hit_rate()
            per = ", ".join(
                f"{names[url]} {int(m.instances.get(url, {}).get('requests', 0))} / {fmt_rate(m.hit_rate(url) if url in m.instances else None)}"
                for url in instances)
            lines.append(f"| {workload} | {policy} | {m.requests} | {m.errors} | {m.ttft(0.5):.2f} s | {m.ttft(0.9):.2f} s | "
                         f"{m.tokens_per_s:.1f} | {fmt_rate(rate)} | {per} | "
                         f"{', '.join(f'{k} {int(v)}' for k, v in sorted(m.decisions.items())) or '-'} |")
    checks = bars(summary, args.policies)
    if checks:
        lines += ["", "The issue's bar (ratios of this run, each policy against round_robin):"]
        lines += [check(f"{workload}: {what} ({policy})", value, bar, direction) for workload, policy, what, value, direction, bar in checks]
    for phase in phases:
        for sample in phase.error_samples:
            lines.append(f"({phase.workload}, {phase.policy}, round {phase.round}) error: {sample}")
    return "\n".join(lines)


def figures(phases: list[Phase], instances: list[str], capacities: list[str], args) -> dict:
    """What docs/bench/affinity_bench.json holds: the settings, and per workload and policy (over all rounds) the
    figures of the table, per instance included, and the issue's ratios of the same run."""
    names = {url: f"i{n}" for n, url in enumerate(instances)}

    def r(value: float | None, digits: int) -> float | None:
        return None if value is None or value != value else round(value, digits)

    rows, summary = [], {}
    for workload in WORKLOADS:
        for policy in args.policies:
            m = summary[(workload, policy)] = merged(phases, workload, policy)
            rows.append({"workload": workload, "policy": policy, "requests": m.requests, "errors": m.errors,
                         "ttft_p50_s": r(m.ttft(0.5), 3), "ttft_p90_s": r(m.ttft(0.9), 3),
                         "tokens_per_s": r(m.tokens_per_s, 2), "hit_rate": r(m.hit_rate(), 3),
                         "decisions": {k: int(v) for k, v in sorted(m.decisions.items())},
                         "instances": {names[url]: {"requests": int(m.instances.get(url, {}).get("requests", 0)),
                                                    "hit_rate": r(m.hit_rate(url) if url in m.instances else None, 3)}
                                       for url in instances}})
    out: dict = {
        "settings": {"instances": len(instances), "kv_cache": capacities, "api": args.api, "sessions": args.sessions,
                     "questions": args.questions, "prefix_tokens_min": args.prefix_tokens_seen,
                     "distinct_tokens": args.distinct_tokens, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "rounds": args.rounds, "seed": args.seed,
                     "affinity_prefix_chars": args.affinity_prefix_chars,
                     "affinity_load_factor": args.affinity_load_factor, "load_interval": args.load_interval,
                     "few_sessions": args.few_sessions, "backend": "fake vLLM" if args.fake else ("upstreams" if args.upstream else "vLLM")},
        "rows": rows,
    }
    # "met" judged on the unrounded ratio, as the printed verdict is (1.004 shows as 1.00 yet misses <= 1)
    out["ratios"] = [{"workload": workload, "policy": policy, "what": what, "value": r(value, 2), "bar": f"{direction} {bar:g}",
                      "met": None if value != value else meets(value, bar, direction)}
                     for workload, policy, what, value, direction, bar in bars(summary, args.policies)]
    return out


def fmt_rate(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.0f} %"


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def meets(value: float, bar: float, direction: str) -> bool:
    return value >= bar if direction == ">=" else value <= bar


def check(what: str, value: float, bar: float, direction: str = ">=") -> str:
    met = meets(value, bar, direction)
    verdict = "n/a" if value != value else ("meets" if met else "MISSES")
    return f"- {what}: {value:.2f} ({verdict} {direction} {bar:g})"


# ---- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 sessions x 3 questions, concurrency 2, 16 tokens")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=None, help="sessions with a prefix of their own (default 8; --quick 4)")
    parser.add_argument("--questions", type=int, default=None, help="questions per session (default 4; --quick 3)")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="tokens of each session's prefix (default 1000)")
    parser.add_argument("--distinct-tokens", type=int, default=256, help="tokens of each distinct prompt (default 256)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 4; --quick 2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 32; --quick 16)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat all phases, policies in turn each round")
    parser.add_argument("--api", choices=("chat", "completions"), default="chat")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, in this order (default: all: "
                        f"{','.join(POLICIES)}); prefix_affinity@1: prefix_affinity with affinity_load_factor 1, beside the others")
    parser.add_argument("--affinity-prefix-chars", type=int, default=2048)
    parser.add_argument("--affinity-load-factor", type=float, default=0.25, help="proxy.affinity_load_factor (default 0.25)")
    parser.add_argument("--load-interval", type=float, default=1.0, help="proxy.load_interval (default 1.0)")
    parser.add_argument("--few-sessions", type=int, default=None, help="sessions of the few workload (default 8, split 6 : 2 as in issue 22; --quick 2)")
    parser.add_argument("--fake", action="store_true", help="start --instances fake vLLMs (tests/fakevllm: prefix cache, "
                        "prefill delay) instead of vLLM; see --fake-prefill-delay")
    parser.add_argument("--fake-prefill-delay", type=float, default=0.004, help="--fake: seconds per uncached prompt word (default 0.004)")
    parser.add_argument("--fake-token-delay", type=float, default=0.02, help="--fake: seconds per generated token (default 0.02)")
    parser.add_argument("--fake-step-time", type=float, default=None, help="--fake: batched decode steps of this many "
                        "seconds (FAKE_VLLM_STEP_TIME), growing with the batch by --fake-seq-cost; default: a fixed delay per token")
    parser.add_argument("--fake-seq-cost", type=float, default=0.3, help="--fake: a step's growth per extra sequence (default 0.3)")
    parser.add_argument("--fake-cache-blocks", type=int, default=None, help="--fake: prefix-cache blocks of 16 words per "
                        "instance (default: 95 %% of the shared workload's prefixes, as the real run's KV cache)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len (the bench model has 2048 positions)")
    parser.add_argument("--upstream", action="append", default=[], metavar="URL",
                        help="an OpenAI-compatible server already running (repeat): no vLLM is started")
    parser.add_argument("--model-name", default=None, help="the model clients name (default: the first of /v1/models)")
    parser.add_argument("--seed", default=None, help="salt of all generated text (default: a new one per run, so a "
                        "second run never meets the first one's prefixes in the instances' caches; printed)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the phases as JSON")
    parser.add_argument("--result", type=Path, default=None, metavar="PATH",
                        help="the result file (bench/result.py's format; default docs/bench/affinity_bench.json when the "
                        "bench starts vLLM itself, none with --upstream: those servers are not the published set-up)")
    add_model_options(parser)
    args = parser.parse_args(argv)
    args.seed = args.seed or random.Random().randbytes(4).hex()
    quick = {"sessions": 4, "questions": 3, "concurrency": 2, "max_tokens": 16, "few_sessions": 2}
    full = {"sessions": 8, "questions": 4, "concurrency": 4, "max_tokens": 32, "few_sessions": 8}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]

    def known(entry: str) -> bool:
        if "@" in entry and not entry.startswith("prefix_affinity@"):
            return False
        try:  # the schema's own bounds for the load factor (pydantic's ValidationError is a ValueError)
            policy, factor = split_policy(entry, args.affinity_load_factor)
            ProxyConfig(affinity_load_factor=factor)
        except ValueError:
            return False
        return policy in POLICIES

    if not args.policies or not all(known(p) for p in args.policies) or len(set(args.policies)) != len(args.policies):
        parser.error(f"--policies: a comma-separated list of distinct policies from {', '.join(POLICIES)}; "
                     "prefix_affinity@EPSILON: prefix_affinity with that proxy.affinity_load_factor")
    if args.fake and args.upstream:
        parser.error("--fake starts its own fake instances: leave out --upstream")
    if args.fake_cache_blocks is None:
        args.fake_cache_blocks = max(1, int(0.95 * args.sessions * args.prefix_tokens / 16))
    for name in ("instances", "sessions", "questions", "prefix_tokens", "distinct_tokens", "concurrency", "max_tokens", "rounds", "few_sessions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.upstream and not args.fake and args.prefix_tokens + 64 + args.max_tokens > args.max_model_len:
        parser.error(f"--prefix-tokens {args.prefix_tokens} + a question + --max-tokens {args.max_tokens} do not fit "
                     f"--max-model-len {args.max_model_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recorder = Recorder("affinity_bench", [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    with tempfile.TemporaryDirectory(prefix="affinity-bench-") as tmp:
        workdir = Path(tmp)
        layout = Layout(workdir)
        try:
            if args.upstream:
                instances = [url.rstrip("/") for url in args.upstream]
            elif args.fake:
                instances = start_fakes(args, layout)
            else:
                resolve_model(args)
                print(f"starting {args.instances} vLLM instance(s) under vsup run ...", file=sys.stderr)
                instances = start_instances(args, layout, workdir)
            args.model_name = args.model_name or model_name(instances[0])
            proxies = start_proxies(args, layout, workdir, instances)
            warm_up(instances, args)
            capacities = [scrape(url)[1] for url in instances]
            tokens = Tokens(instances[0], args.model_name)
            phases: list[Phase] = []
            seen: list[int] = []
            chars: list[int] = []
            for round_no in range(1, args.rounds + 1):
                for workload in WORKLOADS:
                    for policy in args.policies:
                        salt = f"{args.seed}/{workload}/{policy}/{round_no}"
                        if workload == "shared":
                            requests, shortest = shared_workload(tokens, salt, args.sessions, args.questions, args.prefix_tokens)
                            seen.append(shortest)
                            chars.append(min(len(r.prefix) for r in requests))
                        elif workload == "few":
                            requests, shortest = few_workload(tokens, salt, args.few_sessions, args.sessions * args.questions,
                                                              args.prefix_tokens, instances, args)
                            seen.append(shortest)
                        else:
                            requests = distinct_workload(tokens, salt, args.sessions * args.questions, args.distinct_tokens)
                        print(f"  round {round_no}: {workload} / {policy}: {len(requests)} requests", file=sys.stderr)
                        phases.append(measure(Phase(workload, policy, round_no), proxies[policy], instances, requests, args))
            args.prefix_tokens_seen, args.prefix_chars_seen = min(seen), min(chars)
            if any(p.startswith("prefix_affinity") for p in args.policies) and args.prefix_chars_seen < args.affinity_prefix_chars:
                print(f"warning: prefixes of {args.prefix_chars_seen} characters, shorter than --affinity-prefix-chars "
                      f"{args.affinity_prefix_chars}: prefix_affinity keys them with their questions, which spreads them",
                      file=sys.stderr)
        except Exception:
            for log in sorted(workdir.glob("*.log")) + sorted((workdir / "logs").glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            raise
        finally:
            layout.stop()
    print(report(phases, instances, capacities, args))
    if args.json:
        args.json.write_text(json.dumps([phase.__dict__ for phase in phases], indent=1))
    if args.result or not (args.upstream or args.fake):
        result = figures(phases, instances, capacities, args)
        recorder.write(result, args.result.parent if args.result else None, args.result.name if args.result else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
