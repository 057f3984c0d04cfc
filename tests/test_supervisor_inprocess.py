"""`Supervisor.run` in-process: the real proxy, control socket and signal handling, with the
instances' processes and clock faked (tests/lifecycle_fakes.py) and what vsup does to its own
process and the machine recorded (tests/host_fakes.py). What a subprocess test cannot reach: a step
of the shutdown that raises must not leave the instances running; what the supervisor asks of
the host."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest
import yaml

from tests.host_fakes import RecordingHost
from tests.lifecycle_fakes import FakeOps, VirtualClock
from tests.machines import make_machine
from tests.sysfs_builder import build_sysfs
from vsup.config.planning import settings_from_config
from vsup.config.schema import VsupConfig, load_config
from vsup.errors import VsupError
from vsup.proxy import ProxyServer
from vsup.supervisor.preflight import checked_plan
from vsup.supervisor.states import Event, Intent, State
from vsup.supervisor.supervisor import Supervisor
from vsup.systemd.notify import Notifier
from vsup.topology.planner import plan

pytestmark = pytest.mark.timeout(60)


def make_config(tmp_path) -> VsupConfig:
    return VsupConfig.model_validate({
        "model": "m",
        "instances": 2,
        "placement": {"launcher": "none", "reserve_cores": 0, "model_size_gib": 0.01, "kvcache_gib": 0.01,
                      "overhead_gib": 0.01, "memory_reserve_gib": 0.1},
        "proxy": {"port": 0, "drain_timeout": 1},
        "health": {"interval": 1.0, "timeout": 1.0, "startup_timeout": 30},
        "start": {"mode": "parallel"},
        "stop": {"timeout": 5},
        "log": {"dir": str(tmp_path / "logs"), "echo": False},
        "control": {"socket": str(tmp_path / "control.sock")},
    })


async def until(predicate, clock: VirtualClock, what: str, timeout: float = 30.0) -> None:
    """Real I/O (proxy, control socket) runs on real time, the instances on the virtual clock:
    settle, jump the virtual clock when something waits on it, else give real time a moment."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await clock.settle()
        if not predicate() and not clock._jump(clock.time + 10_000):
            await asyncio.sleep(0.01)


class ExplodingNotifier(Notifier):
    """What `stop.timeout: .inf` did to the real one: the first message of the stop raised."""

    def __init__(self) -> None:
        super().__init__(None)

    def stopping(self, status: str | None = None) -> None:
        raise OverflowError("cannot convert float infinity to integer")


@pytest.mark.parametrize("failing", ["notify", "drain"])
async def test_a_failing_shutdown_step_still_stops_every_instance(tmp_path, monkeypatch, caplog, failing):
    config = make_config(tmp_path)
    ops = FakeOps(load_time=2.0)
    notifier = ExplodingNotifier() if failing == "notify" else Notifier(None)
    if failing == "drain":
        stop_proxy = ProxyServer.drain_and_stop

        async def broken_drain(self, timeout):
            await stop_proxy(self, 0)   # its sockets and sessions closed, then the step fails
            raise RuntimeError("the drain broke")
        monkeypatch.setattr(ProxyServer, "drain_and_stop", broken_drain)
    the_plan = plan(make_machine(cores_per_node=4), settings_from_config(config))
    sup = Supervisor(config, the_plan, notifier=notifier, environ={"TMPDIR": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}, ops=ops,
                     host=RecordingHost())
    running = asyncio.create_task(sup.run())
    await until(lambda: len(sup.instances) == 2 and all(i.state is State.READY for i in sup.instances), ops.clock,
                "both instances ready")
    assert len(ops.processes) == 2

    sup._on_stop_signal(signal.SIGTERM)
    await until(running.done, ops.clock, "vsup stopped")
    assert running.result() == 1  # a step failed: not a clean stop, but a complete one
    assert sorted(ops.stopped) == sorted(p.pid for p in ops.processes)  # every tree was stopped
    assert all(p.returncode is not None for p in ops.processes)
    assert [i.state for i in sup.instances] == [State.STOPPED, State.STOPPED]
    assert not (tmp_path / "control.sock").exists()
    assert not list(tmp_path.glob("vsup-*/vsup-*.json"))  # every instance stopped: the state file is gone
    step = "telling systemd" if failing == "notify" else "draining the proxy"
    assert f"stopping: {step} failed; going on with the next step" in caplog.text


