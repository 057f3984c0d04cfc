"""Changing a running fleet one instance at a time: `vsup reload` (SIGHUP, `systemctl reload`) and
`vsup restart all --rolling`.

A reload compares what each instance runs with what the re-read, re-planned configuration would
run (`Launch`: argv, env, CPUs, memory nodes). Unchanged instances keep running; the others become
`Step`s, carried out one at a time, in index order:

- replace, **beside**: when the new instance's CPUs are used by no running instance (and the
  memory of both fits the plan's budgets), it starts in its other slot (under vllm.listen: unix
  the socket `<i>b.sock` or `<i>.sock`, under tcp the port `spare_base_port + i` or
  `base_port + i`, whichever the old one does not use), is warmed up and joins the rotation;
  then the old one is drained and stopped. The number of ready instances never drops.
- replace, **in place**: otherwise the old one is drained and stopped first (its cores are needed),
  then the new one starts in the same slot. One instance fewer is ready meanwhile.

The record and the lines `vsup reload` prints name a slot as it is: `socket 0b.sock`, or
`port 8200` under vllm.listen: tcp (`at`).
- add: a new index starts (warm-up included) and joins the rotation; remove: drained and stopped.

A step whose new instance does not become ready (its first start fails) ends the rollout: what
was done stays done, the rest is not touched, and the record says why. A rolling restart is a
rollout whose steps replace every instance with itself (in place: a drain, a restart, a warm-up).

The pure parts (`launch_changes`, `surge_room`, `fixed_changes`, `live_changes`,
`unapplied_changes`) are tested without processes; `Rollout` runs the steps against a `Fleet`
(fleet.py).
"""

from __future__ import annotations

import difflib
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vsup.config.fleet import is_fleet, models_of
from vsup.config.reloading import MEANING, Reload, changed
from vsup.config.schema import RELOAD, VsupConfig
from vsup.proxy.address import socket_path
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.ports import port_is_free
from vsup.supervisor.states import State
from vsup.topology.cpulist import format_list
from vsup.topology.plan_model import InstancePlan, Plan, format_gib

if TYPE_CHECKING:
    from vsup.supervisor.fleet import Members

logger = logging.getLogger("vsup.rollout")

# How each key reloads is the table in vsup/config/schema.py (RELOAD); these are views of it.
# Keys a running vsup cannot change: a reload that changes one is refused, naming it.
FIXED_KEYS = {key: entry.why or "" for key, entry in RELOAD.items() if entry.reload is Reload.FIXED}
# Sections whose changes reach the instances through the plan and their command lines.
LAUNCH_SECTIONS = tuple(dict.fromkeys(key.split(".")[0] for key, entry in RELOAD.items() if entry.reload is Reload.RELAUNCH))


