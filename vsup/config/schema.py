"""The YAML configuration's keys: each one's type, default, check, documentation and reload class.

`load_config(path)` returns a frozen `VsupConfig` or raises `ConfigError` naming the key, the bad
value and its line ("configs/x.yaml:7: proxy.port: 70000 is not valid: ..."). Unknown keys,
duplicate keys and values of the wrong type (`instances: true`) are errors, so nothing silently
falls back to a default or is coerced; reading the file is bounded (vsup/config/loader.py). Each
field's `description` is the key's documentation: `vsup config --example --all`
(vsup/config/example.py) renders them as the configuration reference (docs/configuration.md).
Each field's `json_schema_extra` says how a change reaches a running vsup
(vsup/config/reloading.py: live, relaunch, fixed, start); `RELOAD` is that table. The keys a user
sets carry `basic(comment, ...)` there too: `vsup config --example` (configs/vsup.yaml) shows only
them, each with that short comment. `vsup tune`'s settings are not here: they have a file of
their own (vsup/config/tune_settings.py), and a `tune:` section is refused naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict

from vsup.config import proxy_routes
from vsup.config.loader import describe, load_yaml, read_text
from vsup.config.loader import quote as quote  # re-exported: callers name keys and values with them
from vsup.config.loader import where as where
from vsup.config.reloading import LIVE, START, KeyReload, fixed, relaunch, reload_table
from vsup.errors import ConfigError

GiB = 1024**3
KiB = 1024
MiB = 1024**2

# The top-level `model` of a config with `models:` (each entry names its own): never a path, so
# code that reads it instead of a model's view (vsup/config/fleet.py) fails loudly.
FLEET_MODEL = "(each entry of models names its model)"

# vllm.spare_base_port when null: this far above vllm.base_port.
SPARE_PORT_OFFSET = 100
# The libraries vllm.preload names without a path (vsup/supervisor/preload.py finds them).
PRELOAD_NAMES = ("tcmalloc", "iomp")
# restart.max_rss as a number: a multiple of the planned memory, at most this.
MAX_RSS_FACTOR = 10.0
# The json_schema_extra entry of a key `vsup config --example` shows: its short comment there.
BASIC = "basic"


def basic(comment: str, extra: JsonDict | None = None) -> JsonDict:
    """Marks a key (or section) `vsup config --example` shows: what a user sets, with `comment`, a few
    words that say what it does and why (a line of that example is at most 100 characters; the
    description is the key's full documentation, in `vsup config --example --all`)."""
    return {**(extra or {}), BASIC: comment}


class _Section(BaseModel):
    # strict: `true` is not 1, "8000" is not 8000; finite: .inf/.nan are no timeout or size
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PlacementConfig(_Section):
    model_size_gib: float | None = Field(None, gt=0, description="weights per instance; null: size of the local model dir's weight files", json_schema_extra=basic("weights per instance; null: the model folder's files", relaunch(plan="model_size_bytes")))
    kvcache_gib: float | None = Field(None, gt=0, description="KV cache per instance (whole GiB -> VLLM_CPU_KVCACHE_SPACE, < 1 GiB -> --kv-cache-memory-bytes); null: largest equal whole-GiB share that fits", json_schema_extra=basic('KV cache per instance; null: the largest that fits', relaunch(plan="kvcache_gib")))
    overhead_gib: float = Field(1.5, ge=0, description="fixed per-instance memory besides weights and KV cache", json_schema_extra=relaunch())
    memory_reserve_gib: float = Field(2.0, ge=0, description="per node, left to the OS and page cache", json_schema_extra=relaunch())
    reserve_cores: int | Literal["auto"] = Field("auto", description="physical cores kept for vsup, the proxy and the OS; auto: one when the instances leave one free, else none (with a warning)", json_schema_extra=basic('cores left to vsup and the OS; auto: one when free', relaunch(plan="reserve_cores")))
    housekeeping_core: bool = Field(False, description="give each instance one core for its API server/EngineCore, outside OpenMP", json_schema_extra=relaunch(plan="housekeeping_core"))
    smt: bool = Field(False, description="one OpenMP thread per hardware thread instead of one per physical core", json_schema_extra=basic('true: an OpenMP thread on each SMT sibling too', relaunch(plan="smt")))
    cores_per_instance: int | None = Field(None, ge=1, description="OpenMP cores per instance; null: split all usable cores", json_schema_extra=basic('null: all usable cores, split among the instances', relaunch(plan="cores_per_instance")))
    omp_threads: int | None = Field(None, ge=1, description="OpenMP threads per instance (OMP_NUM_THREADS), at most its OpenMP CPUs; they take one CPU per core first, the CPUs left over stay in its mask, idle for its API server/EngineCore (decode runs out of memory bandwidth before it runs out of cores; `vsup tune` measures it); null: one thread per OpenMP CPU", json_schema_extra=basic('threads per instance; null: one per core (`vsup tune`)', relaunch(plan="omp_threads")))
    membind: Literal["bind", "preferred"] = Field("bind", description="numactl memory policy: bind (strict) or preferred (fall back to other nodes)", json_schema_extra=relaunch(plan="membind"))
    launcher: Literal["auto", "numactl", "taskset", "none"] = Field("auto", description="numactl, taskset or none; auto: numactl when installed, else taskset", json_schema_extra=relaunch(plan="launcher"))
    nodes: list[int] | None = Field(None, min_length=1, description="only place instances on these NUMA nodes, e.g. [0, 1]; null: every node with usable CPUs", json_schema_extra=basic('only these NUMA nodes, e.g. [0, 1]; null: all', relaunch(plan="nodes")))
    efficiency_cores: Literal["housekeeping", "instances", "unused"] = Field("housekeeping", description="hybrid CPUs, efficiency cores left after the reserve: housekeeping (in the instances' masks, outside OpenMP, for the API server and EngineCore), instances (teams of their own), unused; never inside a performance-core OpenMP team", json_schema_extra=relaunch(plan="efficiency_cores"))

    @field_validator("reserve_cores")
    @classmethod
    def _not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more, or auto")
        return value


class VllmConfig(_Section):
    command: list[str] | None = Field(None, description="argv of the server, e.g. [vllm, serve]; null: `vllm serve`, or vLLM's api_server module for the vllm-cpu distribution", json_schema_extra=relaunch())
    venv: Path | None = Field(None, strict=False, description="virtualenv where vLLM is installed (scripts/vllm-env prints one), used when command is null; null: vsup's own, then `vllm` on PATH", json_schema_extra=basic("vLLM's venv; null: vsup's own, then `vllm` on PATH", relaunch()))
    args: list[str] = Field(default_factory=list, description='extra vLLM options, e.g. [--dtype, float32, --max-model-len, "4096"] (not --host/--port/--uds: vsup sets those)', json_schema_extra=basic('more `vllm serve` flags, e.g. [--max-model-len, "8192"]', relaunch()))
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for every instance (placement variables come from the plan)", json_schema_extra=basic('more environment, e.g. {HF_HUB_OFFLINE: "1"}', relaunch()))
    preload: Literal["auto", "none"] | list[str] = Field("auto", description="LD_PRELOAD of every instance, ahead of any in env: auto (what vLLM's CPU docs advise, where vLLM's environment, the venv or prefix its command runs in, has it: tcmalloc, libtcmalloc_minimal.so.4 from its lib/ or the system's library directories, and Intel OpenMP, its lib/libiomp5.so; nothing when vLLM's environment is not found), none, or a list of tcmalloc, iomp (found as auto finds them) and absolute paths of libraries; one that is not there is an error. `vsup plan` shows what each instance preloads", json_schema_extra=relaunch())
    listen: Literal["unix", "tcp"] = Field("unix", description="where the instances listen: unix (a socket in vsup's private runtime directory, <runtime dir>/instances-<proxy.port>/<i>.sock: no other user can reach an instance or answer in its name) or tcp (127.0.0.1:<base_port + i>, which any local user can reach without the API key; before an instance counts as ready vsup checks that the port's listener is the instance's own process tree, and refuses to route to it otherwise)", json_schema_extra=fixed("the instances' addresses are set when vsup starts"))
    base_port: int = Field(8100, ge=1, le=65535, description="with listen: tcp, instance i listens on 127.0.0.1:<base_port + i> (unused with listen: unix)", json_schema_extra=relaunch(plan="base_port"))
    access_log: Literal["clients", "all", "off"] = Field("clients", description="vLLM's per-request access log lines: clients (all but vsup's own polls of /health and /metrics), all, or off (--disable-uvicorn-access-log); a --disable-access-log-for-endpoints or --disable-uvicorn-access-log in args wins", json_schema_extra=relaunch())
    spare_base_port: int | None = Field(None, ge=1, le=65535, description="with listen: tcp, a replacement started beside the instance it replaces (vsup reload with free cores) listens on <spare_base_port + i> and stays there until its next replacement, which goes back to base_port + i (with listen: unix it gets the socket <i>b.sock); null: base_port + 100", json_schema_extra=relaunch())

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

    @field_validator("preload")
    @classmethod
    def _preload(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("must name a library; for no preload write none")
        out = []
        for item in value:
            library = item if item in PRELOAD_NAMES else os.path.expanduser(item)
            if library not in PRELOAD_NAMES and not os.path.isabs(library):
                raise ValueError(f"{item!r} is neither {' nor '.join(PRELOAD_NAMES)} nor an absolute path (a relative one would depend on each instance's working directory)")
            if len(library) > 4095:
                raise ValueError(f"{quote(item)} is longer than a path may be (4095 bytes)")
            if re.search(r"[\s:]", library):
                raise ValueError(f"{item!r} has a colon or a space, which LD_PRELOAD takes as a separator")
            if library in out:
                raise ValueError(f"{item!r} is listed twice")
            out.append(library)
        return out


class ApiKeyConfig(_Section):
    """One entry of proxy.api_keys: a client's key, its admission priority and its rate limits."""

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="the key's name (metrics, logs, errors; never the key itself)")
    key: str | None = Field(None, min_length=1, description="the Bearer token itself (or key_env)")
    key_env: str | None = Field(None, min_length=1, description="the environment variable that holds the token (kept out of the file)")
    priority: int = Field(0, description="admission priority: higher is served first when a model's instances are all at their limit; also the highest the priority header may ask for")
    requests_per_minute: float | None = Field(None, gt=0, description="token bucket: requests per minute (bursts up to one minute's worth); null: no limit")
    tokens_per_minute: float | None = Field(None, gt=0, description="token bucket: tokens per minute, a request counted as its max_tokens (or max_completion_tokens, else 16) plus its body's bytes / 4; null: no limit")
    admin: bool = Field(False, description="the key opens what only an operator may use: the admin routes proxy.admin_routes opens, /metrics and the /status page (once named keys exist, the other keys get 403 there; proxy.api_key is an admin key)")
    metrics: bool = Field(False, description="a read-only key for Prometheus: it opens /metrics and nothing else (the serving routes, the admin routes and /status answer it 403); give it key_env, not key")

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeyConfig:
        if (self.key is None) == (self.key_env is None):
            raise ValueError("set exactly one of key and key_env")
        if self.admin and self.metrics:
            raise ValueError("set admin or metrics, not both: an admin key reads /metrics already, a metrics key nothing else")
        return self


class ProxyConfig(_Section):
    host: str = Field("127.0.0.1", description="address the proxy listens on (0.0.0.0: every interface)", json_schema_extra=basic('0.0.0.0: other machines too (then set an API key)', fixed("the proxy listens there")))
    port: int = Field(8000, ge=0, le=65535, description="port clients use (http://host:port/v1); not one of the instances' ports", json_schema_extra=basic('clients use http://host:port/v1', fixed("the proxy listens there")))
    api_key: str | None = Field(None, description="Bearer token clients must send; env VSUP_API_KEY overrides; null: no auth", json_schema_extra=basic('Bearer token clients send; null: none (VSUP_API_KEY wins)', LIVE))
    policy: Literal["round_robin", "least_outstanding", "prefix_affinity", "least_loaded", "kv_aware"] = Field("round_robin", description="round_robin, least_outstanding (fewest requests in flight through the proxy), least_loaded (the lowest load by vLLM's own running, waiting and KV-cache figures with the proxy's in-flight requests on top), prefix_affinity (requests that share a prompt prefix or a session go to the same instance, whose prefix cache holds it, within a bounded load; docs/proxy.md), or kv_aware (the instance whose prefix cache holds the longest part of the prompt, known exactly from vLLM's KV-cache events, which vsup then turns on for the model's instances, within the same bounded load; docs/kv-events.md)", json_schema_extra=basic('round_robin; prefix_affinity keeps shared prompts on one cache', LIVE))
    affinity_prefix_chars: int = Field(2048, ge=16, description="prefix_affinity: how many leading characters of a request pick its instance (chat: the messages up to the first user message; completions: the prompt); requests alike in these share an instance", json_schema_extra=LIVE)
    affinity_load_factor: float = Field(0.25, ge=0, le=10, description="prefix_affinity and kv_aware: the ε of bounded-load hashing: an instance takes a request only while its load after it stays within ceil((1 + ε) x the mean load), the load being the work before a new first token in units of this request's prefill (prompt tokens of requests still without a first byte, other clients' waiting requests from the engine's aged sample, half a prefill per decoding stream: docs/proxy.md); beyond, the request's next instance in its hash order takes it (0: as even as whole requests allow; larger: a longer queue of prefill before a key pays a miss elsewhere; the default meets the bar of bench/affinity_bench.py on real vLLM; a key with 2 requests in flight at its instance spreads whatever ε: docs/proxy.md). Replaces affinity_max_imbalance", json_schema_extra=LIVE)
    load_interval: float = Field(1.0, ge=0.05, le=60, description="least_loaded and prefix_affinity: seconds between two samples of each ready instance's /metrics (running, waiting, KV usage); a sample older than 3 intervals, or a failed one, counts for nothing and the proxy's in-flight counts decide", json_schema_extra=LIVE)
    # Admission (vsup/proxy/admission.py, docs/proxy.md "Admission"): a model's requests wait in the proxy, by priority.
    max_in_flight_per_instance: int | Literal["max_num_seqs"] | None = Field(None, description="requests the proxy sends one instance at a time; when every ready instance of a model has this many, the next wait in the proxy in priority order (keys taking turns within one), not in vLLM's queue; max_num_seqs: the --max-num-seqs of the model's vllm.args; null or 0: no admission queue", json_schema_extra=LIVE)
    reserved_slots: int = Field(0, ge=0, description="of each instance's max_in_flight_per_instance, slots only the highest priority in use (of api_keys and priority_header_values) may take, so it never waits behind a batch; must leave at least one slot", json_schema_extra=LIVE)
    queue_max: int = Field(256, ge=0, description="requests that may wait for one model; one more gets 429 (a higher-priority arrival takes the place of the newest lowest-priority waiter, and a key holding fewer places that of the newest of the key holding the most: that waiter gets the 429)", json_schema_extra=LIVE)
    queue_timeout: float = Field(60.0, gt=0, description="seconds a request may wait for an instance; then 503 with Retry-After", json_schema_extra=LIVE)
    api_keys: list[ApiKeyConfig] = Field(default_factory=list, description="named Bearer keys, each [{name, key or key_env, priority, requests_per_minute, tokens_per_minute, admin, metrics}] (over their limit: 429 with Retry-After and x-ratelimit-* headers); api_key still works beside them, as an admin key of priority 0 without limits", json_schema_extra=basic('named keys, priorities, rate limits (docs/proxy.md)', LIVE))
    priority_header: str | None = Field(None, description="a request header that picks the request's priority from priority_header_values (another value: 400); a named key's own priority is the highest it can pick; null: none", json_schema_extra=LIVE)
    priority_header_values: dict[str, int] = Field(default_factory=dict, description="priority_header's allowed values and the priority each means, e.g. {interactive: 10, batch: -10}", json_schema_extra=LIVE)
    max_body_bytes: int = Field(8 * MiB, ge=1024, description="larger request bodies get 413", json_schema_extra=fixed("the proxy's request parser is built with it"))
    max_body_buffer: int | Literal["auto"] | None = Field("auto", description="bytes of request bodies the proxy holds at once, all clients together (each body at most max_body_bytes): a body that does not fit gets 503 with Retry-After, so no number of clients can make the proxy hold more; at least max_body_bytes; auto or null: 1/512 of the machine's memory, at least 32 MiB, at most 256 MiB (24 GiB: 48 MiB), and never less than max_body_bytes", json_schema_extra=fixed("the proxy's body budget is sized with it when it starts"))
    connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to an instance", json_schema_extra=LIVE)
    first_byte_timeout: float = Field(300.0, gt=0, description="seconds to the first byte of a response (prefill of a long prompt on CPU takes a while)", json_schema_extra=LIVE)
    idle_timeout: float = Field(120.0, gt=0, description="longest silence, in seconds, between two chunks of a response", json_schema_extra=LIVE)
    stall_timeout: float = Field(60.0, gt=0, description="seconds an instance may hold requests and send no byte to any of them (a request still waiting for its first byte gets its prompt's prefill time on top, from the slowest prefill its model has shown, x4) before it counts as stalled: out of the rotation at once, its requests without a byte retried on another instance, and under vsup run the instance restarted; keep it well below first_byte_timeout", json_schema_extra=LIVE)
    retries: int = Field(2, ge=0, description="other instances tried before the first byte on connect errors / 503", json_schema_extra=LIVE)
    drain_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests may take to finish when vsup stops, and when one instance is drained (reload, rolling restart, memory watchdog)", json_schema_extra=LIVE)
    max_connections: int = Field(256, ge=1, description="upstream connection pool size, per instance", json_schema_extra=fixed("the proxy's upstream pools are built with it"))
    admin_routes: list[str] = Field(default_factory=list, description="vLLM's admin routes the proxy forwards (LoRA loading, profiling, sleep, cache reset, ...: the table in docs/proxy.md), only to an admin key (proxy.api_key, or a key of api_keys with admin: true); []: none, every route but the serving ones gets 404", json_schema_extra=LIVE)

    @field_validator("admin_routes")
    @classmethod
    def _admin_routes(cls, value: list[str]) -> list[str]:
        return proxy_routes.check_admin_routes(value)

    @field_validator("max_in_flight_per_instance")
    @classmethod
    def _limit(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more (0 or null: no admission queue), or max_num_seqs")
        return value

    @field_validator("priority_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", value):
            raise ValueError(f"{value!r} is not an HTTP header name (letters, digits and -, e.g. X-Priority)")
        return value

    @model_validator(mode="after")
    def _admission(self) -> ProxyConfig:
        names = [entry.name for entry in self.api_keys]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"api_keys: the name {twice[0]!r} is used twice: each key needs its own name")
        if self.priority_header is not None and not self.priority_header_values:
            raise ValueError("priority_header is set but priority_header_values is empty: list the values it may take, e.g. {interactive: 10, batch: -10}")
        if self.priority_header is None and self.priority_header_values:
            raise ValueError("priority_header_values is set but priority_header is null: name the header, e.g. X-Priority")
        buffer = self.max_body_buffer
        if isinstance(buffer, int) and buffer < self.max_body_bytes:
            raise ValueError(f"max_body_buffer ({buffer}) must be at least max_body_bytes ({self.max_body_bytes}): "
                             "a body of max_body_bytes could never be held")
        limit = self.max_in_flight_per_instance
        if self.reserved_slots and isinstance(limit, int) and limit and self.reserved_slots >= limit:
            raise ValueError(f"reserved_slots ({self.reserved_slots}) must be less than max_in_flight_per_instance ({limit}): the other priorities need a slot")
        return self

    # The front door (vsup/proxy/clients.py): what a client may hold before it is authenticated.
    max_header_bytes: int = Field(64 * KiB, ge=1024, description="a request's line and headers together may be this many bytes; more gets 431 and the connection closed (each line is also limited to 8190 bytes, and a request to 128 headers)", json_schema_extra=LIVE)
    header_timeout: float = Field(30.0, gt=0, description="seconds a client has to send a request's line and headers: from its connection (on a keep-alive connection, from the request's first byte); later, the connection is closed", json_schema_extra=LIVE)
    body_timeout: float = Field(60.0, gt=0, description="seconds a client has to send a request's whole body, from the end of its headers; later gets 408 and the connection closed (nothing reaches an instance)", json_schema_extra=LIVE)
    max_connections_per_client: int = Field(512, ge=0, description="client connections one address may have open at once; more get 429 and are closed (/health and /ready are still answered). A reverse proxy in front counts as one client: raise it there; 0: no limit per address (the proxy's limit on all connections, 4096 or half the open-file limit, remains)", json_schema_extra=LIVE)


class WarmupConfig(_Section):
    enabled: bool = Field(True, description="before an instance joins the rotation (first start and every restart), send it one short request that fits its model: a completion (POST /v1/completions) for a generating model; for a pooling model (--runner pooling, --convert embed|classify, or an embedding/classifier architecture) POST /v1/embeddings for an embedding model, POST /pooling for a classifier or reranker; a failed or timed-out warm-up counts as a failed start", json_schema_extra=LIVE)
    prompt: str = Field("Hello", min_length=1, description="the warm-up's text, sent to the instance itself: the prompt of the completion, the input of a pooling model's /v1/embeddings or /pooling request", json_schema_extra=LIVE)
    max_tokens: int = Field(4, ge=1, description="tokens the warm-up completion generates (a pooling model's warm-up generates none)", json_schema_extra=LIVE)
    timeout: float = Field(120.0, gt=0, description="seconds the warm-up may take", json_schema_extra=LIVE)


class HealthConfig(_Section):
    interval: float = Field(5.0, gt=0, description="seconds between /health polls of a ready instance", json_schema_extra=LIVE)
    timeout: float = Field(5.0, gt=0, description="seconds one /health poll may take; longer counts as a failed poll", json_schema_extra=LIVE)
    failures: int = Field(3, ge=1, description="consecutive failed polls that make a ready instance unhealthy (-> restart)", json_schema_extra=LIVE)
    startup_timeout: float = Field(3600.0, gt=0, description="the ceiling of a start that keeps progressing: seconds from the spawn to /health 200 before the start counts as failed; sized for the largest models (a 70B bf16 model from a slow disk: 140 GB at 125 MB/s is 19 min, plus boot and compile, docs/supervisor.md); a start that stops progressing is stopped long before (startup_stall)", json_schema_extra=basic('seconds a load may take at most, if it keeps progressing', LIVE))
    startup_stall: float = Field(300.0, gt=0, description="seconds a start may go without progress before it is stopped as stalled (a failed start: `stalled in <phase> for N s`); progress is a new phase, a line of output (vLLM's repeated waiting lines aside), or CPU time or bytes read by its process tree (API server, EngineCore, Worker)", json_schema_extra=LIVE)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="the warm-up request: the first requests after a (re)start are slow, so the instance gets one before clients do")


