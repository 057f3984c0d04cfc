"""The pure parts of a rollout (vsup/supervisor/rollout.py): what changed, and whether a replacement
can start beside the instance it replaces. The rollout itself runs in tests/test_supervisor_inprocess.py
(fake processes) and tests/test_reload.py (fake vLLM)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.machines import make_machine
from vsup.config.planning import settings_from_config
from vsup.config.schema import VsupConfig
from vsup.supervisor.rollout import (
    Launch,
    Record,
    Rollout,
    Step,
    fixed_changes,
    launch_changes,
    live_changes,
    surge_room,
    unapplied_changes,
)
from vsup.topology.plan_model import GiB, LimitMemory
from vsup.topology.planner import plan

PLACEMENT = {"launcher": "taskset", "reserve_cores": 0, "model_size_gib": 4.0, "kvcache_gib": 2.0, "overhead_gib": 1.0,
             "memory_reserve_gib": 2.0}


def config(**sections) -> VsupConfig:
    data = {"model": "m", "instances": 2, "placement": PLACEMENT}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return VsupConfig.model_validate(data)


def planned(cfg: VsupConfig, **machine):
    return plan(make_machine(**machine), settings_from_config(cfg, numactl_available=False))


def test_launch_changes_name_what_differs():
    the_plan = planned(config(), sockets=2, cores_per_node=4)
    a, b = the_plan.instances
    old = Launch.of(["vllm", "serve", "m", "--dtype", "float32"], {"A": "1", "B": "2"}, a)
    assert launch_changes(old, old) == []
    new = Launch.of(["vllm", "serve", "m", "--dtype", "bfloat16", "--enforce-eager"], {"A": "1", "B": "3", "C": "0"}, b)
    assert launch_changes(old, new) == ["CPUs 0-3 -> 4-7", "memory nodes 0 -> 1",
                                        "command line -float32 +bfloat16 --enforce-eager", "environment B, C"]


def test_a_replacement_goes_beside_only_onto_free_cores_and_within_the_memory_budget():
    cfg = config(instances=1, placement={"nodes": [0]})
    (old,) = planned(cfg, sockets=2, cores_per_node=4, node_memory=64 * GiB).instances
    moved = planned(config(instances=1, placement={"nodes": [1]}), sockets=2, cores_per_node=4, node_memory=64 * GiB)
    (new,) = moved.instances
    assert surge_room(new, [old], moved) == (True, "its CPUs 4-7 are free")
    assert surge_room(old, [old], moved) == (False, "its CPUs 0-3 are in use")
    # both on node 0's memory: 7 GiB each, a budget of 10 GiB holds one
    small = planned(cfg, sockets=2, cores_per_node=4, node_memory=12 * GiB)
    beside = dataclasses.replace(old, cpus=(2, 3), omp_cpus=(2, 3))
    old_half = dataclasses.replace(old, cpus=(0, 1), omp_cpus=(0, 1))
    ok, why = surge_room(beside, [old_half], small)
    assert not ok and why == "node 0's memory budget 10 GiB does not hold both (14 GiB)"
    limited = dataclasses.replace(moved, memory_limit=LimitMemory(12 * GiB, "cgroup", 10 * GiB, 7 * GiB))
    assert surge_room(new, [old], limited) == (False, "the cgroup memory budget 10 GiB does not hold both")


def test_keys_a_running_vsup_cannot_change_and_the_ones_it_applies_at_once():
    old = config()
    new = config(proxy={"port": 9000, "policy": "least_outstanding"}, health={"warmup": {"prompt": "Hi"}},
                 log={"echo": False, "level": "debug"}, vllm={"args": ["--x"]}, instances=3)
    assert fixed_changes(old, new) == ["log.echo (True -> False): the instances' log files are open",
                                       "proxy.port (8000 -> 9000): the proxy listens there"]
    assert live_changes(old, new) == ["health.warmup.prompt", "log.level", "proxy.policy"]
    assert fixed_changes(old, old) == [] and live_changes(old, old) == []
    # taken, but not acted on by a running vsup: reported as such, not as applied
    later = config(start={"mode": "parallel"}, proxy={"connect_timeout": 1.0})
    assert live_changes(old, later) == ["proxy.connect_timeout"] and fixed_changes(old, later) == []
    assert unapplied_changes(old, later) == [
        "start.mode (read when `vsup run` starts; a reload leaves the change for the next start)"]


def test_a_step_with_an_unknown_action_is_an_error_not_a_skip():
    record = Record("reload", "test", 0.0, steps=[Step(0, "frobnicate", "a typo in the planner")])
    with pytest.raises(ValueError, match="unknown action 'frobnicate'"):
        asyncio.run(Rollout(fleet=None, record=record).run())  # the fleet is never reached
    assert record.steps[0].state == "running"