@dataclass(frozen=True)
class Launch:
    """What an instance runs: a change in any of these replaces it."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cpus: tuple[int, ...]
    nodes: tuple[int, ...]

    @classmethod
    def of(cls, argv: Sequence[str], env: Mapping[str, str], plan: InstancePlan) -> Launch:
        return cls(tuple(argv), tuple(sorted(env.items())), tuple(plan.cpus), tuple(plan.nodes))


def launch_changes(old: Launch, new: Launch) -> list[str]:
    """What differs, in words ([] when nothing does)."""
    changes = []
    if old.cpus != new.cpus:
        changes.append(f"CPUs {format_list(old.cpus) or '-'} -> {format_list(new.cpus) or '-'}")
    if old.nodes != new.nodes:
        changes.append(f"memory nodes {format_list(old.nodes) or '-'} -> {format_list(new.nodes) or '-'}")
    if old.argv != new.argv:
        removed: list[str] = []
        added: list[str] = []
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old.argv, b=new.argv, autojunk=False).get_opcodes():
            if tag != "equal":
                removed += old.argv[i1:i2]
                added += new.argv[j1:j2]
        words = ([f"-{' '.join(removed)}"] if removed else []) + ([f"+{' '.join(added)}"] if added else [])
        changes.append(_clip(f"command line {' '.join(words)}"))
    if old.env != new.env:
        before, after = dict(old.env), dict(new.env)
        names = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        changes.append(_clip(f"environment {', '.join(names)}"))
    return changes


def surge_room(new: InstancePlan, live: Iterable[InstancePlan], plan: Plan) -> tuple[bool, str]:
    """Can `new` run beside every instance in `live` for a while? Its CPUs must be free (two
    OpenMP teams on one core would slow both), and the memory of all of them must fit the plan's
    node budgets and the cgroup limit. (True, why) or (False, why not)."""
    live = list(live)
    busy = set().union(*(set(p.cpus) for p in live)) if live else set()
    clash = busy & set(new.cpus)
    if clash:
        return False, f"its CPUs {format_list(clash)} are in use"
    demand: dict[int, int] = defaultdict(int)
    for p in [*live, new]:
        for node in p.nodes:
            demand[node] += p.memory_bytes // len(p.nodes)
    budgets = {m.node: m.budget_bytes for m in plan.memory}
    for node in new.nodes:
        budget = budgets.get(node, 0)
        if budget and demand[node] > budget:
            return False, (f"node {node}'s memory budget {format_gib(budget)} does not hold both "
                           f"({format_gib(demand[node])})")
    if plan.memory_limit is not None:
        total = sum(p.memory_bytes for p in [*live, new])
        if total > plan.memory_limit.budget_bytes:
            return False, f"the cgroup memory budget {format_gib(plan.memory_limit.budget_bytes)} does not hold both"
    return True, f"its CPUs {format_list(new.cpus)} are free"


def config_changes(old: VsupConfig, new: VsupConfig) -> list[tuple[str, str, tuple[Any, Any]]]:
    """Every changed key as (the key as written, its key in RELOAD, (old, new)). Between two fleet
    files each model present in both is compared through its views (vsup.config.fleet), so a key
    written in an entry reads `models[1].proxy.policy` and reloads as that key does; a model
    added or removed is the plan's business (reload_steps), not a key's."""
    fleets = is_fleet(old) and is_fleet(new)
    out = [(key, key, values) for key, values in changed(old, new, RELOAD).items() if not (fleets and key == "models")]
    if not fleets:
        return out
    top = {key for key, _, _ in out}
    before = {view.name: view for view in models_of(old)}
    for view in models_of(new):
        was = before.get(view.name)
        if was is None:
            continue
        for key, values in changed(was.config, view.config, RELOAD).items():
            if key not in top and key != "models":
                written = key.removeprefix("health.") if key.startswith("health.warmup.") else key
                out.append((f"{view.key}.{written}", key, values))
    return out


def at(url: str, port: int) -> str:
    """How rollout lines name an instance's slot: `socket 0b.sock` (vllm.listen: unix), or `port 8200`."""
    path = socket_path(url)
    return f"socket {path.rsplit('/', 1)[-1]}" if path is not None else f"port {port}"


def _on_tcp(url: str) -> bool:
    """The slot is a TCP port, which something else may hold (a Unix socket's folder is vsup's own)."""
    return socket_path(url) is None


def fixed_changes(old: VsupConfig, new: VsupConfig) -> list[str]:
    """Changes a running vsup cannot apply, one phrase each."""
    return [f"{shown} ({_short(a)} -> {_short(b)}): {FIXED_KEYS[key]}"
            for shown, key, (a, b) in config_changes(old, new) if key in FIXED_KEYS]


def live_changes(old: VsupConfig, new: VsupConfig) -> list[str]:
    """Changed keys a running vsup applies at once, without touching an instance's process."""
    return [shown for shown, key, _ in config_changes(old, new) if RELOAD[key].reload is Reload.LIVE]


def unapplied_changes(old: VsupConfig, new: VsupConfig) -> list[str]:
    """Changed keys a reload takes but a running vsup does not act on, one phrase each (start.mode:
    read when vsup starts)."""
    return [f"{shown} ({MEANING[RELOAD[key].reload]})" for shown, key, _ in config_changes(old, new)
            if RELOAD[key].reload is Reload.START]


def _short(value: Any) -> str:
    return _clip(repr(value) if isinstance(value, str) else str(value), 40)


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---- the record `vsup status` shows ----------------------------------------------------------------

