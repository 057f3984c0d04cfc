"""What every export of a fleet (a config with `models:`) shares: a model's name as a DNS label
part or a file name (its slug), and the front proxy's configuration, which routes by model."""

from __future__ import annotations

import re

from vsup.batch.slots import slots_of
from vsup.config.schema import VsupConfig, parse_config
from vsup.export import keys, yamltext


def model_slug(name: str) -> str:
    """A served model name as a DNS label's part: lower case, runs of anything else as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def front_proxy(cfg: VsupConfig) -> dict:
    """The proxy section of a front's configuration: the user's, its keys by environment only."""
    return keys.without_secrets(cfg.proxy.model_dump(mode="json", exclude_defaults=True), keys.key_vars(cfg.proxy))


def upstream_slots(view: VsupConfig, instances: int, cfg: VsupConfig) -> int:
    """What one upstream vsup of `instances` instances of the model `view` runs at once: the
    front's batch share of it (batch.slots_per_instance counts per upstream at a front)."""
    return instances * slots_of(view, cfg.batch)


def front_batch(cfg: VsupConfig, slots: int) -> dict:
    """The batch section of a front's configuration (the front holds the batch store, `vsup proxy
    --batch-dir`; the nodes' vsups have theirs off): the user's keys but `enabled` and `dir` (the
    command line says where), and slots_per_instance as the most one upstream vsup runs at once
    (`slots`: upstream_slots, from the nodes' own slots per instance): at a front the key counts
    per upstream, and a node's busy answers lower it while its interactive traffic takes its
    slots (proxy/batch_share.py)."""
    batch = cfg.batch.model_dump(mode="json", exclude_defaults=True)
    batch.pop("enabled", None)
    batch.pop("dir", None)
    batch["slots_per_instance"] = max(2, slots)
    return batch


def front_config_text(cfg: VsupConfig, note: str, batch: dict | None = None) -> str:
    """The front's configuration: the proxy (its keys by environment only, export/keys.py; the
    front checks them and passes the client's key on, `vsup proxy --forward-key`, to each model's
    vsups, which check the same keys), health (no warm-up: the front has no instances), and each
    model's balancer keys (models[i].proxy), for `vsup proxy --config`; `batch`: its batch
    section (front_batch), None: the Batch API is off."""
    assert cfg.models is not None
    data: dict = {"proxy": {**front_proxy(cfg), "host": "0.0.0.0"}}
    health = cfg.health.model_dump(mode="json", exclude_defaults=True)
    health.pop("warmup", None)
    if health:
        data["health"] = health
    if batch is not None:
        data["batch"] = batch
    data["models"] = []
    for entry in cfg.models:
        item: dict = {"model": entry.model}
        if entry.served_model_name is not None:
            item["served_model_name"] = entry.served_model_name
        if entry.aliases:  # the front routes them to the model too
            item["aliases"] = list(entry.aliases)
        own = {key: getattr(entry.proxy, key) for key in sorted(entry.proxy.model_fields_set)}
        if own:
            item["proxy"] = own
        data["models"].append(item)
    text = yamltext.comment(note) + yamltext.dump(data)
    parse_config(text, "the front proxy's configuration", require_model=False)  # it must load as written
    return text
