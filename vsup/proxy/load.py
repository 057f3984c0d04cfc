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

prefix_affinity's and kv_aware's bound count another load, `work()` below: what delays a new
request's first token (prefill not yet done), not whole requests, since on CPU a request in
decode costs the batch little.

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
    waiting: float = 0.0  # of `requests`, those waiting (not yet scheduled: no prefill begun)
    pending: int = 0  # of `in_flight`, those still without their first byte when the figures arrived


def _value(line: bytes, name: bytes) -> float | None:
    """The value of a sample line `name{labels} value [timestamp]` (a label value may hold spaces,
    so it is what follows the last brace)."""
    rest = line[line.rindex(b"}") + 1:] if b"}" in line else line[len(name):]
    try:
        value = float(rest.split()[0])
    except (ValueError, IndexError):
        return None
    return value if value == value and value >= 0 else None  # NaN or negative: no figure


def parse(text: bytes) -> tuple[float, float, float] | None:
    """(running + waiting, KV usage, waiting) from a Prometheus text: each gauge summed (running,
    waiting: over engines, or a front vsup's instances) or its largest value (KV usage); None when
    the scheduler gauges are missing (not a vLLM, or an old one)."""
    requests = 0.0
    waiting = 0.0
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
                        if bit == 2:
                            waiting += value
                    else:
                        kv = max(kv, min(1.0, value))
                break
    return (requests, kv, waiting) if seen == 3 else None


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


# -- the work before a new request's first token (prefix_affinity's and kv_aware's bound)

# What a request in decode weighs against one waiting for its prefill: on CPU a decode step for
# one more sequence costs the batch little, but many do add up (one instance holding every stream
# of a hot prompt decodes slower than two): two decoding streams weigh one prefill.
DECODE_WEIGHT = 0.5
# The engine's figures for other clients' requests halve every this many load_intervals: they
# finish (or get their first token) while the sample ages, so they must not weigh for the whole
# interval as if nothing moved.
OTHERS_HALF_LIFE = 1.0


def others(sample: Sample, age: float, interval: float) -> tuple[float, float]:
    """(waiting, decoding) requests of the engine's sample that this proxy did not send, aged:
    the engine's running + waiting less the proxy's own in flight at the sample, its waiting less
    the proxy's own still without a first byte (those may sit in `waiting` or be in their prefill,
    in `running`), each halved every OTHERS_HALF_LIFE intervals since the sample."""
    foreign = max(0.0, sample.requests - sample.in_flight)
    waiting = min(foreign, max(0.0, sample.waiting - sample.pending))
    decay = 0.5 ** (max(0.0, age) / (OTHERS_HALF_LIFE * interval)) if interval > 0 else 0.0
    return waiting * decay, (foreign - waiting) * decay


def work(prefill_tokens: float, pending: int, in_flight: int, others_waiting: float, others_decoding: float,
         tokens: float) -> float:
    """An instance's work before a new request's first token, in units of that request's own
    prefill (`tokens` of prompt, the cost of a miss; 0: unknown, each pending request counts one): the prompt tokens of the proxy's requests
    still without a first byte (`prefill_tokens`, `pending` of them), other clients' waiting
    requests as one such prefill each, and every request in decode at DECODE_WEIGHT."""
    unit = max(1.0, tokens if tokens > 0 else prefill_tokens / max(1, pending))  # no size given: one pending request each
    decoding = max(0, in_flight - pending) + others_decoding
    return prefill_tokens / unit + others_waiting + DECODE_WEIGHT * decoding


def works(names: Collection[str], samples: Mapping[str, Sample], in_flight: Mapping[str, int],
          prefill: Mapping[str, float], pending: Mapping[str, int], tokens: float, now: float, interval: float,
          max_age: float) -> dict[str, float]:
    """Each named instance's work() for a request of `tokens` prompt tokens; the engines' others
    count only when every candidate has a fresh sample (else none do: an instance whose figures
    are missing must not look the lightest, load.py's module docstring)."""
    fresh = all((s := samples.get(n)) is not None and now - s.at <= max_age for n in names)
    out: dict[str, float] = {}
    for name in names:
        waiting = decoding = 0.0
        if fresh:
            sample = samples[name]
            waiting, decoding = others(sample, now - sample.at, interval)
        out[name] = work(prefill.get(name, 0.0), pending.get(name, 0), in_flight.get(name, 0), waiting, decoding, tokens)
    return out


def probed_works(probe: LoadProbe | None, names: Collection[str], in_flight: Mapping[str, int],
                 size: int) -> dict[str, float]:
    """works() from a balancer's probe for a request of `size` body bytes; without a probe (no
    first bytes known) each request in flight counts one: it may be a prefill."""
    if probe is None:
        return {n: float(in_flight.get(n, 0)) for n in names}
    prefill = probe.prefill
    return works(names, probe.samples, in_flight, prefill.tokens, prefill.requests,
                 Prefill.estimate(size) if size else 0.0, time.monotonic(), probe.interval, probe.max_age)


class Prefill:
    """The proxy's own requests still without their first byte, per instance: how many and their
    prompt tokens (estimated: CHARS_PER_TOKEN bytes of body a token). The forwarder adds one when
    it sends a request and takes it off at the answer's first body byte, or when the attempt ends;
    the tokens are those the balancer expects uncached (`prefill_bytes`: prefix_affinity counts a
    request to its key's instance by what it adds to the key's last one)."""

    CHARS_PER_TOKEN = 4

    def __init__(self) -> None:
        self.tokens: dict[str, float] = {}
        self.requests: dict[str, int] = {}

    @classmethod
    def estimate(cls, body_bytes: int) -> float:
        return max(1.0, body_bytes / cls.CHARS_PER_TOKEN)

    def add(self, name: str, tokens: float) -> None:
        self.tokens[name] = self.tokens.get(name, 0.0) + tokens
        self.requests[name] = self.requests.get(name, 0) + 1

    def done(self, name: str, tokens: float) -> None:
        left = self.requests.get(name, 0) - 1
        if left > 0:
            self.requests[name] = left
            self.tokens[name] = max(0.0, self.tokens.get(name, 0.0) - tokens)
        else:
            self.requests.pop(name, None)
            self.tokens.pop(name, None)


class LoadProbe:
    """The samples, taken every `interval` seconds from each ready backend's /metrics. Balancers
    read `samples` (and `max_age`); a backend that leaves the rotation, or whose scrape fails,
    loses its sample."""

    def __init__(self, ready: Callable[[], tuple[Backend, ...]], in_flight: Mapping[str, int], sessions: Sessions,
                 interval: float, prefill: Prefill | None = None) -> None:
        self._ready = ready
        self._in_flight = in_flight  # the forwarder's own dict, read when a sample arrives
        self.prefill = prefill or Prefill()  # the forwarder's, read when a sample arrives and by the bound
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
        self.samples[name] = Sample(time.monotonic(), figures[0], figures[1], self._in_flight.get(name, 0), figures[2],
                                    self.prefill.requests.get(name, 0))