@dataclass
class Step:
    index: int
    action: str  # replace | add | remove
    why: str  # what changed
    plan: InstancePlan | None = field(default=None, repr=False)  # the new plan (None: remove)
    how: str = ""  # beside / in place, and why
    state: str = "pending"  # pending | running | done | failed | skipped
    detail: str = ""
    new: Instance | None = field(default=None, repr=False)  # the instance this step started

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index, "action": self.action, "why": self.why, "how": self.how,
                                 "state": self.state, "detail": self.detail}
        if self.new is not None:
            entry["new"] = {"name": self.new.name, "port": self.new.port, "at": at(self.new.url, self.new.port),
                            "pid": self.new.pid, "state": self.new.state.value}
        return entry


@dataclass
class Record:
    kind: str  # reload | rolling restart
    trigger: str  # what asked for it: "vsup reload", "SIGHUP", "vsup restart --rolling"
    started_at: float
    state: str = "running"  # running | done | failed | rejected | interrupted
    finished_at: float | None = None
    error: str | None = None
    steps: list[Step] = field(default_factory=list)
    unchanged: list[int] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # settings applied live
    not_applied: list[str] = field(default_factory=list)  # changed settings a running vsup does not act on

    def finish(self, state: str, now: float, error: str | None = None) -> None:
        self.state, self.finished_at, self.error = state, now, error
        for step in self.steps:
            if step.state == "pending":
                step.state = "skipped"

    def summary(self) -> str:
        counts: dict[str, int] = defaultdict(int)
        for step in self.steps:
            if step.state == "done":
                counts[step.action] += 1
        done = ", ".join(f"{n} {'replaced' if a == 'replace' else a + 'ed' if a == 'add' else 'removed'}"
                         for a, n in counts.items()) or "no instance changed"
        return f"{done}, {len(self.unchanged)} unchanged"

    def to_json(self, started: float, now: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "trigger": self.trigger,
            "state": self.state,
            "started": round(self.started_at - started, 3),
            "took": round((self.finished_at or now) - self.started_at, 3),
            "error": self.error,
            "step": sum(s.state in ("done", "failed", "running") for s in self.steps),
            "steps": [s.to_json() for s in self.steps],
            "unchanged": list(self.unchanged),
            "applied": list(self.applied),
            "not_applied": list(self.not_applied),
        }


# ---- carrying the steps out --------------------------------------------------------------------------

class Fleet(Protocol):
    """What a rollout needs of the running instances (fleet.Fleet)."""

    instances: Members  # the fleet by index (holes allowed): what the proxy's rotation and `vsup status` follow
    @property
    def plan(self) -> Plan:
        """The plan in force (the new one, during a reload)."""

    def plan_of(self, inst: Instance) -> InstancePlan: ...

    def live_plans(self) -> list[InstancePlan]:
        """The plans of every instance that has (or is about to have) processes."""

    def launch(self, plan: InstancePlan, port: int) -> tuple[list[str], dict[str, str]]:
        """argv and env of `plan` on `port`."""

    def spare_port(self, index: int) -> int: ...

    def address(self, plan: InstancePlan, port: int) -> str:
        """Where `plan` listens in the slot `port` (vsup.proxy.address: its socket, or the port)."""

    def create(self, plan: InstancePlan, port: int) -> Instance:
        """A new instance (not started), its driver running, its backend known to the proxy."""

    def adopt(self, inst: Instance, plan: InstancePlan) -> None:
        """`inst` now runs `plan` (a replacement in place)."""

    def swap(self, index: int, inst: Instance | None) -> None:
        """Put `inst` at `index` of the fleet (None: `index` leaves it; the others keep theirs)."""

    def forget(self, inst: Instance) -> None:
        """A stopped instance leaves: its driver, backend and log go."""


