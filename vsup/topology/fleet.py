"""Several models on one machine: the partition of its cores among them (pure), then each model
planned on its part by the single-model planner (vsup.topology.fleet_memory shares the memory).

1. The reserve (placement.reserve_cores, machine-wide) is taken once, where the single-model
   planner would take it for the whole machine (auto: one core when the fleet leaves one free).
2. Each model's demand in physical cores: `share` × the usable cores; else cores_per_instance
   (+ the housekeeping core) × instances when both are set; else an equal split of what the others
   leave, weighted by the instance counts given (auto counts as one), but never below what its
   instances need (water filling).
3. Models with placement.nodes first, then the largest demand first: a model takes whole free NUMA
   nodes while its demand covers one (the nodes closest to those it has, by the distance matrix;
   the first the largest), a model sized by what the others leave never more whole nodes than it
   has instances (then it stops: each instance has its node), a model with instances: auto no
   leftover under half a node (it would be an instance of its own); what it still needs comes from cores of a node another
   model also uses, best fit (the node with the fewest free cores that holds it), a model with
   cores_per_instance one instance at a time, so a small model (an embedding model of 2 cores)
   sits beside another one and every instance that fits in one node gets one node. Cores are
   whole: no physical core goes to two models.
4. Each model is planned on its cores alone (restricted), its instances numbered after the
   previous model's (merge); the memory of every node is budgeted over all of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from vsup.topology.cores import _closest_first, min_cores
from vsup.topology.cpulist import format_list
from vsup.topology.errors import PlanError, SettingError
from vsup.topology.fleet_memory import ModelPlanError, ModelSettingError, plan_models, summed_memory
from vsup.topology.model import Core, Machine
from vsup.topology.plan_model import (
    FleetModel,
    GiB,
    InstancePlan,
    Kept,
    ModelShare,
    NodeMemory,
    Plan,
    PlanSettings,
    format_ids,
    setting_error,
)
from vsup.topology.planner import _check_settings, plan

__all__ = ["Kept", "ModelPlanError", "ModelSettingError", "kept_of", "merge", "plan_fleet", "renumber", "restricted"]


# The reserve probe's instances: tiny, so that only cores decide where the reserve goes.
_PROBE = PlanSettings(model_size_bytes=1, kvcache_gib=1 / 1024, overhead_bytes=0, memory_reserve_bytes=0, launcher="none")


def restricted(machine: Machine, cpus: frozenset[int]) -> Machine:
    """`machine` as a process allowed only `cpus` would see it (as under a cpuset)."""
    cores = tuple(c for c in machine.cores if set(c.cpus) & cpus)
    cores = tuple(replace(c, cpus=tuple(x for x in c.cpus if x in cpus)) for c in cores)
    nodes = tuple(replace(n, usable_cpus=tuple(x for x in n.usable_cpus if x in cpus)) for n in machine.nodes)
    return replace(machine, cores=cores, nodes=nodes, cpus_usable=tuple(x for x in machine.cpus_usable if x in cpus))


@dataclass
class _Part:
    """One model's share while the partition is made."""

    model: FleetModel
    demand: int = 0
    why: str = ""
    cores: list[Core] = field(default_factory=list)
    whole: list[int | None] = field(default_factory=list)  # nodes it took whole
    kept: bool = False  # a reload keeps it where it runs (plan_fleet's keep)


def kept_of(running: Plan, models: Sequence[FleetModel]) -> dict[str, Kept]:
    """The models of `models` a reload finds running unchanged in `running` (same settings and
    share): their CPUs and KV cache, for plan_fleet's `keep`."""
    kept = {}
    for share in running.models:
        model = next((m for m in models if m.name == share.name), None)
        mine = running.of_model(share.name)
        if model is not None and mine and (model.settings, model.share) == (share.settings, share.share):
            kept[share.name] = Kept(frozenset(share.cpus), mine[0].kvcache_bytes, tuple(sorted(mine, key=lambda i: i.replica)))
    return kept