class RestartConfig(_Section):
    # The rest of the policy is derived (vsup/supervisor/backoff.py): the first restart waits 1 s, each further failure doubles it.
    stable_after: float = Field(300.0, ge=0, description="a start counts once the instance has stayed ready this many seconds: the failures before it are forgotten and the next restart waits 1 s again", json_schema_extra=LIVE)
    max_failures: int = Field(5, ge=1, description="failures in a row (any exit, startup timeout, failed warm-up, unhealthy) with no start that counted between them (stable_after) that make a crash loop: the instance is marked failed and left down until `vsup restart N` or a reload", json_schema_extra=LIVE)
    max_delay: float = Field(60.0, gt=0, description="the longest wait before a restart: the first waits 1 s, each further failure in a row doubles it, plus up to 1 s at random so instances that failed together do not restart together", json_schema_extra=LIVE)
    max_rss: float | str | None = Field(None, examples=[1.2], description='memory watchdog: an instance whose process tree (API server, EngineCore, Worker) stays above this resident memory for max_rss_for seconds is drained and restarted; bytes with a unit ("6GiB", "500MB"), or a number: that multiple of the instance\'s planned memory (weights + KV cache + overhead, `vsup plan`); null: off', json_schema_extra=basic('restart an instance above 1.2x its planned memory; default off', LIVE))
    max_rss_for: float = Field(60.0, gt=0, description="seconds the tree must stay above max_rss before the watchdog acts (short peaks pass)", json_schema_extra=basic('... for this many seconds (short peaks pass)', LIVE))

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
    mode: Literal["auto", "staggered", "parallel"] = Field("auto", description="auto: all at once when each node's memory (and the cgroup limit) holds their load peaks together — while loading each holds its weights + overhead and every model's checkpoint pages are resident once (measured: bench/start_bench.py), once loaded weights + KV cache + overhead —, else staggered; vsup's log and `vsup plan` say which and why (docs/supervisor.md); staggered: the next instance starts when the previous is ready (or its start failed); parallel: all at once", json_schema_extra=START)


