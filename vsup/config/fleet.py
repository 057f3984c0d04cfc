"""The models a configuration serves, each as a single-model view of the file.

A file with `models:` is a fleet: each entry names its model and the placement / vllm / proxy /
warmup keys that differ from the top level. `models_of(cfg)` turns it into one `ModelView` per
entry, whose `config` is an ordinary single-model `VsupConfig` (the top level with the entry's
keys written over it), so everything that plans, launches, warms up or checks one model takes a
view unchanged. A file without `models:` is a fleet of one: its one view is the file itself.

What may differ per model is an allow-list (`PER_MODEL`); a machine-wide key in an entry is an
error naming it, as are top-level model keys beside `models:` and two models of the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

from vsup.config.loader import line_of, where
from vsup.config.schema import ModelConfig, VsupConfig
from vsup.errors import ConfigError, VsupError

# The keys of each section an entry of `models:` may set; the rest of each section is machine-wide
# (one reserve, one launcher, one way of listening, one front door).
PER_MODEL: dict[str, frozenset[str]] = {
    "placement": frozenset({"model_size_gib", "kvcache_gib", "overhead_gib", "housekeeping_core", "smt",
                            "cores_per_instance", "omp_threads", "membind", "nodes"}),
    "vllm": frozenset({"command", "venv", "args", "env", "preload", "access_log"}),
    "proxy": frozenset({"policy", "affinity_prefix_chars", "affinity_load_factor",
                        "max_in_flight_per_instance", "reserved_slots", "queue_max", "queue_timeout"}),
}
# Top-level keys that a file with `models:` leaves to its entries.
MODEL_KEYS = ("model", "served_model_name", "aliases", "instances")


@dataclass(frozen=True)
class ModelView:
    name: str  # what clients send as "model": served_model_name, else the model itself
    position: int  # its entry in models (0 for the single-model form)
    config: VsupConfig  # single-model: the top level with the entry's keys over it; models None
    key: str  # "models[1]": where its keys are written ("" for the single-model form)
    share: float | None = None  # models[i].share


def is_fleet(cfg: VsupConfig) -> bool:
    """The file has `models:` (even with one entry)."""
    return cfg.models is not None


def served_name(cfg: VsupConfig | ModelConfig) -> str:
    return cfg.served_model_name or cfg.model


def models_of(cfg: VsupConfig) -> tuple[ModelView, ...]:
    """One view per model, in the file's order."""
    if cfg.models is None:
        return (ModelView(served_name(cfg), 0, cfg, ""),)
    return tuple(_view(cfg, entry, i) for i, entry in enumerate(cfg.models))


def view_of(cfg: VsupConfig, name: str) -> ModelView:
    """The model clients call `name`; VsupError naming the served ones otherwise."""
    views = models_of(cfg)
    for view in views:
        if view.name == name:
            return view
    raise VsupError(f"no model {name!r} in this configuration; it serves {', '.join(repr(v.name) for v in views)}")


def _view(cfg: VsupConfig, entry: ModelConfig, position: int) -> ModelView:
    def over(section: str, top):  # the top-level section with the keys the entry wrote
        own = getattr(entry, section)
        return top.model_copy(update={key: getattr(own, key) for key in own.model_fields_set})

    health = cfg.health.model_copy(update={"warmup": over("warmup", cfg.health.warmup)})
    config = cfg.model_copy(update={
        "model": entry.model, "served_model_name": entry.served_model_name, "aliases": entry.aliases,
        "instances": entry.instances,
        "placement": over("placement", cfg.placement), "vllm": over("vllm", cfg.vllm),
        "proxy": over("proxy", cfg.proxy), "health": health, "models": None,
    })
    key = f"models[{position}]"
    config._origin, config._root, config._prefix = cfg._origin, cfg._root, key
    return ModelView(served_name(entry), position, config, key, entry.share)


def check_fleet(cfg: VsupConfig) -> None:
    """What a file with `models:` must also hold to: ConfigError naming the key and its line."""
    assert cfg.models is not None
    problems = []
    for key in MODEL_KEYS:
        if line_of(cfg, key) is not None:
            problems.append(f"{where(cfg, key)}: set it in each entry of models (beside models: the top level names no model)")
    names: dict[str, int] = {}
    for i, entry in enumerate(cfg.models):
        for section, allowed in PER_MODEL.items():
            for key in sorted(getattr(entry, section).model_fields_set - allowed):
                problems.append(f"{where(cfg, f'models[{i}].{section}.{key}')}: is machine-wide: set it in the "
                                f"top-level {section} (an entry may set {', '.join(sorted(allowed))})")
        name = served_name(entry)
        if name in names:
            written = "served_model_name" if entry.served_model_name is not None else "model"
            problems.append(f"{where(cfg, f'models[{i}].{written}')}: {name!r} is also the name of "
                            f"models[{names[name]}]: clients choose a model by its name, so each needs its own "
                            "(set served_model_name)")
        names.setdefault(name, i)
    if problems:
        raise ConfigError("; ".join(problems))
