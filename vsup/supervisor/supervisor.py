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
  so the instances are always stopped (exit 1 then). SIGHUP gives failed instances a new chance
  (config reload is not supported: restart the service to apply a changed config);
- a metrics collector (observe/collector.py) looks at every instance in the background every
  `metrics.interval` seconds; the proxy appends its cached text to /metrics and serves /status;
- a state file in the runtime directory lets the next vsup clean up if this one is killed
  (leftovers.py); the instances' processes and clock come from an `Operations` object.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from vsup.supervisor import leftovers
from vsup.supervisor.backends import Backend, BackendPool
from vsup.supervisor.config import VsupConfig
from vsup.supervisor.control import ControlServer, control_socket_path
from vsup.supervisor.errors import VsupError
from vsup.supervisor.launch import build_command
from vsup.supervisor.lifecycle import Instance, State, Transition
from vsup.supervisor.logs import InstanceLog
from vsup.supervisor.notify import Notifier
from vsup.supervisor.observe.collector import Collector, Target
from vsup.supervisor.observe.page import status_page
from vsup.supervisor.operations import Operations, SystemOperations
from vsup.supervisor.placement import pin_self, placement_drift, read_placement
from vsup.supervisor.processes import Child, become_subreaper, reap_orphans, sweep_stale_shm, tree_pids
from vsup.supervisor.proxy import ProxyServer
from vsup.supervisor.rundir import prepare_runtime_dir
from vsup.topology.cpulist import format_list
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
    ) -> None:
        self.config = config
        self.plan = plan
        self.config_path = config_path
        self.notifier = notifier or Notifier.from_env(environ)
        self.environ = dict(environ)
        self.ops = ops  # None: SystemOperations over run()'s HTTP session
        self.pool = BackendPool(Backend(str(p.index), f"http://127.0.0.1:{p.port}") for p in plan.instances)
        self.instances: list[Instance] = []
        self.plans: dict[str, InstancePlan] = {str(p.index): p for p in plan.instances}
        self.placement: dict[str, list[str] | None] = {}  # name -> drift lines ([] ok, None not checked)
        self.proxy: ProxyServer | None = None
        self.control: ControlServer | None = None
        self.collector: Collector | None = None  # None: metrics.interval 0
        self.started_at = self._now()
        self._stop_requested = asyncio.Event()
        self._stopping = False
        self._ready_sent = False
        self._status_text = ""
        self._tasks: list[asyncio.Task] = []
        self._logs: list[InstanceLog] = []

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
        state_file = self._write_state()
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

            drivers = [asyncio.create_task(inst.run(), name=f"instance-{inst.name}") for inst in self.instances]
            self._tasks = [*drivers, asyncio.create_task(self._start_all(), name="start"),
                           asyncio.create_task(self._tick(), name="tick")]
            if self.collector is not None:
                self._tasks.append(asyncio.create_task(self.collector.run(), name="metrics"))
            self._update_status()
            waiter = asyncio.create_task(self._stop_requested.wait())
            done, _ = await asyncio.wait([waiter, *drivers], return_when=asyncio.FIRST_COMPLETED)
            code = 0
            for task in done:
                if task is not waiter and not task.cancelled() and task.exception() is not None:
                    logger.error("instance driver %s crashed; stopping everything", task.get_name(),
                                 exc_info=task.exception())
                    code = 1
            waiter.cancel()
            if not await self._shutdown(drivers):
                code = 1
            return code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            # last resort, when run() itself was interrupted before the shutdown: no instance
            # process outlives vsup's own stop
            for inst in self.instances:
                if inst.child is not None:
                    await self._async_step(f"stopping instance {inst.name}'s processes",
                                           self.ops.stop_tree(inst.child, self.config.stop.timeout))
                    inst.child = None
            if self.proxy is not None:  # no-op after the drain; closes it when startup failed later
                await self._async_step("closing the proxy", self.proxy.stop())
            if self.control is not None:
                await self._async_step("removing the control socket", self.control.stop())
            await self._async_step("closing the HTTP session", session.close())
            for log in self._logs:
                self._step(f"closing the log {log.name}", log.close)
            self._step("closing the sd_notify socket", self.notifier.close)
            if state_file is not None and all(inst.child is None for inst in self.instances):
                self._step("removing the state file", state_file.unlink, True)

    def _write_state(self) -> Path | None:
        """The state file that lets the next vsup clean up if this one is killed (leftovers.py)."""
        try:
            return leftovers.write_state(prepare_runtime_dir(self.environ), config=self.config_path,
                                         proxy=f"{self.config.proxy.host}:{self.config.proxy.port}",
                                         ports=[p.port for p in self.plan.instances])
        except (VsupError, OSError) as exc:
            logger.warning("cannot write the state file (%s): if this vsup is killed, the next one cannot "
                           "clean up what it leaves running", exc)
            return None

    def _build_instances(self) -> None:
        log_config = self.config.log
        directory = log_config.dir if log_config.dir is not None else default_log_dir(self.environ)
        for plan in self.plan.instances:
            argv, env = build_command(plan, self.config, self.environ)
            log = InstanceLog(
                f"i{plan.index}", directory, max_bytes=log_config.max_bytes, backups=log_config.backups,
                echo=log_config.echo, logger=logging.getLogger("vsup.instance"),
            )
            self._logs.append(log)
            instance = Instance(plan.index, argv, env, port=plan.port, config=self.config, log=log,
                                ops=self.ops, on_transition=self._on_transition)
            self.instances.append(instance)
            self.placement[instance.name] = None

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
            await inst.wait_for(lambda inst=inst: self._stopping or (inst.starts >= 1 and inst.state is not State.STARTING))

    async def _shutdown(self, drivers: list[asyncio.Task]) -> bool:
        """Drain, then stop every instance. No step can skip the ones after it: an exception in
        one is logged and the next runs (the instances are stopped whatever happened before).
        Returns True when every step went through."""
        self._stopping = True
        drain = self.config.proxy.drain_timeout
        ok = self._step("telling systemd", self._announce_stop, drain)
        logger.info("stopping: draining the proxy (up to %gs), then the instances (stop.timeout %gs each, in parallel)",
                    drain, self.config.stop.timeout)
        if self.proxy is not None:
            ok &= await self._async_step("draining the proxy", self.proxy.drain_and_stop(drain))
        results = await asyncio.gather(*(self._stop_instance(inst, task) for inst, task in zip(self.instances, drivers)))
        ok &= all(results)
        for task in drivers:
            task.cancel()
        await asyncio.gather(*drivers, return_exceptions=True)
        logger.info("stopped after %.1fs", self._now() - self.started_at)
        return ok

    def _announce_stop(self, drain: float) -> None:
        self.notifier.stopping(f"stopping: draining the proxy, then {len(self.instances)} instances")
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
        failed = [inst for inst in self.instances if inst.state is State.FAILED]
        logger.info("SIGHUP: giving %d failed instance(s) a new chance (config reload is not supported: "
                    "restart vsup to apply config changes)", len(failed))
        for inst in failed:
            inst.start()

    # ---- reacting to instances -------------------------------------------------------------------

    def _on_transition(self, inst: Instance, transition: Transition) -> None:
        ready = transition.new is State.READY
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
        plan = self.plans[inst.name]
        launcher = self.plan.settings.launcher
        if launcher == "none" or not plan.argv or not isinstance(inst.child, Child):
            return  # nothing was pinned, so nothing can drift
        # taskset pins CPUs only: memory placement is not part of such a plan
        nodes = plan.nodes if launcher == "numactl" and plan.nodes else None
        drift = placement_drift(read_placement(tree_pids(inst.child)), plan.cpus, nodes)
        self.placement[inst.name] = drift
        for line in drift:
            logger.warning("instance %s: placement drift: %s", inst.name, line)

    def _observed(self) -> list[Target]:
        """What the metrics collector looks at this round: a serving instance's /metrics, and the
        process tree of every instance that has one (a model load's memory shows too)."""
        targets = []
        for inst in self.instances:
            child = inst.child if isinstance(inst.child, Child) else None
            serving = inst.state in (State.READY, State.UNHEALTHY)
            targets.append(Target(
                name=inst.name,
                metrics_url=f"{inst.url}/metrics" if serving else None,
                nodes=tuple(self.plans[inst.name].nodes),
                leader=child.pid if child else None,
                token=child.token if child else None,
                known=dict(child.seen) if child else {},
            ))
        return targets

    def _ready_count(self) -> int:
        return sum(inst.state is State.READY for inst in self.instances)

    def _update_status(self) -> None:
        ready = self._ready_count()
        in_flight = self.proxy.total_in_flight() if self.proxy is not None else 0
        text = f"{ready}/{len(self.instances)} instances ready, {in_flight} in flight"
        failed = [inst.name for inst in self.instances if inst.state is State.FAILED]
        loading = [inst.name for inst in self.instances if inst.state is State.STARTING]
        if loading:
            text += f"; starting: {','.join(loading)}"
        if failed:
            text += f"; failed: {','.join(failed)}"
        if self._stopping:
            text = "stopping; " + text
        if not self._ready_sent and not self._stopping and self.proxy is not None and self._ready_enough():
            self._ready_sent = True
            self._status_text = text
            self.notifier.ready(text)
            logger.info("ready: %s", text)
            return
        if text != self._status_text:
            self._status_text = text
            self.notifier.status(text)

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
            if not self._ready_sent and any(inst.state is not State.FAILED for inst in self.instances):
                self.notifier.extend_timeout(max(EXTEND_BY, 3 * interval))
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
        """Restart the given instances: all at once, or one at a time with each ready again before
        the next goes down. Returns the status of each instance handled; a rolling restart stops at
        an instance that does not come back (the caller sees it is not ready)."""
        targets = [self.instance(i) for i in indices]
        if self._stopping:
            raise VsupError("vsup is stopping; nothing is restarted")
        if not rolling:
            await asyncio.gather(*(inst.restart() for inst in targets))
            return [self.instance_status(inst) for inst in targets]
        done = []
        for inst in targets:
            logger.info("rolling restart: instance %s", inst.name)
            state = await inst.restart()
            done.append(self.instance_status(inst))
            if state is not State.READY:
                logger.warning("rolling restart stopped: instance %s is %s (%s)", inst.name, state.value, inst.last_exit)
                break
        return done

    def instance_statuses(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self.instance_status(self.instance(i)) for i in indices]

    def status(self) -> dict[str, Any]:
        proxy = self.proxy
        return {
            "vsup": {
                "pid": os.getpid(),
                "uptime": round(self._now() - self.started_at, 3),
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
        }

    def instance_status(self, inst: Instance) -> dict[str, Any]:
        now = self._now()
        plan = self.plans[inst.name]
        drift = self.placement.get(inst.name)
        in_flight = self.proxy.in_flight().get(inst.name, 0) if self.proxy else 0
        return {
            "index": inst.index,
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
            # the last background collection (observe/collector.py); None when off or not yet done
            "metrics": self.collector.figures(inst.name) if self.collector else None,
            "transitions": [
                {"at": round(t.at - self.started_at, 3), "from": t.old.value, "to": t.new.value,
                 "event": t.event.value, "reason": t.reason}
                for t in inst.history
            ],
        }
