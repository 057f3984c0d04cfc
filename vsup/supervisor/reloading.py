"""Changing a running vsup: `vsup reload` (and SIGHUP) and `vsup restart --rolling`, one at a time.

A reload re-reads the configuration file and re-plans it with `vsup run`'s checks (`read_config`,
in a thread), applies at once what needs no process (`Changes.apply_settings`), and
turns the rest into rollout steps (`reload_steps`: replace, add, remove) that rollout.py carries
out one instance at a time. Refused with VsupError — and nothing changed — while vsup stops or
another rollout runs, and for an invalid file, an impossible plan or a key that cannot change
while vsup runs, or a TCP port a moved or new instance needs is taken (reload_ports.py: checked
before anything is stopped). `Changes` holds the one rollout (its record is what `vsup status` shows).

SIGHUPs are coalesced (`Changes.signal`): one that arrives while a reload or rolling restart runs
marks one follow-up reload, which re-reads the file as it is once that change ends — N signals
meanwhile make one follow-up, and the status says `pending`, never `done` for a file that changed
since. A `vsup reload` over the control socket while a change runs is refused instead ("a reload
is running"): its client is there to read that and ask again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vsup.batch.folder import default_dir
from vsup.batch.slots import slots_of
from vsup.config import proxy_routes
from vsup.config.admission import resolved
from vsup.config.fleet import is_fleet, models_of
from vsup.config.names import model_names
from vsup.config.schema import ProxyConfig, VsupConfig, load_config
from vsup.errors import VsupError
from vsup.supervisor import rollout
from vsup.supervisor.backoff import RestartPolicy
from vsup.supervisor.launch import build_command, model_config
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.ports import port_is_free
from vsup.supervisor.reload_ports import busy_port
from vsup.supervisor.states import State
from vsup.supervisor.warmup import warmup_kind
from vsup.topology.cpulist import format_list
from vsup.topology.errors import PlanError, TopologyError
from vsup.topology.fleet import renumber
from vsup.topology.plan_model import Plan

if TYPE_CHECKING:
    from vsup.supervisor.supervisor import Supervisor

logger = logging.getLogger("vsup.supervisor")


def model_proxies(config: VsupConfig) -> dict[str, ProxyConfig]:
    """Each served model's proxy section (its policy, its admission limit as a number), for the
    proxy's routing by model."""
    return {view.name: resolved(view.config) for view in models_of(config)}


def batch_slots(config: VsupConfig) -> dict[str, int]:
    """Each served model's slots per instance for the batch lines' share (vsup/batch/slots.py)."""
    return {view.name: slots_of(view.config, config.batch, warmup_kind(view.config.vllm.args, view.config.model) != "completion")
            for view in models_of(config)}


def batch_dir(config: VsupConfig, environ: Mapping[str, str]) -> Path | None:
    """The batch store's folder (batch.dir, else the state folder's batches/); None: batch.enabled is false."""
    if not config.batch.enabled:
        return None
    return config.batch.dir if config.batch.dir is not None else default_dir(config.proxy.port, environ)


def read_config(path: str, fsroot: str, environ: Mapping[str, str], running: VsupConfig,
                current: Mapping[int, int] | None = None, own: Mapping[int, str] | None = None,
                members: Mapping[tuple[str, int], int] | None = None, running_plan: Plan | None = None) -> tuple[VsupConfig, Plan]:
    """The re-read configuration and its plan, checked as `vsup run` checks them (runs in a
    thread: it reads sysfs, the model's files, and may run numactl), and the TCP ports the plan
    moves instances to (`current`: the fleet's port by index; `own`: port -> name of every
    instance of this vsup; see reload_ports.py). `members`: (model, replica) -> index of the
    running fleet: the plan keeps those indexes (topology.fleet.renumber), so a model's instances
    keep their sockets, ports and logs whatever happens to the models around them; `running_plan`:
    the plan in force, so a model the file does not change keeps its CPUs and KV cache (and so
    its processes) while models are added, removed or resized beside it."""
    from vsup.supervisor.leftovers import describe_port_holder
    from vsup.supervisor.preflight import check_programs, checked_plan

    config = load_config(path)
    # as ProxyServer refuses at start: admin routes only behind an admin key (the key may come from the environment)
    proxy_routes.require_key(config.proxy.admin_routes, bool(environ.get("VSUP_API_KEY") or config.proxy.api_key
                                                             or any(key.admin for key in config.proxy.api_keys)))
    _machine, plan = checked_plan(config, fsroot, environ, runs_here=True, running=running_plan)
    if members:
        plan = renumber(plan, members)
    for inst in plan.instances:
        argv, _env = build_command(inst, model_config(config, inst), environ)
        check_programs(argv, len(inst.argv))
    fixed = rollout.fixed_changes(running, config)
    if fixed:
        raise VsupError(f"{path}: {'; '.join(fixed)}; a running vsup cannot change "
                        f"{'this' if len(fixed) == 1 else 'these'}: restart vsup to apply, or change back")
    busy = busy_port(config, plan, current or {}, own or {}, port_is_free, describe_port_holder)
    if busy is not None:
        raise VsupError(busy)
    return config, plan


