"""What a running vsup says about itself: the JSON the control socket serves (`vsup status`, the
proxy's /status page), and what it tells systemd (`Readiness`: READY=1 once enough instances are
ready, the one-line STATUS= whenever it changes).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vsup.config.fleet import is_fleet, models_of, served_name
from vsup.config.schema import VsupConfig
from vsup.observe import by_model
from vsup.proxy.address import label
from vsup.safetext import printable
from vsup.supervisor.lifecycle import Instance
from vsup.supervisor.states import State
from vsup.systemd.notify import Notifier

if TYPE_CHECKING:
    from vsup.supervisor.fleet import Fleet
    from vsup.supervisor.supervisor import Supervisor

logger = logging.getLogger("vsup.supervisor")


def status(sup: Supervisor) -> dict[str, Any]:
    proxy, config = sup.proxy, sup.config
    now = sup.now()
    instances = [instance_status(sup, inst) for inst in sup.instances]
    return {
        "vsup": {
            "pid": os.getpid(),
            "uptime": round(now - sup.started_at, 3),
            "config": sup.config_path,
            "proxy": f"{config.proxy.host}:{proxy.port if proxy else config.proxy.port}",
            "in_flight": proxy.total_in_flight() if proxy else 0,
            "ready": ready_count(sup.instances),
            "stopping": sup.stopping,
            "reserved_cpus": list(sup.plan.reserved_cpus),
            "control_socket": str(sup.control.path) if sup.control else None,
            "metrics_interval": config.metrics.interval,
        },
        # the proxy's admission queues by model (proxy.max_in_flight_per_instance): waiting by priority, waits so far
        "queues": proxy.queues() if proxy else {},
        # the Batch API's running batches and those ended in the last hour: counts, rate, ETA (batch/watch.py);
        # the owner is its key's name, never a key (this JSON is the control socket's: 0600, vsup's user)
        "batches": proxy.batches() if proxy else [],
        # per model: its instances' indexes, ready count, states, in flight (by_model.summarize)
        "models": by_model.summarize(instances, model_order(config)),
        "instances": instances,
        # a rollout's new instance before it joins the fleet, a replaced one while it drains
        "changing": [instance_status(sup, inst) for inst in sup.fleet.outside()],
        "rollout": sup.changes.to_json(),  # its state "pending" while a SIGHUP's follow-up reload waits
    }


def instance_status(sup: Supervisor, inst: Instance) -> dict[str, Any]:
    now = sup.now()
    plan = sup.fleet.plans[inst.name]
    drift = sup.fleet.placement.get(inst.name)
    return {
        "index": inst.index,
        "name": inst.name,
        "model": model_of(sup.fleet, inst),
        "state": inst.state.value,
        "pid": inst.pid,
        "port": inst.port,  # its slot: base_port + i, or spare_base_port + i beside
        "address": label(inst.url),  # where it listens: its Unix socket, or 127.0.0.1:<port> (vllm.listen)
        "cpus": list(plan.cpus),
        "nodes": list(plan.nodes),
        "uptime": round(now - inst.started_at, 3) if inst.pid is not None and inst.started_at is not None else None,
        "in_state_for": round(now - inst.since, 3),
        # starting or warming: where the start is and since when, the load's progress, when it last
        # moved, a waiting line of vLLM's explained (phases.StartWatch); None otherwise
        "phase": inst.watch.to_json(now) if inst.watch is not None and inst.state in (State.STARTING, State.WARMING) else None,
        # the current process's start once it reached ready: seconds from the spawn to ready, each phase's
        "start": inst.watch.record() if inst.watch is not None else None,
        "restarts": inst.restarts,
        "last_exit": inst.last_exit,
        "placement_ok": None if drift is None else not drift,
        "placement_drift": drift or [],
        "in_flight": sup.in_flight(inst.name),
        "next_start_in": round(max(0.0, inst.next_start_at - now), 3) if inst.next_start_at else None,
        "backoff_failures": inst.policy.attempt,
        "memory_watchdog": sup.watchdog.status(inst) if sup.watchdog is not None else None,
        # the last background collection (observe/collector.py); None when off or not yet done
        "metrics": sup.metrics.figures(inst.name),
        "transitions": [
            {"at": round(t.at - sup.started_at, 3), "from": t.old.value, "to": t.new.value,
             "event": t.event.value, "reason": t.reason}
            for t in inst.history
        ],
    }


def model_of(fleet: Fleet, inst: Instance) -> str:
    """The served model name of the instance's plan; a plan without one (made by the single-model
    planner) serves the single-model config's one model."""
    plan = fleet.plans.get(inst.name)
    if plan is not None and plan.model:
        return plan.model
    config = fleet.owner.config
    return "" if is_fleet(config) else served_name(config)


