"""One instance's Prometheus text: parsed, labelled with its instance, merged with the others'.

The text is parsed with prometheus_client's own parser; every sample gets `instance="<index>"`.
Names are kept as the instance wrote them (`vllm:num_requests_running`, `process_cpu_seconds_total`,
...) except where they would clash with vsup's own: a family in vsup's namespace (`vsup_*`, an
instance that is itself a vsup) is renamed `instance_vsup_*`, and a label already called
`instance` becomes `exported_instance` (what Prometheus itself does with such a label).
`summarize` reads the figures `vsup status` shows out of the parsed families (pure).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

INSTANCE_LABEL = "instance"
RESERVED_PREFIX = "vsup_"
RENAMED_PREFIX = "instance_"

# vLLM's names for the figures `vsup status` shows; older vLLMs called the KV-cache gauge gpu_cache_*.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"


def parse(text: str) -> list[Metric]:
    """The families of one Prometheus text; ValueError (from the parser) when it is not one."""
    return [family for family in text_string_to_metric_families(text) if family.samples]


def _rename(name: str) -> str:
    return RENAMED_PREFIX + name if name.startswith(RESERVED_PREFIX) else name


def relabel(families: Iterable[Metric], instance: str) -> list[Metric]:
    """Copies of `families` with instance="<instance>" on every sample (see the module docstring)."""
    out = []
    for family in families:
        copy = Metric(_rename(family.name), family.documentation, family.type, family.unit)
        for sample in family.samples:
            labels = dict(sample.labels)
            if INSTANCE_LABEL in labels:
                labels["exported_" + INSTANCE_LABEL] = labels.pop(INSTANCE_LABEL)
            labels = {INSTANCE_LABEL: instance, **labels}
            copy.samples.append(Sample(_rename(sample.name), labels, sample.value, sample.timestamp, sample.exemplar))
        out.append(copy)
    return out


def merge(per_instance: Iterable[Iterable[Metric]]) -> list[Metric]:
    """One family per name, with every instance's samples (the text format allows each name once).
    A family whose type differs from the first instance's (two vLLM versions) is left out: one
    name cannot be a gauge and a histogram at once."""
    merged: dict[str, Metric] = {}
    for families in per_instance:
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            if into.type == family.type:
                into.samples.extend(family.samples)
    return list(merged.values())


def _values(families: Iterable[Metric], names: Iterable[str]) -> list[float]:
    wanted = set(names)
    return [s.value for family in families for s in family.samples if s.name in wanted]


def _sum(families: Iterable[Metric], name: str) -> float | None:
    values = _values(families, (name,))
    return sum(values) if values else None


def summarize(families: list[Metric]) -> dict[str, float | None]:
    """Requests running/waiting and token counters summed over the instance's engines, KV-cache
    use (0..1) of its fullest engine; None for what the instance does not expose."""
    kv = next((values for name in KV_CACHE if (values := _values(families, (name,)))), [])
    return {
        "requests_running": _sum(families, RUNNING),
        "requests_waiting": _sum(families, WAITING),
        "kv_cache_usage": max(kv) if kv else None,
        "prompt_tokens_total": _sum(families, PROMPT_TOKENS),
        "generation_tokens_total": _sum(families, GENERATION_TOKENS),
    }


class Families:
    """A fixed list of families as a prometheus_client collector (for generate_latest)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families

