"""The proxy's Prometheus metrics (`vsup_` namespace, its own registry, served at /metrics).

The hot path only bumps plain ints in dicts and lists (a prometheus_client child costs a lock and
a few µs per call, a real share of the per-request budget); a custom collector turns them into
counters and histograms when Prometheus scrapes. In-flight counts and instance states are read
from their owners at scrape time too. Single event loop: no locks needed.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from vsup.batch.watch import Figures

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
    """The per-backend families carry a `model` label beside `instance` once any backend has a
    model (`vsup run`: every instance; a standalone proxy's upstreams never, so its families stay
    as they were). Recorded counts keep the model they were recorded with: a reload may give an
    index that a removed model's instance had to another model's."""

    def __init__(self, in_flight: Callable[[], Mapping[str, int]], states: Callable[[], Mapping[str, str]], ready: Callable[[str], bool],
                 models: Callable[[], Mapping[str, str]] = dict) -> None:
        self._in_flight = in_flight
        self._states = states
        self._ready = ready
        self._models = models  # instance name -> its model ("" unknown), at scrape time
        self._model_of: dict[str, str] = {}  # every instance seen with a model (in-flight counts outlive a removal)
        self.with_model = False  # sticky: once labelled, always (a series keeps its label set)
        self.requests: dict[tuple[str, int, str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.disconnects: dict[str, int] = {}
        self.upstream_errors: dict[tuple[str, str, str], int] = {}
        self.ejections: dict[tuple[str, str], int] = {}
        self.client_timeouts: dict[str, int] = {}
        self.malformed_requests: dict[int, int] = {}
        self.connections_refused = 0
        self.body_budget_refusals = 0
        # Set by the server: bytes of request bodies held now, and proxy.max_body_buffer
        self.body_buffer: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.client_connections: Callable[[], int] = lambda: 0  # set by the server: open client connections
        # Set by the server: the balancer's policy and its own decision counts (it bumps them).
        self.policy = ""
        self.policy_decisions: Mapping[str, int] = {}
        # Set by the server in a fleet: (model, policy, decisions) of each model's balancer, and
        # the requests refused by model ((model, reason) -> count; routing.py).
        self.model_policies: Callable[[], list[tuple[str, str, Mapping[str, int]]]] = list
        self.refusals: Mapping[tuple[str, str], int] | None = None
        # More families, each a generator of them at scrape time (the admission gate's, gate.py)
        self.families: list[Callable[[], Iterable[Any]]] = []
        self._ttfb = {True: _Histogram(TTFB_BUCKETS), False: _Histogram(TTFB_BUCKETS)}
        self._duration = {True: _Histogram(DURATION_BUCKETS), False: _Histogram(DURATION_BUCKETS)}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- the hot path
    def request(self, route: str, status: int, instance: str, model: str = "") -> None:
        key = (route, status, instance, model)
        self.requests[key] = self.requests.get(key, 0) + 1

    def retry(self, reason: str) -> None:
        self.retries[reason] = self.retries.get(reason, 0) + 1

    def disconnect(self, phase: str) -> None:
        self.disconnects[phase] = self.disconnects.get(phase, 0) + 1

    def upstream_error(self, instance: str, kind: str, model: str = "") -> None:
        key = (instance, kind, model)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def client_timeout(self, phase: str) -> None:
        self.client_timeouts[phase] = self.client_timeouts.get(phase, 0) + 1

    def malformed(self, status: int) -> None:
        self.malformed_requests[status] = self.malformed_requests.get(status, 0) + 1

    def connection_refused(self) -> None:
        self.connections_refused += 1

    def body_budget_refusal(self) -> None:
        self.body_budget_refusals += 1

    def ejection(self, instance: str, model: str = "") -> None:
        key = (instance, model)
        self.ejections[key] = self.ejections.get(key, 0) + 1

    def ttfb(self, stream: bool, seconds: float) -> None:
        self._ttfb[stream].observe(seconds)

    def duration(self, stream: bool, seconds: float) -> None:
        self._duration[stream].observe(seconds)

    # -- scrape time
    def _labelled(self) -> tuple[bool, dict[str, str]]:
        models = {name: model for name, model in self._models().items() if model}
        self._model_of.update(models)
        if not self.with_model:
            self.with_model = bool(models) or any(key[3] for key in self.requests)
        return self.with_model, self._model_of

    def collect(self):
        labelled, model_of = self._labelled()
        m = ["model"] if labelled else []

        def values(*given: str, model: str) -> list[str]:
            return [*given, model] if labelled else list(given)

        family = CounterMetricFamily("vsup_proxy_requests", "Requests answered by the proxy", labels=["route", "status", "instance", *m])
        for (route, status, instance, model), count in self.requests.items():
            family.add_metric(values(route, str(status), instance, model=model), count)
        yield family
        if self.refusals is not None:
            family = CounterMetricFamily(
                "vsup_proxy_model_refusals",
                "Requests refused by model: unknown_model and no_model (model empty: the name is the client's), no_ready_instance",
                labels=["model", "reason"])
            for (model, reason), count in self.refusals.items():
                family.add_metric([model, reason], count)
            yield family
        family = CounterMetricFamily("vsup_proxy_retries", "Requests sent to another instance before the first byte", labels=["reason"])
        for reason, count in self.retries.items():
            family.add_metric([reason], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_client_disconnects", "Clients gone before their response was complete, by phase", labels=["phase"])
        for phase, count in self.disconnects.items():
            family.add_metric([phase], count)
        yield family
        family = CounterMetricFamily("vsup_proxy_upstream_errors", "Failed upstream attempts by kind (connect, stale, 503, broken, timeout)",
                                     labels=["instance", "kind", *m])
        for (instance, kind, model), count in self.upstream_errors.items():
            family.add_metric(values(instance, kind, model=model), count)
        yield family
        family = CounterMetricFamily("vsup_proxy_ejections", "Instances taken out of the rotation by the proxy after failing to reach them",
                                     labels=["instance", *m])
        for (instance, model), count in self.ejections.items():
            family.add_metric(values(instance, model=model), count)
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
            "Routing decisions of the proxy's policy (prefix_affinity: placed, affinity, session, escaped, spread, no_prefix; kv_aware: hit, miss, escaped, no_tokens)",
            labels=["policy", "decision", *m],
        )
        for decision, count in self.policy_decisions.items():
            family.add_metric(values(self.policy, decision, model=""), count)
        for model, policy, decisions in self.model_policies():
            for decision, count in decisions.items():
                family.add_metric(values(policy, decision, model=model), count)
        yield family
        yield CounterMetricFamily("vsup_proxy_client_connections_refused", "Client connections refused at the connection limit", value=self.connections_refused)
        yield GaugeMetricFamily("vsup_proxy_client_connections", "Client connections open", value=self.client_connections())
        held, limit = self.body_buffer()
        yield GaugeMetricFamily("vsup_proxy_body_buffer_bytes", "Bytes of request bodies the proxy holds now", value=held)
        yield GaugeMetricFamily("vsup_proxy_body_buffer_limit_bytes", "proxy.max_body_buffer: the most it holds at once", value=limit)
        yield CounterMetricFamily("vsup_proxy_body_buffer_refusals", "Requests answered 503 because proxy.max_body_buffer was full",
                                  value=self.body_budget_refusals)
        for name, doc, histograms in (
            ("vsup_proxy_upstream_ttfb_seconds", "Request sent -> first body byte from the instance", self._ttfb),
            ("vsup_proxy_upstream_duration_seconds", "Request sent -> response complete", self._duration),
        ):
            family = HistogramMetricFamily(name, doc, labels=["stream"])
            for stream, histogram in histograms.items():
                family.add_metric(["true" if stream else "false"], histogram.buckets(), histogram.sum)
            yield family
        flight = GaugeMetricFamily("vsup_proxy_in_flight", "Requests in flight through the proxy, per instance", labels=["instance", *m])
        for name, count in self._in_flight().items():
            flight.add_metric(values(name, model=model_of.get(name, "")), count)
        yield flight
        state = GaugeMetricFamily("vsup_instance_state", "1 for the instance's current state", labels=["instance", "state", *m])
        ready = GaugeMetricFamily("vsup_instance_ready", "1 when the instance is in the proxy's rotation", labels=["instance", *m])
        for name, value in self._states().items():
            model = model_of.get(name, "")
            state.add_metric(values(name, value, model=model), 1)
            ready.add_metric(values(name, model=model), 1 if self._ready(name) else 0)
        yield state
        yield ready
        for more in self.families:
            yield from more()
        yield GaugeMetricFamily("vsup_asyncio_tasks", "asyncio tasks alive in vsup's event loop (flat over time: nothing piles up)",
                                value=_asyncio_tasks())

    def render(self) -> bytes:
        return generate_latest(self.registry)


def batch_families(figures: Figures) -> Iterable[Any]:
    """The Batch API's families (batch/watch.py's figures): labels are models, outcomes, states and
    statuses only — never a batch id, an owner or a custom_id (unbounded, and a tenant's)."""
    lines = CounterMetricFamily("vsup_batch_lines", "Batch lines by model and outcome: completed (a 2xx answer), failed (any other "
                                 "answer, attempts exhausted, cancelled, expired, model removed), requeued (tried again)",
                                 labels=["model", "outcome"])
    for (model, outcome), count in sorted(figures.outcomes.items()):
        lines.add_metric([model, outcome], count)
    yield lines
    # (a name of its own: a gauge named as the counter's base, vsup_batch_lines, clashes in OpenMetrics)
    family: GaugeMetricFamily = GaugeMetricFamily("vsup_batch_lines_open", "Lines of unfinished batches by model and state: pending, running (sent, or held for a slot)",
                                                  labels=["model", "state"])
    for (model, state), count in sorted(figures.lines.items()):
        family.add_metric([model, state], count)
    yield family
    family = GaugeMetricFamily("vsup_batch_batches", "Batches in the store by status", labels=["status"])
    for status, count in figures.batches.items():
        family.add_metric([status], count)
    yield family
    yield GaugeMetricFamily("vsup_batch_store_bytes", "Bytes the batch store holds: files, and the lines and results of unfinished "
                            "batches (bounded by batch.max_total_bytes)", value=figures.store_bytes)


def preempted_family(preempted: Mapping[str, int]) -> Any:
    """Batch lines an interactive request took the slot of (proxy/batch_share.py), by model: each
    was aborted in vLLM and sent again later (no attempt spent); its work so far was lost."""
    family = CounterMetricFamily("vsup_batch_preempted", "Batch lines stopped by model so that an interactive request "
                                 "could take their slot (sent again later; their work so far is lost)", labels=["model"])
    for model, count in sorted(preempted.items()):
        family.add_metric([model], count)
    return family