def plan_fleet(machine: Machine, models: Sequence[FleetModel], keep: Mapping[str, Kept] | None = None) -> Plan:
    """`keep` (a reload, kept_of): those models keep the CPUs and KV cache they run with when the
    CPUs are still theirs to take (usable, not reserved), and the others share what is left, so a
    model added, removed or resized beside them never moves them. When what is left cannot hold
    the others, the kept models sized by what others leave (no share, no cores_per_instance) are
    planned anew (a reload replaces them one instance at a time), then every model."""
    keep = dict(keep or {})
    fixed = {name: kept for name, kept in keep.items()
             if any(m.name == name and (m.share is not None or m.settings.cores_per_instance) for m in models)}
    tries = [keep, fixed] if fixed != keep else [keep]
    for held in (t for t in tries if t):  # each distinct non-empty keep once; the plan from scratch last, its error the answer
        try:
            return _plan_fleet(machine, models, held)
        except (ModelPlanError, ModelSettingError):
            continue
    return _plan_fleet(machine, models, {})


def _plan_fleet(machine: Machine, models: Sequence[FleetModel], keep: Mapping[str, Kept]) -> Plan:
    for m in models:
        try:
            _check_settings(m.settings)
        except SettingError as exc:
            raise ModelSettingError(m.name, exc) from None
    if len(models) == 1 and models[0].share is None and not keep:
        return _fleet_of_one(machine, models[0])
    warnings: list[str] = []
    reserved = _reserve(machine, models, warnings)
    pool = [c for c in machine.cores if c.cpus and not set(c.cpus) & reserved]
    held = _held(pool, models, keep)
    parts = _demands(models, len(pool), held, keep)
    _assign(machine, [c for c in pool if not any(c in cores for cores in held.values())], parts)
    planned = plan_models(machine, [(p.model, restricted(machine, frozenset(x for c in p.cores for x in c.cpus))) for p in parts])
    for i, p in enumerate(parts):  # a kept model's instances exactly as they run (summed_memory checks them with the rest)
        if p.kept and keep[p.model.name].instances:
            planned[i] = replace(planned[i], instances=tuple(replace(inst, index=inst.replica)
                                                             for inst in keep[p.model.name].instances))
    fleet = merge(list(zip(models, planned, strict=True)))
    memory, limit = summed_memory(machine, fleet, models[0].settings.memory_reserve_bytes, warnings)
    taken = {x for p in parts for c in p.cores for x in c.cpus}
    unused: dict[int, str] = dict(machine.unusable)
    for one in planned:
        unused.update((cpu, why) for cpu, why in one.unused_cpus if cpu in taken)
    for core in pool:
        if not set(core.cpus) & taken:
            unused.update((cpu, f"node {core.node}: in no model's share (each model's demand is met)") for cpu in core.cpus)
    idle = sorted(n for n in {c.node for c in pool} - {c.node for c in pool if set(c.cpus) & taken} if n is not None)
    if idle:
        warnings.append(f"node(s) {format_ids(idle)} idle: no model's demand reaches them; more instances (or instances: auto) "
                        "or a share would use them")
    for cpu in reserved:
        unused.pop(cpu, None)
    for name, one in zip((m.name for m in models), planned, strict=True):
        warnings.extend(f"{name}: {w}" for w in one.warnings)
    shares = tuple(replace(share, reason=_reason(pool, parts, i)) for i, share in enumerate(fleet.models))
    return replace(fleet, reserved_cpus=tuple(sorted(reserved)), unused_cpus=tuple(sorted(unused.items())),
                   warnings=tuple(dict.fromkeys(warnings)), memory=memory, memory_limit=limit, models=shares)


def _fleet_of_one(machine: Machine, model: FleetModel) -> Plan:
    """One model on the whole machine is the single-model plan."""
    try:
        one = plan(machine, model.settings)
    except SettingError as exc:
        raise ModelSettingError(model.name, exc) from None
    except PlanError as exc:
        raise ModelPlanError(model.name, None, str(exc)) from None
    instances = tuple(replace(inst, model=model.name, replica=inst.index) for inst in one.instances)
    cpus = tuple(sorted(x for inst in instances for x in inst.cpus))
    nodes = tuple(sorted({n for inst in instances for n in inst.cpu_nodes}))
    reason = f"the whole machine{f' (nodes {format_ids(nodes)})' if len(nodes) > 1 else ''}: the only model"
    share = ModelShare(model.name, model.settings, cpus, nodes, tuple(i.index for i in instances), reason)
    return replace(one, instances=instances, models=(share,))


