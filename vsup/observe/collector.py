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
from vsup.observe.families import dropped_families, instance_families
from vsup.observe.rates import CounterWindow
from vsup.proxy.address import Sessions

log = logging.getLogger("vsup.observe")

# Seconds between two reads of a tree's PSS (smaps_rollup) and NUMA placement (numa_maps): the kernel
# walks every page table to count them (~50 ms of CPU each for a 6 GB model's worker, 2-3x that for a
# 7B's), which every metrics.interval cost a few % of a core per instance; they change slowly.
PAGE_WALK_EVERY = 30.0

# A vLLM /metrics is ~100 KiB (~1,500 series). An instance's body is read up to this many bytes per
# series of metrics.max_series_per_instance (a vLLM series line with a long model path is ~200
# bytes), so a huge one costs a bounded read, not a parse of it all (200,000 series: ~400 MiB).
BYTES_PER_SERIES = 400
DEFAULT_MAX_SERIES = 20000


WHY_DROPPED = {
    "clash": "{family} (its names clash with another family's)",
    "duplicate": "{family} (the same series twice)",
    "invalid": "{family} (samples its type does not have, or a bucket bound that is no number)",
    "vsup_name": "{family} (a name in vsup's vsup_ namespace)",
    "series_cap": "the families past metrics.max_series_per_instance ({cap} series)",
}


