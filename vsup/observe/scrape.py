"""One instance's Prometheus text: parsed, labelled with its instance, merged with the others'.

The text is parsed with prometheus_client's own parser; every sample gets `instance="<index>"`
and, under `vsup run`, `model="<served name>"`. Names are kept as the instance wrote them
(`vllm:num_requests_running`, `process_cpu_seconds_total`, ...) except where they would clash with
vsup's own: a family in vsup's namespace (`vsup_*`, an instance that is itself a vsup) is renamed
`instance_vsup_*`, and a label already called `instance` (or `model`) becomes `exported_instance`
(`exported_model`), what Prometheus itself does with such a label.
`summarize` reads the figures `vsup status` shows out of the parsed families (pure).

Whatever the instances send, the merged text must parse (one family Prometheus cannot read makes
it drop the whole scrape, vsup's own families included): `merge` leaves out, and reports as
`Dropped`, an instance's family whose names another family already has in the text (a histogram
`foo` writes foo_bucket, foo_count and foo_sum, so a gauge `foo_count` beside it is a second TYPE
for `foo`; one name as a gauge and a counter), one in vsup's namespace after renaming, and one with
the same series twice, samples its type does not have, or a bucket bound that is no number. `cap` bounds what one instance may cost before it is parsed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

INSTANCE_LABEL = "instance"
MODEL_LABEL = "model"  # the served model name of the instance (vLLM's own series also carry model_name)
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


def relabel(families: Iterable[Metric], instance: str, model: str = "") -> list[Metric]:
    """Copies of `families` with instance="<instance>" on every sample, and model="<model>" when
    given (see the module docstring)."""
    ours = {INSTANCE_LABEL: instance, **({MODEL_LABEL: model} if model else {})}
    out = []
    for family in families:
        copy = Metric(_rename(family.name), family.documentation, family.type, family.unit)
        for sample in family.samples:
            labels = dict(sample.labels)
            for key in ours:
                if key in labels:
                    labels["exported_" + key] = labels.pop(key)
            labels = {**ours, **labels}
            copy.samples.append(Sample(_rename(sample.name), labels, sample.value, sample.timestamp, sample.exemplar))
        out.append(copy)
    return out


class Dropped(NamedTuple):
    instance: str
    family: str  # "": families cut off unparsed (series_cap)
    reason: str  # clash | duplicate | invalid | vsup_name | series_cap
    number: int = 1  # series_cap: how many families


# generate_latest writes names it cannot write as they are with underscores (escaping): two names
# may become one. Cached: the same few hundred names come every round.
_metric_name = functools.lru_cache(maxsize=8192)(escape_metric_name)
_label_name = functools.lru_cache(maxsize=8192)(escape_label_name)
# Sample names a text parser files under a histogram's or summary's own name.
_UNDER_FAMILY = {"histogram": ("_bucket", "_count", "_sum"), "gaugehistogram": ("_bucket", "_count", "_sum"),
                 "summary": ("_count", "_sum")}
_TYPE_SUFFIX = {"counter": "_total", "info": "_info"}
# The sample names a family of each type has (name + suffix); any other is a parser's leniency (two
# families of one name in one text taken as one) that the rendered text would carry as nonsense.
_SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                    "gaugehistogram": ("_bucket", "_gcount", "_gsum"), "summary": ("", "_count", "_sum", "_created"),
                    "info": ("_info",)}


# The float Prometheus's parser takes as a bucket's `le` or a quantile (Go's ParseFloat; Python's
# float() also takes "1_0" and spaces).
_FLOAT = re.compile(r"[+-]?(?:inf|infinity|nan|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)", re.I)
_BOUND_LABEL = {"histogram": ("_bucket", "le"), "gaugehistogram": ("_bucket", "le"), "summary": ("", "quantile")}


def _bad_bounds(family: Metric) -> bool:
    """A bucket whose `le`, or a quantile whose `quantile`, is no float: Prometheus refuses the text."""
    bound = _BOUND_LABEL.get(family.type)
    if bound is None:
        return False
    name, label = family.name + bound[0], bound[1]
    return any(sample.name == name and label in sample.labels and not _FLOAT.fullmatch(sample.labels[label])
               for sample in family.samples)


def names(family: Metric) -> set[str]:
    """Every name `family` has in the rendered text: its TYPE line's (a counter's foo_total), its
    samples' (also _created, which generate_latest writes as a family of its own), the parsed
    name, and the suffixed names a parser files under a histogram or summary."""
    name = family.name
    found = {name, name + _TYPE_SUFFIX.get(family.type, "")}
    found.update(name + suffix for suffix in _UNDER_FAMILY.get(family.type, ()))
    found.update({sample.name for sample in family.samples})
    return {_metric_name(n) for n in found}


def _has_duplicate_series(family: Metric) -> bool:
    samples = family.samples
    if len({(sample.name, frozenset(sample.labels.items())) for sample in samples}) != len(samples):
        return True
    label_names = {k for sample in samples for k in sample.labels}
    if all(_label_name(k) == k for k in label_names):
        return False
    # some label name is written escaped: two may render alike (one label twice, or two series as one)
    keys = {(sample.name, frozenset((_label_name(k), v) for k, v in sample.labels.items())) for sample in samples}
    return len(keys) != len(samples) or any(len({_label_name(k) for k in s.labels}) != len(s.labels) for s in samples)


def merge(per_instance: Iterable[tuple[str, Iterable[Metric]]]) -> tuple[list[Metric], list[Dropped]]:
    """One family per name, with every instance's samples (the text format allows each name once),
    and the instances' families left out (see the module docstring). First come, first kept: the
    order of the instances decides which of two clashing families stays."""
    merged: dict[str, Metric] = {}
    owner: dict[str, str] = {}  # each name in the text -> the family that has it
    dropped: list[Dropped] = []
    for instance, families in per_instance:
        here: set[str] = set()
        for family in families:
            exposed = names(family)
            reason = _refusal(family, exposed, merged, owner, here)
            if reason is not None:
                dropped.append(Dropped(instance, family.name, reason))
                continue
            here.add(family.name)
            for name in exposed:
                owner[name] = family.name
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(family.samples)
    return list(merged.values()), dropped


def _refusal(family: Metric, exposed: set[str], merged: dict[str, Metric], owner: dict[str, str], here: set[str]) -> str | None:
    if family.name in here:  # e.g. vsup_x renamed onto the instance's own instance_vsup_x
        return "duplicate"
    into = merged.get(family.name)
    if into is not None and into.type != family.type:  # one name, two types (two vLLM versions)
        return "clash"
    if any(name.startswith(RESERVED_PREFIX) for name in exposed):
        return "vsup_name"
    if any(owner.get(name, family.name) != family.name for name in exposed):
        return "clash"
    allowed = {family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",))}
    if not {sample.name for sample in family.samples} <= allowed or _bad_bounds(family):
        return "invalid"
    if _has_duplicate_series(family):
        return "duplicate"
    return None


class Cut(NamedTuple):
    text: str
    left_out: int  # families not kept (known from their TYPE lines), 0 when nothing was cut
    partial: bool  # the last family kept may be incomplete: leave it out too


def cap(text: str, max_series: int, whole: bool = True) -> Cut:
    """The text up to its first `max_series` samples, cut before the family that would pass them
    (or in it: that family is then `partial`). `whole`: False when the body was cut off at a byte
    limit (at a line end), so its last family may be incomplete. Scans lines without parsing."""
    series = 0
    position = 0
    block = -1  # where the comment lines just before this line begin; -1: the last line was a sample
    length = len(text)
    while position < length:
        end = text.find("\n", position)
        end = length if end < 0 else end + 1
        if text.startswith("#", position):
            if block < 0:
                block = position
        elif text[position:end].strip():
            if series == max_series:
                cut = block if block >= 0 else position
                return Cut(text[:cut], text.count("# TYPE ", cut) + (block < 0), block < 0)
            series += 1
            block = -1
        position = end
    return Cut(text, 0 if whole else 1, not whole)


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