class Rollout:
    def __init__(self, fleet: Fleet, record: Record) -> None:
        self.fleet = fleet
        self.record = record

    async def run(self) -> bool:
        """Carry out every step, one at a time; False (and the record says why) at the first that
        fails. Cancelling (vsup stopping) leaves the instances to the shutdown."""
        for step in self.record.steps:
            step.state = "running"
            logger.info("%s: step %d/%d: %s instance %d (%s)", self.record.kind, self.record.steps.index(step) + 1,
                        len(self.record.steps), step.action, step.index, step.why)
            match step.action:
                case "replace":
                    ok = await self._replace(step)
                case "add":
                    ok = await self._add(step)
                case "remove":
                    ok = await self._remove(step)
                case _:
                    raise ValueError(f"rollout step {step.index}: unknown action {step.action!r}")
            step.state = "done" if ok else "failed"
            if not ok:
                logger.warning("%s stopped at instance %d: %s", self.record.kind, step.index, step.detail)
                return False
        return True

    async def _replace(self, step: Step) -> bool:
        fleet = self.fleet
        old = fleet.instances[step.index]
        plan = step.plan
        assert plan is not None
        slots = (plan.port, fleet.spare_port(step.index))
        beside, why = surge_room(plan, fleet.live_plans(), fleet.plan)
        # which slot the old one is in, by its address: under vllm.listen: unix a socket, which a
        # changed base_port does not move
        now = next((port for port in slots if fleet.address(plan, port) == old.url), None)
        other = slots[1] if now == slots[0] else slots[0]
        other_at = at(fleet.address(plan, other), other)
        if beside and _on_tcp(fleet.address(plan, other)) and not port_is_free(other):
            beside, why = False, f"its other port {other} is taken"
        if beside:
            step.how = f"beside, on {other_at}: {why}"
            new = fleet.create(plan, other)
            step.new = new
            new.start()
            if not await self._ready(new):
                await new.stop()
                fleet.forget(new)
                step.detail = (f"the new instance {new.name} did not become ready ({new.last_exit}); it was stopped, "
                               f"and instance {old.name} keeps running its old command")
                return False
            fleet.swap(step.index, new)
            await old.retire(f"replaced by {new.name} on {at(new.url, new.port)} ({self.record.kind})")
            fleet.forget(old)
            step.detail = f"{new.name} ready on {at(new.url, new.port)}; the old one drained and stopped"
            return True
        port = now if now is not None else plan.port
        step.how = f"in place, on {at(fleet.address(plan, port), port)}: {why}"
        if now is not None:
            argv, env = fleet.launch(plan, port)
            old.relaunch(argv, env)
            fleet.adopt(old, plan)
            step.new = old
            state = await old.recycle(f"{self.record.kind}: {step.why}")
            if state is not State.READY:
                step.detail = self._not_ready(old)
                return False
            step.detail = f"ready again as pid {old.pid}"
            return True
        await old.retire(f"{self.record.kind}: replaced on {at(fleet.address(plan, port), port)}")
        fleet.forget(old)
        return await self._start_in_slot(step, plan, port)

    async def _add(self, step: Step) -> bool:
        plan = step.plan
        assert plan is not None
        tcp = _on_tcp(self.fleet.address(plan, plan.port))
        port = plan.port if not tcp or port_is_free(plan.port) else self.fleet.spare_port(step.index)
        step.how = f"on {at(self.fleet.address(plan, port), port)}"
        return await self._start_in_slot(step, plan, port)

    async def _start_in_slot(self, step: Step, plan: InstancePlan, port: int) -> bool:
        """A new instance in the step's slot of the fleet, started on `port`; True once it is ready."""
        new = self.fleet.create(plan, port)
        self.fleet.swap(step.index, new)
        step.new = new
        new.start()
        if not await self._ready(new):
            step.detail = self._not_ready(new)
            return False
        step.detail = f"ready on {at(new.url, port)}"
        return True

    async def _remove(self, step: Step) -> bool:
        old = self.fleet.instances[step.index]
        await old.retire(f"{self.record.kind}: removed ({step.why})")
        self.fleet.swap(step.index, None)
        self.fleet.forget(old)
        step.detail = "drained and stopped"
        return True

    @staticmethod
    async def _ready(inst: Instance) -> bool:
        """Wait until a new instance is ready, or its first run failed, or it was halted."""
        halts = inst.halts
        await inst.wait_for(lambda: inst.state is State.READY or inst.halts > halts
                            or (inst.failures > 0 and inst.state is not State.STOPPING))
        return inst.state is State.READY

    @staticmethod
    def _not_ready(inst: Instance) -> str:
        if inst.state is State.STOPPED:
            return f"instance {inst.name} was stopped before it was ready"
        return (f"instance {inst.name} did not become ready ({inst.last_exit}); it is {inst.state.value} "
                "and keeps trying under the restart policy")