def reload_steps(fleet: rollout.Fleet, plan: Plan) -> tuple[list[rollout.Step], list[int]]:
    """What a reload changes, matched by index (the plan was renumbered to the running fleet's):
    first the removal of every instance of a model the plan no longer has (its CPUs and memory are
    free before anything starts), then replacements and additions by index, then the other
    removals from the last index down; and the indexes that keep running (they adopt their new
    plan: a model whose launch did not change is not touched)."""
    steps, unchanged = [], []
    planned = {new.index for new in plan.instances}
    models = {new.model for new in plan.instances}
    gone = [i for i in reversed(fleet.instances.indexes()) if i not in planned]
    for index in gone:  # a model that left the configuration goes first
        model = fleet.plan_of(fleet.instances[index]).model
        if model not in models:
            steps.append(rollout.Step(index, "remove", f"the configuration no longer serves model {model}"))
    for new in plan.instances:
        if new.index not in fleet.instances:
            what = f" of model {new.model}" if len(models) > 1 else ""
            steps.append(rollout.Step(new.index, "add", f"a new instance{what}", plan=new))
            continue
        inst = fleet.instances[new.index]
        argv, env = inst.launch or (inst.argv, inst.env)
        current = rollout.Launch.of(argv, env, fleet.plan_of(inst))
        # its slot under the new plan: the one at its address (under vllm.listen: unix a socket,
        # whatever base_port says), else it moves to the new base port
        slot = next((port for port in (new.port, fleet.spare_port(new.index)) if fleet.address(new, port) == inst.url), None)
        if slot is not None:
            changes = rollout.launch_changes(current, rollout.Launch.of(*fleet.launch(new, slot), new))
        else:
            changes = [f"port {inst.port} -> {new.port}",
                       *rollout.launch_changes(current, rollout.Launch.of(*fleet.launch(new, new.port), new))]
        if changes:
            steps.append(rollout.Step(new.index, "replace", "; ".join(changes), plan=new))
        else:
            unchanged.append(new.index)
            fleet.adopt(inst, new)
    for index in gone:
        model = fleet.plan_of(fleet.instances[index]).model
        if model in models:
            count = sum(new.model == model for new in plan.instances)
            whose = f"model {model}" if len(models) > 1 else "the configuration"
            steps.append(rollout.Step(index, "remove", f"{whose} runs {count} instance(s)"))
    return steps, unchanged


def running_members(fleet: rollout.Fleet) -> dict[tuple[str, int], int]:
    """(model, replica) -> index of every instance in the fleet (what renumber keeps)."""
    return {(fleet.plan_of(inst).model, fleet.plan_of(inst).replica): inst.index for inst in fleet.instances}


