"""The background collection: every `metrics.interval` seconds, each instance's /metrics and its
process tree's figures, turned into one cached snapshot.

Nothing here runs per scrape of the proxy's /metrics or per request: the proxy appends the cached
`text()` (bytes made once per round) and `vsup status` / `/status` read `figures()`. The HTTP
fetches run on the event loop (bounded by `metrics.timeout`, all instances at once); parsing,
/proc reading and rendering run in a worker thread, so the loop keeps forwarding meanwhile.
Rounds never overlap: the next starts `interval` after the previous one started, or at once when
a round took longer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import generate_latest

from vsup.observe import numa, procstats, scrape
from vsup.observe.families import instance_families
from vsup.observe.rates import CounterWindow
from vsup.proxy.address import Sessions

log = logging.getLogger("vsup.observe")

MAX_BODY = 16 * 1024 * 1024  # a vLLM /metrics is ~100 KiB; anything far larger is not one


@dataclass(frozen=True)
class Target:
    """One instance as the collector sees it at the start of a round (taken on the event loop)."""

    name: str
    address: str | None  # the instance's (vsup.proxy.address), scraped at /metrics; None: not serving now, not scraped
    nodes: tuple[int, ...]  # the plan's NUMA nodes: memory there is local
    leader: int | None = None  # the tree's leader pid; None: no process
    token: str | None = None  # its VSUP_TREE token (proctree.find_tree)
    known: Mapping[int, int] = field(default_factory=dict)  # pid -> start time of members seen before


@dataclass(frozen=True)
class Snapshot:
    at: float = 0.0  # monotonic time of the round; 0: none yet
    wall: float = 0.0
    took: float = 0.0
    text: bytes = b""
    figures: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


class Collector:
    def __init__(
        self,
        targets: Callable[[], list[Target]],
        session: aiohttp.ClientSession | Sessions,
        *,
        interval: float,
        timeout: float,
        pids: Callable[[Target], list[int]],
    ) -> None:
        self._targets = targets
        self._sessions = session if isinstance(session, Sessions) else Sessions.around(session)
        self.interval = interval
        self.timeout = timeout
        self._pids = pids
        self._trees: dict[str, procstats.TreeSample] = {}
        self._tokens: dict[str, dict[str, CounterWindow]] = {}
        self._scrape_state: dict[str, str] = {}
        self.snapshot = Snapshot()

    # -- what the others read

    def text(self) -> bytes:
        return self.snapshot.text

    def figures(self, name: str) -> dict[str, Any] | None:
        """The instance's figures of the last round, with their age in seconds; None before the first."""
        snapshot = self.snapshot
        found = snapshot.figures.get(name)
        if found is None:
            return None
        return {**found, "age": round(time.monotonic() - snapshot.at, 3)}

    # -- the rounds

    async def run(self) -> None:
        while True:
            began = time.monotonic()
            try:
                await self.collect()
            except Exception:  # a bad round must not end the collection for good
                log.exception("collecting the instances' metrics failed; trying again in %gs", self.interval)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    async def collect(self) -> Snapshot:
        began = time.monotonic()
        targets = self._targets()
        texts = await asyncio.gather(*(self._fetch(t) for t in targets))
        snapshot = await asyncio.to_thread(self._build, targets, texts, began)
        self.snapshot = snapshot
        return snapshot

    async def _fetch(self, target: Target) -> tuple[str | None, str | None]:
        """(text, None), (None, why it failed), or (None, None) when the target is not scraped."""
        if target.address is None:
            return None, None
        session, base = self._sessions.get(target.address)
        try:
            async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                if response.status != 200:
                    return None, f"HTTP {response.status}"
                body = bytearray()
                async for chunk in response.content.iter_chunked(65536):
                    body += chunk
                    if len(body) > MAX_BODY:
                        return None, f"larger than {MAX_BODY // (1024 * 1024)} MiB"
                return body.decode("utf-8", "replace"), None
        except asyncio.TimeoutError:
            return None, f"no answer within {self.timeout:g}s"
        except aiohttp.ClientError as exc:
            return None, str(exc) or type(exc).__name__

    def _build(self, targets: list[Target], texts: list[tuple[str | None, str | None]], began: float) -> Snapshot:
        """In the worker thread: parse, read /proc, render. The only place the state changes."""
        now = time.monotonic()
        figures: dict[str, dict[str, Any]] = {}
        scraped = []
        for target, (text, error) in zip(targets, texts, strict=True):
            f: dict[str, Any] = {"nodes": list(target.nodes)}
            if text is not None:
                try:
                    families = scrape.parse(text)
                except ValueError as exc:
                    error = f"not Prometheus text: {exc}"
                else:
                    scraped.append(scrape.relabel(families, target.name))
                    f.update(scrape.summarize(families))
                    self._count_tokens(target.name, f, now)
            f["scrape"] = "ok" if text is not None and error is None else error
            self._note_scrape(target.name, f["scrape"])
            f.update(self._token_rates(target.name, now))
            f.update(self._process_figures(target, now))
            figures[target.name] = f
        for gone in set(self._trees) - {t.name for t in targets if t.leader is not None}:
            del self._trees[gone]
        took = time.monotonic() - began
        wall = time.time()
        families = scrape.merge(scraped) + instance_families(figures, wall, took)
        return Snapshot(at=now, wall=wall, took=took, text=generate_latest(scrape.Families(families)), figures=figures)

    def _count_tokens(self, name: str, f: Mapping[str, Any], now: float) -> None:
        windows = self._tokens.setdefault(name, {"prompt": CounterWindow(), "generation": CounterWindow()})
        for kind, window in windows.items():
            value = f.get(f"{kind}_tokens_total")
            if value is not None:
                window.add(now, value)

    def _token_rates(self, name: str, now: float) -> dict[str, float | None]:
        windows = self._tokens.get(name, {})
        rates = {}
        for kind in ("prompt", "generation"):
            window = windows.get(kind)
            if window is not None:
                window.prune(now)  # an instance no longer scraped ages out of its window
            rates[f"{kind}_tokens_per_s"] = window.rate() if window is not None else None
        return rates

    def _process_figures(self, target: Target, now: float) -> dict[str, Any]:
        pids = self._pids(target)
        if not pids:
            self._trees.pop(target.name, None)
            return {"pids": [], "cpu_seconds": None, "cpu_percent": None, "rss_bytes": None, "pss_bytes": None,
                    "numa_bytes": {}, "numa_local_bytes": None, "numa_remote_bytes": None, "numa_local_ratio": None}
        sample = procstats.read_tree(pids, now)
        before = self._trees.get(target.name)
        self._trees[target.name] = sample
        by_node = numa.add_up(part for pid in sample.pids if (part := numa.read_numa_bytes(pid)) is not None)
        local, remote = numa.local_split(by_node, target.nodes)
        known = bool(by_node)
        return {
            "pids": list(sample.pids),
            "cpu_seconds": round(sample.cpu_seconds, 3),
            "cpu_percent": _round(procstats.cpu_percent(before, sample), 1),
            "rss_bytes": sample.rss,
            "pss_bytes": sample.pss,
            "numa_bytes": {str(node): size for node, size in sorted(by_node.items())},
            "numa_local_bytes": local if known else None,
            "numa_remote_bytes": remote if known else None,
            "numa_local_ratio": _round(numa.local_ratio(by_node, target.nodes), 4),
        }

    def _note_scrape(self, name: str, state: str | None) -> None:
        before = self._scrape_state.get(name, "ok")
        if state is not None and state != before:
            if state == "ok":
                log.info("instance %s: /metrics answers again", name)
            else:
                log.warning("instance %s: scraping /metrics failed: %s", name, state)
        if state is not None:
            self._scrape_state[name] = state


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
