"""How loaded each instance is, from vLLM's own figures and the proxy's own in-flight counts.

vLLM's /metrics carries the scheduler's gauges, set at every engine step:
`vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (0..1;
`vllm:gpu_cache_usage_perc` before 0.10). They see what the proxy cannot: requests from other
clients or proxies, and a queue that forms because prompts are long, not many. The proxy sees what
a sample cannot: the requests it sent since (vllm-router #177: a cached figure alone sends a whole
burst between two samples to the same instance). So an instance's load is

    load = max(running + waiting + (in flight now - in flight at the sample), in flight now) + kv usage

in requests, per unit of weight; the KV term (at most 1) puts the instance whose cache is fuller
behind an equally busy one. A sample older than `max_age` or a failed scrape gives no figure, and
then every candidate of that choice is scored by its in-flight count alone: mixing the two scales
would make the instance whose figures are missing look the lightest and draw the traffic (the
silent-instance spiral of vllm-router #179, where a load never counted read as idle).

`LoadProbe` takes the samples: every `interval` seconds one GET /metrics per ready instance, all
at once, read with a byte scan for the three gauges (no Prometheus parse: a vLLM /metrics is ~100
KiB, and the scan reads it in well under a millisecond). Pure functions below, I/O in the probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

import aiohttp

from vsup.proxy.address import Sessions
from vsup.proxy.backends import Backend

log = logging.getLogger("vsup.proxy")

RUNNING = b"vllm:num_requests_running"
WAITING = b"vllm:num_requests_waiting"
KV_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
GAUGES = ((RUNNING, 1), (WAITING, 2), (KV_USAGE[0], 0), (KV_USAGE[1], 0))
# A sample is stale after this many intervals (one late round passes; two do not).
STALE_INTERVALS = 3.0
# The longest a sample's GET may take, at most (shorter with a short interval).
FETCH_TIMEOUT = 2.0
# A vLLM /metrics is ~100 KiB; a body past this is not read further (the gauges come early).
MAX_BODY = 4 * 1024 * 1024


class Sample(NamedTuple):
    at: float  # monotonic time the figures arrived
    requests: float  # running + waiting, as the engine counted them
    kv: float  # KV-cache usage, 0..1
    in_flight: int  # the proxy's own requests in flight to the instance when the figures arrived


def _value(line: bytes, name: bytes) -> float | None:
    """The value of a sample line `name{labels} value [timestamp]` (a label value may hold spaces,
    so it is what follows the last brace)."""
    rest = line[line.rindex(b"}") + 1:] if b"}" in line else line[len(name):]
    try:
        value = float(rest.split()[0])
    except (ValueError, IndexError):
        return None
    return value if value == value and value >= 0 else None  # NaN or negative: no figure


def parse(text: bytes) -> tuple[float, float] | None:
    """(running + waiting, KV usage) from a Prometheus text: each gauge summed (running, waiting:
    over engines, or a front vsup's instances) or its largest value (KV usage); None when the
    scheduler gauges are missing (not a vLLM, or an old one)."""
    requests = 0.0
    kv = 0.0
    seen = 0
    for line in text.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        for name, bit in GAUGES:
            if line.startswith(name) and line[len(name):len(name) + 1] in (b"{", b" "):  # not ..._by_reason
                value = _value(line, name)
                if value is not None:
                    if bit:
                        requests += value
                        seen |= bit
                    else:
                        kv = max(kv, min(1.0, value))
                break
    return (requests, kv) if seen == 3 else None


def estimate(sample: Sample | None, in_flight: int, now: float, max_age: float) -> float | None:
    """The instance's load now (see the module docstring); None when there is no fresh sample."""
    if sample is None or now - sample.at > max_age:
        return None
    return max(sample.requests + in_flight - sample.in_flight, float(in_flight)) + sample.kv


def loads(names: Collection[str], samples: Mapping[str, Sample], in_flight: Mapping[str, int], now: float,
          max_age: float) -> tuple[dict[str, float], bool]:
    """Each named instance's load, and whether they are the engines' figures (True) or, because
    one of them has no fresh sample, every one's in-flight count (False)."""
    out: dict[str, float] = {}
    for name in names:  # estimate(), inlined: this runs per request
        sample = samples.get(name)
        flight = in_flight.get(name, 0)
        if sample is None or now - sample.at > max_age:
            return {n: float(in_flight.get(n, 0)) for n in names}, False
        engine = sample.requests + flight - sample.in_flight
        out[name] = (engine if engine > flight else flight) + sample.kv
    return out, True


class LoadProbe:
    """The samples, taken every `interval` seconds from each ready backend's /metrics. Balancers
    read `samples` (and `max_age`); a backend that leaves the rotation, or whose scrape fails,
    loses its sample."""

    def __init__(self, ready: Callable[[], tuple[Backend, ...]], in_flight: Mapping[str, int], sessions: Sessions,
                 interval: float) -> None:
        self._ready = ready
        self._in_flight = in_flight  # the forwarder's own dict, read when a sample arrives
        self._sessions = sessions
        self.interval = interval
        self.samples: dict[str, Sample] = {}
        self.failures: dict[str, int] = {}  # backend -> failed scrapes (/metrics)
        self._failing: set[str] = set()

    @property
    def max_age(self) -> float:
        return STALE_INTERVALS * self.interval

    async def run(self) -> None:
        while True:
            began = time.monotonic()
            try:
                await self.round()
            except Exception:  # a bad round must not end the sampling for good
                log.exception("sampling the instances' load failed; trying again in %gs", self.interval)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    async def round(self) -> None:
        ready = self._ready()
        names = {b.name for b in ready}
        for gone in set(self.samples) - names:
            del self.samples[gone]
        await asyncio.gather(*(self._sample(b) for b in ready))

    async def _sample(self, backend: Backend) -> None:
        session, base = self._sessions.get(backend.url)
        why = None
        figures = None
        try:
            async with session.get(base + "/metrics", allow_redirects=False,
                                   timeout=aiohttp.ClientTimeout(total=min(FETCH_TIMEOUT, self.interval * 2))) as response:
                if response.status != 200:
                    why = f"HTTP {response.status}"
                else:
                    body = bytearray()
                    async for chunk in response.content.iter_chunked(65536):
                        body += chunk
                        if len(body) > MAX_BODY:
                            break
                    figures = parse(bytes(body))
                    if figures is None:
                        why = "no vllm:num_requests_running/waiting in its /metrics"
        except asyncio.TimeoutError:
            why = "no answer in time"
        except aiohttp.ClientError as exc:
            why = str(exc) or type(exc).__name__
        name = backend.name
        if figures is None:
            self.samples.pop(name, None)
            self.failures[name] = self.failures.get(name, 0) + 1
            if name not in self._failing:
                self._failing.add(name)
                log.warning("instance %s: no load figures (%s): routing counts its requests in flight instead", name, why)
            return
        if name in self._failing:
            self._failing.discard(name)
            log.info("instance %s: load figures again", name)
        self.samples[name] = Sample(time.monotonic(), figures[0], figures[1], self._in_flight.get(name, 0))