async def test_restart_requests_after_the_stop_began_are_refused_and_change_nothing(tmp_path):
    config = make_config(tmp_path)
    ops = FakeOps(load_time=2.0, stop_time=3.0)
    sup = Supervisor(config, plan(make_machine(cores_per_node=4), settings_from_config(config)),
                     notifier=Notifier(None), environ={"TMPDIR": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}, ops=ops, host=RecordingHost())
    running = asyncio.create_task(sup.run())
    await until(lambda: len(sup.instances) == 2 and all(i.state is State.READY for i in sup.instances), ops.clock,
                "both instances ready")
    sup._on_stop_signal(signal.SIGTERM)
    await until(lambda: all(i.state is State.STOPPING for i in sup.instances), ops.clock, "stopping")
    for inst in sup.instances:  # the driver's precedence holds even without the supervisor's check
        inst.ask(Intent.RESTART)
    await until(running.done, ops.clock, "vsup stopped")
    assert running.result() == 0
    assert len(ops.processes) == 2 and [i.state for i in sup.instances] == [State.STOPPED, State.STOPPED]


async def test_the_supervisor_asks_its_host_to_pin_adopt_orphans_sweep_and_check_placement(tmp_path):
    base = make_config(tmp_path)
    config = base.model_copy(update={"placement": base.placement.model_copy(update={"launcher": "taskset",
                                                                                    "reserve_cores": 1})})
    the_plan = plan(make_machine(cores_per_node=4), settings_from_config(config, numactl_available=False))
    assert the_plan.reserved_cpus and all(p.argv for p in the_plan.instances)  # pinned, so placement is checked
    ops = FakeOps(load_time=2.0)
    host = RecordingHost(subreaper=False, drift=["pid 7 (VLLM::EngineCore): CPUs 0-7 outside plan 1-3"])
    sup = Supervisor(config, the_plan, notifier=Notifier(None), environ={"TMPDIR": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}, ops=ops, host=host)
    running = asyncio.create_task(sup.run())
    await until(lambda: len(sup.instances) == 2 and all(i.state is State.READY for i in sup.instances), ops.clock,
                "both instances ready")
    # before anything started: vsup on the reserved CPUs, the orphans' subreaper, last run's /dev/shm swept
    assert host.calls[:3] == [("pin_self", sorted(the_plan.reserved_cpus)), ("become_subreaper",),
                              ("sweep_stale_shm",)]
    # each instance, once ready, was read where the plan put it, and the drift the host saw is reported
    assert sorted(call[1:] for call in host.named("placement_drift")) == sorted(
        (inst.pid, list(p.cpus), None) for inst, p in zip(sup.instances, the_plan.instances, strict=True))
    (entry,) = {(s["placement_ok"], tuple(s["placement_drift"])) for s in sup.status()["instances"]}
    assert entry == (False, tuple(host.drift))
    await until(lambda: host.named("reap_orphans"), ops.clock, "a tick reaped orphans")

    sweeps = len(host.named("sweep_stale_shm"))
    ops.processes[0].exit(1)  # a failure: the driver backs off, and the supervisor sweeps after it
    await until(lambda: len(host.named("sweep_stale_shm")) > sweeps, ops.clock, "a sweep after the failure")
    sup._on_stop_signal(signal.SIGTERM)
    await until(running.done, ops.clock, "vsup stopped")
    assert running.result() == 0


# ---- reload and rolling restart: the rollout over fake processes on the virtual clock -------------------

def reload_config(tmp_path, **sections) -> dict:
    """A config file's content for the reload tests: a 2-node machine of 4 cores each (fsroot),
    the fake processes' command an existing program (the reload checks it as `vsup run` does)."""
    config = {
        "model": "m",
        "instances": 2,
        "placement": {"launcher": "none", "reserve_cores": 0, "model_size_gib": 0.01, "kvcache_gib": 0.01,
                      "overhead_gib": 0.01, "memory_reserve_gib": 0.1},
        "vllm": {"command": [sys.executable, "serve"], "base_port": 41000, "args": ["--dtype", "float32"]},
        "proxy": {"port": 0, "drain_timeout": 5},
        "health": {"interval": 1.0, "timeout": 1.0, "startup_timeout": 30},
        "start": {"mode": "parallel"},
        "stop": {"timeout": 5},
        "log": {"dir": str(tmp_path / "logs"), "echo": False},
        "control": {"socket": str(tmp_path / "control.sock")},
    }
    for section, values in sections.items():
        config[section] = {**config[section], **values} if isinstance(values, dict) else values
    return config


