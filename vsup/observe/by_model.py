"""The instances of a status JSON grouped by the model they serve (pure), for the status JSON's
`models` list and the views (`vsup status`, `vsup top`, the /status page, systemd's STATUS=).

An instance entry's `model` is its plan's served model name; an entry without one (a status from
a vsup before models) counts as one unnamed model, so an older status reads as a fleet of one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The order states are counted in (a state not listed comes after these, by name).
STATE_ORDER = ("ready", "unhealthy", "starting", "warming", "backoff", "stopping", "failed", "stopped")


def summarize(instances: Iterable[Mapping[str, Any]], order: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One entry per model that has an instance: name, its instances' indexes, how many are ready,
    the count of each state, requests in flight. Models in `order` first (the config's order), then
    the others as their first instance comes."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for e in instances:
        groups.setdefault(str(e.get("model") or ""), []).append(e)
    rank = {name: i for i, name in enumerate(order)}
    names = sorted(groups, key=lambda name: rank.get(name, len(rank)))  # stable: the rest keep their order
    return [_entry(name, groups[name]) for name in names]


def _entry(name: str, entries: list[Mapping[str, Any]]) -> dict[str, Any]:
    states: dict[str, int] = {}
    for e in entries:
        state = str(e.get("state"))
        states[state] = states.get(state, 0) + 1
    ranked = {s: i for i, s in enumerate(STATE_ORDER)}
    return {
        "name": name,
        "instances": [e.get("index") for e in entries],
        "ready": states.get("ready", 0),
        "states": dict(sorted(states.items(), key=lambda item: (ranked.get(item[0], len(ranked)), item[0]))),
        "in_flight": sum(int(e.get("in_flight") or 0) for e in entries),
    }


def models(status: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    """The status's `models` list; computed from its instances when it has none (an older vsup)."""
    found = status.get("models")
    if isinstance(found, list):
        return [m for m in found if isinstance(m, Mapping)]
    return summarize(status.get("instances") or ())


def several(status: Mapping[str, Any]) -> bool:
    """Whether the views name models: only when there is more than one (a fleet of one looks as before)."""
    return len(models(status)) > 1


def tokens_per_s(instances: Iterable[Mapping[str, Any]]) -> float:
    """Generated tokens/s summed over `instances` (the collector's last-minute rate; unknown counts 0)."""
    return sum((e.get("metrics") or {}).get("generation_tokens_per_s") or 0.0 for e in instances)


def of_model(status: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    """The status's instances that serve `name`."""
    return [e for e in status.get("instances") or () if str(e.get("model") or "") == name]


def ready_text(model: Mapping[str, Any]) -> str:
    """"chat 2/3 ready" (the name as written: callers escape it for where it goes)."""
    return f"{model.get('name')} {model.get('ready', 0)}/{len(model.get('instances') or ())} ready"


def not_ready(model: Mapping[str, Any]) -> str:
    """"1 starting, 1 failed": the states other than ready; "" when all are ready."""
    return ", ".join(f"{count} {state}" for state, count in (model.get("states") or {}).items() if state != "ready")