def _count(s: PlanSettings) -> int | None:
    return s.instances if isinstance(s.instances, int) else None


def _reserve(machine: Machine, models: Sequence[FleetModel], warnings: list[str]) -> frozenset[int]:
    """The reserved CPUs: the single-model planner's choice for the whole machine (one instance per
    node, else one instance), for the fleet's count of reserved cores."""
    s = models[0].settings
    pool = [c for c in machine.cores if c.cpus]
    if s.reserve_cores == "auto":
        need = sum((_count(m.settings) or 1) * min_cores(m.settings) for m in models)
        count = 1 if len(pool) > need else 0
        if not count:
            warnings.append("no core reserved for vsup, the proxy and the OS: the models' instances take every usable core, "
                            "so they share them with everything else (fewer instances or cores_per_instance leave one free)")
    else:
        count = int(s.reserve_cores)
    if not count:
        return frozenset()
    probe = replace(_PROBE, reserve_cores=count, efficiency_cores=s.efficiency_cores)
    for instances in ("auto", 1):
        try:
            return frozenset(plan(machine, replace(probe, instances=instances)).reserved_cpus)
        except PlanError:
            continue
    raise ModelSettingError(models[0].name, setting_error("reserve_cores", count, f"the machine has {len(pool)} usable "
                                                          "physical cores: none is left for the models"))


def _held(pool: list[Core], models: Sequence[FleetModel], keep: Mapping[str, Kept]) -> dict[str, list[Core]]:
    """The pool's cores each kept model runs on, when every one of them is still in the pool."""
    held: dict[str, list[Core]] = {}
    for m in models:
        kept = keep.get(m.name)
        if kept is None:
            continue
        cores = [c for c in pool if set(c.cpus) & kept.cpus]
        if {x for c in cores for x in c.cpus} == set(kept.cpus):
            held[m.name] = cores
    return held


