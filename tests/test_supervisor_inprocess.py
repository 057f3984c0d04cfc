"""`Supervisor.run` in-process: the real proxy, control socket and signal handling, with the
instances' processes and clock faked (tests/lifecycle_fakes.py). What a subprocess test cannot
reach: a step of the shutdown that raises must not leave the instances running."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.lifecycle_fakes import FakeOps, VirtualClock
from tests.machines import make_machine
from vsup.supervisor import proctree
from vsup.supervisor.config import VsupConfig
from vsup.supervisor.lifecycle import Intent, State
from vsup.supervisor.notify import Notifier
from vsup.supervisor.planning import settings_from_config
from vsup.supervisor.proxy import ProxyServer
from vsup.supervisor.supervisor import Supervisor
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


@pytest.fixture
def restore_subreaper():
    yield
    proctree.stop_being_subreaper()  # Supervisor.run made this test process a subreaper


@pytest.mark.parametrize("failing", ["notify", "drain"])
async def test_a_failing_shutdown_step_still_stops_every_instance(tmp_path, monkeypatch, caplog, restore_subreaper, failing):
    config = make_config(tmp_path)
    ops = FakeOps(load_time=2.0)
    notifier = ExplodingNotifier() if failing == "notify" else Notifier(None)
    if failing == "drain":
        async def broken_drain(self, timeout):
            raise RuntimeError("the drain broke")
        monkeypatch.setattr(ProxyServer, "drain_and_stop", broken_drain)
    the_plan = plan(make_machine(cores_per_node=4), settings_from_config(config))
    sup = Supervisor(config, the_plan, notifier=notifier, environ={"TMPDIR": str(tmp_path)}, ops=ops)
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


async def test_restart_requests_after_the_stop_began_are_refused_and_change_nothing(tmp_path, restore_subreaper):
    config = make_config(tmp_path)
    ops = FakeOps(load_time=2.0, stop_time=3.0)
    sup = Supervisor(config, plan(make_machine(cores_per_node=4), settings_from_config(config)),
                     notifier=Notifier(None), environ={"TMPDIR": str(tmp_path)}, ops=ops)
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
