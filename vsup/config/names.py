"""The names each model answers to, and the rule that each belongs to one model.

A client picks a model by the name it sends as "model": a model's served name
(served_model_name, else the model itself), its aliases, and the LoRA adapters its vllm.args
load (`--lora-modules name=path` or vLLM's JSON form) — also any `--served-model-name` written
in its vllm.args. The proxy routes a name only to the instances of the model that owns it
(vsup/proxy/routing.py), so two models claiming one name would split its requests between
them: `check_names` refuses such a file, naming both entries ("FILE:LINE: key").

`model_names(cfg)` is what the proxy is given: each claimed name (alias or adapter) -> its
owner; the served names themselves are the models' keys already.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from vsup.config.fleet import ModelView, models_of
from vsup.config.loader import where
from vsup.config.schema import VsupConfig
from vsup.errors import ConfigError

LORA_OPTION = "--lora-modules"
SERVED_OPTION = "--served-model-name"

ALIAS = "alias"  # every instance of the model serves it (vLLM: a further served name)
ADAPTER = "adapter"  # a LoRA adapter (or a served name) the model's vllm.args give its instances


@dataclass(frozen=True)
class Name:
    """A name a model answers to besides its served name."""

    model: str  # the owning model's served name
    kind: str  # ALIAS or ADAPTER


def option_values(args: Sequence[str], option: str) -> Iterator[tuple[int, str]]:
    """(index in args, value) of every value `option` takes in `args`, as argparse reads an
    option with nargs="+": `--opt a b c` up to the next option, or `--opt=a`."""
    taking = False
    for index, arg in enumerate(args):
        if arg == option:
            taking = True
        elif arg.startswith(option + "="):
            taking = False
            yield index, arg[len(option) + 1:]
        elif taking and arg.startswith("-") and not arg[1:2].isdigit():
            taking = False
        elif taking:
            yield index, arg


def lora_name(item: str) -> str | None:
    """The adapter name of one --lora-modules value, read as vLLM reads it (LoRAParserAction:
    `name=path` when it has a '=' and no ',', else a JSON object with "name"); None: vLLM refuses it."""
    if "=" in item and "," not in item:
        return item.split("=", 1)[0]
    try:
        value = json.loads(item)
    except ValueError:
        return None
    name = value.get("name") if isinstance(value, dict) else None
    return name if isinstance(name, str) else None


@dataclass(frozen=True)
class _Claim:
    name: str
    model: str  # the claiming model's served name
    kind: str  # "served" (its served name), ALIAS or ADAPTER
    at: str  # where the file writes it: "FILE:LINE: key"


def _claims(view: ModelView) -> Iterator[_Claim]:
    cfg = view.config
    written = "served_model_name" if cfg.served_model_name is not None else "model"
    yield _Claim(view.name, view.name, "served", where(cfg, written))
    for i, alias in enumerate(cfg.aliases):
        yield _Claim(alias, view.name, ALIAS, where(cfg, f"aliases[{i}]"))
    for index, item in option_values(cfg.vllm.args, LORA_OPTION):
        name = lora_name(item)
        if name:
            yield _Claim(name, view.name, ADAPTER, where(cfg, f"vllm.args[{index}]"))
    for index, item in option_values(cfg.vllm.args, SERVED_OPTION):
        if item != view.name:
            yield _Claim(item, view.name, ADAPTER, where(cfg, f"vllm.args[{index}]"))


_WHAT = {"served": "the served name", ALIAS: "an alias", ADAPTER: "a LoRA adapter (or served name) in vllm.args"}


def check_names(cfg: VsupConfig) -> None:
    """Each name claimed once in the file: ConfigError naming both places of each name claimed
    twice. (Two models' served names alike are check_fleet's: it says so first.)"""
    seen: dict[str, _Claim] = {}
    problems = []
    for view in models_of(cfg):
        for claim in _claims(view):
            first = seen.setdefault(claim.name, claim)
            if first is claim or (first.kind == claim.kind == "served"):
                continue
            whose = "its own" if first.model == claim.model else f"of the model {first.model!r}"
            problems.append(
                f"{claim.at}: {claim.name!r} ({_WHAT[claim.kind]} of the model {claim.model!r}) is also {_WHAT[first.kind]} "
                f"{whose} ({first.at}): clients choose a model by its name, so each name belongs to one model: rename one")
    if problems:
        raise ConfigError("; ".join(problems))


def model_names(cfg: VsupConfig) -> dict[str, Name]:
    """Every alias and vllm.args adapter of the file -> the model that owns it (for the proxy)."""
    out: dict[str, Name] = {}
    for view in models_of(cfg):
        for claim in _claims(view):
            if claim.kind != "served":
                out.setdefault(claim.name, Name(claim.model, claim.kind))
    return out