class StopConfig(_Section):
    timeout: float = Field(30.0, gt=0, description="seconds from SIGTERM to SIGKILL, per instance (instances stop in parallel)", json_schema_extra=LIVE)


class LogConfig(_Section):
    dir: Path | None = Field(None, strict=False, description="per-instance rotating logs <dir>/i<N>.log, in a folder of vsup's own user that no one else may write (created 0700, files 0600; an existing folder of another user or writable by group or others is refused); null: $LOGS_DIRECTORY (/var/log/vsup) under systemd, else $XDG_STATE_HOME/vsup/logs (~/.local/state/vsup/logs)", json_schema_extra=basic('null: ~/.local/state/vsup/logs (systemd: /var/log/vsup)', fixed("the instances' log files are open")))
    group: str | None = Field(None, description="a group (name or number) that may read the instance logs: the folder becomes 0750 and the files 0640 of that group (vsup's user must be a member, or root); null: private to vsup's user", json_schema_extra=fixed("the instances' log files are open"))
    max_bytes: int = Field(50 * MiB, ge=4096, description="rotate an instance log at this size", json_schema_extra=fixed("the instances' log files are open"))
    backups: int = Field(5, ge=0, description="rotated files kept per instance", json_schema_extra=fixed("the instances' log files are open"))
    echo: bool = Field(True, description="copy instance output to vsup's own log, prefixed [i<N>]", json_schema_extra=fixed("the instances' log files are open"))
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="vsup's log level: debug, info, warning, error (`vsup run --log-level` overrides)", json_schema_extra=LIVE)


