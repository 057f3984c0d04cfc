"""The fake's /metrics: a realistic subset of what vLLM (0.32, V1 engine) exposes, made the way
vLLM makes it (prometheus_client, text format 0.0.4, labels model_name + engine, vLLM's bucket
bounds), plus the process_* and python_* families vLLM's default registry carries.

Scheduler gauges are read from the server when scraped; counters and histograms are fed by the
generation code: prompt/generation tokens, prefix-cache queries and hits (prefix_cache.py),
request_success{finished_reason}, time to first token, inter-token latency, end-to-end latency and
queue time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

# vllm/v1/metrics/buckets.py
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ["model_name", "engine"]
KV_BLOCKS = 64  # the fake's KV cache holds this many running requests: usage = running / KV_BLOCKS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class VllmMetrics:
    def __init__(self, model_name: str, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        registry = self.registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        values = (model_name, "0")

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, LABELS, registry=registry, multiprocess_mode="mostrecent").labels(*values).set_function(read)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda: min(1.0, running() / KV_BLOCKS))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=registry).labels(*values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=registry).labels(*values)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                                            LABELS, registry=registry).labels(*values)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                         LABELS, registry=registry).labels(*values)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", LABELS, registry=registry).labels(*values)
        success = Counter("vllm:request_success", "Count of successfully processed requests.", LABELS + ["finished_reason"], registry=registry)
        self.success = {reason: success.labels(*values, reason) for reason in ("stop", "length", "abort")}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*values)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)