class Fleet:
    """A Supervisor over FakeOps, run in-process; `ready_counts` records the fleet's ready count
    after every transition (what the proxy's rotation had)."""

    def __init__(self, tmp_path, **sections) -> None:
        self.tmp_path = tmp_path
        self.fsroot = build_sysfs(tmp_path / "machine", nodes=(4, 4))
        self.path = tmp_path / "vsup.yaml"
        self.write(**sections)
        config = load_config(self.path)
        _machine, the_plan = checked_plan(config, str(self.fsroot), {}, runs_here=True)
        self.ops = FakeOps(load_time=2.0, stop_time=0.5)
        self.host = RecordingHost()
        self.sup = Supervisor(config, the_plan, config_path=str(self.path), notifier=Notifier(None),
                              environ={"TMPDIR": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}, ops=self.ops, host=self.host, fsroot=str(self.fsroot))
        self.rotation: list[int] = []  # len(pool.ready()) after every change of the proxy's rotation
        self.sup.pool.subscribe(lambda backend, state, ready: self.rotation.append(len(self.sup.pool.ready())))
        self.task: asyncio.Task | None = None

    def write(self, **sections) -> None:
        self.path.write_text(yaml.safe_dump(reload_config(self.tmp_path, **sections)))

    async def start(self) -> None:
        self.task = asyncio.create_task(self.sup.run())
        count = len(self.sup.plan.instances)
        await self.until(lambda: len(self.sup.instances) == count and self.ready() == count, "every instance ready")
        self.rotation.clear()

    def ready(self) -> int:
        return sum(i.state is State.READY for i in self.sup.instances)

    async def until(self, predicate, what: str) -> None:
        await until(lambda: predicate() or (self.task is not None and self.task.done()), self.ops.clock, what)
        if self.task is not None and self.task.done():
            raise AssertionError(f"vsup ended while waiting for {what}: {self.task.result()!r}")

    async def run(self, coroutine):
        job = asyncio.ensure_future(coroutine)
        await self.until(job.done, "the request to finish")
        return job.result()

    async def stop(self) -> int:
        self.sup._on_stop_signal(signal.SIGTERM)
        await until(self.task.done, self.ops.clock, "vsup stopped")
        return self.task.result()


def fleet_fixture(kind: type[Fleet]):
    """A fixture that starts fleets of `kind` on demand and stops each one the test left running."""

    @pytest.fixture
    async def fleet(tmp_path):
        made: list[Fleet] = []

        async def make(**sections) -> Fleet:
            f = kind(tmp_path, **sections)
            made.append(f)
            await f.start()
            return f

        yield make
        for f in made:
            if f.task is not None and not f.task.done():
                await f.stop()

    return fleet


fleet = fleet_fixture(Fleet)


async def test_reload_replaces_changed_instances_one_at_a_time_in_place_when_no_core_is_free(fleet):
    f = await fleet()
    old = [i.child for i in f.sup.instances]
    f.write(vllm={"args": ["--dtype", "bfloat16"]})
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done" and record["unchanged"] == [] and record["error"] is None
    assert [(s["index"], s["action"], s["state"]) for s in record["steps"]] == [(0, "replace", "done"), (1, "replace", "done")]
    assert record["steps"][0]["why"] == "command line -float32 +bfloat16"
    assert record["steps"][0]["how"].startswith("in place, on socket 0.sock: its CPUs")  # vllm.listen: unix
    new = [i.child for i in f.sup.instances]
    assert all(n is not o for n, o in zip(new, old, strict=True)) and all(o.returncode is not None for o in old)
    assert all(n.argv[-2:] == ["--dtype", "bfloat16"] for n in new)
    assert [i.name for i in f.sup.instances] == ["0", "1"] and [i.restarts for i in f.sup.instances] == [1, 1]
    assert min(f.rotation) == 1  # one instance fewer at most: there was no free core
    # one at a time: instance 1 left the rotation only after instance 0 was back in it
    zero_back = next(t.at for t in f.sup.instances[0].history if t.new is State.READY and t.at > 0.01 + f.sup.instances[0].history[2].at)
    one_drained = next(t.at for t in f.sup.instances[1].history if t.new is State.DRAINING)
    assert one_drained >= zero_back
    assert [t.new for t in f.sup.instances[1].history][-5:] == [State.DRAINING, State.STOPPING, State.STARTING,
                                                                 State.WARMING, State.READY]
    assert f.sup.status()["rollout"]["state"] == "done"


