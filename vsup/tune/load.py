"""The load: streamed requests through vsup's proxy, as `vllm bench serve` sends them.

- closed loop at concurrency C: C clients, each sends its next request when the previous one ended,
  until the run length is over; requests in flight then finish (as the last requests of a
  benchmark do) and count;
- open loop at R requests/s: requests start at Poisson arrival times for the run length,
  however many are in flight.
Each request is streamed (`stream_options.include_usage`, `ignore_eos`), and every chunk that
carries text is timestamped; metrics.py turns the records into vLLM's figures.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Sequence

import aiohttp

from vsup.errors import VsupError
from vsup.safetext import printable
from vsup.tune.metrics import LevelMetrics, RequestRecord, level_metrics, level_name
from vsup.tune.workload import WorkItem


class Client:
    """One aiohttp session to the proxy for a run; `headers` carries the proxy's API key."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, request_timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.request_timeout = request_timeout
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.request_timeout)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=self.headers)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("Client used outside `async with`")
        return self.session

    async def tokenize(self, text: str) -> int:
        """Token count of `text` by the server itself (vLLM's /tokenize, reached through the proxy)."""
        url = f"{self.base_url}/tokenize"
        async with self._session().post(url, json={"model": self.model, "prompt": text}) as response:
            answer = await response.text(errors="replace")
        if response.status in (404, 405):  # a server that is not vLLM's (or an old one): the same for every candidate
            raise VsupError(f"the server at {self.base_url} has no /tokenize (HTTP {response.status}); vsup tune sizes its synthetic "
                            "prompts with vLLM's /tokenize: run it against vllm serve, or give --workload a JSONL of prompts")
        try:
            body = json.loads(answer)
        except ValueError:
            body = None
        if response.status != 200 or not isinstance(body, dict) or not isinstance(body.get("count"), int):
            raise RuntimeError(f"/tokenize answered HTTP {response.status}: {printable(answer[:200])}")
        return int(body["count"])

    async def stream(self, item: WorkItem) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter())
        try:
            async with self._session().post(f"{self.base_url}{item.path}", json=item.body(self.model)) as response:
                if response.status != 200:
                    text = (await response.text())[:200].strip()
                    record.error = f"HTTP {response.status}: {text}"
                    return record
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if "error" in event:
                        record.error = f"stream error: {str(event['error'])[:200]}"
                        return record
                    if _has_text(event):
                        record.chunks.append(now)
                    usage = event.get("usage")
                    if usage:
                        record.output_tokens = int(usage.get("completion_tokens") or 0)
                        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:200]
            return record
        if not record.chunks:
            record.error = "the stream ended without text"
        elif not record.output_tokens:
            record.output_tokens = len(record.chunks)
        return record


def _has_text(event: dict) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def closed_loop(client: Client, items: Sequence[WorkItem], concurrency: int, duration: float) -> LevelMetrics:
    records: list[RequestRecord] = []
    order = itertools.cycle(range(len(items)))
    began = time.perf_counter()
    deadline = began + duration

    async def worker() -> None:
        while time.perf_counter() < deadline:
            record = await client.stream(items[next(order)])
            records.append(record)
            if record.error:
                await asyncio.sleep(0.2)  # a failing server must not be hammered in a tight loop

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return level_metrics(level_name(concurrency=concurrency), records, time.perf_counter() - began)


async def open_loop(client: Client, items: Sequence[WorkItem], rate: float, duration: float, seed: int = 0) -> LevelMetrics:
    rng = random.Random(seed)
    began = time.perf_counter()
    tasks = []
    at = began
    for index in itertools.count():
        at += rng.expovariate(rate)
        if at >= began + duration:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(client.stream(items[index % len(items)])))
    records = list(await asyncio.gather(*tasks))
    return level_metrics(level_name(rate=rate), records, time.perf_counter() - began)


async def warm_up(client: Client, items: Sequence[WorkItem], requests: int) -> None:
    """A few short requests before the clock starts (first requests compile and fill caches)."""
    short = [WorkItem(prompt=i.prompt, messages=i.messages, max_tokens=min(i.max_tokens, 8)) for i in (items[n % len(items)] for n in range(requests))]
    records = await asyncio.gather(*(client.stream(item) for item in short))
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")
