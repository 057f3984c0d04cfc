"""What vsup keeps per instance restart is bounded: the real Supervisor, proxy and lifecycle over
fake processes on a virtual clock (tests/lifecycle_fakes.py), an instance killed over and over.
bench/soak.py watches the same over real processes for half an hour; this catches a per-restart
leak (a task, a transition record, a log buffer, a per-run series) in seconds."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import tracemalloc
from collections import Counter

import pytest

from tests.lifecycle_fakes import FakeOps
from tests.machines import make_machine
from tests.test_supervisor_inprocess import make_config, until
from vsup.config.planning import settings_from_config
from vsup.config.schema import VsupConfig
from vsup.proxy.metrics import _asyncio_tasks
from vsup.supervisor.lifecycle import HISTORY, State
from vsup.supervisor.supervisor import Supervisor
from vsup.systemd.notify import Notifier
from vsup.topology.planner import plan

pytestmark = pytest.mark.timeout(240)
WARM, RESTARTS = 20, 120


def census() -> Counter:
    """vsup's own objects alive, by class (transition records, instances' runs, logs, decisions):
    the whole heap's count swings by the tasks in flight at the moment it is taken."""
    return Counter(type(o).__qualname__ for o in gc.get_objects() if str(vars(type(o)).get("__module__", "")).startswith("vsup."))


async def test_a_hundred_kills_keep_no_more_tasks_objects_or_memory(tmp_path, restore_subreaper):
    raw = make_config(tmp_path).model_dump(mode="json")
    raw["restart"].update(max_failures=100_000, max_delay=0.001)
    config = VsupConfig.model_validate(raw)
    ops = FakeOps(load_time=0.5)
    sup = Supervisor(config, plan(make_machine(cores_per_node=4), settings_from_config(config)),
                     notifier=Notifier(None), environ={"TMPDIR": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}, ops=ops)
    running = asyncio.create_task(sup.run())

    try:
        def ready() -> bool:
            return len(sup.instances) == 2 and all(i.state is State.READY for i in sup.instances)

        await until(ready, ops.clock, "both ready")
        # pytest keeps every log record it captures (at --log-level INFO, ~10 KB per restart):
        # that is pytest's memory, not vsup's, so the INFO lines are not emitted while measuring
        logging.disable(logging.INFO)
        tracemalloc.start()
        try:
            for n in range(RESTARTS):
                inst = sup.instances[n % 2]
                starts = inst.starts
                inst.child.exit(-signal.SIGKILL)
                await until(lambda inst=inst, starts=starts: inst.starts > starts and ready(), ops.clock, "ready again")
                del ops.processes[:-2], ops.stopped[:], ops.warmups[:]  # what the fake itself records
                if n == WARM:
                    gc.collect()
                    tasks, objects, (memory, _) = _asyncio_tasks(), census(), tracemalloc.get_traced_memory()
            gc.collect()
            grown = census() - objects
            grown_objects = sum(grown.values())
            grown_memory = tracemalloc.get_traced_memory()[0] - memory
        finally:
            tracemalloc.stop()
            logging.disable(logging.NOTSET)
        per_restart = RESTARTS - WARM - 1
        assert _asyncio_tasks() <= tasks + 2  # a probe or a timer may be in flight at either moment
        assert grown_objects < 10, f"{grown_objects} more of vsup's objects after {per_restart} more restarts: {grown.most_common(8)}"
        # the stale /dev/shm sweep after each failure runs in a thread and reads all of /proc: up to
        # ~0.5 MB in flight at either moment; a leak of 10 KB per restart would be twice that
        assert grown_memory < 1 << 20, f"{grown_memory} B more after {per_restart} more restarts"
        assert all(len(i.history) <= HISTORY for i in sup.instances)
    finally:  # also after a failed assertion: a running supervisor would hang the test's teardown
        sup._on_stop_signal(signal.SIGTERM)
        await until(running.done, ops.clock, "vsup stopped")


@pytest.fixture
def restore_subreaper():
    from vsup.supervisor import proctree

    yield
    proctree.stop_being_subreaper()
