"""How a change to each key reaches a running vsup (`vsup reload`, SIGHUP): the one table.

Every key of vsup/config/schema.py names its reload class in its Field
(`json_schema_extra=LIVE`, `relaunch(plan=...)`, `fixed(why)`, ...); `reload_table` reads them
back. What `vsup reload` applies, refuses and reports (vsup/supervisor/rollout.py), which planner
setting comes from which key (vsup/config/planning.py) and the reload tag on every line of the
configuration reference (vsup/config/example.py) all come from that table, so none of them can
say one thing while the code does another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel
from pydantic.config import JsonDict


class Reload(StrEnum):
    LIVE = "live"  # a running vsup applies it at once
    RELAUNCH = "relaunch"  # re-planned: instances whose launch changes are replaced one at a time
    FIXED = "fixed"  # built into what vsup holds open: a reload that changes it is refused
    START = "start"  # read when `vsup run` starts: a reload takes the file, the value waits for the next start


# What each class means, as the configuration reference's legend and `vsup reload` word it.
MEANING = {
    Reload.LIVE: "a running vsup applies a change at once",
    Reload.RELAUNCH: "a reload replaces, one at a time, the instances whose command, environment, CPUs or memory nodes change",
    Reload.FIXED: "a reload that changes it is refused: restart vsup",
    Reload.START: "read when `vsup run` starts; a reload leaves the change for the next start",
}

LIVE: JsonDict = {"reload": Reload.LIVE.value}
START: JsonDict = {"reload": Reload.START.value}


def relaunch(plan: str | None = None) -> JsonDict:
    """`plan`: the PlanSettings field the key sets, so the planner's errors name the key."""
    return {"reload": Reload.RELAUNCH.value, **({"plan": plan} if plan else {})}


def fixed(why: str) -> JsonDict:
    """`why`: what holds the value, as the refusal says it."""
    return {"reload": Reload.FIXED.value, "why": why}


@dataclass(frozen=True)
class KeyReload:
    key: str  # dotted: proxy.connect_timeout
    reload: Reload
    why: str | None = None  # fixed: what holds it
    plan: str | None = None  # the PlanSettings field it sets


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def reload_table(model: type[BaseModel], prefix: str = "") -> dict[str, KeyReload]:
    """dotted key -> its reload class, for every key (leaf field) of `model`; ValueError for a key
    that names none (a new key must say how it reloads)."""
    table: dict[str, KeyReload] = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section(field.annotation)
        if section is not None:
            table.update(reload_table(section, f"{key}."))
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "reload" not in extra:
            raise ValueError(f"{key}: every config key needs a reload class (json_schema_extra=LIVE, relaunch(), ...)")
        why, plan = extra.get("why"), extra.get("plan")
        table[key] = KeyReload(key, Reload(str(extra["reload"])), str(why) if why else None, str(plan) if plan else None)
    return table


def flat(data: Mapping[str, Any], table: Mapping[str, KeyReload], prefix: str = "") -> dict[str, Any]:
    """A config dump as dotted key -> value, down to the table's keys (vllm.env is one value)."""
    out: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and key not in table:
            out.update(flat(value, table, f"{key}."))
        else:
            out[key] = value
    return out


def changed(old: BaseModel, new: BaseModel, table: Mapping[str, KeyReload]) -> dict[str, tuple[Any, Any]]:
    """Every key whose value differs: key -> (old, new), in key order."""
    a, b = flat(old.model_dump(mode="json"), table), flat(new.model_dump(mode="json"), table)
    return {key: (a.get(key), b.get(key)) for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)}