@dataclass(frozen=True)
class Target:
    """One instance as the collector sees it at the start of a round (taken on the event loop)."""

    name: str
    address: str | None  # the instance's (vsup.proxy.address), scraped at /metrics; None: not serving now, not scraped
    nodes: tuple[int, ...]  # the plan's NUMA nodes: memory there is local
    leader: int | None = None  # the tree's leader pid; None: no process
    token: str | None = None  # its VSUP_TREE token (proctree.find_tree)
    known: Mapping[int, int] = field(default_factory=dict)  # pid -> start time of members seen before
    model: str = ""  # the served model name: a `model` label beside `instance` ("": none)


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
        max_series: int = DEFAULT_MAX_SERIES,
    ) -> None:
        self._targets = targets
        self._sessions = session if isinstance(session, Sessions) else Sessions.around(session)
        self.interval = interval
        self.timeout = timeout
        self._pids = pids
        self.max_series = max_series
        self._dropped: dict[tuple[str, str], int] = {}  # (instance, reason) -> families left out, all rounds
        self._dropping: dict[str, set[tuple[str, str]]] = {}  # instance -> (family, reason) of its last round
        self._trees: dict[str, procstats.TreeSample] = {}
        # instance -> (when, its pids then, their PSS, bytes per NUMA node): the page walks' last read
        self._walked: dict[str, tuple[float, tuple[int, ...], int | None, dict[int, int]]] = {}
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

    async def _fetch(self, target: Target) -> tuple[str | None, str | None, bool]:
        """(text, None, whole), (None, why it failed, True), or (None, None, True) when the target
        is not scraped; whole: False when the body was cut off at the byte limit (at a line end)."""
        if target.address is None:
            return None, None, True
        session, base = self._sessions.get(target.address)
        limit = self.max_series * BYTES_PER_SERIES
        try:
            async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                if response.status != 200:
                    return None, f"HTTP {response.status}", True
                body = bytearray()
                async for chunk in response.content.iter_chunked(65536):
                    body += chunk
                    if len(body) > limit:  # the rest is not read: the connection closes with the response
                        del body[body.rfind(b"\n", 0, limit) + 1:]
                        return body.decode("utf-8", "replace"), None, False
                return body.decode("utf-8", "replace"), None, True
        except asyncio.TimeoutError:
            return None, f"no answer within {self.timeout:g}s", True
        except aiohttp.ClientError as exc:
            return None, str(exc) or type(exc).__name__, True

    def _build(self, targets: list[Target], texts: list[tuple[str | None, str | None, bool]], began: float) -> Snapshot:
        """In the worker thread: parse, read /proc, render. The only place the state changes."""
        now = time.monotonic()
        figures: dict[str, dict[str, Any]] = {}
        scraped = []
        dropped: list[scrape.Dropped] = []
        for target, (text, error, whole) in zip(targets, texts, strict=True):
            f: dict[str, Any] = {"nodes": list(target.nodes)}
            if text is not None:
                cut = scrape.cap(text, self.max_series, whole)
                try:
                    families = scrape.parse(cut.text)
                except ValueError as exc:
                    error = f"not Prometheus text: {exc}"
                else:
                    if cut.partial and families:
                        families.pop()
                    if cut.left_out:
                        dropped.append(scrape.Dropped(target.name, "", "series_cap", cut.left_out))
                    scraped.append((target.name, scrape.relabel(families, target.name, target.model)))
                    f.update(scrape.summarize(families))
                    self._count_tokens(target.name, f, now)
            f["scrape"] = "ok" if text is not None and error is None else error
            self._note_scrape(target.name, f["scrape"])
            f.update(self._token_rates(target.name, now))
            f.update(self._process_figures(target, now))
            figures[target.name] = f
        for gone in set(self._trees) - {t.name for t in targets if t.leader is not None}:
            del self._trees[gone]
            self._walked.pop(gone, None)
        took = time.monotonic() - began
        wall = time.time()
        merged, refused = scrape.merge(scraped)
        self._note_dropped(dropped + refused, {t.name for t in targets})
        models = {t.name: t.model for t in targets}
        families = merged + instance_families(figures, wall, took, models) + [dropped_families(self._dropped)]
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
            self._walked.pop(target.name, None)
            return {"pids": [], "cpu_seconds": None, "cpu_percent": None, "rss_bytes": None, "pss_bytes": None,
                    "numa_bytes": {}, "numa_local_bytes": None, "numa_remote_bytes": None, "numa_local_ratio": None}
        walked = self._walked.get(target.name)
        walk = walked is None or now - walked[0] >= PAGE_WALK_EVERY or walked[1] != tuple(sorted(pids))
        sample = procstats.read_tree(pids, now, pss=walk)
        before = self._trees.get(target.name)
        self._trees[target.name] = sample
        if walk:
            by_node = numa.add_up(part for pid in sample.pids if (part := numa.read_numa_bytes(pid)) is not None)
            pss = sample.pss
            self._walked[target.name] = (now, tuple(sorted(pids)), pss, by_node)
        else:
            _, _, pss, by_node = walked  # type: ignore[misc]
        local, remote = numa.local_split(by_node, target.nodes)
        known = bool(by_node)
        return {
            "pids": list(sample.pids),
            "cpu_seconds": round(sample.cpu_seconds, 3),
            "cpu_percent": _round(procstats.cpu_percent(before, sample), 1),
            "rss_bytes": sample.rss,
            "pss_bytes": pss,
            "numa_bytes": {str(node): size for node, size in sorted(by_node.items())},
            "numa_local_bytes": local if known else None,
            "numa_remote_bytes": remote if known else None,
            "numa_local_ratio": _round(numa.local_ratio(by_node, target.nodes), 4),
        }

    def _note_dropped(self, dropped: list[scrape.Dropped], names: set[str]) -> None:
        """Count this round's left-out families; warn about those an instance did not have left
        out the round before (once, not every round)."""
        now: dict[str, set[tuple[str, str]]] = {name: set() for name in names}
        for item in dropped:
            key = (item.instance, item.reason)
            self._dropped[key] = self._dropped.get(key, 0) + item.number
            now.setdefault(item.instance, set()).add((item.family, item.reason))
        for name, items in now.items():
            new = sorted(items - self._dropping.get(name, set()))
            if new:
                shown = ", ".join(WHY_DROPPED[reason].format(family=family, cap=self.max_series) for family, reason in new[:5])
                more = f" (and {len(new) - 5} more)" if len(new) > 5 else ""
                log.warning("instance %s: /metrics families left out of the proxy's /metrics: %s%s", name, shown, more)
        self._dropping = now

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
