"""The proxy's Prometheus metrics (`vsup_` namespace, its own registry, served at /metrics).

The hot path only bumps plain ints in dicts and lists (a prometheus_client child costs a lock and
a few µs per call, a real share of the per-request budget); a custom collector turns them into
counters and histograms when Prometheus scrapes. In-flight counts and instance states are read
from their owners at scrape time too. Single event loop: no locks needed.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Route label values: the known API routes, everything else is "other" (bounded cardinality).
_KNOWN_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/tokenize",
    "/detokenize",
)
ROUTE_LABELS = {route: route for route in _KNOWN_ROUTES}

# Seconds; prefill on CPU ranges from milliseconds to minutes.
TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def route_label(path: str) -> str:
    return ROUTE_LABELS.get(path, "other")


class _Histogram:
    __slots__ = ("bounds", "counts", "total", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above the largest bound (+Inf)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):  # counts has one more: +Inf
            running += count
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.total))
        return out


def _asyncio_tasks() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # rendered outside a running loop
        return 0


class ProxyMetrics:
    def __init__(self, in_flight: Callable[[], Mapping[str, int]], states: Callable[[], Mapping[str, str]], ready: Callable[[str], bool]) -> None:
        self._in_flight = in_flight
        self._states = states
        self._ready = ready
        self.requests: dict[tuple[str, int, str], int] = {}
        self.retries: dict[str, int] = {}
        self.disconnects: dict[str, int] = {}
        self.upstream_errors: dict[tuple[str, str], int] = {}
        self.ejections: dict[str, int] = {}
        self.client_timeouts: dict[str, int] = {}
        self.malformed_requests: dict[int, int] = {}
        self.connections_refused = 0
        self.client_connections: Callable[[], int] = lambda: 0  # set by the server: open client connections
        # Set by the server: the balancer's policy and its own decision counts (it bumps them).
        self.policy = ""
        self.policy_decisions: Mapping[str, int] = {}
        self._ttfb = {True: _Histogram(TTFB_BUCKETS), False: _Histogram(TTFB_BUCKETS)}
        self._duration = {True: _Histogram(DURATION_BUCKETS), False: _Histogram(DURATION_BUCKETS)}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- the hot path
    def request(self, route: str, status: int, instance: str) -> None:
        key = (route, status, instance)
        self.requests[key] = self.requests.get(key, 0) + 1

    def retry(self, reason: str) -> None:
        self.retries[reason] = self.retries.get(reason, 0) + 1

    def disconnect(self, phase: str) -> None:
        self.disconnects[phase] = self.disconnects.get(phase, 0) + 1

    def upstream_error(self, instance: str, kind: str) -> None:
        key = (instance, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def client_timeout(self, phase: str) -> None:
        self.client_timeouts[phase] = self.client_timeouts.get(phase, 0) + 1

    def malformed(self, status: int) -> None:
        self.malformed_requests[status] = self.malformed_requests.get(status, 0) + 1

    def connection_refused(self) -> None:
        self.connections_refused += 1

    def ejection(self, instance: str) -> None:
        self.ejections[instance] = self.ejections.get(instance, 0) + 1

    def ttfb(self, stream: bool, seconds: float) -> None:
        self._ttfb[stream].observe(seconds)

    def duration(self, stream: bool, seconds: float) -> None:
        self._duration[stream].observe(seconds)

    # -- scrape time
    def collect(self):
        family = CounterMetricFamily("vsup_proxy_requests", "Requests answered by the proxy", labels=["route", "status", "instance"])
        for (route, status, instance), count in self.requests.items():
            family.add_metric([route, str(status), instance], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_retries", "Requests sent to another instance before the first byte", labels=["reason"])
        for reason, count in self.retries.items():
            family.add_metric([reason], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_client_disconnects", "Clients gone before their response was complete, by phase", labels=["phase"])
        for phase, count in self.disconnects.items():
            family.add_metric([phase], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_upstream_errors", "Failed upstream attempts by kind (connect, stale, 503, broken, timeout)", labels=["instance", "kind"])
        for (instance, kind), count in self.upstream_errors.items():
            family.add_metric([instance, kind], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_ejections", "Instances taken out of the rotation by the proxy after failing to reach them", labels=["instance"])
        for instance, count in self.ejections.items():
            family.add_metric([instance], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_client_timeouts", "Clients that left a request half-sent past the client timeout, by phase", labels=["phase"])
        for phase, count in self.client_timeouts.items():
            family.add_metric([phase], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_malformed_requests", "Requests the proxy could not parse, by the status it answered", labels=["status"])
        for status, count in self.malformed_requests.items():
            family.add_metric([str(status)], count)
        yield family
        family = CounterMetricFamily(
            "vsup_proxy_policy_decisions",
            "Routing decisions of the proxy's policy (prefix_affinity: affinity, session, escaped, no_prefix)",
            labels=["policy", "decision"],
        )
        for decision, count in self.policy_decisions.items():
            family.add_metric([self.policy, decision], count)
        yield family
        yield CounterMetricFamily("vsup_proxy_client_connections_refused", "Client connections refused at the connection limit", value=self.connections_refused)
        yield GaugeMetricFamily("vsup_proxy_client_connections", "Client connections open", value=self.client_connections())
        for name, doc, histograms in (
            ("vsup_proxy_upstream_ttfb_seconds", "Request sent -> first body byte from the instance", self._ttfb),
            ("vsup_proxy_upstream_duration_seconds", "Request sent -> response complete", self._duration),
        ):
            family = HistogramMetricFamily(name, doc, labels=["stream"])
            for stream, histogram in histograms.items():
                family.add_metric(["true" if stream else "false"], histogram.buckets(), histogram.sum)
            yield family
        flight = GaugeMetricFamily("vsup_proxy_in_flight", "Requests in flight through the proxy, per instance", labels=["instance"])
        for name, count in self._in_flight().items():
            flight.add_metric([name], count)
        yield flight
        state = GaugeMetricFamily("vsup_instance_state", "1 for the instance's current state", labels=["instance", "state"])
        ready = GaugeMetricFamily("vsup_instance_ready", "1 when the instance is in the proxy's rotation", labels=["instance"])
        for name, value in self._states().items():
            state.add_metric([name, value], 1)
            ready.add_metric([name], 1 if self._ready(name) else 0)
        yield state
        yield ready
        yield GaugeMetricFamily("vsup_asyncio_tasks", "asyncio tasks alive in vsup's event loop (flat over time: nothing piles up)",
                                value=_asyncio_tasks())

    def render(self) -> bytes:
        return generate_latest(self.registry)