async def test_reload_starts_a_replacement_beside_the_old_one_when_its_cores_are_free(fleet):
    f = await fleet(instances=1, placement={"nodes": [0]})
    (old,) = f.sup.instances
    f.write(instances=1, placement={"nodes": [1]})  # the instance moves to node 1, whose cores are free
    record = await f.run(f.sup.reload("SIGHUP"))
    assert record["state"] == "done", record
    (step,) = record["steps"]
    assert step["why"].startswith("CPUs 0-3 -> 4-7; memory nodes 0 -> 1")
    assert step["how"] == "beside, on socket 0b.sock: its CPUs 4-7 are free"
    (new,) = f.sup.instances
    assert new is not old and new.name == "0b" and new.port == 41100 and new.state is State.READY
    assert old.state is State.STOPPED and old not in f.sup.fleet.drivers
    assert min(f.rotation) == 1  # never dark: the new one served before the old one drained
    assert [t.new for t in old.history][-3:] == [State.DRAINING, State.STOPPING, State.STOPPED]
    assert set(f.sup.pool.states()) == {"0b"}  # the old backend is gone from the proxy
    assert f.sup.status()["instances"][0]["cpus"] == [4, 5, 6, 7]
    # the next replacement goes back to the base port
    f.write(instances=1, placement={"nodes": [0]})
    record = await f.run(f.sup.reload("SIGHUP"))
    assert record["state"] == "done" and [(i.name, i.port) for i in f.sup.instances] == [("0", 41000)]


async def test_an_invalid_or_impossible_config_is_refused_and_nothing_changes(fleet):
    f = await fleet()
    before = [(i, i.child, i.starts) for i in f.sup.instances]
    for sections, message in [({"instances": "many"}, "instances: 'many' is not valid"),
                              ({"instances": 9}, "9 instance(s) need 9 physical cores"),
                              ({"proxy": {"port": 8999}}, "proxy.port (0 -> 8999): the proxy listens there; a running vsup cannot change this: restart vsup"),
                              ({"vllm": {"command": ["/no/such/vllm"]}}, "vllm.command: '/no/such/vllm' is not an executable")]:
        f.write(**sections)
        with pytest.raises(VsupError, match="reload refused, nothing was changed") as err:
            await f.run(f.sup.reload("vsup reload"))
        assert message in str(err.value)
        assert f.sup.rollout.state == "rejected" and message in f.sup.rollout.error
    assert [(i, i.child, i.starts) for i in f.sup.instances] == before and f.rotation == []
    assert f.sup.config.vllm.args == ["--dtype", "float32"]


async def test_unchanged_instances_keep_running_and_settings_apply_at_once(fleet):
    f = await fleet()
    before = [i.child for i in f.sup.instances]
    f.write(proxy={"policy": "least_outstanding", "api_key": "sekret", "first_byte_timeout": 12},
            health={"interval": 2.0, "warmup": {"max_tokens": 1}})
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done" and record["steps"] == [] and record["unchanged"] == [0, 1]
    assert record["applied"] == ["health.interval", "health.warmup.max_tokens", "proxy.api_key",
                                 "proxy.first_byte_timeout", "proxy.policy"]
    assert [i.child for i in f.sup.instances] == before and f.rotation == []
    proxy = f.sup.proxy
    assert proxy._balancer.name == "least_outstanding" and proxy._auth.enabled
    assert proxy._forwarder.config.first_byte_timeout == 12 and proxy._forwarder.drop_authorization
    assert all(i.config.health.interval == 2.0 for i in f.sup.instances)


async def test_a_changed_instance_count_adds_and_removes_the_same_way(fleet):
    f = await fleet(placement={"cores_per_instance": 2})
    f.write(instances=3, placement={"cores_per_instance": 2})
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    # three instances split the nodes 2 + 1: instance 1 moves beside itself onto node 0's free cores,
    # then instance 2 is added on node 1
    assert [(s["index"], s["action"], s["how"]) for s in record["steps"]] == [
        (1, "replace", "beside, on socket 1b.sock: its CPUs 2-3 are free"), (2, "add", "on socket 2.sock")]
    assert record["steps"][0]["why"].startswith("CPUs 4-5 -> 2-3; memory nodes 1 -> 0") and record["unchanged"] == [0]
    assert [i.state for i in f.sup.instances] == [State.READY] * 3 and min(f.rotation) >= 2
    f.write(instances=1, placement={"cores_per_instance": 2})
    record = await f.run(f.sup.reload("vsup reload"))
    assert [(s["index"], s["action"], s["state"]) for s in record["steps"]] == [(2, "remove", "done"), (1, "remove", "done")]
    assert len(f.sup.instances) == 1 and set(f.sup.pool.states()) == {"0"} and len(f.sup.fleet.drivers) == 1
    assert record["unchanged"] == [0] and min(f.rotation) >= 1