class ControlConfig(_Section):
    socket: Path | None = Field(None, strict=False, description="unix socket (0600) for `vsup status` / `restart` / `reload`; null: $RUNTIME_DIRECTORY/control.sock under systemd (/run/vsup), else /tmp/vsup-<uid>/control-<proxy.port>.sock", json_schema_extra=fixed("vsup listens there"))


class MetricsConfig(_Section):
    interval: float = Field(5.0, ge=0, description="seconds between two collections of every instance's vLLM /metrics and process figures (CPU, RSS/PSS, NUMA memory) for the proxy's /metrics, `vsup status`, `vsup top` and /status; 0: off", json_schema_extra=LIVE)
    timeout: float = Field(2.0, gt=0, description="seconds one instance's /metrics may take to answer; slower counts as a failed scrape", json_schema_extra=LIVE)
    max_series_per_instance: int = Field(20000, ge=1, description="most series of one instance's /metrics the proxy's /metrics carries; its families past them are left out, counted in vsup_metrics_dropped_families_total (reason series_cap), and its body is read only up to 400 bytes per series", json_schema_extra=LIVE)


class NotifyConfig(_Section):
    ready_when: Literal["all", "any"] = Field("all", description="READY=1 once all instances are ready (those in a crash loop aside), or any: once one is", json_schema_extra=LIVE)


