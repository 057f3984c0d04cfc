"""Checks of a loaded configuration that need more than its own keys: the file system (a local
model path must exist), the plan's instance count (ports), the plan's model size (restart.max_rss
as a multiple). `vsup plan`, `vsup run` and `vsup reload` run them (vsup/supervisor/preflight.py)."""

from __future__ import annotations

from pathlib import Path

from vsup.config.loader import quote, where
from vsup.config.schema import SPARE_PORT_OFFSET, VsupConfig, spare_base_port
from vsup.errors import ConfigError


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
        prefix = getattr(cfg, "_prefix", None)  # a fleet's model: name it and its own key
        model = f" ({where(cfg, 'model')})" if prefix else ""
        size = f"{prefix}.placement.model_size_gib" if prefix else "placement.model_size_gib"
        raise ConfigError(f"{where(cfg, 'restart.max_rss')}: {quote(cfg.restart.max_rss)} is a multiple of the planned memory, "
                          f"but the plan does not know the model's size{model} (a hub name, or no weight files found); set "
                          f'{size}, or give restart.max_rss in bytes, e.g. "6GiB"')
