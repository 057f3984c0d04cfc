"""`vsup tune --settings FILE`: the settings of a tune, in a file of their own (not the run file).

The file holds the keys of `TuneSettings` at its top level (`concurrency: [8, 32]`,
`omp_threads: [all]`, ...); each has a flag of the same name that overrides it. It is read as
strictly as a run file (vsup/config/loader.py: bounded, duplicate and unknown keys refused, one
line per bad key naming FILE:LINE). `vsup config --tune-settings` prints every key with its
default and what it does, from these Fields; docs/tune.md carries that text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from vsup.config.loader import describe, load_yaml, read_text
from vsup.errors import ConfigError

# unknown keys: where every key is listed
LISTING = "`vsup config --tune-settings` lists every key"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class TuneSettings(_Section):
    """What `vsup tune` may try and the load it measures with; each key's flag (--concurrency for concurrency) overrides it."""

    instances_per_node: list[int] | None = Field(None, min_length=1, description="instances per NUMA node to try, e.g. [1, 2]; null: 1, 2, 4, ... while every instance of the smallest node keeps a physical core")
    omp_threads: list[int | Literal["all", "half"]] | None = Field(None, min_length=1, description="OpenMP threads per instance to try (placement.omp_threads): all (one per OpenMP CPU), half (of the smallest instance's OpenMP CPUs, where that leaves one idle) or a count, e.g. [all, half, 3]; null: [all, half]")
    smt: list[bool] | None = Field(None, min_length=1, description="placement.smt values to try, e.g. [false]; null: [false, true] where cores have SMT siblings, else [false]")
    housekeeping_core: list[bool] | None = Field(None, min_length=1, description="placement.housekeeping_core values to try, e.g. [false]; null: [false, true]")
    preload: list[Literal["none", "tcmalloc", "iomp", "tcmalloc+iomp"]] | None = Field(None, min_length=1, description="LD_PRELOAD sets tried on the best layout: none, tcmalloc, iomp (Intel OpenMP) or tcmalloc+iomp, each measured and written as vllm.preload (none: nothing preloaded); a set that is not installed is pruned; null: none, and every installed library together")
    max_num_seqs: list[int] | None = Field(None, min_length=1, description="vLLM --max-num-seqs values tried on the best layout, besides the config's own (or vLLM's default); null: half the busiest load level's requests per instance, when that is 2 or more")
    max_num_batched_tokens: list[int] | None = Field(None, min_length=1, description="vLLM --max-num-batched-tokens values tried on the best layout, besides the config's own (or vLLM's default); null: none")
    kvcache_gib: list[float] | None = Field(None, min_length=1, description="KV cache sizes per instance, in GiB (whole GiB, or below 1), tried on the best layout besides placement.kvcache_gib; sizes that do not fit are pruned; null: the largest that fits, when placement.kvcache_gib sets a size")
    enforce_eager: list[bool] | None = Field(None, min_length=1, description="vLLM --enforce-eager values tried last, on the best layout with its other tweaks, besides the config's own (vllm.args): true (no torch.compile: a faster start), false (torch.compile at every start: minutes longer, often faster decode); the report shows each one's start-to-ready seconds beside its tokens/s; null: the config's own only")
    concurrency: list[int] = Field(default_factory=lambda: [8, 32], min_length=1, description="closed-loop load levels: requests kept in flight, each level measured in every run")
    request_rate: list[float] = Field(default_factory=list, description="open-loop load levels, in requests per second (Poisson arrivals), e.g. [0.5, 2.0]; []: closed loop only")
    input_len: int = Field(128, ge=1, description="synthetic prompts: input tokens per request, sized with the server's own /tokenize (not used with a workload)")
    output_len: int = Field(64, ge=1, description="synthetic prompts: output tokens per request (max_tokens, generated in full; not used with a workload)")
    workload: Path | None = Field(None, strict=False, description='JSONL file of requests, one per line: {"prompt": ..., "max_tokens": N} or {"messages": [...], "max_tokens": N}; a relative path is from the folder of this file; null: synthetic prompts of input_len/output_len tokens')

    @field_validator("instances_per_node", "max_num_seqs", "max_num_batched_tokens", "concurrency")
    @classmethod
    def _positive_counts(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(v < 1 for v in value):
            raise ValueError("every value must be at least 1")
        return value

    @field_validator("omp_threads")
    @classmethod
    def _positive_threads(cls, value: list | None) -> list | None:
        if value is not None and any(isinstance(v, int) and v < 1 for v in value):
            raise ValueError("a thread count must be at least 1 (or all, half)")
        return value

    @field_validator("kvcache_gib", "request_rate")
    @classmethod
    def _positive_numbers(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and any(not v > 0 for v in value):
            raise ValueError("every value must be positive")
        return value


class LocatedSettings(TuneSettings):
    """TuneSettings read from a file: where each key was written, for error lines (loader.where)."""

    _origin: str | None = PrivateAttr(None)
    _root: Any = PrivateAttr(None)
    _prefix: str | None = PrivateAttr(None)


def load_tune_settings(path: str | Path) -> LocatedSettings:
    """The settings file, checked; ConfigError naming FILE:LINE and the key. A relative workload
    path is taken from the file's folder (`~` is the home folder)."""
    path = Path(path)
    text, origin = read_text(path), str(path)
    root, data = load_yaml(text, origin)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of vsup tune's settings (concurrency: [8, 32], ...), "
                          f"got {type(data).__name__}")
    if isinstance(data.get("tune"), dict):
        line = next(key.start_mark.line + 1 for key, _ in root.value if key.value == "tune")
        raise ConfigError(f"{origin}:{line}: tune: a settings file holds the keys at its top level "
                          "(concurrency: [8, 32], ...): take them out from under tune:")
    try:
        settings = LocatedSettings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(exc, root, origin, listing=LISTING)) from None
    settings._origin, settings._root = origin, root
    if settings.workload is not None:
        workload = settings.workload.expanduser()
        settings = settings.model_copy(update={"workload": workload if workload.is_absolute() else path.parent / workload})
        settings._origin, settings._root = origin, root
    return settings
