"""Placement read from /proc for real processes started under taskset / numactl, and drift."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import need_tool
from vsup.errors import VsupError
from vsup.supervisor.placement import ThreadPlacement, parse_mem_policy, placement_drift, read_placement

REPO = Path(__file__).resolve().parents[1]

# Starts two extra threads; the second pins itself to the CPU given in argv[1] (as vLLM's Worker pins
# each OpenMP thread to one CPU), then prints the tids and waits for stdin to close.
THREADED = r'''
import os, sys, threading
ready = threading.Barrier(3)
def idle(cpu):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ready.wait()
    sys.stdin.read()
tids = []
for cpu in (None, int(sys.argv[1]) if len(sys.argv) > 1 else None):
    t = threading.Thread(target=idle, args=(cpu,), daemon=True)
    t.start()
ready.wait()
print(" ".join(str(t) for t in sorted(int(t) for t in os.listdir("/proc/self/task"))), flush=True)
sys.stdin.read()
'''

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to make a mask wider than the plan")


class Started:
    def __init__(self, prefix: list[str], *args: str) -> None:
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", THREADED, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.tids = [int(t) for t in self.proc.stdout.readline().split()]
        assert len(self.tids) == 3, "the child did not start its threads"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture
def started():
    children: list[Started] = []

    def start(prefix: list[str], *args: str) -> Started:
        children.append(Started(prefix, *args))
        return children[-1]

    yield start
    for child in children:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait()
        child.proc.stdout.close()
        if not child.proc.stdin.closed:
            child.proc.stdin.close()


def test_taskset_child_every_thread_on_the_planned_cpu(started):
    cpu = CPUS[0]
    child = started(["taskset", "-c", str(cpu)])
    placements = read_placement([child.proc.pid])
    assert sorted(p.tid for p in placements) == child.tids
    assert all(p.pid == child.proc.pid and p.cpus_allowed == {cpu} for p in placements)
    assert all(p.process_comm == p.comm == "python" or p.process_comm.startswith("python") for p in placements)
    assert placement_drift(placements, [cpu], None) == []


@needs_two_cpus
def test_wider_mask_is_drift_and_one_thread_per_cpu_is_not(started):
    plan = [CPUS[0], CPUS[1]]
    child = started(["taskset", "-c", f"{plan[0]},{plan[1]}"], str(plan[1]))
    placements = read_placement([child.proc.pid])
    by_cpus = sorted(sorted(p.cpus_allowed) for p in placements)
    assert by_cpus == sorted([[plan[1]], plan, plan])  # the self-pinned thread is a subset: fine
    pinned = next(p.tid for p in placements if p.cpus_allowed == {plan[1]})
    assert placement_drift(placements, plan, None) == []
    lines = placement_drift(placements, [plan[0]], None)
    assert len(lines) == 3  # main thread, the unpinned one, and the one on the other CPU
    main = f"pid {child.proc.pid} (python"
    assert any(line.startswith(main) and f": CPUs {plan[0]}-{plan[1]} outside plan {plan[0]}" in line for line in lines)
    assert any(f"thread {pinned} " in line and f": CPUs {plan[1]} outside plan {plan[0]}" in line for line in lines)


def test_numactl_membind_shows_as_the_memory_policy(started):
    need_tool("numactl")
    cpu = CPUS[0]
    node = sorted(read_placement([os.getpid()])[0].mems_allowed)[0]
    child = started(["numactl", f"--physcpubind={cpu}", f"--membind={node}"])
    placements = read_placement([child.proc.pid])
    assert len(placements) == 3
    for p in placements:
        assert p.cpus_allowed == {cpu}
        assert (p.mem_policy, p.policy_nodes, p.memory_nodes) == ("bind", {node}, {node})
    assert placement_drift(placements, [cpu], [node]) == []
    other = node + 1  # a node the plan names but the process is not bound to
    lines = placement_drift(placements, [cpu], [other])
    assert len(lines) == 3 and all(f"memory policy bind on nodes {node} outside plan {other}" in line for line in lines)


def test_default_policy_without_numactl(started):
    child = started([])
    placements = read_placement([child.proc.pid])
    assert {p.mem_policy for p in placements} == {"default"}
    assert all(p.policy_nodes is None and p.memory_nodes == p.mems_allowed for p in placements)


def test_vanished_processes_are_skipped():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert read_placement([proc.pid]) == []


@pytest.mark.parametrize(
    "line, expected",
    [
        ("55893d423000 default file=/usr/bin/head mapped=2", ("default", None)),
        ("7f00 bind:0-1 anon=3 N0=3", ("bind", frozenset({0, 1}))),
        ("7f00 bind=static:2 anon=1", ("bind", frozenset({2}))),
        ("7f00 preferred:1 anon=1", ("preferred", frozenset({1}))),
        ("7f00 interleave:0,2 anon=1", ("interleave", frozenset({0, 2}))),
        ("7f00 prefer (many):0-1 anon=1", ("prefer (many)", frozenset({0, 1}))),
        ("7f00 weighted interleave:0-1 anon=1", ("weighted interleave", frozenset({0, 1}))),
        ("7f00 local anon=1", ("local", None)),
        ("7f00 mystery anon=1", None),
    ],
)
def test_parse_mem_policy(line, expected):
    assert parse_mem_policy(line) == expected


def test_memory_drift_on_a_two_node_plan():
    # Values as a 2-node machine reports them; the memory rule: policy nodes within the cpuset's.
    def t(mems, policy, nodes):
        return ThreadPlacement(pid=10, tid=10, comm="python", cpus_allowed=frozenset({4}), mems_allowed=frozenset(mems),
                               process_comm="python", mem_policy=policy, policy_nodes=None if nodes is None else frozenset(nodes))

    assert placement_drift([t({0, 1}, "bind", {1})], [4, 5], [1]) == []
    assert placement_drift([t({1}, "default", None)], [4, 5], [1]) == []  # a cpuset limited to node 1
    assert placement_drift([t({0, 1}, "default", None)], [4, 5], [1]) == [
        "pid 10 (python): memory policy default on nodes 0-1 outside plan 1"
    ]
    assert placement_drift([t({0, 1}, "default", None)], [4, 5], None) == []  # plan binds no memory


def _run_pin(cpus: str) -> subprocess.CompletedProcess:
    code = (
        "import os, threading, time\n"
        "from vsup.supervisor.placement import pin_self\n"
        "from vsup.errors import VsupError\n"
        "t = threading.Thread(target=time.sleep, args=(3,), daemon=True); t.start()\n"
        f"try:\n    pin_self({{{cpus}}})\nexcept VsupError as e:\n    print('error:', e); raise SystemExit(0)\n"
        "print(sorted({tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir('/proc/self/task')}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_pin_self_pins_every_thread():
    # In a child process: pinning the test runner itself would slow everything else down.
    result = _run_pin(str(CPUS[-1]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[({CPUS[-1]},)]"


def test_pin_self_refuses_cpus_it_cannot_have():
    result = _run_pin(f"{CPUS[0]}, 4095")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"error: cannot pin vsup to CPUs {CPUS[0]},4095: CPUs 4095 are not available here")
    with pytest.raises(VsupError, match="empty CPU set"):
        from vsup.supervisor.placement import pin_self

        pin_self([])
