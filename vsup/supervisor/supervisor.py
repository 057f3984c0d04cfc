"""`vsup run`: N instances, the proxy and the control endpoint in one event loop.

The `Supervisor` owns the pieces and the wiring between them:
- each `Instance` (vsup/supervisor/lifecycle.py) drives one vLLM process through the state machine;
  every transition reaches `_on_transition`, which updates the proxy's `BackendPool` at once
  (ready <=> in rotation), checks placement when an instance becomes ready, and updates sd_notify;
- instances start one after another (`start.mode: staggered`: the next when the previous is ready
  or its first start failed) or all at once (`parallel`);
- a tick loop sends WATCHDOG=1 (so a stuck loop stops pinging), keeps STATUS= current and extends
  systemd's start timeout while models load;
- SIGTERM/SIGINT: STOPPING=1, the proxy drains, the instances stop in parallel (stop_tree with
  stop.timeout each), exit 0. Each step is guarded: one that raises is logged and the next runs,
  so the instances are always stopped (exit 1 then);
- SIGHUP and `vsup reload` re-read the config and apply the difference one instance at a time
  (rollout.py); `vsup restart all --rolling` takes the same path; one rollout at a time;
- the memory watchdog (memwatch.py) drains and restarts an instance that stays above
  `restart.max_rss`;
- a metrics collector (observe/collector.py) looks at every instance in the background every
  `metrics.interval` seconds; the proxy appends its cached text to /metrics and serves /status
  (a reload applies a new interval, timeout, or turns it on or off);
- a state file in the runtime directory lets the next vsup clean up if this one is killed
  (leftovers.py); the instances' processes and clock come from an `Operations` object.

`instances` is the fleet by index (what `vsup status`, `vsup restart N` and the plan's indexes
mean); during a rollout a new instance may run beside it, and a replaced one drains outside it.
Every instance with a driver task, inside the fleet or not, is in `_drivers`, and the shutdown
stops them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from vsup.config.schema import VsupConfig, load_config, spare_base_port
from vsup.errors import VsupError
from vsup.observe.collector import Collector, Target
from vsup.observe.page import status_page
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool
from vsup.supervisor import leftovers, rollout
from vsup.supervisor.backoff import RestartPolicy
from vsup.supervisor.control import ControlServer, control_socket_path
from vsup.supervisor.launch import build_command
from vsup.supervisor.lifecycle import Instance, State, Transition
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.memwatch import MemoryWatchdog
from vsup.supervisor.operations import Operations, SystemOperations
from vsup.supervisor.placement import pin_self, placement_drift, read_placement
from vsup.supervisor.processes import Child, become_subreaper, reap_orphans, sweep_stale_shm, tree_pids
from vsup.supervisor.rundir import prepare_runtime_dir
from vsup.systemd.notify import Notifier
from vsup.topology.cpulist import format_list
from vsup.topology.errors import PlanError, TopologyError
from vsup.topology.plan_model import InstancePlan, Plan

logger = logging.getLogger("vsup.supervisor")

TICK = 1.0  # seconds between supervision ticks (watchdog, status); shorter if the watchdog asks
EXTEND_BY = 30.0  # while models load, ask systemd for this much more start time on every tick


def default_log_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """systemd's LogsDirectory= (e.g. /var/log/vsup) when set, else ./vsup-logs."""
    logs = environ.get("LOGS_DIRECTORY", "").split(":")[0]
    return Path(logs) if logs else Path("vsup-logs")


