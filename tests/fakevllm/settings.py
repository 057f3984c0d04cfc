"""Faults and knobs, read once from FAKE_VLLM_* environment variables (see docs/fakevllm.md).

A bad value is a one-line error naming the variable and what would work, never a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class SettingsError(Exception):
    """A FAKE_VLLM_* variable with a bad value; the message is one line."""


@dataclass(frozen=True)
class Faults:
    name: str | None = None  # FAKE_VLLM_NAME: instance name in X-Fake-Instance (default: port)
    start_delay: float = 0.0  # seconds of "model load" before the port opens
    crash_at_start: int | None = None  # exit code instead of binding
    sigill_at_start: bool = False  # die by SIGILL before anything else, as vLLM's x86 build on a CPU without AVX2
    crash_after: int | None = None  # crash when the Nth completion request arrives
    crash_code: int = 1
    crash_mid_stream: bool = False  # ... after crash_after_tokens tokens of that request instead
    crash_after_tokens: int = 3
    hang_after: float | None = None  # seconds after ready: nothing is answered any more
    # stall: requests wait forever; block: the event loop is blocked; engine: the API server answers
    # (/health, /metrics, /v1/models) while every generation waits forever (a stalled EngineCore)
    hang_mode: str = "stall"
    health_fail_after: float | None = None  # seconds after ready: /health answers an error
    health_fail_status: int = 500
    ignore_sigterm: bool = False
    token_delay: float = 0.01
    first_token_delay: float = 0.0
    noise: float = 0.0  # lines per second to stdout and stderr
    long_line: int = 0  # bytes of one long line written once when ready
    status_503: bool = False
    events: str | None = None  # JSONL event log path
    child: bool = True  # spawn the EngineCore stand-in
    worker: bool = True  # ... and let it spawn a Worker stand-in
    shm: bool = True  # create /dev/shm/psm_* and sem.mp-* files
    exit_on_engine_death: bool = True  # like vLLM: EngineCore gone -> API server exits 0
    access_log: bool = True
    tokenize: bool = True  # False: no /tokenize, /detokenize routes (a server that is not vLLM's)
    max_num_seqs: int | None = None  # concurrent generations; more wait ("queued"), like --max-num-seqs
    grow_mib_per_s: float = 0.0  # resident memory the server adds per second once ready (a leak)
    prefill_delay: float = 0.0  # seconds per prompt token not in the prefix cache, one prefill at a time
    prefix_cache_blocks: int = 4096  # blocks of 16 tokens the prefix cache holds (LRU)
    # speed model (engine.py): batched steps whose length depends on threads, CPUs and LD_PRELOAD
    step_time: float | None = None  # seconds per step with one thread; None: per-request delays instead
    seq_cost: float = 0.0  # a step grows by this fraction per extra sequence in the batch
    saturate_threads: int | None = None  # more threads than this add nothing (memory bandwidth)
    busy_penalty: float = 1.0  # step factor when OpenMP takes every CPU of the mask
    preload_speedup: float = 1.0  # step divisor when LD_PRELOAD is set
    compiled_speedup: float = 1.0  # step divisor without --enforce-eager (torch.compile's faster decode)
    # a start in vLLM's phases, printing its lines (phases.py): ((name, seconds), ...)
    phases: tuple[tuple[str, float], ...] = ()
    compile_seconds: float | None = None  # without --enforce-eager: a compile phase of this many seconds after PHASES
    shards: int = 4  # checkpoint shards a `load` phase reports
    wait_line_every: float | None = None  # seconds between shm_broadcast's waiting lines in compile/stall phases


PHASE_NAMES = ("boot", "load", "profile", "compile", "stall")


def _phases(env: Mapping[str, str]) -> tuple[tuple[str, float], ...]:
    raw = env.get("FAKE_VLLM_PHASES", "").strip()
    if not raw:
        return ()
    phases = []
    for part in raw.split(","):
        name, _, seconds = part.strip().partition(":")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in PHASE_NAMES or not 0 <= value < float("inf"):
            raise SettingsError(f"FAKE_VLLM_PHASES={raw!r}: {part.strip()!r} is not NAME:SECONDS with NAME one of "
                                f"{', '.join(PHASE_NAMES)} (e.g. FAKE_VLLM_PHASES=load:2,compile:3)")
        phases.append((name, value))
    return tuple(phases)


def _number(env: Mapping[str, str], key: str, kind: type, low: float, example: str):
    raw = env.get(key, "").strip()
    if raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise SettingsError(f"{key}={raw!r} is not {'an integer' if kind is int else 'a number'} (e.g. {key}={example})") from None
    if value < low:
        raise SettingsError(f"{key}={raw!r} must be >= {low} (e.g. {key}={example})")
    return value


def _flag(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{key}={raw!r} is not a boolean (use 1 or 0)")


def load_faults(env: Mapping[str, str] = os.environ) -> Faults:
    def num(key: str, kind: type = float, low: float = 0, example: str = "2"):
        return _number(env, key, kind, low, example)

    def default(value, fallback):
        return fallback if value is None else value

    hang_mode = env.get("FAKE_VLLM_HANG_MODE", "").strip() or "stall"
    if hang_mode not in ("stall", "block", "engine"):
        raise SettingsError(f"FAKE_VLLM_HANG_MODE={hang_mode!r} is not one of: stall, block, engine")
    crash_at_start = num("FAKE_VLLM_CRASH_AT_START", int, 0, "1")
    if crash_at_start is not None and crash_at_start > 255:
        raise SettingsError(f"FAKE_VLLM_CRASH_AT_START={crash_at_start} is not an exit code (0..255)")
    crash_code = default(num("FAKE_VLLM_CRASH_CODE", int, 0, "1"), 1)
    if crash_code > 255:
        raise SettingsError(f"FAKE_VLLM_CRASH_CODE={crash_code} is not an exit code (0..255)")
    health_status = default(num("FAKE_VLLM_HEALTH_FAIL_STATUS", int, 400, "503"), 500)
    if health_status > 599:
        raise SettingsError(f"FAKE_VLLM_HEALTH_FAIL_STATUS={health_status} is not an HTTP error status (400..599)")
    return Faults(
        name=env.get("FAKE_VLLM_NAME") or None,
        start_delay=default(num("FAKE_VLLM_START_DELAY"), 0.0),
        crash_at_start=crash_at_start,
        sigill_at_start=_flag(env, "FAKE_VLLM_SIGILL_AT_START", False),
        crash_after=num("FAKE_VLLM_CRASH_AFTER", int, 1, "3"),
        crash_code=crash_code,
        crash_mid_stream=_flag(env, "FAKE_VLLM_CRASH_MID_STREAM", False),
        crash_after_tokens=default(num("FAKE_VLLM_CRASH_AFTER_TOKENS", int, 0, "3"), 3),
        hang_after=num("FAKE_VLLM_HANG_AFTER"),
        hang_mode=hang_mode,
        health_fail_after=num("FAKE_VLLM_HEALTH_FAIL_AFTER"),
        health_fail_status=health_status,
        ignore_sigterm=_flag(env, "FAKE_VLLM_IGNORE_SIGTERM", False),
        token_delay=default(num("FAKE_VLLM_TOKEN_DELAY", example="0.01"), 0.01),
        first_token_delay=default(num("FAKE_VLLM_FIRST_TOKEN_DELAY", example="0.5"), 0.0),
        noise=default(num("FAKE_VLLM_NOISE", example="100"), 0.0),
        long_line=default(num("FAKE_VLLM_LONG_LINE", int, 0, "204800"), 0),
        status_503=_flag(env, "FAKE_VLLM_STATUS_503", False),
        events=env.get("FAKE_VLLM_EVENTS") or None,
        child=_flag(env, "FAKE_VLLM_CHILD", True),
        worker=_flag(env, "FAKE_VLLM_WORKER", True),
        shm=_flag(env, "FAKE_VLLM_SHM", True),
        exit_on_engine_death=_flag(env, "FAKE_VLLM_EXIT_ON_ENGINE_DEATH", True),
        access_log=_flag(env, "FAKE_VLLM_ACCESS_LOG", True),
        tokenize=_flag(env, "FAKE_VLLM_TOKENIZE", True),
        max_num_seqs=num("FAKE_VLLM_MAX_NUM_SEQS", int, 1, "4"),
        grow_mib_per_s=default(num("FAKE_VLLM_GROW_MIB_PER_S", example="20"), 0.0),
        prefill_delay=default(num("FAKE_VLLM_PREFILL_DELAY", example="0.001"), 0.0),
        prefix_cache_blocks=default(num("FAKE_VLLM_PREFIX_CACHE_BLOCKS", int, 0, "64"), 4096),
        step_time=num("FAKE_VLLM_STEP_TIME", example="0.02"),
        seq_cost=default(num("FAKE_VLLM_SEQ_COST", example="0.05"), 0.0),
        saturate_threads=num("FAKE_VLLM_SATURATE_THREADS", int, 1, "2"),
        busy_penalty=default(num("FAKE_VLLM_BUSY_PENALTY", low=1, example="1.5"), 1.0),
        preload_speedup=default(num("FAKE_VLLM_PRELOAD_SPEEDUP", low=1, example="1.2"), 1.0),
        compiled_speedup=default(num("FAKE_VLLM_COMPILED_SPEEDUP", low=1, example="1.5"), 1.0),
        phases=_phases(env),
        compile_seconds=num("FAKE_VLLM_COMPILE", example="3"),
        shards=default(num("FAKE_VLLM_SHARDS", int, 1, "4"), 4),
        wait_line_every=num("FAKE_VLLM_WAIT_LINE_EVERY", low=0.1, example="60"),
    )
