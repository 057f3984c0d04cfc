#!/usr/bin/env python3
"""Interactive chat behind a batch of long summarization requests: its TTFT with priority admission
(proxy.max_in_flight_per_instance, reserved_slots, priority_header) against none, and against the
same chat unloaded, in one run over the same instances (issue 22 §4).

    .venv/bin/python bench/priority_bench.py --quick     # fake vLLM, ~40 s; writes docs/bench/priority_bench.json
    .venv/bin/python bench/priority_bench.py             # fake vLLM, 30 s per scenario
    .venv/bin/python bench/priority_bench.py --upstream http://127.0.0.1:8100 --upstream http://127.0.0.1:8101 \\
        --model NAME --max-num-seqs 4                    # real vLLM servers already running (each with --max-num-seqs 4)

Scenarios, each through its own `vsup proxy` in front of the same instances, in turn:
  unloaded    the interactive client alone (no admission: nothing to admit)
  none        interactive + batch, no admission: every request goes straight to vLLM, whose
              scheduler queues what is over --max-num-seqs first come first served
  priority    interactive + batch, max_in_flight_per_instance = --max-num-seqs, reserved_slots =
              --reserved, the interactive requests X-Priority: interactive (10), the batch ones
              X-Priority: batch (-10): the batch waits in the proxy, the chat takes a free (or
              the reserved) slot at once
  priority_no_reserve  the same with reserved_slots 0: the chat passes every waiting batch request
              but still waits for a batch request to end (what reserved_slots buys)
The interactive client: one chat at a time (closed loop), a short question, streamed, --chat-tokens
tokens; TTFT = to the first streamed event with content, client side. The batch: --batch clients
in a closed loop, each a summarization completion of a --batch-words prompt and --batch-tokens
tokens (not streamed). Reported: interactive TTFT p50/p90 per scenario, the ratios to unloaded
(the goal: priority's p50 within 1.5x of unloaded) and the batch's progress (completions and
tokens per second: it must go on under priority, not starve).

Fake vLLM (the default: tests/fakevllm, real processes): its batched engine model
(FAKE_VLLM_STEP_TIME s per decode step, +FAKE_VLLM_SEQ_COST per extra sequence in the batch),
prefill at FAKE_VLLM_PREFILL_DELAY s per uncached prompt token, one prefill at a time, and
FAKE_VLLM_MAX_NUM_SEQS sequences at once, the rest queued as vLLM's scheduler does; the defaults
below (50 ms a step, 10 % more per sequence, 2 ms a prompt token) are a small model on a few CPU
cores: prefill cheap per token, decode dear. The figures are then the proxy's scheduling against
that model, not vLLM's speed; the --upstream run is the one that measures vLLM. One way the model
flatters a loaded instance: a sequence that joins a busy engine gets its first token at the end
of the step in progress, while an idle engine starts a whole step for it (vLLM schedules a new
request into the next step), so the fake's loaded TTFT can come out below its unloaded one by up
to one step (--step-time); read the fake's ratio as "no queueing behind the batch", not as a
speed-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.append(str(REPO))  # tests.fakevllm
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)

GOAL = 1.5  # priority's interactive TTFT p50 at most this many times the unloaded one
SCENARIOS = ("unloaded", "none", "priority", "priority_no_reserve")
MODEL = "chat"
WORDS = ("the a of to in on for with model server request token stream core node memory cache process "
         "thread worker engine queue batch prompt answer question river mountain city window garden").split()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}/ready: not ready after {timeout:g} s")


def start_proxy(upstreams: list[str], model: str, scenario: str, seqs: int, reserved: int, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proxy: dict = {"port": port, "first_byte_timeout": 600, "policy": "least_outstanding"}
    if scenario.startswith("priority"):
        proxy.update(max_in_flight_per_instance=seqs, reserved_slots=0 if scenario == "priority_no_reserve" else reserved, queue_max=1024, queue_timeout=600,
                     priority_header="X-Priority", priority_header_values={"interactive": 10, "batch": -10})
    config = workdir / f"{scenario}.yaml"
    config.write_text(json.dumps({"proxy": proxy}))  # JSON is YAML
    log = open(workdir / f"proxy-{scenario}.log", "wb")
    argv = [str(REPO / ".venv" / "bin" / "vsup"), "proxy", "--config", str(config)]
    for upstream in upstreams:
        argv += ["--upstream", f"{model}={upstream}"]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


async def interactive(session: aiohttp.ClientSession, url: str, model: str, tokens: int, stop: float,
                      ttfts: list[float], rng: random.Random) -> None:
    while time.monotonic() < stop:
        body = {"model": model, "messages": [{"role": "user", "content": "quick question: " + text(12, rng)}],
                "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0}
        began, first = time.monotonic(), None
        async with session.post(url + "/v1/chat/completions", json=body, headers={"X-Priority": "interactive"}) as response:
            if response.status != 200:
                raise RuntimeError(f"interactive: HTTP {response.status}: {(await response.text())[:200]}")
            async for raw in response.content:
                line = raw.strip()
                if first is None and line.startswith(b"data: {") and b'"content"' in line:
                    first = time.monotonic() - began
        if first is None:
            raise RuntimeError("interactive: a stream without content")
        ttfts.append(first)
        await asyncio.sleep(rng.uniform(0.05, 0.15))  # a person reads, then asks again


async def batch(session: aiohttp.ClientSession, url: str, model: str, words: int, tokens: int, stop: float,
                done: list[int], rng: random.Random) -> None:
    api_path, key = "/v1/completions", "prompt"
    while time.monotonic() < stop:
        body = {"model": model, key: "Summarize: " + text(words, rng), "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
        async with session.post(url + api_path, json=body, headers={"X-Priority": "batch"}) as response:
            payload = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"batch: HTTP {response.status}: {str(payload)[:200]}")
            done.append(payload["usage"]["completion_tokens"])


async def scenario(url: str, args: argparse.Namespace, loaded: bool, seed: int) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        ttfts: list[float] = []
        done: list[int] = []
        began = time.monotonic()
        stop = began + args.duration
        tasks = [asyncio.create_task(interactive(session, url, args.model, args.chat_tokens, stop, ttfts, rng))]
        if loaded:
            tasks += [asyncio.create_task(batch(session, url, args.model, args.batch_words, args.batch_tokens, stop, done, rng))
                      for _ in range(args.batch)]
            await asyncio.sleep(args.warmup)  # the batch fills the instances first
            ttfts.clear()
        await tasks[0]
        elapsed = time.monotonic() - began
        for task in tasks[1:]:
            task.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
    ttfts.sort()
    return {
        "interactive_requests": len(ttfts),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
        "batch_completions_per_s": round(len(done) / elapsed, 3),
        "batch_tokens_per_s": round(sum(done) / elapsed, 1),
    }


def start_fakes(args: argparse.Namespace, workdir: Path) -> tuple[list, list[str]]:
    from tests.fakevllm.fixtures import start_fake

    env = {"FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0", "FAKE_VLLM_ACCESS_LOG": "0",
           "FAKE_VLLM_MAX_NUM_SEQS": str(args.max_num_seqs), "FAKE_VLLM_STEP_TIME": str(args.step_time),
           "FAKE_VLLM_SEQ_COST": str(args.seq_cost), "FAKE_VLLM_SATURATE_THREADS": "1",
           "FAKE_VLLM_PREFILL_DELAY": str(args.prefill_delay), "FAKE_VLLM_PREFIX_CACHE_BLOCKS": "0"}
    fakes = [start_fake(name=f"i{i}", served_model_names=[MODEL], env=env) for i in range(args.instances)]
    for fake in fakes:
        fake.wait_ready()
    return fakes, [fake.url for fake in fakes]


async def run(args: argparse.Namespace, upstreams: list[str], workdir: Path) -> dict:
    out: dict = {}
    for i, name in enumerate(SCENARIOS):
        process, url = start_proxy(upstreams, args.model, name, args.max_num_seqs, args.reserved, workdir)
        try:
            await wait_ready(url)
            out[name] = await scenario(url, args, name != "unloaded", seed=i)
        finally:
            process.terminate()
            process.wait(timeout=30)
        print(f"{name:>9}: {out[name]}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", action="append", default=[], help="a running vLLM server (repeat); none: fake vLLM instances")
    parser.add_argument("--model", default=MODEL, help="the served model name the upstreams serve")
    parser.add_argument("--instances", type=int, default=2, help="fake vLLM instances")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each instance's --max-num-seqs (the fakes get it; real ones must run with it)")
    parser.add_argument("--reserved", type=int, default=1, help="proxy.reserved_slots of the priority scenario")
    parser.add_argument("--batch", type=int, default=16, help="batch clients (closed loop)")
    parser.add_argument("--batch-words", type=int, default=200, help="words of a batch prompt")
    parser.add_argument("--batch-tokens", type=int, default=128, help="tokens a batch request generates")
    parser.add_argument("--chat-tokens", type=int, default=16, help="tokens an interactive chat generates")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per scenario")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of batch load before TTFTs count")
    parser.add_argument("--step-time", type=float, default=0.05, help="fake: FAKE_VLLM_STEP_TIME")
    parser.add_argument("--seq-cost", type=float, default=0.1, help="fake: FAKE_VLLM_SEQ_COST")
    parser.add_argument("--prefill-delay", type=float, default=0.002, help="fake: FAKE_VLLM_PREFILL_DELAY")
    parser.add_argument("--quick", action="store_true", help="12 s per scenario")
    parser.add_argument("--out", type=Path, default=None,
                        help="the result file (a name ending in .json) or its folder [docs/bench/priority_bench.json]")
    args = parser.parse_args()
    if args.quick:
        args.duration = 12.0
    recorder = Recorder("priority_bench")
    fakes: list = []
    with tempfile.TemporaryDirectory(prefix="priority-bench-") as tmp:
        workdir = Path(tmp)
        try:
            if args.upstream:
                upstreams = args.upstream
            else:
                fakes, upstreams = start_fakes(args, workdir)
            results = asyncio.run(run(args, upstreams, workdir))
        finally:
            for fake in fakes:
                fake.cleanup()
    unloaded = results["unloaded"]["ttft_p50_s"]
    ratios = {name: round(results[name]["ttft_p50_s"] / unloaded, 2) for name in SCENARIOS[1:]}
    figures = {
        "backend": "vllm" if args.upstream else "fake",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "upstream", "quick")},
        "scenarios": results,
        "ttft_p50_ratio_to_unloaded": ratios,
        "goal": {"priority_ttft_p50_ratio_at_most": GOAL, "met": ratios["priority"] <= GOAL
                 and results["priority"]["batch_completions_per_s"] > 0},
    }
    if not args.upstream:
        figures["settings"].pop("model")
    print(json.dumps(figures, indent=2))
    if args.out is not None and args.out.suffix == ".json":  # a file of its own, e.g. a real-vLLM run beside the fake's
        recorder.write(figures, args.out.parent, args.out.name)
    else:
        recorder.write(figures, args.out)


if __name__ == "__main__":
    main()