def _demands(models: Sequence[FleetModel], usable: int, held: Mapping[str, list[Core]] | None = None,
             keep: Mapping[str, Kept] | None = None) -> list[_Part]:
    parts = [_Part(m) for m in models]
    fixed, before = 0, list[str]()
    for p in parts:
        cores = (held or {}).get(p.model.name)
        if cores is not None:  # a model a reload keeps where it runs, with the KV cache it has
            kv = (keep or {})[p.model.name].kvcache_bytes if keep else None
            settings = p.model.settings
            if kv is not None and settings.kvcache_gib is None:
                settings = replace(settings, kvcache_gib=kv / GiB)
            p.model, p.cores, p.demand = replace(p.model, settings=settings), list(cores), len(cores)
            p.why, p.kept = "kept where it runs: the reload did not change it", True
            fixed += p.demand
            before.append(f"{p.model.name} ({p.demand})")
            continue
        s, share, count = p.model.settings, p.model.share, _count(p.model.settings)
        least = min_cores(s) * (count or 1)
        if share is not None:
            p.demand, p.why = round(share * usable), f"share {share:g} of {usable} usable cores"
            if p.demand < least:
                raise ModelPlanError(p.model.name, "share", f"{share:g} of the {usable} usable physical cores is {p.demand}, but "
                                     f"{count or 1} instance(s) need at least {least}; raise the share or give fewer instances")
            key = "share"
        elif s.cores_per_instance and count:
            p.demand = least
            p.why = f"{count} instance(s) × {s.cores_per_instance} core(s)" + (" + a housekeeping core" if s.housekeeping_core else "")
            key = "placement.cores_per_instance"
        else:
            continue
        if fixed + p.demand > usable:
            after = f" after {', '.join(before)}" if before else ""
            raise ModelPlanError(p.model.name, key, f"needs {p.demand} physical cores but only {usable - fixed} of the {usable} "
                                 f"usable are left{after}; lower the shares or the instances")
        fixed += p.demand
        before.append(f"{p.model.name} ({p.demand})")
    rest = [p for p in parts if not p.demand and not p.kept]
    left = usable - fixed
    minimum = {id(p): min_cores(p.model.settings) * (_count(p.model.settings) or 1) for p in rest}
    weights = {id(p): _count(p.model.settings) or 1 for p in rest}
    # an equal split, except that a model whose part would be below its instances' minimum gets that
    # minimum and the others split the rest (water filling)
    raised: set[int] = set()
    while True:
        open_ = [p for p in rest if id(p) not in raised]
        room = left - sum(minimum[i] for i in raised)
        low = [p for p in open_ if room * weights[id(p)] < minimum[id(p)] * sum(weights[id(q)] for q in open_)]
        if not low or room < 0:
            break
        raised |= {id(p) for p in low}
    open_ = [p for p in rest if id(p) not in raised]
    total = sum(weights[id(p)] for p in open_)
    extra = room - sum(room * weights[id(p)] // total for p in open_) if open_ else 0
    taken = list(before)
    for p in rest:
        w = weights[id(p)]
        if id(p) in raised:
            p.demand = minimum[id(p)]
        else:
            p.demand = room * w // total + (1 if extra > 0 else 0)
            extra -= 1
        weighted = " by instance count" if len({weights[id(q)] for q in rest}) > 1 else ""
        p.why = (f"an equal split{weighted} of the {left} cores the others leave" if len(rest) > 1 or fixed else "all usable cores")
        if id(p) in raised:
            p.why = f"its {_count(p.model.settings) or 1} instance(s)' minimum of the {left} cores the others leave"
        spare = left - sum(q.demand for q in rest if q.demand and q is not p)
        if p.demand < minimum[id(p)] or spare < p.demand:
            raise ModelPlanError(p.model.name, None, f"gets {max(0, min(p.demand, spare))} of the {left} physical cores the other "
                                 f"models leave ({usable} usable, {', '.join(taken) or 'none'} taken), but "
                                 f"{_count(p.model.settings) or 1} instance(s) need at least {minimum[id(p)]}; give the other "
                                 "models smaller shares, or this one fewer instances")
        taken.append(f"{p.model.name} ({p.demand})")
    return parts


def _assign(machine: Machine, pool: list[Core], parts: list[_Part]) -> None:
    """Step 3 of the module's docstring: each part's cores, taken from `pool`."""
    cutter = _Cutter(machine, pool)
    for i in sorted(range(len(parts)), key=lambda i: (parts[i].model.settings.nodes is None, -parts[i].demand, i)):
        if not parts[i].kept:
            cutter.give(parts[i])


class _Cutter:
    """The free cores of every node (node, L3 order) and who took the others."""

    def __init__(self, machine: Machine, pool: list[Core]) -> None:
        self.machine = machine
        self.free: dict[int | None, list[Core]] = defaultdict(list)
        for core in sorted(pool, key=lambda c: (-1 if c.node is None else c.node, -1 if c.l3 is None else c.l3, c.id)):
            self.free[core.node].append(core)
        self.size = {n: len(cores) for n, cores in self.free.items()}
        closest: list[int | None] = list(_closest_first(machine))
        self.chain = [n for n in closest if n in self.free] + [n for n in self.free if n not in closest]
        self.distance = _distances(machine)
        self.owners: dict[int | None, list[str]] = defaultdict(list)

    def _near(self, p: _Part, n: int | None) -> tuple[int, int]:
        mine = {c.node for c in p.cores}
        return (min((self.distance(n, m) for m in mine), default=0), self.chain.index(n))

    def _take(self, p: _Part, n: int | None, k: int) -> None:
        p.cores.extend(self.free[n][:k])
        del self.free[n][:k]
        self.owners[n].append(p.model.name)

    def give(self, p: _Part) -> None:
        s, count = p.model.settings, _count(p.model.settings)
        free, size = self.free, self.size
        allowed = self.chain if s.nodes is None else self._listed(p)
        need = p.demand
        sized = s.cores_per_instance is not None  # instance by instance, below
        # a share is what was asked for; a split of what the others leave stops at a node per instance
        most = len(self.chain) if p.model.share is not None or count is None else count
        while not sized and need > 0 and len(p.whole) < most:
            whole = [n for n in allowed if free[n] and len(free[n]) == size[n] <= need]
            if not whole:
                break
            # next to its nodes; the first (and on ties) the largest: the reserve's node is left to small models
            n = min(whole, key=lambda n: (self._near(p, n)[0], -size[n], self.chain.index(n)))
            need -= size[n]
            p.whole.append(n)
            self._take(p, n, size[n])
        if p.whole and len(p.whole) == most == count:
            need = 0  # every instance has a node of its own
        if p.whole and count is None and need < min(size[n] for n in p.whole) / 2:
            need = 0  # instances: auto would give so few cores an instance of their own
        per = min_cores(s) if sized else need
        while need >= (per if sized else 1) and any(free[n] for n in allowed):
            piece = min(per, need)
            need -= piece
            fits = [n for n in allowed if len(free[n]) >= piece]
            if fits:
                self._take(p, min(fits, key=lambda n: (len(free[n]), self._near(p, n))), piece)
                continue
            if sized and count is None:
                break  # instances: auto is one per node: an instance straddling nodes would be two
            for n in sorted(allowed, key=lambda n: (-len(free[n]), self._near(p, n))):  # no node holds it: straddle
                k = min(piece, len(free[n]))
                if k:
                    self._take(p, n, k)
                    piece -= k
        least = min_cores(s) * (count or 1)
        if len(p.cores) < least:
            raise ModelPlanError(p.model.name, None if s.nodes is None else "placement.nodes",
                                 f"gets {len(p.cores)} physical core(s), but {count or 1} instance(s) need at least {least}: "
                                 f"{self._taken(allowed)}; give the other models smaller shares or this one fewer instances")

    def _listed(self, p: _Part) -> list[int | None]:
        """The nodes of placement.nodes, checked: known, with usable cores, not all taken."""
        assert p.model.settings.nodes is not None
        nodes: list[int | None] = list(dict.fromkeys(p.model.settings.nodes))
        with_cpus = sorted(n for n in self.size if n is not None)
        known = {node.id for node in self.machine.nodes}
        for n in nodes:
            if n not in known:
                raise ModelSettingError(p.model.name, setting_error(
                    "nodes", None, f"unknown node {n}; this machine's nodes with usable CPUs are {format_ids(with_cpus)}"))
            if n not in self.size:
                raise ModelSettingError(p.model.name, setting_error(
                    "nodes", None, f"node {n} has no usable CPUs; nodes with usable CPUs are {format_ids(with_cpus)}"))
        need = min_cores(p.model.settings) * (_count(p.model.settings) or 1)
        if sum(len(self.free[n]) for n in nodes) < need:
            raise ModelSettingError(p.model.name, setting_error("nodes", None, f"{self._taken(nodes)}; "
                                                                f"{p.model.name} needs {need} core(s) there"))
        listed = f"placement.nodes {format_ids(n for n in nodes if n is not None)}"
        # a model sized by what the others leave is sized by its nodes instead
        p.why = listed if p.why.endswith("leave") or p.why == "all usable cores" else f"{listed}; {p.why}"
        return nodes

    def _taken(self, nodes: Sequence[int | None]) -> str:
        words = []
        for n in nodes:
            who = " and ".join(dict.fromkeys(self.owners.get(n, []))) or "nobody"
            if not self.free[n]:
                words.append(f"node {n} is all taken by {who} ({self.size[n]} cores)")
            else:
                words.append(f"node {n} has {len(self.free[n])} of {self.size[n]} cores free")
        return "; ".join(words)


def _distances(machine: Machine) -> Callable[[int | None, int | None], int]:
    column = {n.id: position for position, n in enumerate(machine.nodes)}

    def distance(a: int | None, b: int | None) -> int:
        if a is None or b is None:
            return 0 if a == b else 1000
        row = machine.node(a).distances
        return row[column[b]] if len(row) == len(column) else abs(a - b)

    return distance


def _reason(pool: list[Core], parts: list[_Part], i: int) -> str:
    p = parts[i]
    size: dict[int | None, int] = defaultdict(int)
    for core in pool:
        size[core.node] += 1
    mine: dict[int | None, int] = defaultdict(int)
    for core in p.cores:
        mine[core.node] += 1
    whole = [n for n in mine if mine[n] == size[n] and n is not None]
    words = [f"node{'s' if len(whole) > 1 else ''} {format_list(whole)} whole"] if whole else []
    for n in mine:
        if n in whole:
            continue
        others = [q.model.name for q in parts if q is not p and any(c.node == n for c in q.cores)]
        where = "without a NUMA node" if n is None else f"of node {n}"
        words.append(f"{mine[n]} core{'s' if mine[n] > 1 else ''} {where}" + (f" beside {', '.join(others)}" if others else ""))
    took = f"; it takes {len(p.cores)} of them" if p.why.endswith("leave") and len(p.cores) < p.demand else ""
    return f"{' + '.join(words)} ({p.why}{took})"


def merge(plans: Sequence[tuple[FleetModel, Plan]]) -> Plan:
    """Per-model plans as one: instances numbered in order, their ports from the first model's
    base port, every node's memory summed."""
    instances: list[InstancePlan] = []
    shares: list[ModelShare] = []
    memory: dict[int, NodeMemory] = {}
    base_port = plans[0][0].settings.base_port
    for model, one in plans:
        first = len(instances)
        for replica, inst in enumerate(one.instances):
            index = first + replica
            instances.append(replace(inst, index=index, port=base_port + index, model=model.name, replica=replica))
        for node in one.memory:
            moved = tuple(first + i for i in node.instances)
            old = memory.get(node.node)
            memory[node.node] = node if old is None and not moved else replace(
                node, demand_bytes=(old.demand_bytes if old else 0) + node.demand_bytes,
                instances=(old.instances if old else ()) + moved)
        cpus = tuple(sorted(x for inst in one.instances for x in inst.cpus))
        nodes = tuple(sorted({n for inst in one.instances for n in inst.cpu_nodes}))
        shares.append(ModelShare(model.name, model.settings, cpus, nodes, tuple(range(first, len(instances))), "",
                                 model.share))
    head = plans[0][1]
    return replace(head, instances=tuple(instances), memory=tuple(memory[n] for n in sorted(memory)),
                   warnings=tuple(w for _, p in plans for w in p.warnings), models=tuple(shares))


def renumber(fleet_plan: Plan, running: Mapping[tuple[str, int], int]) -> Plan:
    """`fleet_plan` with the indexes a running fleet already uses (a reload): an instance whose
    (model, replica) runs keeps its index (so its socket, port, log and name); the others take
    the lowest indexes nobody keeps. Ports follow the indexes."""
    kept = {key: index for key, index in running.items()
            if any((inst.model, inst.replica) == key for inst in fleet_plan.instances)}
    taken = set(kept.values())
    free = (i for i in range(len(fleet_plan.instances) + len(taken) + 1) if i not in taken)
    base = fleet_plan.settings.base_port
    mapping: dict[int, int] = {}
    for inst in fleet_plan.instances:
        key = (inst.model, inst.replica)
        mapping[inst.index] = kept[key] if key in kept else next(free)
    instances = tuple(sorted((replace(inst, index=mapping[inst.index], port=base + mapping[inst.index])
                              for inst in fleet_plan.instances), key=lambda inst: inst.index))
    memory = tuple(replace(node, instances=tuple(sorted(mapping[i] for i in node.instances))) for node in fleet_plan.memory)
    models = tuple(replace(m, instances=tuple(sorted(mapping[i] for i in m.instances))) for m in fleet_plan.models)
    return replace(fleet_plan, instances=instances, memory=memory, models=models)