class Changes:
    """The one reload or rolling restart of a running vsup, and the record of the last one."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.record: rollout.Record | None = None  # the last reload or rolling restart
        self.task: asyncio.Task[None] | None = None
        self._reading: asyncio.Future[None] | None = None  # a reload is reading and checking the file
        self.pending: str | None = None  # the trigger of a follow-up reload (SIGHUP during a change)
        self._signalled: asyncio.Task[None] | None = None  # carries out the signalled reloads, one by one

    def busy(self) -> str | None:
        """What runs now, in words; None when a change may begin."""
        if self._reading is not None:
            return "a reload is reading the configuration"
        if self.task is not None and not self.task.done() and self.record is not None:
            done = sum(step.state == "done" for step in self.record.steps)
            return f"a {self.record.kind} is running ({done} of {len(self.record.steps)} steps done)"
        return None

    def check_free(self, outcome: str) -> None:
        if self.sup.stopping:
            raise VsupError(f"vsup is stopping; {outcome}")
        busy = self.busy()
        if busy is not None:
            raise VsupError(f"{busy}; {outcome} (`vsup status` shows its progress)")

    async def rolling_restart(self, targets: list[Instance]) -> rollout.Record:
        """Each of `targets` drained, restarted and warmed up, the next only once it is ready
        again; stops at an instance that does not come back."""
        self.check_free("nothing is restarted")
        record = rollout.Record("rolling restart", "vsup restart --rolling", self.sup.now())
        record.steps = [rollout.Step(inst.index, "replace", "restart requested", plan=self.sup.fleet.plan_of(inst))
                        for inst in targets]
        await asyncio.shield(self._start(record))  # a client that goes away does not cut it in half
        return record

    def signal(self, trigger: str) -> None:
        """SIGHUP: reload now, or once the change that runs has ended. Signals while one is
        pending add nothing: the follow-up reads the file as it is when it begins."""
        if self.sup.stopping:
            return
        if self.pending is None and self.busy() is not None:
            logger.info("%s during %s: the file is re-read once it ends", trigger, self.busy())
        self.pending = trigger
        if self._signalled is None or self._signalled.done():
            self._signalled = asyncio.create_task(self._signalled_reloads(), name="signalled reloads")

    async def _signalled_reloads(self) -> None:
        while self.pending is not None and not self.sup.stopping:
            while self.busy() is not None:  # whatever runs (also a `vsup reload` or rolling restart) ends first
                await asyncio.wait({future for future in (self._reading, self.task) if future is not None and not future.done()})
            if self.sup.stopping:
                return
            trigger, self.pending = self.pending, None
            try:
                await self.reload(trigger, wait=True)
            except VsupError as exc:
                logger.error("reload (%s) refused: %s", trigger, exc)
            except Exception:  # a bug: its record says failed; later signals still get their reload
                logger.exception("reload (%s) failed", trigger)

    def to_json(self) -> dict[str, Any] | None:
        """The last rollout's record for `vsup status`; while a follow-up reload is pending and it
        has ended, its state reads "pending" (what it did is for a file that changed since)."""
        if self.record is None:
            return None
        entry = self.record.to_json(self.sup.started_at, self.sup.now())
        entry["pending"] = self.pending
        if self.pending is not None and entry["state"] != "running":
            entry["state"] = "pending"
        return entry

    async def reload(self, trigger: str, wait: bool) -> dict[str, Any]:
        """Re-read, re-plan, apply (see the module docstring). `wait`: return once it is done,
        else once it has begun. Returns the rollout's record."""
        sup = self.sup
        self.check_free("nothing is reloaded")
        if sup.config_path is None:
            raise VsupError("this vsup was started without a configuration file: there is nothing to re-read")
        # the record from the start: while the file is read, `vsup status` shows a reload running
        record = self.record = rollout.Record("reload", trigger, sup.now())
        self._reading = asyncio.get_running_loop().create_future()
        current = {inst.index: inst.port for inst in sup.fleet.instances}
        own = {inst.port: inst.name for inst in sup.fleet.drivers}
        members = running_members(sup.fleet)
        try:
            config, plan = await asyncio.to_thread(read_config, sup.config_path, sup.fsroot, sup.environ, sup.config,
                                                   current, own, members, sup.plan)
        except (VsupError, TopologyError, PlanError) as exc:
            record.finish("rejected", sup.now(), str(exc))
            logger.error("reload (%s) refused, nothing was changed: %s", trigger, exc)
            raise VsupError(f"reload refused, nothing was changed: {exc}") from None
        except asyncio.CancelledError:
            record.finish("interrupted", sup.now(), "vsup stopped while it read the file")
            raise
        except Exception as exc:  # a bug: the record must not say "running" for ever
            record.finish("failed", sup.now(), f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._reading.set_result(None)
            self._reading = None
        if sup.stopping:  # a stop began meanwhile
            record.finish("interrupted", sup.now(), "vsup began to stop before it changed anything")
            raise VsupError("vsup is stopping; nothing is reloaded")
        record.applied = rollout.live_changes(sup.config, config)
        record.not_applied = rollout.unapplied_changes(sup.config, config)
        if record.not_applied:
            logger.warning("reload (%s): not applied by the running vsup: %s", trigger, "; ".join(record.not_applied))
        self.apply_settings(config, plan)
        record.steps, record.unchanged = reload_steps(sup.fleet, plan)
        logger.info("reload (%s): %s; %s", trigger,
                    f"settings applied at once: {', '.join(record.applied)}" if record.applied else "no setting changed",
                    f"instances to change: {', '.join(f'{s.action} {s.index} ({s.why})' for s in record.steps)}"
                    if record.steps else "every instance keeps running")
        for index in record.unchanged:  # as SIGHUP always did: a crash-looped instance gets a new chance
            if sup.fleet.instances[index].state is State.FAILED:
                sup.fleet.instances[index].start()
        task = self._start(record)
        if wait:
            await asyncio.shield(task)
        return record.to_json(sup.started_at, sup.now())

    def apply_settings(self, config: VsupConfig, plan: Plan) -> None:
        """What applies without touching a process: the proxy's settings (each model's policy too),
        metrics, every instance's health/restart/stop/warm-up settings (from its model's view),
        vsup's log level and CPUs."""
        sup = self.sup
        sup.config, old_plan, sup.plan = config, sup.plan, plan
        if sup.proxy is not None:
            sup.proxy.reconfigure(config.proxy, sup.environ.get("VSUP_API_KEY") or config.proxy.api_key,
                                  models=model_proxies(config), names=model_names(config), batch=config.batch,
                                  batch_slots=batch_slots(config))
        sup.metrics.apply(config)
        views = {view.name: view.config for view in models_of(config)}
        single = not is_fleet(config)
        for inst in sup.fleet.drivers:
            # a model the new file no longer serves keeps its view until its removal step drains it
            view = config if single else views.get(sup.fleet.plan_of(inst).model, inst.config)
            if inst.config.restart != view.restart:
                inst.policy = RestartPolicy(view.restart)  # the new delays; the failure count starts over
            inst.config = view
        if not sup.log_level_given:
            logging.getLogger().setLevel(config.log.level.upper())
        if plan.reserved_cpus and plan.reserved_cpus != old_plan.reserved_cpus:
            sup.host.pin_self(plan.reserved_cpus)
            logger.info("vsup pinned to the reserved CPUs %s", format_list(plan.reserved_cpus))

    async def cancel(self) -> None:
        """vsup stops: a running rollout ends here (its instances are stopped with the others)."""
        self.pending = None
        if self._signalled is not None and not self._signalled.done():
            self._signalled.cancel()
            await asyncio.gather(self._signalled, return_exceptions=True)
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def _start(self, record: rollout.Record) -> asyncio.Task[None]:
        """Run `record`'s steps as the one rollout, in a task of its own (set before anything can
        await: a second request sees it at once)."""
        self.record = record
        self.task = asyncio.create_task(self._run(record), name=record.kind)
        return self.task

    async def _run(self, record: rollout.Record) -> None:
        sup = self.sup
        if not record.steps:
            record.finish("done", sup.now())
            logger.info("%s done: %s", record.kind, record.summary())
            return
        announce = record.kind == "reload" and sup.readiness.sent  # a READY=1 before the first one would end the start
        if announce:
            sup.notifier.reloading(f"reloading: {len(record.steps)} instance(s) to change")
        try:
            ok = await rollout.Rollout(sup.fleet, record).run()
            failed = next((step for step in record.steps if step.state == "failed"), None)
            record.finish("done" if ok else "failed", sup.now(),
                          None if failed is None else f"instance {failed.index}: {failed.detail}")
            logger.log(logging.INFO if ok else logging.ERROR, "%s %s: %s%s", record.kind, record.state,
                       record.summary(), f"; {record.error}" if record.error else "")
        except asyncio.CancelledError:
            record.finish("interrupted", sup.now(), "vsup stopped during it")
            raise
        except Exception as exc:  # a bug: the fleet goes on as it is, the record says what happened
            logger.exception("%s failed", record.kind)
            record.finish("failed", sup.now(), f"{type(exc).__name__}: {exc}")
        finally:
            sup.on_members_changed()  # the state file
            if announce and not sup.stopping:
                sup.readiness.ready_again()
            sup.readiness.update()
