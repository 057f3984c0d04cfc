"""The YAML configuration: every key, its default and its check, in one place.

`load_config(path)` returns a frozen `VsupConfig` or raises `ConfigError` naming the key, the bad
value and its line ("configs/x.yaml:7: proxy.port: 70000 is not valid: ..."). Unknown keys are
errors, so a typo never silently falls back to a default. `configs/vsup.yaml` documents each key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vsup.supervisor.errors import ConfigError

GiB = 1024**3
MiB = 1024**2


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlacementConfig(_Section):
    """How cores and memory are split among instances (see vsup.topology.planner)."""

    model_size_gib: float | None = Field(None, gt=0, description="weights per instance; default: size of the local model dir's weight files")
    kvcache_gib: float | None = Field(None, gt=0, description="KV cache per instance: whole GiB go to VLLM_CPU_KVCACHE_SPACE, less than 1 GiB to --kv-cache-memory-bytes; default: largest equal whole-GiB share that fits")
    overhead_gib: float = Field(1.5, ge=0, description="fixed per-instance memory besides weights and KV cache")
    memory_reserve_gib: float = Field(2.0, ge=0, description="per node, left to the OS and page cache")
    reserve_cores: int | Literal["auto"] = Field("auto", description="physical cores kept for vsup, the proxy and the OS; auto: one when the instances leave one free, else none (with a warning)")
    housekeeping_core: bool = Field(False, description="give each instance one core for its API server/EngineCore, outside OpenMP")
    smt: bool = Field(False, description="one OpenMP thread per hardware thread instead of per physical core")
    cores_per_instance: int | None = Field(None, ge=1, description="OpenMP cores per instance; default: split all usable cores")
    omp_threads: int | None = Field(None, ge=1, description="OpenMP threads per instance, fewer than its cores: the rest stay in its mask for its API server/EngineCore; default: one per core")
    membind: Literal["bind", "preferred"] = "bind"
    launcher: Literal["auto", "numactl", "taskset", "none"] = Field("auto", description="auto: numactl when installed, else taskset")
    nodes: list[int] | None = Field(None, min_length=1, description="only place instances on these NUMA nodes; default: every node with usable CPUs")

    @field_validator("reserve_cores")
    @classmethod
    def _not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more, or auto")
        return value


class VllmConfig(_Section):
    """The server command. vsup runs `<launcher> <command> <model> --host 127.0.0.1 --port P <args>`."""

    command: list[str] | None = Field(None, description="default: `vllm serve`, or vLLM's api_server module for the vllm-cpu distribution")
    venv: Path | None = Field(None, description="virtual environment where vLLM is installed, when it is not vsup's own (scripts/vllm-env prints one; ~ is expanded); used when command is unset; default: vsup's environment, then `vllm` on PATH")
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    base_port: int = Field(8100, ge=1, le=65535)

    @field_validator("command")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("must name a program, e.g. [vllm, serve]")
        return value

    @field_validator("venv")
    @classmethod
    def _expand_venv(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None


class ProxyConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, description="Bearer token clients must send; env VSUP_API_KEY overrides")
    policy: Literal["round_robin", "least_outstanding"] = "round_robin"
    max_body_bytes: int = Field(8 * MiB, ge=1024)
    connect_timeout: float = Field(5.0, gt=0)
    first_byte_timeout: float = Field(300.0, gt=0, description="prefill of a long prompt on CPU takes a while")
    idle_timeout: float = Field(120.0, gt=0, description="longest silence between two chunks of a response")
    retries: int = Field(2, ge=0, description="other instances tried before the first byte on connect errors / 503")
    drain_timeout: float = Field(30.0, ge=0, description="on stop, how long in-flight requests may finish")
    max_connections: int = Field(256, ge=1, description="upstream connection pool size, per instance")


class HealthConfig(_Section):
    interval: float = Field(5.0, gt=0, description="seconds between /health polls of a ready instance")
    timeout: float = Field(5.0, gt=0, description="seconds one /health poll may take; longer counts as a failed poll")
    failures: int = Field(3, ge=1, description="consecutive failed polls that make a ready instance unhealthy")
    startup_timeout: float = Field(600.0, gt=0, description="longest model load before the start counts as failed")


class RestartConfig(_Section):
    initial_delay: float = Field(1.0, ge=0, description="seconds before the first restart after a failure")
    max_delay: float = Field(60.0, gt=0, description="cap on the delay between restarts (jitter included)")
    multiplier: float = Field(2.0, ge=1, description="each further failure multiplies the delay by this")
    jitter: float = Field(1.0, ge=0, description="up to this many random seconds added to each delay")
    stable_after: float = Field(300.0, ge=0, description="ready this long resets the backoff")
    crash_loop_failures: int = Field(5, ge=1, description="this many failures within crash_loop_window -> failed")
    crash_loop_window: float = Field(600.0, gt=0, description="seconds over which crash_loop_failures are counted")


class StartConfig(_Section):
    mode: Literal["staggered", "parallel"] = Field("staggered", description="staggered: next instance starts when the previous is ready")


class StopConfig(_Section):
    timeout: float = Field(30.0, gt=0, description="SIGTERM -> SIGKILL grace, per instance")


class LogConfig(_Section):
    dir: Path | None = Field(None, description="per-instance rotating logs; default: ./vsup-logs, /var/log/vsup under systemd")
    max_bytes: int = Field(50 * MiB, ge=4096)
    backups: int = Field(5, ge=0)
    echo: bool = Field(True, description="copy instance output to vsup's own log, prefixed")
    level: Literal["debug", "info", "warning", "error"] = "info"


class ControlConfig(_Section):
    socket: Path | None = Field(None, description="unix socket (mode 0600) for vsup status/restart; default: $RUNTIME_DIRECTORY/control.sock under systemd, else /tmp/vsup-<uid>/control-<proxy.port>.sock")


class NotifyConfig(_Section):
    ready_when: Literal["all", "any"] = Field("all", description="sd_notify READY=1 once all instances are ready (those in a crash loop aside) / at least one is")


class TuneConfig(_Section):
    """`vsup tune`: what it may try and the load it measures with (docs/tune.md); the command line overrides each key."""

    instances_per_node: list[int] | None = Field(None, min_length=1, description="instances per NUMA node to try; default: 1, 2, 4, ... while each keeps a core")
    omp_threads: list[int | Literal["all", "half"]] | None = Field(None, min_length=1, description="OpenMP threads per instance: all (one per core), half, or a number; default: [all, half]")
    smt: list[bool] | None = Field(None, min_length=1, description="default: [false, true] where cores have SMT siblings, else [false]")
    housekeeping_core: list[bool] | None = Field(None, min_length=1, description="default: [false, true]")
    preload: list[Literal["none", "tcmalloc", "iomp", "tcmalloc+iomp"]] | None = Field(None, min_length=1, description="LD_PRELOAD sets; default: none and every installed library together")
    max_num_seqs: list[int] | None = Field(None, min_length=1, description="vLLM --max-num-seqs values; default: the config's and half the busiest level's requests per instance")
    max_num_batched_tokens: list[int] | None = Field(None, min_length=1, description="vLLM --max-num-batched-tokens values; default: the config's")
    kvcache_gib: list[float] | None = Field(None, min_length=1, description="KV cache per instance; default: the config's, plus the largest that fits when it sets one")
    concurrency: list[int] = Field(default_factory=lambda: [8, 32], min_length=1, description="closed-loop levels: requests kept in flight")
    request_rate: list[float] = Field(default_factory=list, description="open-loop levels: requests per second, Poisson arrivals")
    input_len: int = Field(128, ge=1, description="synthetic prompts: input tokens, calibrated with the server's /tokenize")
    output_len: int = Field(64, ge=1, description="synthetic prompts: output tokens per request")
    workload: Path | None = Field(None, description="JSONL of prompts or chat messages with max_tokens; default: synthetic prompts")

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


class VsupConfig(_Section):
    model: str = Field(..., min_length=1, description="local model directory or name, as `vllm serve` takes it")
    served_model_name: str | None = None
    instances: int | Literal["auto"] = Field("auto", description="a number, or auto: one per NUMA node with usable cores")
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    start: StartConfig = Field(default_factory=StartConfig)
    stop: StopConfig = Field(default_factory=StopConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)

    @field_validator("model")
    @classmethod
    def _expand_home(cls, value: str) -> str:
        # a local directory under the home folder; vLLM would take "~/..." for a hub name
        return os.path.expanduser(value) if value.startswith("~") else value

    @field_validator("instances")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, or auto")
        return value


def load_config(path: str | Path, *, require_model: bool = True) -> VsupConfig:
    """require_model=False: for commands that read only other sections (`vsup proxy --config`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror or exc}") from None
    return parse_config(text, str(path), require_model=require_model)