class BatchConfig(_Section):
    enabled: bool = Field(True, description="serve the OpenAI Batch API (/v1/files with purpose batch, /v1/batches) and run its batches on the capacity interactive requests leave: each line enters its model's admission below every interactive priority and takes only slots no interactive request uses; false: those routes answer 404 and nothing is stored", json_schema_extra=basic("the OpenAI Batch API on idle capacity (docs/batch.md)", fixed("the batch store is open")))
    dir: Path | None = Field(None, strict=False, description="the folder of the batch store (an SQLite database holding uploaded files, batches, each line's state and result), of vsup's own user alone (made 0700, the database 0600); it must be kept across restarts: a batch resumes from it; null: $STATE_DIRECTORY/batches under systemd (/var/lib/vsup/batches), else $XDG_STATE_HOME/vsup/batches-<proxy.port> (~/.local/state/vsup/batches-8000; one store per proxy port, as the control socket: a store is one vsup's at a time)", json_schema_extra=fixed("the batch store is open"))
    max_file_bytes: int | str = Field("200MiB", description='the largest file one upload may be (bytes, or a size with a unit: "200MiB"); a larger upload gets 413 naming this key. OpenAI\'s own limit for a batch input file, so a file made for it fits', json_schema_extra=LIVE)
    max_total_bytes: int | str = Field("10GiB", description="the bytes the batch store may hold in all: every file and every result; an upload or batch over it gets 413 naming this key (delete files, or wait for retention). A bound so batches cannot fill the disk vsup's state lives on", json_schema_extra=LIVE)
    retention: float = Field(30 * 86400.0, ge=0, description="seconds files and finished batches are kept after they end (a file from its upload, a batch from its completion, failure, expiry or cancel); then deleted with their results; 0: kept until deleted. 30 days, OpenAI's own for batch files", json_schema_extra=LIVE)
    priority: int | None = Field(None, description="the admission priority of batch lines (proxy.api_keys' priorities); null: one below the lowest priority in use, so every interactive request is admitted ahead of any batch line", json_schema_extra=LIVE)
    max_attempts: int = Field(3, ge=1, description="tries of one line that the instances refused as busy (429, 503), broke off (502, 504) or never answered before the line fails (error attempts_exhausted in the error file); an answer the proxy gave because no slot was free counts as no try. 3: a passing fault is retried, a line that breaks an instance is not retried for ever", json_schema_extra=LIVE)
    slots_per_instance: int | Literal["auto"] = Field("auto", description="the requests one instance runs at once, of which batch lines take what interactive requests leave (less proxy.reserved_slots; and one slot kept free while interactive traffic is recent: batch.quiet_after): auto: its model's proxy.max_in_flight_per_instance, else the --max-num-seqs of its vllm.args, else vLLM's CPU default (128), so an idle instance is kept full with batch lines; a pooling model (embeddings, scores) without an admission limit twice that: it answers in one engine step, so lines queued in vLLM make an interactive request wait one step, and keep its engine from idling between steps", json_schema_extra=LIVE)

    quiet_after: float = Field(30.0, ge=0, description="seconds after a model's latest interactive request during which one slot of each of its instances stays free of batch lines for the next one, and lines hold no more than batch.beside_interactive of the slots; after them batch lines take every slot and as many again wait in vLLM's queue (without an admission limit), and an interactive request that finds no slot stops the youngest lines on its instance (sent again later, costing them no attempt). 30: the pause between two messages of a conversation keeps the slot; 0: batch lines always take every slot free", json_schema_extra=LIVE)
    beside_interactive: float = Field(0.125, ge=0, le=1, description="the share of each instance's slots batch lines may hold while its model's interactive traffic is recent (batch.quiet_after): on a CPU every running line's next token shares the engine step a chat's first token waits for, so the fewer lines beside the chats, the nearer their time to first token stays to its unloaded value, and the slower the batch runs while they go on (docs/batch.md measures both). At least one line an instance unless 0 (no new line until the model is quiet: a batch then waits as long as the chats go on); 1: every slot but the one kept. 0.125: 2 lines beside the chats of an instance of 16 slots", json_schema_extra=LIVE)

    @field_validator("max_file_bytes", "max_total_bytes")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        if isinstance(value, int):
            if value < 1:
                raise ValueError("must be at least 1 byte")
            return value
        parse_bytes(value)  # (checked here, read by bytes_of)
        return value

    @field_validator("slots_per_instance")
    @classmethod
    def _slots(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, or auto")
        return value


class _ModelKeys(_Section):
    """The checks of the keys a model is given by: the top level's and each entry of models:."""

    @field_validator("model", check_fields=False)
    @classmethod
    def _expand_home(cls, value: str) -> str:
        # a local directory under the home folder; vLLM would take "~/..." for a hub name
        return os.path.expanduser(value) if value.startswith("~") else value

    @field_validator("aliases", check_fields=False)
    @classmethod
    def _aliases(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not alias or alias != alias.strip():
                raise ValueError(f"{alias!r} is not a name clients can send: give it a non-empty name without leading or trailing spaces")
        return value

    @field_validator("instances", check_fields=False)
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, or auto")
        return value


class ModelConfig(_ModelKeys):
    """One entry of `models:`: a model the fleet serves (vsup/config/fleet.py reads them)."""

    model: str = Field(..., min_length=1, examples=["/srv/models/chat"], description="local model directory or hub name, as `vllm serve` takes it", json_schema_extra=relaunch())
    served_model_name: str | None = Field(None, description='the name clients send as "model" for it (unique in the fleet); null: the model path/name itself', json_schema_extra=relaunch())
    aliases: list[str] = Field(default_factory=list, description='more names clients may send as "model" for it (names they already use), each unique in the fleet like served_model_name; vLLM serves them as further served names (--served-model-name), /v1/models lists each as a model of its own, answers carry served_model_name', json_schema_extra=relaunch())
    instances: int | Literal["auto"] = Field("auto", description="a number, or auto: one per NUMA node of its share", json_schema_extra=relaunch(plan="instances"))
    share: float | None = Field(None, gt=0, le=1, description="the fraction of the usable physical cores its instances get, e.g. 0.25; null: placement.cores_per_instance x instances when both are set, else an equal share of what the others leave", json_schema_extra=relaunch())
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="its placement keys; a key written here replaces the top-level placement's for this model (the machine-wide memory_reserve_gib, reserve_cores, launcher, efficiency_cores only at the top level)")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="its vLLM keys (command, venv, args, env, access_log), each replacing the top-level one (a list or mapping whole); listen and the ports only at the top level")
    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="how the proxy picks among its instances and admits its requests: policy, affinity_prefix_chars, affinity_load_factor, max_in_flight_per_instance, reserved_slots, queue_max, queue_timeout (the rest of proxy is the one front door: top level only)")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="its warm-up (health.warmup for this model): a generating model gets a completion, a pooling model an embedding (/v1/embeddings) or pooling (/pooling) request")