class Supervisor:
    def __init__(
        self,
        config: VsupConfig,
        plan: Plan,
        *,
        config_path: str | None = None,
        notifier: Notifier | None = None,
        environ: Mapping[str, str] = os.environ,
        ops: Operations | None = None,
        fsroot: str = "/",
        log_level_given: bool = False,
    ) -> None:
        self.config = config
        self.plan = plan
        self.config_path = config_path
        self.fsroot = fsroot  # where a reload reads the machine (`vsup run --fsroot`)
        self.log_level_given = log_level_given  # `vsup run --log-level`: a reload keeps it
        self.notifier = notifier or Notifier.from_env(environ)
        self.environ = dict(environ)
        self.ops = ops  # None: SystemOperations over run()'s HTTP session
        self.pool = BackendPool()
        self.instances: list[Instance] = []  # the fleet, by index
        self.plans: dict[str, InstancePlan] = {}  # instance name -> its plan
        self.placement: dict[str, list[str] | None] = {}  # name -> drift lines ([] ok, None not checked)
        self.proxy: ProxyServer | None = None
        self.control: ControlServer | None = None
        self.watchdog: MemoryWatchdog | None = None
        self.rollout: rollout.Record | None = None  # the last reload or rolling restart
        self.collector: Collector | None = None  # None: metrics.interval 0
        self._collector_task: asyncio.Task | None = None
        self._http: aiohttp.ClientSession | None = None  # run()'s session (a reload may start the collector)
        self.started_at = self._now()
        self._stop_requested = asyncio.Event()
        self._stopping = False
        self._crashed = False
        self._ready_sent = False
        self._status_text = ""
        self._tasks: list[asyncio.Task] = []
        self._drivers: dict[Instance, asyncio.Task] = {}
        self._logs: dict[Instance, InstanceLog] = {}
        self._rollout_task: asyncio.Task | None = None
        self._reading_config = False  # a reload is reading and checking the file
        self._state_file: Path | None = None

    # ---- the whole run ---------------------------------------------------------------------------

    async def run(self) -> int:
        """Start everything, supervise until SIGTERM/SIGINT, stop everything. Returns the exit code."""
        loop = asyncio.get_running_loop()
        if self.plan.reserved_cpus:
            pin_self(self.plan.reserved_cpus)
            logger.info("vsup pinned to the reserved CPUs %s", format_list(self.plan.reserved_cpus))
        for warning in self.plan.warnings:
            logger.warning("plan: %s", warning)
        # orphans of an instance (EngineCore after a kill -9 of its API server) become our children:
        # stop_tree can find and reap them, and no zombie is left to an init that may not reap
        if not become_subreaper():
            logger.warning("could not become a child subreaper; orphaned instance processes are reaped by init")
        self._sweep_shm("left by an earlier run")
        self._state_file = self._write_state()
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        if self.ops is None:
            self.ops = SystemOperations(session)
        try:
            self._build_instances()
            api_key = self.environ.get("VSUP_API_KEY") or self.config.proxy.api_key
            self.proxy = ProxyServer(self.config.proxy, self.pool, api_key=api_key)
            self.proxy.add_page("/status", status_page(self.status, self.config.metrics.interval))
            await self.proxy.start()
            self._http = session
            if self.config.metrics.interval > 0:
                self.collector = Collector(self._observed, session, interval=self.config.metrics.interval,
                                           timeout=self.config.metrics.timeout)
                self.proxy.extra_metrics = self.collector.text
            self.control = ControlServer(control_socket_path(self.config, self.environ), self)
            await self.control.start()
            logger.info("control socket %s", self.control.path)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_stop_signal, sig)
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

            for inst in self.instances:
                self._launch(inst)
            self.watchdog = MemoryWatchdog(self.ops, lambda: self.config, lambda: self.instances,
                                           lambda inst: self.plans[inst.name].memory_bytes, self._watchdog_waits)
            self._tasks = [asyncio.create_task(self._start_all(), name="start"),
                           asyncio.create_task(self._tick(), name="tick"),
                           asyncio.create_task(self.watchdog.run(), name="memory watchdog")]
            if self.collector is not None:
                self._tasks.append(self._start_collector())
            self._update_status()
            await self._stop_requested.wait()
            code = 1 if self._crashed else 0
            if not await self._shutdown():
                code = 1
            return code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            tasks = [*self._tasks, *self._drivers.values(), *([self._rollout_task] if self._rollout_task else [])]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # last resort, when run() itself was interrupted before the shutdown: no instance
            # process outlives vsup's own stop
            for inst in self._drivers:
                if inst.child is not None:
                    await self._async_step(f"stopping instance {inst.name}'s processes",
                                           self.ops.stop_tree(inst.child, self.config.stop.timeout))
                    inst.child = None
            if self.proxy is not None:  # no-op after the drain; closes it when startup failed later
                await self._async_step("closing the proxy", self.proxy.stop())
            if self.control is not None:
                await self._async_step("removing the control socket", self.control.stop())
            await self._async_step("closing the HTTP session", session.close())
            for log in self._logs.values():
                self._step(f"closing the log {log.name}", log.close)
            self._step("closing the sd_notify socket", self.notifier.close)
            if self._state_file is not None and all(inst.child is None for inst in self._drivers):
                self._step("removing the state file", self._state_file.unlink, True)

    def _write_state(self) -> Path | None:
        """The state file that lets the next vsup clean up if this one is killed (leftovers.py):
        the instances' ports and their spare ports (where a reload may start a replacement)."""
        spare = spare_base_port(self.config)
        ports = sorted({p.port for p in self.plan.instances} | {spare + p.index for p in self.plan.instances}
                       | {inst.port for inst in self._drivers})
        try:
            return leftovers.write_state(prepare_runtime_dir(self.environ), config=self.config_path,
                                         proxy=f"{self.config.proxy.host}:{self.config.proxy.port}",
                                         ports=ports)
        except (VsupError, OSError) as exc:
            logger.warning("cannot write the state file (%s): if this vsup is killed, the next one cannot "
                           "clean up what it leaves running", exc)
            return None

    def _build_instances(self) -> None:
        for plan in self.plan.instances:
            self.instances.append(self._new_instance(plan, plan.port))

    def _new_instance(self, plan: InstancePlan, port: int) -> Instance:
        """An instance of `plan` listening on `port`, its backend known to the proxy (not in the
        rotation). On its spare port (a replacement beside the old one) it is named `<i>b`, with
        its own log i<i>b.log, so the two never share a name, a backend or a log file."""
        name = f"{plan.index}b" if port == spare_base_port(self.config) + plan.index else str(plan.index)
        argv, env = self.launch(plan, port)
        log_config = self.config.log
        directory = log_config.dir if log_config.dir is not None else default_log_dir(self.environ)
        log = InstanceLog(
            f"i{name}", directory, max_bytes=log_config.max_bytes, backups=log_config.backups,
            echo=log_config.echo, logger=logging.getLogger("vsup.instance"),
        )
        instance = Instance(plan.index, argv, env, port=port, config=self.config, log=log, ops=self.ops,
                            on_transition=self._on_transition, name=name,
                            in_flight=lambda: self.proxy.in_flight().get(name, 0) if self.proxy is not None else 0)
        self._logs[instance] = log
        self.plans[name] = plan
        self.placement[name] = None
        self.pool.add(Backend(name, instance.url))
        return instance

    def _launch(self, inst: Instance) -> None:
        """Start the instance's driver task; a driver that crashes stops vsup (exit 1)."""
        task = asyncio.create_task(inst.run(), name=f"instance-{inst.name}")
        self._drivers[inst] = task

        def ended(task: asyncio.Task) -> None:
            if task.cancelled() or task.exception() is None:
                return
            logger.error("instance driver %s crashed; stopping everything", task.get_name(), exc_info=task.exception())
            self._crashed = True
            self._stopping = True
            self._stop_requested.set()

        task.add_done_callback(ended)

    # ---- rollout.Fleet: what a reload or rolling restart does to the fleet -----------------------

    def plan_of(self, inst: Instance) -> InstancePlan:
        return self.plans[inst.name]

    def live_plans(self) -> list[InstancePlan]:
        return [self.plans[inst.name] for inst in self._drivers if inst.state is not State.STOPPED or inst.intent]

    def launch(self, plan: InstancePlan, port: int) -> tuple[list[str], dict[str, str]]:
        return build_command(dataclasses.replace(plan, port=port), self.config, self.environ)

    def spare_port(self, index: int) -> int:
        return spare_base_port(self.config) + index

    def create(self, plan: InstancePlan, port: int) -> Instance:
        inst = self._new_instance(plan, port)
        self._launch(inst)
        self._write_state()
        return inst

    def adopt(self, inst: Instance, plan: InstancePlan) -> None:
        self.plans[inst.name] = plan

    def swap(self, index: int, inst: Instance | None) -> None:
        if inst is None:
            assert index == len(self.instances) - 1, (index, len(self.instances))
            self.instances.pop()
        elif index == len(self.instances):
            self.instances.append(inst)
        else:
            self.instances[index] = inst
        self._update_status()

    def forget(self, inst: Instance) -> None:
        task = self._drivers.pop(inst, None)
        if task is not None:
            task.cancel()
        self.pool.remove(inst.name)
        if inst not in self.instances:  # the same name may be back in the fleet (an in-place reuse)
            self.plans.pop(inst.name, None)
            self.placement.pop(inst.name, None)
        log = self._logs.pop(inst, None)
        if log is not None:
            self._step(f"closing the log {log.name}", log.close)

    async def _start_all(self) -> None:
        if self.config.start.mode == "parallel":
            for inst in self.instances:
                inst.start()
            return
        for inst in self.instances:
            if self._stopping:
                return
            inst.start()
            # the next starts once this one is ready or its first start failed (N weight loads at
            # once would spike memory together)
            await inst.wait_for(lambda inst=inst: self._stopping or (
                inst.starts >= 1 and inst.state not in (State.STARTING, State.WARMING)))

    async def _shutdown(self) -> bool:
        """Drain, then stop every instance. No step can skip the ones after it: an exception in
        one is logged and the next runs (the instances are stopped whatever happened before).
        Returns True when every step went through."""
        self._stopping = True
        if self._rollout_task is not None and not self._rollout_task.done():
            self._rollout_task.cancel()  # its instances are stopped below with the others
            await asyncio.gather(self._rollout_task, return_exceptions=True)
        drain = self.config.proxy.drain_timeout
        ok = self._step("telling systemd", self._announce_stop, drain)
        logger.info("stopping: draining the proxy (up to %gs), then the instances (stop.timeout %gs each, in parallel)",
                    drain, self.config.stop.timeout)
        if self.proxy is not None:
            ok &= await self._async_step("draining the proxy", self.proxy.drain_and_stop(drain))
        drivers = dict(self._drivers)
        results = await asyncio.gather(*(self._stop_instance(inst, task) for inst, task in drivers.items()))
        ok &= all(results)
        for task in drivers.values():
            task.cancel()
        await asyncio.gather(*drivers.values(), return_exceptions=True)
        logger.info("stopped after %.1fs", self._now() - self.started_at)
        return ok

    def _announce_stop(self, drain: float) -> None:
        self.notifier.stopping(f"stopping: draining the proxy, then {len(self._drivers)} instances")
        self.notifier.extend_timeout(drain + self.config.stop.timeout + 10)

    async def _stop_instance(self, inst: Instance, driver: asyncio.Task) -> bool:
        """Stop one instance through its driver; if the driver is gone (crashed) or ends while
        stopping, stop its processes directly. True when that went without an error."""
        timeout = self.config.stop.timeout
        if not driver.done():
            stopping = asyncio.ensure_future(inst.stop())
            await asyncio.wait({stopping, driver}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.done() and stopping.exception() is None:
                return True
            stopping.cancel()
            logger.error("instance %s: stopping it through its driver did not finish; stopping its processes directly", inst.name)
        if inst.child is None:
            return driver.cancelled() or driver.exception() is None
        return await self._async_step(f"stopping instance {inst.name}'s processes", self.ops.stop_tree(inst.child, timeout))

    @staticmethod
    def _step(what: str, function, *args) -> bool:
        try:
            function(*args)
            return True
        except Exception:
            logger.exception("stopping: %s failed; going on with the next step", what)
            return False

    @staticmethod
    async def _async_step(what: str, awaitable) -> bool:
        try:
            await awaitable
            return True
        except Exception:
            logger.exception("stopping: %s failed; going on with the next step", what)
            return False

    def _on_stop_signal(self, sig: int) -> None:
        if self._stop_requested.is_set():
            logger.info("%s received again: already stopping", signal.Signals(sig).name)
            return
        logger.info("%s received: stopping", signal.Signals(sig).name)
        self._stopping = True
        self._stop_requested.set()

    def _on_sighup(self) -> None:
        if self._stopping:
            return
        logger.info("SIGHUP: reloading the configuration")

        async def reload() -> None:
            try:
                await self.reload("SIGHUP", wait=False)
            except VsupError as exc:
                logger.error("reload (SIGHUP) refused: %s", exc)

        task = asyncio.create_task(reload(), name="SIGHUP reload")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    # ---- reacting to instances -------------------------------------------------------------------

    def _on_transition(self, inst: Instance, transition: Transition) -> None:
        ready = transition.new is State.READY
        if inst.name in self.pool.states():
            self.pool.set_state(inst.name, transition.new.value, ready)
        if transition.new is State.STARTING:
            self.placement[inst.name] = None
        elif ready:
            self._check_placement(inst)
        elif transition.new in (State.BACKOFF, State.FAILED):
            # stop_tree removed the files of the processes it found; a tree that died in pieces
            # may have left some no process maps any more
            self._sweep_shm(f"after instance {inst.name} failed")
        self._update_status()

    def _sweep_shm(self, why: str) -> None:
        def report(future: asyncio.Future) -> None:
            if future.cancelled():
                return
            if future.exception() is not None:
                logger.warning("sweeping stale /dev/shm files %s failed: %s", why, future.exception())
            elif future.result():
                logger.info("removed %d stale /dev/shm files %s", len(future.result()), why)
        future = asyncio.get_running_loop().run_in_executor(None, sweep_stale_shm)
        future.add_done_callback(report)

    def _check_placement(self, inst: Instance) -> None:
        plan = self.plans.get(inst.name)
        if plan is None:
            return
        launcher = self.plan.settings.launcher
        if launcher == "none" or not plan.argv or not isinstance(inst.child, Child):
            return  # nothing was pinned, so nothing can drift
        # taskset pins CPUs only: memory placement is not part of such a plan
        nodes = plan.nodes if launcher == "numactl" and plan.nodes else None
        drift = placement_drift(read_placement(tree_pids(inst.child)), plan.cpus, nodes)
        self.placement[inst.name] = drift
        for line in drift:
            logger.warning("instance %s: placement drift: %s", inst.name, line)

    def _start_collector(self) -> asyncio.Task:
        self._collector_task = asyncio.create_task(self.collector.run(), name="metrics")
        return self._collector_task

    def _apply_metrics(self, config: VsupConfig) -> None:
        """A reload's `metrics:` section: a new interval or timeout applies from the next round;
        0 stops the collection (the proxy's /metrics keeps only its own), > 0 from 0 starts it."""
        interval, timeout = config.metrics.interval, config.metrics.timeout
        if self.proxy is not None:
            self.proxy.add_page("/status", status_page(self.status, interval))  # its refresh follows the interval
        if interval > 0 and self.collector is not None:
            self.collector.interval, self.collector.timeout = interval, timeout
        elif interval > 0 and self._http is not None:
            self.collector = Collector(self._observed, self._http, interval=interval, timeout=timeout)
            self._tasks.append(self._start_collector())
            if self.proxy is not None:
                self.proxy.extra_metrics = self.collector.text
        elif interval == 0 and self.collector is not None:
            if self._collector_task is not None:
                self._collector_task.cancel()  # the shutdown gathers it with the other tasks
            self.collector = self._collector_task = None
            if self.proxy is not None:
                self.proxy.extra_metrics = None

    def _observed(self) -> list[Target]:
        """What the metrics collector looks at this round: a serving instance's /metrics, and the
        process tree of every instance that has one (a model load's memory shows too); during a
        rollout also the instances outside the fleet (a replacement starting, a replaced one draining)."""
        targets = []
        for inst in [*self.instances, *(inst for inst in self._drivers if inst not in self.instances)]:
            child = inst.child if isinstance(inst.child, Child) else None
            serving = inst.state in (State.READY, State.UNHEALTHY)
            targets.append(Target(
                name=inst.name,
                metrics_url=f"{inst.url}/metrics" if serving else None,
                nodes=tuple(self.plans[inst.name].nodes) if inst.name in self.plans else (),
                leader=child.pid if child else None,
                token=child.token if child else None,
                known=dict(child.seen) if child else {},
            ))
        return targets

    def _ready_count(self) -> int:
        return sum(inst.state is State.READY for inst in self.instances)

    def _update_status(self) -> None:
        text = self._status_line()
        if not self._ready_sent and not self._stopping and self.proxy is not None and self._ready_enough():
            self._ready_sent = True
            self._status_text = text
            self.notifier.ready(text)
            logger.info("ready: %s", text)
            return
        if text != self._status_text:
            self._status_text = text
            self.notifier.status(text)

    def _status_line(self) -> str:
        ready = self._ready_count()
        in_flight = self.proxy.total_in_flight() if self.proxy is not None else 0
        text = f"{ready}/{len(self.instances)} instances ready, {in_flight} in flight"
        failed = [inst.name for inst in self.instances if inst.state is State.FAILED]
        loading = [inst.name for inst in self.instances if inst.state in (State.STARTING, State.WARMING)]
        if loading:
            text += f"; starting: {','.join(loading)}"
        if failed:
            text += f"; failed: {','.join(failed)}"
        record = self.rollout
        if record is not None and record.state == "running":
            done = sum(step.state == "done" for step in record.steps)
            text += f"; {record.kind}: {done}/{len(record.steps)} done"
        if self._stopping:
            text = "stopping; " + text
        return text

    def _ready_enough(self) -> bool:
        states = [inst.state for inst in self.instances]
        if self.config.notify.ready_when == "any":
            return State.READY in states
        # all: every instance ready, except ones that already gave up (failed) — they must not keep
        # the whole service from starting while the others serve
        return State.READY in states and all(s in (State.READY, State.FAILED) for s in states)

    async def _tick(self) -> None:
        interval = min(TICK, self.notifier.watchdog_interval or TICK)
        while True:
            self.notifier.watchdog()
            self._update_status()
            reap_orphans()
            reloading = self.rollout is not None and self.rollout.kind == "reload" and self._rollout_busy() is not None
            if reloading or (not self._ready_sent and any(inst.state is not State.FAILED for inst in self.instances)):
                self.notifier.extend_timeout(max(EXTEND_BY, 3 * interval))  # model loads (a reload's too)
            await asyncio.sleep(interval)

    def _now(self) -> float:
        return self.ops.now() if self.ops is not None else time.monotonic()

    # ---- requests from the control endpoint (control.Controlled) ---------------------------------

    @property
    def instance_count(self) -> int:
        return len(self.instances)

    def instance(self, index: int) -> Instance:
        if not 0 <= index < len(self.instances):
            raise VsupError(f"no instance {index}: this vsup runs instances 0..{len(self.instances) - 1}")
        return self.instances[index]

    async def restart(self, indices: list[int], rolling: bool) -> list[dict[str, Any]]:
        """Restart the given instances: all at once, or one at a time (a rollout: each drained,
        restarted and warmed up, the next only once it is ready again). Returns the status of each
        instance handled; a rolling restart stops at an instance that does not come back (the
        caller sees it is not ready)."""
        targets = [self.instance(i) for i in indices]
        self._check_free_to_change("nothing is restarted")
        if not rolling:
            await asyncio.gather(*(inst.restart() for inst in targets))
            return [self.instance_status(inst) for inst in targets]
        record = rollout.Record("rolling restart", "vsup restart --rolling", self._now())
        record.steps = [rollout.Step(inst.index, "replace", "restart requested", plan=self.plans[inst.name])
                        for inst in targets]
        await asyncio.shield(self._start_rollout(record))  # a client that goes away does not cut it in half
        return [self.instance_status(self.instances[step.index]) for step in record.steps
                if step.state in ("done", "failed") and step.index < len(self.instances)]

    async def reload(self, trigger: str = "vsup reload", wait: bool = True) -> dict[str, Any]:
        """Re-read the config file, re-plan with `vsup run`'s checks, and apply the difference:
        settings of the proxy, health, restart and stop at once, changed instances one at a time
        (rollout.py). Refused with VsupError — and nothing changed — while vsup stops or another
        rollout runs, and for an invalid file, an impossible plan or a key that cannot change
        while vsup runs. `wait`: return once it is done, else once it has begun. Returns the
        rollout's record."""
        self._check_free_to_change("nothing is reloaded")
        if self.config_path is None:
            raise VsupError("this vsup was started without a configuration file: there is nothing to re-read")
        began = self._now()
        self._reading_config = True
        try:
            config, plan = await asyncio.to_thread(self._read_config)
        except (VsupError, TopologyError, PlanError) as exc:
            self.rollout = rollout.Record("reload", trigger, began)
            self.rollout.finish("rejected", self._now(), str(exc))
            logger.error("reload (%s) refused, nothing was changed: %s", trigger, exc)
            raise VsupError(f"reload refused, nothing was changed: {exc}") from None
        finally:
            self._reading_config = False
        self._check_free_to_change("nothing is reloaded")  # a stop may have begun meanwhile
        record = rollout.Record("reload", trigger, began)
        record.applied = rollout.live_changes(self.config, config)
        record.not_applied = rollout.unapplied_changes(self.config, config)
        if record.not_applied:
            logger.warning("reload (%s): not applied by the running vsup: %s", trigger, "; ".join(record.not_applied))
        self._apply_settings(config, plan)
        record.steps, record.unchanged = self._reload_steps(plan)
        logger.info("reload (%s): %s; %s", trigger,
                    f"settings applied at once: {', '.join(record.applied)}" if record.applied else "no setting changed",
                    f"instances to change: {', '.join(f'{s.action} {s.index} ({s.why})' for s in record.steps)}"
                    if record.steps else "every instance keeps running")
        for index in record.unchanged:  # as SIGHUP always did: a crash-looped instance gets a new chance
            if self.instances[index].state is State.FAILED:
                self.instances[index].start()
        task = self._start_rollout(record)
        if wait:
            await asyncio.shield(task)
        return record.to_json(self.started_at, self._now())

    def _check_free_to_change(self, outcome: str) -> None:
        if self._stopping:
            raise VsupError(f"vsup is stopping; {outcome}")
        busy = self._rollout_busy()
        if busy is not None:
            raise VsupError(f"{busy}; {outcome} (`vsup status` shows its progress)")

    def _rollout_busy(self) -> str | None:
        if self._reading_config:
            return "a reload is reading the configuration"
        if self._rollout_task is not None and not self._rollout_task.done() and self.rollout is not None:
            done = sum(step.state == "done" for step in self.rollout.steps)
            return f"a {self.rollout.kind} is running ({done} of {len(self.rollout.steps)} steps done)"
        return None

    def _watchdog_waits(self) -> str | None:
        if self._stopping:
            return "vsup is stopping"
        return self._rollout_busy()

    def _read_config(self) -> tuple[VsupConfig, Plan]:
        """The re-read configuration and its plan, checked as `vsup run` checks them (runs in a
        thread: it reads sysfs, the model's files, and may run numactl)."""
        from vsup.supervisor.preflight import check_programs, checked_plan

        config = load_config(self.config_path)
        _machine, plan = checked_plan(config, self.fsroot, self.environ, runs_here=True)
        for inst in plan.instances:
            argv, _env = build_command(inst, config, self.environ)
            check_programs(argv, len(inst.argv))
        fixed = rollout.fixed_changes(self.config, config)
        if fixed:
            raise VsupError(f"{self.config_path}: {'; '.join(fixed)}; a running vsup cannot change "
                            f"{'this' if len(fixed) == 1 else 'these'}: restart vsup to apply, or change back")
        return config, plan

    def _apply_settings(self, config: VsupConfig, plan: Plan) -> None:
        """What applies without touching a process: the proxy's settings, every instance's
        health/restart/stop/warm-up settings, vsup's log level and CPUs."""
        self.config, old_plan, self.plan = config, self.plan, plan
        if self.proxy is not None:
            self.proxy.reconfigure(config.proxy, self.environ.get("VSUP_API_KEY") or config.proxy.api_key)
        self._apply_metrics(config)
        for inst in self._drivers:
            if inst.config.restart != config.restart:
                inst.policy = RestartPolicy(config.restart)  # the new delays; the failure count starts over
            inst.config = config
        if not self.log_level_given:
            logging.getLogger().setLevel(config.log.level.upper())
        if plan.reserved_cpus and plan.reserved_cpus != old_plan.reserved_cpus:
            pin_self(plan.reserved_cpus)
            logger.info("vsup pinned to the reserved CPUs %s", format_list(plan.reserved_cpus))

    def _reload_steps(self, plan: Plan) -> tuple[list[rollout.Step], list[int]]:
        """What a reload changes, in order: replacements and additions by index, then removals
        from the last index down."""
        steps, unchanged = [], []
        for new in plan.instances:
            if new.index >= len(self.instances):
                steps.append(rollout.Step(new.index, "add", "a new instance", plan=new))
                continue
            inst = self.instances[new.index]
            argv, env = inst.launch or (inst.argv, inst.env)
            current = rollout.Launch.of(argv, env, self.plans[inst.name])
            if inst.port in (new.port, self.spare_port(new.index)):
                changes = rollout.launch_changes(current, rollout.Launch.of(*self.launch(new, inst.port), new))
            else:
                changes = [f"port {inst.port} -> {new.port}",
                           *rollout.launch_changes(current, rollout.Launch.of(*self.launch(new, new.port), new))]
            if changes:
                steps.append(rollout.Step(new.index, "replace", "; ".join(changes), plan=new))
            else:
                unchanged.append(new.index)
                self.adopt(inst, new)
        count = len(plan.instances)
        for index in reversed(range(count, len(self.instances))):
            steps.append(rollout.Step(index, "remove", f"the configuration runs {count} instance(s)"))
        return steps, unchanged

    def _start_rollout(self, record: rollout.Record) -> asyncio.Task:
        """Run `record`'s steps as the one rollout, in a task of its own (set before anything can
        await: a second request sees it at once)."""
        self.rollout = record
        self._rollout_task = asyncio.create_task(self._run_rollout(record), name=record.kind)
        return self._rollout_task

    async def _run_rollout(self, record: rollout.Record) -> None:
        if not record.steps:
            record.finish("done", self._now())
            logger.info("%s done: %s", record.kind, record.summary())
            return
        announce = record.kind == "reload" and self._ready_sent  # a READY=1 before the first one would end the start
        if announce:
            self.notifier.reloading(f"reloading: {len(record.steps)} instance(s) to change")
        try:
            ok = await rollout.Rollout(self, record).run()
            failed = next((step for step in record.steps if step.state == "failed"), None)
            record.finish("done" if ok else "failed", self._now(),
                          None if failed is None else f"instance {failed.index}: {failed.detail}")
            logger.log(logging.INFO if ok else logging.ERROR, "%s %s: %s%s", record.kind, record.state,
                       record.summary(), f"; {record.error}" if record.error else "")
        except asyncio.CancelledError:
            record.finish("interrupted", self._now(), "vsup stopped during it")
            raise
        except Exception as exc:  # a bug: the fleet goes on as it is, the record says what happened
            logger.exception("%s failed", record.kind)
            record.finish("failed", self._now(), f"{type(exc).__name__}: {exc}")
        finally:
            self._write_state()
            if announce and not self._stopping:
                self._status_text = ""
                self.notifier.ready(self._status_line())
            self._update_status()

    def instance_statuses(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self.instance_status(self.instance(i)) for i in indices]

    def status(self) -> dict[str, Any]:
        proxy = self.proxy
        now = self._now()
        return {
            "vsup": {
                "pid": os.getpid(),
                "uptime": round(now - self.started_at, 3),
                "config": self.config_path,
                "proxy": f"{self.config.proxy.host}:{proxy.port if proxy else self.config.proxy.port}",
                "in_flight": proxy.total_in_flight() if proxy else 0,
                "ready": self._ready_count(),
                "stopping": self._stopping,
                "reserved_cpus": list(self.plan.reserved_cpus),
                "control_socket": str(self.control.path) if self.control else None,
                "metrics_interval": self.config.metrics.interval,
            },
            "instances": [self.instance_status(inst) for inst in self.instances],
            # a rollout's new instance before it joins the fleet, a replaced one while it drains
            "changing": [self.instance_status(inst) for inst in self._drivers if inst not in self.instances],
            "rollout": self.rollout.to_json(self.started_at, now) if self.rollout is not None else None,
        }

    def instance_status(self, inst: Instance) -> dict[str, Any]:
        now = self._now()
        plan = self.plans[inst.name]
        drift = self.placement.get(inst.name)
        in_flight = self.proxy.in_flight().get(inst.name, 0) if self.proxy else 0
        return {
            "index": inst.index,
            "name": inst.name,
            "state": inst.state.value,
            "pid": inst.pid,
            "port": inst.port,
            "cpus": list(plan.cpus),
            "nodes": list(plan.nodes),
            "uptime": round(now - inst.started_at, 3) if inst.pid is not None and inst.started_at is not None else None,
            "in_state_for": round(now - inst.since, 3),
            "restarts": inst.restarts,
            "last_exit": inst.last_exit,
            "placement_ok": None if drift is None else not drift,
            "placement_drift": drift or [],
            "in_flight": in_flight,
            "next_start_in": round(max(0.0, inst.next_start_at - now), 3) if inst.next_start_at else None,
            "backoff_failures": inst.policy.attempt,
            "memory_watchdog": self.watchdog.status(inst) if self.watchdog is not None else None,
            # the last background collection (observe/collector.py); None when off or not yet done
            "metrics": self.collector.figures(inst.name) if self.collector else None,
            "transitions": [
                {"at": round(t.at - self.started_at, 3), "from": t.old.value, "to": t.new.value,
                 "event": t.event.value, "reason": t.reason}
                for t in inst.history
            ],
        }
