"""The YAML configuration: every key, its default, its check and its documentation, in one place.

`load_config(path)` returns a frozen `VsupConfig` or raises `ConfigError` naming the key, the bad
value and its line ("configs/x.yaml:7: proxy.port: 70000 is not valid: ..."). Unknown keys,
duplicate keys and values of the wrong type (`instances: true`) are errors, so nothing silently
falls back to a default or is coerced. Each field's `description` is the key's documentation:
`vsup config --example` (vsup/config/example.py) renders them as the commented example,
configs/vsup.yaml, and the README's configuration reference is that same text.

Loading is bounded: a file over MAX_FILE_BYTES, YAML nested deeper than MAX_DEPTH or expanding
(through aliases and merges) to more than MAX_VALUES values is refused before anything walks it,
and error messages quote at most a short excerpt of a value.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, field_validator

from vsup.errors import ConfigError

GiB = 1024**3
MiB = 1024**2

# A vsup configuration is a few KiB with ~70 keys; these leave room for long vllm.args/env lists.
MAX_FILE_BYTES = 1 * MiB
MAX_DEPTH = 32
MAX_VALUES = 10_000
# Error lines name at most this many problems.
MAX_PROBLEMS = 5
# vllm.spare_base_port when null: this far above vllm.base_port.
SPARE_PORT_OFFSET = 100
# restart.max_rss as a number: a multiple of the planned memory, at most this.
MAX_RSS_FACTOR = 10.0


class _Section(BaseModel):
    # strict: `true` is not 1, "8000" is not 8000; finite: .inf/.nan are no timeout or size
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PlacementConfig(_Section):
    model_size_gib: float | None = Field(None, gt=0, description="weights per instance; null: size of the local model dir's weight files")
    kvcache_gib: float | None = Field(None, gt=0, description="KV cache per instance (whole GiB -> VLLM_CPU_KVCACHE_SPACE, < 1 GiB -> --kv-cache-memory-bytes); null: largest equal whole-GiB share that fits")
    overhead_gib: float = Field(1.5, ge=0, description="fixed per-instance memory besides weights and KV cache")
    memory_reserve_gib: float = Field(2.0, ge=0, description="per node, left to the OS and page cache")
    reserve_cores: int | Literal["auto"] = Field("auto", description="physical cores kept for vsup, the proxy and the OS; auto: one when the instances leave one free, else none (with a warning)")
    housekeeping_core: bool = Field(False, description="give each instance one core for its API server/EngineCore, outside OpenMP")
    smt: bool = Field(False, description="one OpenMP thread per hardware thread instead of one per physical core")
    cores_per_instance: int | None = Field(None, ge=1, description="OpenMP cores per instance; null: split all usable cores")
    omp_threads: int | None = Field(None, ge=1, description="OpenMP threads per instance (OMP_NUM_THREADS), at most its OpenMP CPUs; they take one CPU per core first, the CPUs left over stay in its mask, idle for its API server/EngineCore (decode runs out of memory bandwidth before it runs out of cores; `vsup tune` measures it); null: one thread per OpenMP CPU")
    membind: Literal["bind", "preferred"] = Field("bind", description="numactl memory policy: bind (strict) or preferred (fall back to other nodes)")
    launcher: Literal["auto", "numactl", "taskset", "none"] = Field("auto", description="numactl, taskset or none; auto: numactl when installed, else taskset")
    nodes: list[int] | None = Field(None, min_length=1, description="only place instances on these NUMA nodes, e.g. [0, 1]; null: every node with usable CPUs")
    efficiency_cores: Literal["housekeeping", "instances", "unused"] = Field("housekeeping", description="hybrid CPUs, efficiency cores left after the reserve: housekeeping (in the instances' masks, outside OpenMP, for the API server and EngineCore), instances (teams of their own), unused; never inside a performance-core OpenMP team")

    @field_validator("reserve_cores")
    @classmethod
    def _not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more, or auto")
        return value


class VllmConfig(_Section):
    command: list[str] | None = Field(None, description="argv of the server, e.g. [vllm, serve]; null: `vllm serve`, or vLLM's api_server module for the vllm-cpu distribution")
    venv: Path | None = Field(None, strict=False, description="virtualenv where vLLM is installed (scripts/vllm-env prints one), used when command is null; null: vsup's own, then `vllm` on PATH")
    args: list[str] = Field(default_factory=list, description='extra vLLM options, e.g. [--dtype, float32, --max-model-len, "4096"] (not --host/--port: vsup sets those)')
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for every instance (placement variables come from the plan)")
    base_port: int = Field(8100, ge=1, le=65535, description="instance i listens on 127.0.0.1:<base_port + i>")
    access_log: Literal["clients", "all", "off"] = Field("clients", description="vLLM's per-request access log lines: clients (all but vsup's own polls of /health and /metrics), all, or off (--disable-uvicorn-access-log); a --disable-access-log-for-endpoints or --disable-uvicorn-access-log in args wins")
    spare_base_port: int | None = Field(None, ge=1, le=65535, description="a replacement started beside the instance it replaces (vsup reload with free cores) listens on <spare_base_port + i> and stays there until its next replacement, which goes back to base_port + i; null: base_port + 100")

    @field_validator("command")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("must name a program, e.g. [vllm, serve]")
        return value

    @field_validator("access_log", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return {False: "off", True: "all"}.get(value, value) if isinstance(value, bool) else value  # YAML reads off as false

    @field_validator("venv")
    @classmethod
    def _expand_venv(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None


class ProxyConfig(_Section):
    host: str = Field("127.0.0.1", description="address the proxy listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="port clients use (http://host:port/v1); not one of the instances' ports")
    api_key: str | None = Field(None, description="Bearer token clients must send; env VSUP_API_KEY overrides; null: no auth")
    policy: Literal["round_robin", "least_outstanding", "prefix_affinity"] = Field("round_robin", description="round_robin, least_outstanding (fewest requests in flight), or prefix_affinity (requests that share a prompt prefix or a session go to the same instance, whose prefix cache holds it; docs/proxy.md)")
    affinity_prefix_chars: int = Field(2048, ge=16, description="prefix_affinity: how many leading characters of a request pick its instance (chat: the messages up to the first user message; completions: the prompt); requests alike in these share an instance")
    affinity_max_imbalance: int = Field(4, ge=0, description="prefix_affinity: the chosen instance may have this many requests in flight more than the least loaded one (per unit of weight); beyond that the least loaded gets the request")
    max_body_bytes: int = Field(8 * MiB, ge=1024, description="larger request bodies get 413")
    connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to an instance")
    first_byte_timeout: float = Field(300.0, gt=0, description="seconds to the first byte of a response (prefill of a long prompt on CPU takes a while)")
    idle_timeout: float = Field(120.0, gt=0, description="longest silence, in seconds, between two chunks of a response")
    retries: int = Field(2, ge=0, description="other instances tried before the first byte on connect errors / 503")
    drain_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests may take to finish when vsup stops, and when one instance is drained (reload, rolling restart, memory watchdog)")
    max_connections: int = Field(256, ge=1, description="upstream connection pool size, per instance")


class WarmupConfig(_Section):
    enabled: bool = Field(True, description="before an instance joins the rotation (first start and every restart), send it one short completion; a failed or timed-out warm-up counts as a failed start (turn it off for models that do not generate, e.g. embeddings)")
    prompt: str = Field("Hello", min_length=1, description="the warm-up's prompt (POST /v1/completions to the instance itself)")
    max_tokens: int = Field(4, ge=1, description="tokens the warm-up generates")
    timeout: float = Field(120.0, gt=0, description="seconds the warm-up may take")


class HealthConfig(_Section):
    interval: float = Field(5.0, gt=0, description="seconds between /health polls of a ready instance")
    timeout: float = Field(5.0, gt=0, description="seconds one /health poll may take; longer counts as a failed poll")
    failures: int = Field(3, ge=1, description="consecutive failed polls that make a ready instance unhealthy (-> restart)")
    startup_timeout: float = Field(600.0, gt=0, description="seconds a model load may take before the start counts as failed")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="the warm-up request: the first requests after a (re)start are slow, so the instance gets one before clients do")


class RestartConfig(_Section):
    initial_delay: float = Field(1.0, ge=0, description="seconds before the first restart after a failure")
    max_delay: float = Field(60.0, gt=0, description="cap on the delay between restarts (jitter included)")
    multiplier: float = Field(2.0, ge=1, description="each further failure multiplies the delay by this")
    jitter: float = Field(1.0, ge=0, description="up to this many random seconds added to each delay")
    stable_after: float = Field(300.0, ge=0, description="ready this many seconds resets the backoff and the crash count")
    crash_loop_failures: int = Field(5, ge=1, description="this many failures within crash_loop_window -> failed (until `vsup restart N`)")
    crash_loop_window: float = Field(600.0, gt=0, description="seconds over which crash_loop_failures are counted")
    max_rss: float | str | None = Field(None, examples=[1.2], description='memory watchdog: an instance whose process tree (API server, EngineCore, Worker) stays above this resident memory for max_rss_for seconds is drained and restarted; bytes with a unit ("6GiB", "500MB"), or a number: that multiple of the instance\'s planned memory (weights + KV cache + overhead, `vsup plan`); null: off')
    max_rss_for: float = Field(60.0, gt=0, description="seconds the tree must stay above max_rss before the watchdog acts (short peaks pass)")

    @field_validator("max_rss")
    @classmethod
    def _rss_limit(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float) and not 0 < value <= MAX_RSS_FACTOR:
            raise ValueError(f"a number is a multiple of the instance's planned memory: more than 0, at most {MAX_RSS_FACTOR:g} "
                             '(write bytes with a unit, e.g. "6GiB")')
        if isinstance(value, str):
            parse_bytes(value)
        return value

    def rss_limit(self, planned_bytes: int) -> int | None:
        """max_rss in bytes for an instance planned to hold `planned_bytes`; None: off."""
        if self.max_rss is None:
            return None
        if isinstance(self.max_rss, str):
            return parse_bytes(self.max_rss)
        return int(self.max_rss * planned_bytes)


class StartConfig(_Section):
    mode: Literal["staggered", "parallel"] = Field("staggered", description="staggered: the next instance starts when the previous is ready (or its start failed); parallel: all at once")


class StopConfig(_Section):
    timeout: float = Field(30.0, gt=0, description="seconds from SIGTERM to SIGKILL, per instance (instances stop in parallel)")


class LogConfig(_Section):
    dir: Path | None = Field(None, strict=False, description="per-instance rotating logs <dir>/i<N>.log; null: ./vsup-logs, or $LOGS_DIRECTORY (/var/log/vsup) under systemd")
    max_bytes: int = Field(50 * MiB, ge=4096, description="rotate an instance log at this size")
    backups: int = Field(5, ge=0, description="rotated files kept per instance")
    echo: bool = Field(True, description="copy instance output to vsup's own log, prefixed [i<N>]")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="vsup's log level: debug, info, warning, error (`vsup run --log-level` overrides)")


class ControlConfig(_Section):
    socket: Path | None = Field(None, strict=False, description="unix socket (0600) for `vsup status` / `restart` / `reload`; null: $RUNTIME_DIRECTORY/control.sock under systemd (/run/vsup), else /tmp/vsup-<uid>/control-<proxy.port>.sock")


class MetricsConfig(_Section):
    interval: float = Field(5.0, ge=0, description="seconds between two collections of every instance's vLLM /metrics and process figures (CPU, RSS/PSS, NUMA memory) for the proxy's /metrics, `vsup status`, `vsup top` and /status; 0: off")
    timeout: float = Field(2.0, gt=0, description="seconds one instance's /metrics may take to answer; slower counts as a failed scrape")


class NotifyConfig(_Section):
    ready_when: Literal["all", "any"] = Field("all", description="READY=1 once all instances are ready (those in a crash loop aside), or any: once one is")


class TuneConfig(_Section):
    """`vsup tune`: what it may try and the load it measures with (docs/tune.md); the command line overrides each key."""

    instances_per_node: list[int] | None = Field(None, min_length=1, description="instances per NUMA node to try, e.g. [1, 2]; null: 1, 2, 4, ... while every instance of the smallest node keeps a physical core")
    omp_threads: list[int | Literal["all", "half"]] | None = Field(None, min_length=1, description="OpenMP threads per instance to try (placement.omp_threads): all (one per OpenMP CPU), half (of the smallest instance's OpenMP CPUs, where that leaves one idle) or a count, e.g. [all, half, 3]; null: [all, half]")
    smt: list[bool] | None = Field(None, min_length=1, description="placement.smt values to try, e.g. [false]; null: [false, true] where cores have SMT siblings, else [false]")
    housekeeping_core: list[bool] | None = Field(None, min_length=1, description="placement.housekeeping_core values to try, e.g. [false]; null: [false, true]")
    preload: list[Literal["none", "tcmalloc", "iomp", "tcmalloc+iomp"]] | None = Field(None, min_length=1, description="LD_PRELOAD sets tried on the best layout: none, tcmalloc, iomp (Intel OpenMP) or tcmalloc+iomp; a set that is not installed is pruned; null: none, and every installed library together")
    max_num_seqs: list[int] | None = Field(None, min_length=1, description="vLLM --max-num-seqs values tried on the best layout, besides the config's own (or vLLM's default); null: half the busiest load level's requests per instance, when that is 2 or more")
    max_num_batched_tokens: list[int] | None = Field(None, min_length=1, description="vLLM --max-num-batched-tokens values tried on the best layout, besides the config's own (or vLLM's default); null: none")
    kvcache_gib: list[float] | None = Field(None, min_length=1, description="KV cache sizes per instance, in GiB (whole GiB, or below 1), tried on the best layout besides placement.kvcache_gib; sizes that do not fit are pruned; null: the largest that fits, when placement.kvcache_gib sets a size")
    concurrency: list[int] = Field(default_factory=lambda: [8, 32], min_length=1, description="closed-loop load levels: requests kept in flight, each level measured in every run")
    request_rate: list[float] = Field(default_factory=list, description="open-loop load levels, in requests per second (Poisson arrivals), e.g. [0.5, 2.0]; []: closed loop only")
    input_len: int = Field(128, ge=1, description="synthetic prompts: input tokens per request, sized with the server's own /tokenize (not used with a workload)")
    output_len: int = Field(64, ge=1, description="synthetic prompts: output tokens per request (max_tokens, generated in full; not used with a workload)")
    workload: Path | None = Field(None, strict=False, description='JSONL file of requests, one per line: {"prompt": ..., "max_tokens": N} or {"messages": [...], "max_tokens": N}; a relative path is from the current directory; null: synthetic prompts of input_len/output_len tokens')

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
    model: str = Field(..., min_length=1, examples=["/srv/models/my-model"], description="local model directory or hub name, as `vllm serve` takes it; a local path (/, ./, ~) must exist")
    served_model_name: str | None = Field(None, description='the name clients send as "model"; null: the model path/name itself')
    instances: int | Literal["auto"] = Field("auto", description="a number, or auto: one per NUMA node with usable cores")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="how cores and memory are split among the instances (docs/placement.md)")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="vsup runs `<launcher> <command> <model> --host 127.0.0.1 --port P <args>`")
    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="the one OpenAI-compatible endpoint in front of the ready instances")
    health: HealthConfig = Field(default_factory=HealthConfig, description="when an instance counts as ready, and when as unhealthy")
    restart: RestartConfig = Field(default_factory=RestartConfig, description="restart policy after a failure (any exit, code 0 too; startup timeout; failed warm-up; unhealthy), and the memory watchdog")
    start: StartConfig = Field(default_factory=StartConfig, description="how the instances start")
    stop: StopConfig = Field(default_factory=StopConfig, description="how the instances stop (vsup stopping, `vsup restart N`, a failure)")
    log: LogConfig = Field(default_factory=LogConfig, description="the instances' output and vsup's own log")
    control: ControlConfig = Field(default_factory=ControlConfig, description="where `vsup status`, `vsup restart` and `vsup reload` reach a running vsup")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="what vsup collects about each instance in the background (docs/metrics.md)")
    notify: NotifyConfig = Field(default_factory=NotifyConfig, description="systemd Type=notify (no-op outside systemd)")
    tune: TuneConfig = Field(default_factory=TuneConfig, description="what `vsup tune` tries and the load it measures with (docs/tune.md); its command-line options override each key; `vsup run` ignores this section")

    # Where each key was written (file and YAML tree), for error lines; not a key.
    _origin: str | None = PrivateAttr(None)
    _root: Any = PrivateAttr(None)

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


def parse_bytes(text: str) -> int:
    """ "6GiB", "500 MB", "1073741824" -> bytes (pydantic's ByteSize); ValueError naming what works."""
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        size = -1
    if size <= 0:
        raise ValueError('not a size in bytes: write a number and a unit, e.g. "6GiB", "500MB"')
    return size


# --- loading ------------------------------------------------------------------------------------


def load_config(path: str | Path, *, require_model: bool = True) -> VsupConfig:
    """require_model=False: for commands that read only other sections (`vsup proxy --config`)."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES // MiB} MiB; a vsup configuration is a few KiB "
                          "(configs/vsup.yaml lists every key)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                          f"(line {line}, column {column}); save the file as UTF-8") from None
    return parse_config(text, str(path), require_model=require_model)


def parse_config(text: str, origin: str = "<config>", *, require_model: bool = True) -> VsupConfig:
    root, data = _load_yaml(text, origin)
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of keys (model: ..., instances: ...), got {type(data).__name__}")
    if not require_model:
        data.setdefault("model", "(not used)")
    try:
        config = VsupConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, root, origin)) from None
    config._origin, config._root = origin, root
    return config


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that vsup will not take (too deep, too large, a key given twice)."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, counting while it composes: the depth of nesting, and for every node the
    number of values it stands for once aliases are expanded (an alias is one node in the YAML tree
    but a full copy for whoever walks the result: validation, error messages). A "billion laughs"
    document is refused after composing a few dozen nodes, before anything walks it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._size: dict[int, tuple[int, int]] = {}  # id(node) -> (values when expanded, height)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            if id(node) not in self._size:  # still being composed: the alias is inside its own anchor
                raise _Refused(None, None, f"alias *{event.anchor} refers to a node that contains it", event.start_mark)
            return node
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels; a vsup configuration needs 4", mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        sizes = [self._size[id(child)] for child in children]
        values = 1 + sum(size for size, _ in sizes)
        height = 1 + max((h for _, h in sizes), default=0)
        if values > MAX_VALUES:
            raise _Refused(None, None, f"expands to more than {MAX_VALUES} values (through YAML aliases and merges); "
                           "a vsup configuration needs a few hundred", mark)
        if height > MAX_DEPTH:
            raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels once its aliases are expanded; "
                           "a vsup configuration needs 4", mark)
        self._size[id(node)] = (values, height)
        return node


def _load_yaml(text: str, origin: str) -> tuple[Any, Any]:
    """(the YAML node tree, for line numbers; the Python data) or a ConfigError."""
    loader = None
    try:
        loader = _BoundedLoader(text)
        root = loader.get_single_node()
        if root is not None:
            _check_duplicate_keys(root)
        data = loader.construct_document(root) if root is not None else None
    except _Refused as exc:
        where = f"{origin}:{exc.problem_mark.line + 1}" if exc.problem_mark else origin
        raise ConfigError(f"{where}: {exc.problem}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, other controls)
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{origin}:{line}: not valid YAML: character U+{exc.character:04X} at offset {exc.position} "
                          f"is not allowed ({exc.reason})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}" if mark else origin
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
    return root, data


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_duplicate_keys(root: Any) -> None:
    """YAML says keys are unique; PyYAML lets the last one win. Name the key and both lines.
    (Explicit keys may still override keys merged in with `<<: *anchor`.)"""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:  # an alias: the same node again
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], Any] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    dotted = f"{path}{key.value}"
                    previous = first.setdefault((key.tag, key.value), key)
                    if previous is not key:
                        raise _Refused(None, None, f"{_clip(dotted)}: given twice (lines {previous.start_mark.line + 1} "
                                       f"and {key.start_mark.line + 1}); YAML would keep only the last: remove one",
                                       key.start_mark)
                    stack.append((value, f"{dotted}."))
                else:
                    stack.append((value, path))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}{index}.") for index, item in enumerate(node.value))


# --- error messages -----------------------------------------------------------------------------

_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = 60
_quote.maxlong = 40
_quote.maxlist = _quote.maxtuple = _quote.maxdict = _quote.maxset = 4
_quote.maxlevel = 2


def quote(value: Any) -> str:
    """A value as an error message shows it: YAML's spelling of true/false/null, else a repr cut
    to a short excerpt (a 10 MB value or a deep structure must not become a 10 MB error line)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return _quote.repr(value)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


_UNION_MEMBERS = {"int", "float", "str"}  # what pydantic names the members of `int | float | str` unions


def _describe(exc: ValidationError, root: Any, origin: str) -> str:
    """One entry per bad key: "<file>:<line>: <dotted.key>: <value> is not valid: <why>"; several
    are joined with "; " (the CLI prints one line), at most MAX_PROBLEMS of them."""
    problems: dict[str, tuple[str, list[str]]] = {}  # key -> (start of the entry, reasons)
    for error in exc.errors():
        # drop the union member names pydantic adds to the location ("int", "literal['auto']")
        loc = [part for part in error["loc"] if not (isinstance(part, str) and (part in _UNION_MEMBERS or "[" in part))]
        key = _clip(".".join(str(p) for p in loc) or "(top level)")
        line = _line_of(root, loc)
        where = f"{origin}:{line}" if line else origin
        if error["type"] == "extra_forbidden":
            problems.setdefault(key, (f"{where}: {key}: unknown key (check the spelling; `vsup config --example` lists every key)", []))
        elif error["type"] == "missing":
            problems.setdefault(key, (f"{where}: {key}: required key is missing", []))
        else:
            value = error.get("input")
            reasons = problems.setdefault(key, (f"{where}: {key}: {quote(value)} is not valid", []))[1]
            reasons.append(_reason(error, value))
    entries = []
    for head, reasons in problems.values():
        if reasons:
            # a union (`instances: 3 or auto`) fails once per member: "a valid integer or 'auto'"
            first, *rest = reasons
            head += ": " + " or ".join([first, *(r.removeprefix("Input should be ") for r in rest)])
        entries.append(head)
    if len(entries) > MAX_PROBLEMS:
        entries = entries[:MAX_PROBLEMS] + [f"and {len(entries) - MAX_PROBLEMS} more"]
    return "; ".join(entries)


def _reason(error: Mapping[str, Any], value: Any) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "string_type" and isinstance(value, (int, float, bool)):
        message += " (quote it: YAML reads it as a number or a boolean)"
    return message


def _line_of(node: Any, loc: list, *, exact: bool = False) -> int | None:
    """The 1-based line of the YAML node at `loc`, or of its nearest existing parent (None with
    exact=True: the key is not in the file)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if pair is None:
                return None if exact else line
            line = pair[0].start_mark.line + 1
            node = pair[1]
        elif isinstance(node, yaml.SequenceNode) and str(part).isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def where(cfg: VsupConfig, key: str) -> str:
    """How an error names a key: "FILE:LINE: dotted.key" when the file sets it, "FILE: dotted.key
    (default)" when it does not, the bare key for a config that was not read from a file."""
    if cfg._origin is None:
        return key
    line = _line_of(cfg._root, key.split("."), exact=True)
    return f"{cfg._origin}:{line}: {key}" if line else f"{cfg._origin}: {key} (default)"


# --- checks that need more than the YAML --------------------------------------------------------


def looks_local(model: str) -> bool:
    """A model given as a path (absolute, ./, ../, ~) rather than a hub name like org/name."""
    return model.startswith(("/", "./", "../", "~")) or model in {".", ".."}


def check_model_path(cfg: VsupConfig, flag: str | None = None) -> None:
    """A local model path must exist here: vLLM would fail in every instance, again at each restart.
    `flag`: the command-line option the model came from, when not the config."""
    model = cfg.model
    if not looks_local(model) or Path(model).exists():
        return
    name = f"{flag} {quote(model)}" if flag else f"{where(cfg, 'model')}: {quote(model)}"
    raise ConfigError(f"{name}: no such file or directory; give the model's local directory, "
                      "or a hub name like org/name")


def spare_base_port(cfg: VsupConfig) -> int:
    """Where replacements started beside their instance listen (vllm.spare_base_port)."""
    spare = cfg.vllm.spare_base_port
    return spare if spare is not None else cfg.vllm.base_port + SPARE_PORT_OFFSET


def check_instance_ports(cfg: VsupConfig, count: int, base_port_flag: str | None = None) -> None:
    """The instances listen on vllm.base_port .. +count-1, and a replacement started beside one
    (vsup reload) on vllm.spare_base_port .. +count-1; the proxy must not be one of them (it would
    answer the instance's health checks and send requests to itself), and the two ranges must not
    meet. `base_port_flag`: the option the base port came from, when not the config."""
    base, proxy = cfg.vllm.base_port, cfg.proxy.port
    last = base + count - 1
    source = f"{base_port_flag} {base}" if base_port_flag else f"{where(cfg, 'vllm.base_port')} {base}"
    ports = f"{base}-{last}" if count > 1 else str(base)
    if proxy != 0 and base <= proxy <= last:
        raise ConfigError(f"{where(cfg, 'proxy.port')}: {proxy} is the port of instance {proxy - base} "
                          f"(from {source}); choose a proxy.port outside {ports} or move vllm.base_port")
    spare = spare_base_port(cfg)
    spare_last = spare + count - 1
    if cfg.vllm.spare_base_port is not None:
        spare_source = where(cfg, "vllm.spare_base_port")
    else:
        spare_source = f"{where(cfg, 'vllm.spare_base_port')} (null: vllm.base_port + {SPARE_PORT_OFFSET})"
    spares = f"{spare}-{spare_last}" if count > 1 else str(spare)
    if spare_last > 65535:
        raise ConfigError(f"{spare_source}: the spare ports of {count} instance(s) would end at {spare_last}, above 65535; "
                          "set vllm.spare_base_port lower")
    if spare <= last and base <= spare_last:
        raise ConfigError(f"{spare_source}: the spare ports {spares} meet the instances' ports {ports} (from {source}); "
                          f"set vllm.spare_base_port to {last + 1} or higher")
    if proxy != 0 and spare <= proxy <= spare_last:
        raise ConfigError(f"{where(cfg, 'proxy.port')}: {proxy} is the spare port of instance {proxy - spare} "
                          f"(from {spare_source}), where its replacement listens during a reload; choose a proxy.port "
                          f"outside {spares} or set vllm.spare_base_port")


def check_rss_limit(cfg: VsupConfig, planned: list[int | None]) -> None:
    """restart.max_rss as a multiple of the planned memory needs the model's size: without it the
    plan holds only the KV cache and the overhead, and the limit would restart healthy instances.
    `planned`: each instance's planned weights in bytes (None: unknown)."""
    if isinstance(cfg.restart.max_rss, float) and any(weights is None for weights in planned):
        raise ConfigError(f"{where(cfg, 'restart.max_rss')}: {quote(cfg.restart.max_rss)} is a multiple of the planned memory, "
                          "but the plan does not know the model's size (a hub name, or no weight files found); set "
                          'placement.model_size_gib, or give restart.max_rss in bytes, e.g. "6GiB"')
