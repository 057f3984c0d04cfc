"""`vsup run`: N instances, the proxy and the control endpoint in one event loop.

(Just over 400 lines for a reason: it is the wiring itself; each piece it wires is its own module:
fleet.py, reloading.py, status.py, metrics.py, memwatch.py, host.py.)

The `Supervisor` owns the pieces and the wiring between them:
- the instances (`fleet.Fleet`; each an `Instance` of lifecycle.py driving one vLLM process through
  the state machine of states.py): every transition reaches `on_transition`, which updates the
  proxy's `BackendPool` at once (ready <=> in rotation), checks placement when an instance becomes
  ready, and updates sd_notify;
- instances start all at once (`start.mode: parallel`) or one after another (`staggered`: the next
  when the previous is ready or its first start failed); `auto` picks parallel when the plan's
  memory holds their load peaks together (vsup/topology/startmode.py) and says why in the log;
- a tick loop sends WATCHDOG=1 (so a stuck loop stops pinging), keeps STATUS= current (status.py)
  and extends systemd's start timeout while models load;
- SIGTERM/SIGINT: STOPPING=1, the proxy drains, the instances stop in parallel (stop_tree with
  stop.timeout each), exit 0. Each step is guarded: one that raises is logged and the next runs,
  so the instances are always stopped (exit 1 then);
- SIGHUP and `vsup reload` re-read the config and apply the difference one instance at a time
  (reloading.py, rollout.py); `vsup restart all --rolling` takes the same path; one at a time;
- the memory watchdog (memwatch.py) drains and restarts an instance that stays above
  `restart.max_rss`; the metrics collector (metrics.py) looks at every instance in the background;
- a state file in the runtime directory lets the next vsup clean up if this one is killed
  (leftovers.py). The instances' processes and clock come from an `Operations` object
  (operations.py), what vsup does to its own process and the host (pinning, subreaper, orphans,
  /dev/shm, /proc placement) from a `Host` (host.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from vsup.config.names import model_names
from vsup.config.schema import VsupConfig, spare_base_port
from vsup.errors import VsupError
from vsup.proxy import ProxyServer
from vsup.proxy.address import Sessions
from vsup.proxy.backends import BackendPool
from vsup.supervisor import leftovers
from vsup.supervisor import status as status_json
from vsup.supervisor.control import ControlServer, control_socket_path
from vsup.supervisor.fleet import Fleet
from vsup.supervisor.host import Host, SystemHost
from vsup.supervisor.launch import wants_kv_events
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.memwatch import MemoryWatchdog
from vsup.supervisor.metrics import Metrics
from vsup.supervisor.operations import Operations, SystemOperations
from vsup.supervisor.reloading import Changes, batch_dir, batch_slots, model_proxies
from vsup.supervisor.rollout import Record
from vsup.supervisor.rundir import prepare_instance_dir, prepare_runtime_dir, remove_instance_dir
from vsup.supervisor.states import Intent, State, Transition
from vsup.systemd.notify import Notifier
from vsup.topology.cpulist import format_list
from vsup.topology.plan_model import Plan
from vsup.topology.startmode import choose_start

logger = logging.getLogger("vsup.supervisor")

TICK = 1.0  # seconds between supervision ticks (watchdog, status); shorter if the watchdog asks
EXTEND_BY = 30.0  # while models load, ask systemd for this much more start time on every tick


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
        host: Host | None = None,
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
        self._ops = ops  # None: SystemOperations over run()'s HTTP session
        self.host = host if host is not None else SystemHost()
        self.pool = BackendPool()
        self.pool.on_stalled = self._stalled
        self.fleet = Fleet(self, self.pool)
        self.proxy: ProxyServer | None = None
        self.control: ControlServer | None = None
        self.watchdog: MemoryWatchdog | None = None
        self.metrics = Metrics(self.fleet, self.status)
        self.changes = Changes(self)
        self.readiness = status_json.Readiness(self, self.notifier)
        self.started_at = self.now()
        self.stopping = False
        self._stop_requested = asyncio.Event()
        self._crashed = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._state_file: Path | None = None

    def _stalled(self, name: str, why: str) -> None:
        """The proxy found an instance hung (it answers /health, sends nothing to its requests): it
        is out of the rotation already; restart it (no drain: what it holds is not moving)."""
        for inst in self.instances:
            if inst.name == name and inst.state is State.READY:
                logger.warning("instance %s: %s: restarting it", name, why)
                inst.ask(Intent.RESTART, why)

    @property
    def instances(self) -> list[Instance]:
        """The fleet's instances in index order (fleet.py; `self.fleet.instances[i]` is instance i)."""
        return list(self.fleet.instances)

    @property
    def ops(self) -> Operations:
        if self._ops is None:
            raise RuntimeError("the instances' operations exist once run() has opened its HTTP session")
        return self._ops

    def now(self) -> float:
        return self._ops.now() if self._ops is not None else time.monotonic()

    # ---- the whole run ---------------------------------------------------------------------------

    async def run(self) -> int:
        """Start everything, supervise until SIGTERM/SIGINT, stop everything. Returns the exit code."""
        loop = asyncio.get_running_loop()
        if self.plan.reserved_cpus:
            self.host.pin_self(self.plan.reserved_cpus)
            logger.info("vsup pinned to the reserved CPUs %s", format_list(self.plan.reserved_cpus))
        for warning in self.plan.warnings:
            logger.warning("plan: %s", warning)
        # orphans of an instance (EngineCore after a kill -9 of its API server) become our children:
        # stop_tree can find and reap them, and no zombie is left to an init that may not reap
        if not self.host.become_subreaper():
            logger.warning("could not become a child subreaper; orphaned instance processes are reaped by init")
        self._sweep_shm("left by an earlier run")
        self._state_file = self._write_state()
        # probes, warm-ups and scrapes: one session for TCP instances, one per instance socket
        session = Sessions(connector={"limit": 0, "force_close": False}, timeout=aiohttp.ClientTimeout(total=None))
        if self._ops is None:
            self._ops = SystemOperations(session)
        try:
            if self.config.vllm.listen == "unix" or wants_kv_events(self.config):  # private (0700) before any instance binds there
                logger.info("instance sockets in %s", prepare_instance_dir(self.config.proxy.port, self.environ))
            self.fleet.build()
            api_key = self.environ.get("VSUP_API_KEY") or self.config.proxy.api_key
            self.proxy = ProxyServer(self.config.proxy, self.pool, api_key=api_key, models=model_proxies(self.config),
                                     names=model_names(self.config), batch=self.config.batch,
                                     batch_dir=batch_dir(self.config, self.environ), batch_slots=batch_slots(self.config))
            await self.proxy.start()
            self.metrics.start(self.config, self.proxy, session)
            self.control = ControlServer(control_socket_path(self.config, self.environ), self)
            await self.control.start()
            logger.info("control socket %s", self.control.path)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_stop_signal, sig)
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

            for inst in self.instances:
                self.fleet.launch_driver(inst)
            self.watchdog = MemoryWatchdog(self.ops, lambda: self.config, lambda: self.instances,
                                           lambda inst: self.fleet.plans[inst.name].memory_bytes, self._watchdog_waits)
            self._tasks = [asyncio.create_task(self._start_all(), name="start"),
                           asyncio.create_task(self._tick(), name="tick"),
                           asyncio.create_task(self.watchdog.run(), name="memory watchdog")]
            self.readiness.update()
            await self._stop_requested.wait()
            code = 1 if self._crashed else 0
            if not await self._shutdown():
                code = 1
            return code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await self.changes.cancel()
            tasks = [*self._tasks, *self.fleet.drivers.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._async_step("stopping the metrics collector", self.metrics.close())
            # last resort, when run() itself was interrupted before the shutdown: no instance
            # process outlives vsup's own stop
            for inst in self.fleet.drivers:
                if inst.child is not None:
                    await self._async_step(f"stopping instance {inst.name}'s processes",
                                           self.ops.stop_tree(inst.child, self.config.stop.timeout))
                    inst.child = None
            if self.proxy is not None:  # no-op after the drain; closes it when startup failed later
                await self._async_step("closing the proxy", self.proxy.stop())
            if self.control is not None:
                await self._async_step("removing the control socket", self.control.stop())
            await self._async_step("closing the HTTP session", session.close())
            for log in self.fleet.logs.values():
                self._step(f"closing the log {log.name}", log.close)
            self._step("closing the sd_notify socket", self.notifier.close)
            if all(inst.child is None for inst in self.fleet.drivers):
                if self._state_file is not None:
                    self._step("removing the state file", self._state_file.unlink, True)
                if self.config.vllm.listen == "unix":
                    self._step("removing the instance sockets", remove_instance_dir, self.config.proxy.port, self.environ)

    def _write_state(self) -> Path | None:
        """The state file that lets the next vsup clean up if this one is killed (leftovers.py):
        the instances' ports and their spare ports (where a reload may start a replacement)."""
        spare = spare_base_port(self.config)
        ports = sorted({p.port for p in self.plan.instances} | {spare + p.index for p in self.plan.instances}
                       | {inst.port for inst in self.fleet.drivers})
        try:
            return leftovers.write_state(prepare_runtime_dir(self.environ), config=self.config_path,
                                         proxy=f"{self.config.proxy.host}:{self.config.proxy.port}",
                                         ports=ports)
        except (VsupError, OSError) as exc:
            logger.warning("cannot write the state file (%s): if this vsup is killed, the next one cannot "
                           "clean up what it leaves running", exc)
            return None

    async def _start_all(self) -> None:
        choice = choose_start(self.plan, self.config.start.mode)
        logger.info("start: %s", choice.describe())
        if choice.mode == "parallel":
            for inst in self.instances:
                inst.start()
            return
        for inst in list(self.instances):
            if self.stopping:
                return
            inst.start()
            # the next starts once this one is ready or its first start failed (N weight loads at
            # once would spike memory together)
            await inst.wait_for(functools.partial(self._first_start_over, inst))

    def _first_start_over(self, inst: Instance) -> bool:
        return self.stopping or (inst.starts >= 1 and inst.state not in (State.STARTING, State.WARMING))

    async def _shutdown(self) -> bool:
        """Drain, then stop every instance. No step can skip the ones after it: an exception in
        one is logged and the next runs (the instances are stopped whatever happened before).
        Returns True when every step went through."""
        self.stopping = True
        await self.changes.cancel()  # its instances are stopped below with the others
        drain = self.config.proxy.drain_timeout
        ok = self._step("telling systemd", self._announce_stop, drain)
        logger.info("stopping: draining the proxy (up to %gs), then the instances (stop.timeout %gs each, in parallel)",
                    drain, self.config.stop.timeout)
        if self.proxy is not None:
            ok &= await self._async_step("draining the proxy", self.proxy.drain_and_stop(drain))
        drivers = dict(self.fleet.drivers)
        results = await asyncio.gather(*(self._stop_instance(inst, task) for inst, task in drivers.items()))
        ok &= all(results)
        for task in drivers.values():
            task.cancel()
        await asyncio.gather(*drivers.values(), return_exceptions=True)
        logger.info("stopped after %.1fs", self.now() - self.started_at)
        return ok

    def _announce_stop(self, drain: float) -> None:
        self.notifier.stopping(f"stopping: draining the proxy, then {len(self.fleet.drivers)} instances")
        self.notifier.extend_timeout(drain + self.config.stop.timeout + 10)

    async def _stop_instance(self, inst: Instance, driver: asyncio.Task[None]) -> bool:
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
    def _step(what: str, function: Callable[..., object], *args: object) -> bool:
        try:
            function(*args)
            return True
        except Exception:
            logger.exception("stopping: %s failed; going on with the next step", what)
            return False

    @staticmethod
    async def _async_step(what: str, awaitable: Awaitable[object]) -> bool:
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
        self.stopping = True
        self._stop_requested.set()

    def _on_sighup(self) -> None:
        if self.stopping:
            return
        logger.info("SIGHUP: reloading the configuration")
        self.changes.signal("SIGHUP")  # coalesced: one follow-up for every SIGHUP during a reload

    # ---- fleet.Owner: reacting to instances --------------------------------------------------------

    def on_transition(self, inst: Instance, transition: Transition) -> None:
        ready = transition.new is State.READY
        if inst.name in self.pool.states():
            self.pool.set_state(inst.name, transition.new.value, ready)
        if transition.new is State.STARTING:
            self.fleet.placement[inst.name] = None
        elif ready:
            self._check_placement(inst)
        elif transition.new in (State.BACKOFF, State.FAILED):
            # stop_tree removed the files of the processes it found; a tree that died in pieces
            # may have left some no process maps any more
            self._sweep_shm(f"after instance {inst.name} failed")
        self.readiness.update()

    def on_driver_crash(self, task: asyncio.Task[None]) -> None:
        logger.error("instance driver %s crashed; stopping everything", task.get_name(), exc_info=task.exception())
        self._crashed = True
        self.stopping = True
        self._stop_requested.set()

    def on_members_changed(self) -> None:
        self._write_state()

    def on_fleet_changed(self) -> None:
        self.readiness.update()

    def in_flight(self, name: str) -> int:
        return self.proxy.in_flight().get(name, 0) if self.proxy is not None else 0

    def _sweep_shm(self, why: str) -> None:
        def report(future: asyncio.Future[list[str]]) -> None:
            if future.cancelled():
                return
            if future.exception() is not None:
                logger.warning("sweeping stale /dev/shm files %s failed: %s", why, future.exception())
            elif future.result():
                logger.info("removed %d stale /dev/shm files %s", len(future.result()), why)
        future = asyncio.get_running_loop().run_in_executor(None, self.host.sweep_stale_shm)
        future.add_done_callback(report)

    def _check_placement(self, inst: Instance) -> None:
        plan = self.fleet.plans.get(inst.name)
        if plan is None or inst.child is None:
            return
        launcher = self.plan.settings.launcher
        if launcher == "none" or not plan.argv:
            return  # nothing was pinned, so nothing can drift
        # taskset pins CPUs only: memory placement is not part of such a plan
        nodes = plan.nodes if launcher == "numactl" and plan.nodes else None
        drift = self.host.placement_drift(inst.child, plan.cpus, nodes)
        if drift is None:
            return  # not a process this host can read
        self.fleet.placement[inst.name] = drift
        for line in drift:
            logger.warning("instance %s: placement drift: %s", inst.name, line)

    async def _tick(self) -> None:
        interval = min(TICK, self.notifier.watchdog_interval or TICK)
        while True:
            self.notifier.watchdog()
            self.readiness.update()
            self.host.reap_orphans()
            record = self.changes.record
            reloading = record is not None and record.kind == "reload" and self.changes.busy() is not None
            if reloading or (not self.readiness.sent and any(inst.state is not State.FAILED for inst in self.instances)):
                self.notifier.extend_timeout(max(EXTEND_BY, 3 * interval))  # model loads (a reload's too)
            await asyncio.sleep(interval)

    def _watchdog_waits(self) -> str | None:
        if self.stopping:
            return "vsup is stopping"
        return self.changes.busy()

    # ---- requests from the control endpoint (control.Controlled) ---------------------------------

    @property
    def instance_count(self) -> int:
        return len(self.fleet.instances)

    @property
    def instance_indexes(self) -> list[int]:
        """The fleet's indexes (a removed model leaves holes)."""
        return self.fleet.instances.indexes()

    def instance(self, index: int) -> Instance:
        inst = self.fleet.instances.get(index)
        if inst is None:
            raise VsupError(f"no instance {index}: this vsup runs instances {self.fleet.instances.describe()}")
        return inst

    async def restart(self, indices: list[int], rolling: bool) -> list[dict[str, Any]]:
        """Restart the given instances: all at once, or one at a time (a rollout: each drained,
        restarted and warmed up, the next only once it is ready again). Returns the status of each
        instance handled; a rolling restart stops at an instance that does not come back (the
        caller sees it is not ready)."""
        targets = [self.instance(i) for i in indices]
        if not rolling:
            self.changes.check_free("nothing is restarted")
            await asyncio.gather(*(inst.restart() for inst in targets))
            return [self.instance_status(inst) for inst in targets]
        record = await self.changes.rolling_restart(targets)
        return [self.instance_status(self.fleet.instances[step.index]) for step in record.steps
                if step.state in ("done", "failed") and step.index in self.fleet.instances]

    async def reload(self, trigger: str = "vsup reload", wait: bool = True) -> dict[str, Any]:
        """Re-read the config file and apply the difference (reloading.py). VsupError, and nothing
        changed, when refused. Returns the rollout's record."""
        return await self.changes.reload(trigger, wait)

    @property
    def rollout(self) -> Record | None:
        """The last reload or rolling restart."""
        return self.changes.record

    def instance_statuses(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self.instance_status(self.instance(i)) for i in indices]

    def status(self) -> dict[str, Any]:
        return status_json.status(self)

    def instance_status(self, inst: Instance) -> dict[str, Any]:
        return status_json.instance_status(self, inst)