class VsupConfig(_ModelKeys):
    model: str = Field(..., min_length=1, examples=["/srv/models/my-model"], description="local model directory or hub name, as `vllm serve` takes it; a local path (/, ./, ~) must exist (with `models:`, each entry names its own and this key is left out)", json_schema_extra=basic('REQUIRED: a local model folder or a hub name', relaunch()))
    served_model_name: str | None = Field(None, description='the name clients send as "model"; null: the model path/name itself', json_schema_extra=basic('the name clients send as "model"; null: the model itself', relaunch()))
    aliases: list[str] = Field(default_factory=list, description='more names clients may send as "model" for it (names they already use); vLLM serves them as further served names (--served-model-name), /v1/models lists each as a model of its own, answers carry served_model_name (with `models:`, each entry has its own)', json_schema_extra=relaunch())
    instances: int | Literal["auto"] = Field("auto", description="a number, or auto: one per NUMA node with usable cores", json_schema_extra=basic('auto: one per NUMA node; or a number', relaunch(plan="instances")))
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="how cores and memory are split among the instances (docs/placement.md)", json_schema_extra=basic('how cores and memory are split (docs/placement.md)'))
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="vsup runs `<launcher> <command> <model> --uds <socket> <args>` (listen: tcp: `--host 127.0.0.1 --port P`)", json_schema_extra=basic('how each instance runs `vllm serve`'))
    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="the one OpenAI-compatible endpoint in front of the ready instances", json_schema_extra=basic('the one OpenAI-compatible endpoint'))
    health: HealthConfig = Field(default_factory=HealthConfig, description="when an instance counts as ready, and when as unhealthy", json_schema_extra=basic('when an instance counts as ready, or as sick'))
    restart: RestartConfig = Field(default_factory=RestartConfig, description="restart policy after a failure (any exit, code 0 too; a stalled start or one past the startup timeout; failed warm-up; unhealthy), and the memory watchdog", json_schema_extra=basic('the memory watchdog (docs/supervisor.md)'))
    start: StartConfig = Field(default_factory=StartConfig, description="how the instances start")
    stop: StopConfig = Field(default_factory=StopConfig, description="how the instances stop (vsup stopping, `vsup restart N`, a failure)")
    log: LogConfig = Field(default_factory=LogConfig, description="the instances' output and vsup's own log", json_schema_extra=basic("the instances' output"))
    control: ControlConfig = Field(default_factory=ControlConfig, description="where `vsup status`, `vsup restart` and `vsup reload` reach a running vsup")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="what vsup collects about each instance in the background (docs/metrics.md)")
    notify: NotifyConfig = Field(default_factory=NotifyConfig, description="systemd Type=notify (no-op outside systemd)")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="the OpenAI Batch API: batches of requests run durably on the capacity interactive traffic leaves (top level only: one store for every model)", json_schema_extra=basic("batch jobs below interactive traffic"))
    models: list[ModelConfig] | None = Field(None, min_length=1, description="several models behind the one endpoint (the second form below): each entry its model, served_model_name, instances, share, and the placement/vllm/proxy/warmup keys that differ from the top level; the proxy routes each request by its \"model\"; null: the one model of the top-level keys", json_schema_extra=relaunch())

    # Where each key was written (file and YAML tree), for error lines; not a key.
    _origin: str | None = PrivateAttr(None)
    _root: Any = PrivateAttr(None)
    # A model's view of a fleet (vsup/config/fleet.py): "models[1]", where its own keys are written.
    _prefix: str | None = PrivateAttr(None)