def parse_config(text: str, origin: str = "<config>", *, require_model: bool = True) -> VsupConfig:
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}" if mark else origin
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of keys (model: ..., instances: ...), got {type(data).__name__}")
    if not require_model:
        data.setdefault("model", "(not used)")
    try:
        return VsupConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, root, origin)) from None


def _describe(exc: ValidationError, root: Any, origin: str) -> str:
    """One line per problem: "<file>:<line>: <dotted.key>: <value> is not valid: <why>"."""
    lines = []
    for error in exc.errors():
        loc = [part for part in error["loc"] if not (isinstance(part, str) and part in {"int", "literal['auto']"} or "[" in str(part))]
        key = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(root, loc)
        where = f"{origin}:{line}" if line else origin
        if error["type"] == "extra_forbidden":
            lines.append(f"{where}: {key}: unknown key (check the spelling; configs/vsup.yaml lists every key)")
        elif error["type"] == "missing":
            lines.append(f"{where}: {key}: required key is missing")
        else:
            value = error.get("input")
            lines.append(f"{where}: {key}: {value!r} is not valid: {error['msg']}")
    # one line for the first problem, the rest after it (the CLI prints them all)
    return "; ".join(dict.fromkeys(lines))


def _line_of(node: Any, loc: list) -> int | None:
    """The 1-based line of the YAML node at `loc`, or of its nearest existing parent."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if k.value == part), None)
            if pair is None:
                return line
            line = pair[0].start_mark.line + 1
            node = pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