def model_order(config: VsupConfig) -> list[str]:
    return [view.name for view in models_of(config)]


def status_line(sup: Supervisor) -> str:
    """systemd's STATUS=: how many are ready (per model when there are several), what is starting
    (and its phase) or failed, a rollout's progress."""
    instances = sup.instances
    in_flight = sup.proxy.total_in_flight() if sup.proxy is not None else 0
    models = by_model.summarize(({"model": model_of(sup.fleet, inst), "index": inst.index, "state": inst.state.value}
                                 for inst in instances), model_order(sup.config))
    if len(models) > 1:  # "chat 2/2 ready, embed 0/1 ready": the names come from the config, shown as data
        text = ", ".join(printable(by_model.ready_text(m)) for m in models) + f", {in_flight} in flight"
    else:
        text = f"{ready_count(instances)}/{len(instances)} instances ready, {in_flight} in flight"
    failed = [inst.name for inst in instances if inst.state is State.FAILED]
    loading = [f"{inst.name} ({inst.watch.phase.value})" if inst.watch is not None else inst.name
               for inst in instances if inst.state in (State.STARTING, State.WARMING)]
    if loading:  # "starting: 0 (compiling), 1 (loading)": systemctl status shows where the starts are
        text += f"; starting: {', '.join(loading)}"
    if failed:
        text += f"; failed: {','.join(failed)}"
    record = sup.changes.record
    if record is not None and record.state == "running":
        done = sum(step.state == "done" for step in record.steps)
        text += f"; {record.kind}: {done}/{len(record.steps)} done"
    if sup.stopping:
        text = "stopping; " + text
    return text


def ready_count(instances: list[Instance]) -> int:
    return sum(inst.state is State.READY for inst in instances)


def ready_enough(config: VsupConfig, instances: list[Instance]) -> bool:
    """Whether vsup may tell systemd READY=1 (`notify.ready_when`)."""
    states = [inst.state for inst in instances]
    if config.notify.ready_when == "any":
        return State.READY in states
    # all: every instance ready, except ones that already gave up (failed) — they must not keep
    # the whole service from starting while the others serve
    return State.READY in states and all(s in (State.READY, State.FAILED) for s in states)


class Readiness:
    """READY=1 and STATUS= for systemd (sd_notify), sent only when something changed."""

    def __init__(self, sup: Supervisor, notifier: Notifier) -> None:
        self.sup = sup
        self.notifier = notifier
        self.sent = False  # READY=1 went out
        self._text = ""

    def update(self) -> None:
        sup = self.sup
        text = status_line(sup)
        if not self.sent and not sup.stopping and sup.proxy is not None and ready_enough(sup.config, sup.instances):
            self.sent = True
            self._text = text
            self.notifier.ready(text)
            logger.info("ready: %s", text)
            return
        if text != self._text:
            self._text = text
            self.notifier.status(text)

    def ready_again(self) -> None:
        """READY=1 again after a reload's RELOADING=1."""
        self._text = ""
        self.notifier.ready(status_line(self.sup))
