"""The `vllm serve` / `api_server` command line, as far as the fake needs it.

Both forms are accepted:
    python -m tests.fakevllm serve MODEL --host H --port P [--served-model-name N ...] [...]
    python -m tests.fakevllm --model MODEL --host H --port P [...]
    python -m tests.fakevllm serve MODEL --uds PATH [...]   (host and port are then ignored, like vLLM)
Flags the fake does not use (`--dtype float32`, ...) are accepted and ignored, like a real vLLM
would accept them, so a supervisor's argv runs unchanged. `--enforce-eager` / `--no-enforce-eager`
(vLLM's BooleanOptionalAction: never a value, the last one wins) decide whether the fake's start
compiles and its steps run compiled (FAKE_VLLM_COMPILE, FAKE_VLLM_COMPILED_SPEEDUP).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

USAGE = ("usage: fakevllm serve MODEL [--host H] [--port P | --uds PATH] [--served-model-name NAME ...]"
         " [--lora-modules name=path|JSON ...] [--flag VALUE ...]")
_NUMBER = re.compile(r"^-\d")
_BOOLEAN = {"--disable-uvicorn-access-log", "--enforce-eager", "--no-enforce-eager"}
_KNOWN = ("--model", "--host", "--port", "--uds", "--served-model-name", "--max-model-len", "--max-num-seqs",
          "--disable-access-log-for-endpoints", "--lora-modules", "--kv-events-config")
_MANY = {"--served-model-name", "--lora-modules"}  # nargs="+" in vLLM


class UsageError(Exception):
    """A bad command line; the message is one line that names the argument."""


@dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry (vLLM's LoRAModulePath): `name=path` or a JSON object."""

    name: str
    path: str
    base_model_name: str | None = None


def _lora_module(item: str) -> LoraModule:
    # vLLM's LoRAParserAction: JSON when it starts with "{", else exactly one "name=path"
    if item.startswith("{"):
        try:
            given = json.loads(item)
            return LoraModule(str(given["name"]), str(given["path"]), given.get("base_model_name"))
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"Invalid JSON format for --lora-modules: {item}") from None
    name, eq, path = item.partition("=")
    if not eq or not name or "=" in path:
        raise UsageError(f"Invalid format for --lora-modules: {item}. Expected format 'name=path' or JSON.")
    return LoraModule(name, path)


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str = "127.0.0.1"  # vLLM defaults to all interfaces; the fake stays on loopback
    port: int = 8000
    uds: str | None = None  # a Unix socket path: bound instead of host:port (vLLM's --uds)
    served_model_names: tuple[str, ...] = ()
    lora_modules: tuple[LoraModule, ...] = ()
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    # vLLM's uvicorn access log: off with --disable-uvicorn-access-log, or without the paths of
    # --disable-access-log-for-endpoints (one comma-separated string, matched without the query)
    access_log: bool = True
    access_log_excluded: frozenset[str] = frozenset()
    ignored: tuple[str, ...] = field(default=())
    kv_events: dict | None = None  # --kv-events-config with enable_kv_cache_events: the publisher's settings
    enforce_eager: bool = False  # --enforce-eager (vLLM's default: off, so it compiles)

    @property
    def names(self) -> tuple[str, ...]:
        """Names clients may put in "model": the served names, else the model itself."""
        return self.served_model_names or (self.model,)


def _is_value(token: str) -> bool:
    return not token.startswith("-") or bool(_NUMBER.match(token))


def _int(flag: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{flag} {value!r} is not an integer ({low}..{high})") from None
    if not low <= number <= high:
        raise UsageError(f"{flag} {number} is out of range ({low}..{high})")
    return number


def parse_args(argv: list[str]) -> ServeArgs:
    tokens = list(argv)
    positional: list[str] = []
    if tokens and tokens[0] == "serve":
        tokens.pop(0)
    options: dict[str, list[str]] = {}
    ignored: list[str] = []
    enforce_eager = False
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("-h", "--help"):
            raise UsageError(USAGE)
        if not token.startswith("-") or _NUMBER.match(token):
            positional.append(token)
            i += 1
            continue
        key, eq, inline = token.partition("=")
        key = key.replace("_", "-")
        if eq:
            values = [inline]
            i += 1
        elif key in _MANY:
            j = i + 1
            while j < len(tokens) and _is_value(tokens[j]):
                j += 1
            values = tokens[i + 1 : j]
            i = j
        elif key in _BOOLEAN:  # store_true in vLLM: never takes the next word
            values = []
            i += 1
        elif i + 1 < len(tokens) and _is_value(tokens[i + 1]):
            values = [tokens[i + 1]]
            i += 2
        else:
            values = []
            i += 1
        if key in _KNOWN:
            if not values:
                raise UsageError(f"{key} needs a value")
            options[key] = values
        elif key in ("--enforce-eager", "--no-enforce-eager"):
            if values:
                raise UsageError(f"{key}: ignored explicit argument {values[0]!r}")
            enforce_eager = key == "--enforce-eager"
        elif key in _BOOLEAN:
            options[key] = []
        else:
            ignored.append(key)
    model = positional[0] if positional else (options.get("--model") or [None])[0]
    if model is None:
        raise UsageError("no model given: use `serve MODEL` or `--model MODEL`")
    if len(positional) > 1:
        raise UsageError(f"unexpected argument {positional[1]!r} (only one MODEL may be given)")
    return ServeArgs(
        model=model,
        host=options.get("--host", ["127.0.0.1"])[0],
        port=_int("--port", options["--port"][0], 1, 65535) if "--port" in options else 8000,
        uds=options["--uds"][0] if "--uds" in options else None,
        served_model_names=tuple(options.get("--served-model-name", ())),
        lora_modules=tuple(_lora_module(item) for item in options.get("--lora-modules", ())),
        max_model_len=(
            _int("--max-model-len", options["--max-model-len"][0], 1, 1 << 24)
            if "--max-model-len" in options
            else 2048
        ),
        max_num_seqs=(
            _int("--max-num-seqs", options["--max-num-seqs"][0], 1, 1 << 20) if "--max-num-seqs" in options else None
        ),
        access_log="--disable-uvicorn-access-log" not in options,
        access_log_excluded=frozenset(
            p.strip() for p in options.get("--disable-access-log-for-endpoints", [""])[0].split(",") if p.strip()),
        ignored=tuple(ignored),
        kv_events=_kv_events(options["--kv-events-config"][0]) if "--kv-events-config" in options else None,
        enforce_eager=enforce_eager,
    )


def _kv_events(value: str) -> dict | None:
    try:
        config = json.loads(value)
    except ValueError:
        raise UsageError(f"--kv-events-config: not JSON: {value!r}") from None
    if not isinstance(config, dict):
        raise UsageError(f"--kv-events-config: expected a JSON object, got {value!r}")
    return config if config.get("enable_kv_cache_events") else None
