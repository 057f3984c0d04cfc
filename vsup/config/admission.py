"""Each model's admission limit, read from its config: proxy.max_in_flight_per_instance, where
`max_num_seqs` means the --max-num-seqs its vllm.args pass (pure; the proxy gets the number)."""

from __future__ import annotations

from collections.abc import Sequence

from vsup.config.loader import where
from vsup.config.schema import ProxyConfig, VsupConfig
from vsup.errors import ConfigError

FLAG = "--max-num-seqs"


def flag_int(args: Sequence[str], flag: str = FLAG) -> int | None:
    """`--flag N` or `--flag=N` in vLLM's args (the last one wins, as in argparse); None: absent or not a number."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def instance_limit(view: VsupConfig) -> int | None:
    """Requests one instance of this (single-model) config is sent at a time; None: no limit.
    ConfigError naming the key when `max_num_seqs` has no --max-num-seqs to read, or reserved_slots
    leaves no slot."""
    proxy = view.proxy
    limit = proxy.max_in_flight_per_instance
    if limit == "max_num_seqs":
        seqs = flag_int(view.vllm.args)
        if seqs is None or seqs < 1:
            raise ConfigError(f"{where(view, 'proxy.max_in_flight_per_instance')}: max_num_seqs reads {FLAG} N from "
                              f"vllm.args, which sets none: add [{FLAG}, \"8\"] there, or give a number")
        limit = seqs
    if not limit:
        return None
    assert isinstance(limit, int)
    if proxy.reserved_slots >= limit:
        raise ConfigError(f"{where(view, 'proxy.reserved_slots')}: {proxy.reserved_slots} must be less than the "
                          f"{limit} requests per instance of proxy.max_in_flight_per_instance: the other priorities need a slot")
    return limit


def resolved(view: VsupConfig) -> ProxyConfig:
    """The model's proxy section with max_in_flight_per_instance as a number (or None)."""
    limit = instance_limit(view)
    if limit == view.proxy.max_in_flight_per_instance:
        return view.proxy
    return view.proxy.model_copy(update={"max_in_flight_per_instance": limit})


def check_admission(cfg: VsupConfig) -> None:
    """Every model's limit readable (parse_config runs it: the error at load time, not at start)."""
    from vsup.config.fleet import models_of

    for view in models_of(cfg):
        instance_limit(view.config)