def bytes_of(value: int | str) -> int:
    """A size key's value (a number of bytes, or a size with a unit) in bytes."""
    return value if isinstance(value, int) else parse_bytes(value)


def parse_bytes(text: str) -> int:
    """ "6GiB", "500 MB", "1073741824" -> bytes (pydantic's ByteSize); ValueError naming what works."""
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        size = -1
    if size <= 0:
        raise ValueError('not a size in bytes: write a number and a unit, e.g. "6GiB", "500MB"')
    return size


def spare_base_port(cfg: VsupConfig) -> int:
    """Where replacements started beside their instance listen (vllm.spare_base_port)."""
    spare = cfg.vllm.spare_base_port
    return spare if spare is not None else cfg.vllm.base_port + SPARE_PORT_OFFSET


# dotted key -> how a change to it reaches a running vsup, for every key
RELOAD: dict[str, KeyReload] = reload_table(VsupConfig)


# --- loading ------------------------------------------------------------------------------------


def load_config(path: str | Path, *, require_model: bool = True) -> VsupConfig:
    """require_model=False: for commands that read only other sections (`vsup proxy --config`)."""
    path = Path(path)
    return parse_config(read_text(path), str(path), require_model=require_model)


def parse_config(text: str, origin: str = "<config>", *, require_model: bool = True,
                 only: tuple[tuple[str, str], ...] | None = None) -> VsupConfig:
    """`only`: check just these (section, key) pairs of the file, the rest at their defaults."""
    root, data = load_yaml(text, origin)
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of keys (model: ..., instances: ...), got {type(data).__name__}")
    if only is not None:
        parts: dict[str, dict] = {section: part for section, _ in only if isinstance(part := data.get(section), dict)}
        data = {section: {key: parts[section][key]} for section, key in only if key in parts.get(section, {})}
    if not require_model or only is not None:
        data.setdefault("model", "(not used)")
    if isinstance(data.get("models"), list) and "model" not in data:
        data = {**data, "model": FLEET_MODEL}  # each entry names its model (vsup/config/fleet.py)
    try:
        config = VsupConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(exc, root, origin)) from None
    config._origin, config._root = origin, root
    if config.models is not None:
        from vsup.config.fleet import check_fleet

        check_fleet(config)
    from vsup.config.admission import check_admission
    from vsup.config.names import check_names

    check_names(config)
    check_admission(config)
    return config


def load_control_keys(path: str | Path) -> VsupConfig:
    """Only what tells a client where the vsup run with this file listens (proxy.port,
    control.socket), checked; the rest of the file is the running vsup's to check (`vsup reload`
    of a broken file is refused there, and recorded). A file that is not YAML, or those two keys
    invalid: ConfigError — never a guess at another vsup's socket."""
    return parse_config(read_text(Path(path)), str(path), only=(("proxy", "port"), ("control", "socket")))
