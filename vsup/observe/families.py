"""vsup's own per-instance families (process figures and collection health), from a round's figures (pure).

Units are Prometheus's base units: seconds, bytes, ratios 0..1 (CPU % is the one percentage, as
`top` shows it: 100 = one CPU busy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric


def instance_families(figures: Mapping[str, Mapping[str, Any]], collected_at: float, took: float,
                      models: Mapping[str, str] | None = None) -> list[Metric]:
    """figures: instance name -> the dict `Collector` keeps for it (see collector.py); models:
    instance name -> its served model name. The per-instance families carry `model` beside
    `instance` when any instance has a model (`vsup run`: all of them), "" for one without."""
    models = models or {}
    m = ["model"] if any(models.get(name) for name in figures) else []
    cpu = CounterMetricFamily("vsup_instance_cpu_seconds", "CPU seconds (user+system) of the instance's process tree; resets when the instance restarts", labels=["instance", *m])
    cpu_percent = GaugeMetricFamily("vsup_instance_cpu_percent", "CPU use of the instance's process tree between the last two collections, % of one CPU", labels=["instance", *m])
    rss = GaugeMetricFamily("vsup_instance_rss_bytes", "Resident memory of the instance's process tree (sum over its processes)", labels=["instance", *m])
    pss = GaugeMetricFamily("vsup_instance_pss_bytes", "Proportional set size of the instance's process tree (shared pages shared out)", labels=["instance", *m])
    processes = GaugeMetricFamily("vsup_instance_processes", "Processes in the instance's tree (API server, EngineCore, Worker, ...)", labels=["instance", *m])
    numa = GaugeMetricFamily("vsup_instance_numa_memory_bytes", "Memory of the instance's process tree on each NUMA node (numa_maps); local: the node is one of the instance's planned nodes", labels=["instance", *m, "node", "local"])
    ratio = GaugeMetricFamily("vsup_instance_numa_local_ratio", "Share of the instance's memory on its own NUMA nodes (0..1)", labels=["instance", *m])
    up = GaugeMetricFamily("vsup_instance_metrics_up", "1 when the last scrape of the instance's /metrics worked, 0 when it failed (absent while the instance is not serving)", labels=["instance", *m])
    for instance, f in figures.items():
        labels = [instance, models.get(instance, "")] if m else [instance]  # the leading label values
        if f.get("cpu_seconds") is not None:
            cpu.add_metric(labels, f["cpu_seconds"])
            processes.add_metric(labels, len(f.get("pids", ())))
        if f.get("cpu_percent") is not None:
            cpu_percent.add_metric(labels, f["cpu_percent"])
        if f.get("rss_bytes") is not None:
            rss.add_metric(labels, f["rss_bytes"])
        if f.get("pss_bytes") is not None:
            pss.add_metric(labels, f["pss_bytes"])
        local_nodes = set(f.get("nodes", ()))
        for node, size in sorted((f.get("numa_bytes") or {}).items(), key=lambda item: int(item[0])):
            numa.add_metric([*labels, str(node), "true" if int(node) in local_nodes else "false"], size)
        if f.get("numa_local_ratio") is not None:
            ratio.add_metric(labels, f["numa_local_ratio"])
        if f.get("scrape") is not None:
            up.add_metric(labels, 1 if f["scrape"] == "ok" else 0)
    stamp = GaugeMetricFamily("vsup_metrics_collected_timestamp_seconds", "Unix time of the last collection of the instances' figures (the instance metrics are as old as this)")
    stamp.add_metric([], collected_at)
    duration = GaugeMetricFamily("vsup_metrics_collect_seconds", "How long the last collection took")
    duration.add_metric([], took)
    return [cpu, cpu_percent, rss, pss, processes, numa, ratio, up, stamp, duration]


def dropped_families(counts: Mapping[tuple[str, str], int]) -> Metric:
    """counts: (instance, reason) -> families left out of the merged text so far (scrape.merge, scrape.cap)."""
    dropped = CounterMetricFamily("vsup_metrics_dropped_families", "Instance metric families left out of /metrics, per round: clash (their names clash with another family's), duplicate (the same series twice), invalid (samples its type does not have, or a bucket bound that is no number), vsup_name (in vsup's namespace), series_cap (past metrics.max_series_per_instance)", labels=["instance", "reason"])
    for (instance, reason), count in sorted(counts.items()):
        dropped.add_metric([instance, reason], count)
    return dropped


def start_families(instances: Iterable[Mapping[str, Any]]) -> list[Metric]:
    """Where each starting instance is, from the status JSON's instances (their "phase", present
    while starting or warming: vsup/supervisor/phases.py). Series only for the instances that are
    starting: a serving instance has none."""
    labels = ["instance", "model"]
    phase = GaugeMetricFamily("vsup_instance_start_phase", "1 for the phase a starting instance is in: booting, loading, profiling, compiling, opening, warming", labels=[*labels, "phase"])
    seconds = GaugeMetricFamily("vsup_instance_start_phase_seconds", "Seconds the starting instance has been in its phase", labels=labels)
    idle = GaugeMetricFamily("vsup_instance_start_idle_seconds", "Seconds since the start last made progress (a phase, output, CPU time or reads of its tree); health.startup_stall stops it", labels=labels)
    read = GaugeMetricFamily("vsup_instance_start_read_bytes", "Bytes its tree has read since the load began (while loading; against vsup_instance_start_weights_bytes)", labels=labels)
    weights = GaugeMetricFamily("vsup_instance_start_weights_bytes", "The model's weight files, what a load reads (while loading, when known)", labels=labels)
    for entry in instances:
        p = entry.get("phase")
        if not isinstance(p, Mapping):
            continue
        values = [str(entry.get("name", "")), str(entry.get("model") or "")]
        phase.add_metric([*values, str(p.get("name"))], 1)
        seconds.add_metric(values, float(p.get("for") or 0.0))
        if p.get("judged"):
            idle.add_metric(values, float(p.get("idle") or 0.0))
        if p.get("read_bytes") is not None:
            read.add_metric(values, p["read_bytes"])
        if p.get("weights_bytes") is not None:
            weights.add_metric(values, p["weights_bytes"])
    return [phase, seconds, idle, read, weights]