async def test_a_replacement_that_does_not_come_up_stops_the_reload_and_the_old_one_keeps_serving(fleet):
    f = await fleet(instances=1, placement={"nodes": [0]})
    (old,) = f.sup.instances
    f.ops.load_time = 1e9  # the new instance never answers /health
    f.write(instances=1, placement={"nodes": [1]}, health={"startup_timeout": 10})
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "failed" and "did not become ready" in record["error"]
    assert "not healthy after the startup timeout of 10s" in record["error"] and "keeps running its old command" in record["error"]
    assert f.sup.instances == [old] and old.state is State.READY and min(f.rotation) == 1
    assert len(f.sup.fleet.drivers) == 1 and set(f.sup.pool.states()) == {"0"}


async def test_one_rollout_at_a_time_and_none_while_stopping(fleet):
    f = await fleet()
    f.write(vllm={"args": ["--dtype", "bfloat16"]})
    first = asyncio.ensure_future(f.sup.reload("vsup reload"))
    await f.until(lambda: f.sup.changes.busy() is not None and "running" in f.sup.changes.busy(), "the reload runs")
    with pytest.raises(VsupError, match=r"a reload is running \(0 of 2 steps done\); nothing is reloaded"):
        await f.sup.reload("SIGHUP")
    with pytest.raises(VsupError, match="a reload is running"):
        await f.sup.restart([0], rolling=True)
    await f.until(first.done, "the first reload")
    assert first.result()["state"] == "done"


async def test_rolling_restart_drains_restarts_and_warms_each_instance_in_turn(fleet):
    f = await fleet()
    result = await f.run(f.sup.restart([0, 1], rolling=True))
    assert [r["state"] for r in result] == ["ready", "ready"] and [r["restarts"] for r in result] == [1, 1]
    assert min(f.rotation) == 1
    assert f.sup.rollout.kind == "rolling restart" and f.sup.rollout.state == "done"
    for inst in f.sup.instances:
        assert [t.event for t in inst.history][-5:] == [Event.DRAIN, Event.DRAINED, Event.RESTART, Event.HEALTHY, Event.WARMED]


async def test_a_new_base_port_moves_each_instance_one_at_a_time(fleet):
    # the reload probes the new ports for real: below the kernel's ephemeral range (32768-60999),
    # where no other test's outgoing connection can hold one as its local port
    f = await fleet(vllm={"listen": "tcp"})
    old = list(f.sup.instances)
    f.write(vllm={"listen": "tcp", "base_port": 22000})
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    assert [s["why"].split(";")[0] for s in record["steps"]] == ["port 41000 -> 22000", "port 41001 -> 22001"]
    assert [s["how"].split(":")[0] for s in record["steps"]] == ["in place, on port 22000", "in place, on port 22001"]
    assert [(i.name, i.port, i.state) for i in f.sup.instances] == [("0", 22000, State.READY), ("1", 22001, State.READY)]
    assert all(o.state is State.STOPPED and o not in f.sup.fleet.drivers for o in old)
    assert set(f.sup.pool.states()) == {"0", "1"} and {b.url for b in f.sup.pool.all()} == {
        "http://127.0.0.1:22000", "http://127.0.0.1:22001"}
    assert min(f.rotation) == 1


async def test_on_unix_sockets_a_new_base_port_moves_nothing(fleet):
    # the instances' sockets are <i>.sock whatever base_port says: a replacement "on the new port"
    # would have taken the running instance's own socket path
    f = await fleet()
    old = list(f.sup.instances)
    urls = {b.url for b in f.sup.pool.all()}
    assert all(url.startswith("unix:") for url in urls)
    f.write(vllm={"base_port": 22000})
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done" and record["steps"] == [] and record["unchanged"] == [0, 1], record
    assert f.sup.instances == old and all(i.state is State.READY for i in old)
    assert {b.url for b in f.sup.pool.all()} == urls and f.ops.stopped == []
