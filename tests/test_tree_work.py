"""A starting instance's tree counters from /proc (proctree.read_counters, processes.tree_work,
TreeWork) on real processes: a child and grandchild that read a file and use CPU, and one that
does nothing; the sums only grow as processes come and go."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vsup.supervisor import proctree
from vsup.supervisor.processes import TreeWork, tree_work

pytestmark = pytest.mark.timeout(60)

# reads FILE (the page cache is enough: rchar counts read() calls) then burns CPU until told to stop
WORKER = """
import sys, time
with open(sys.argv[1], "rb") as f:
    while f.read(1 << 20):
        pass
print("read", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
time.sleep(60)
"""
# starts WORKER as its child (a grandchild of the test), then idles
PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
time.sleep(60)
"""


@pytest.fixture
def tree(tmp_path):
    started = []

    def start(busy: float) -> subprocess.Popen:
        data = tmp_path / "weights.bin"
        data.write_bytes(os.urandom(8 << 20))
        proc = subprocess.Popen([sys.executable, "-c", PARENT, WORKER, str(data), str(busy)], start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def sample(leader: int, work: TreeWork) -> TreeWork:
    found, readings = tree_work(leader, "", {})
    work.add(readings)
    return work


def test_the_tree_s_cpu_and_reads_are_summed_over_its_processes(tree):
    proc = tree(busy=1.0)  # a second of busy looping: a share of a core on a busy box
    work = TreeWork()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        sample(proc.pid, work)
        if work.cpu_seconds >= 0.25 and (work.rchar or 0) >= 8 << 20:
            break
        time.sleep(0.1)
    assert (work.rchar or 0) >= 8 << 20, "the grandchild's 8 MiB read did not show"
    assert work.cpu_seconds >= 0.25, "the grandchild's CPU time did not show"
    assert len(tree_work(proc.pid, "", {})[0]) == 2  # the leader and its child
    # once it idles, nothing grows
    time.sleep(1.5)
    before = (sample(proc.pid, work).cpu_seconds, work.rchar)
    time.sleep(0.5)
    after = (sample(proc.pid, work).cpu_seconds, work.rchar)
    assert after[0] - before[0] < 0.05 and after[1] - before[1] < 64 * 1024


def test_a_process_that_leaves_the_tree_keeps_what_it_added(tree):
    proc = tree(busy=0.3)
    work = TreeWork()
    deadline = time.monotonic() + 20
    while (work.rchar or 0) < 8 << 20 and time.monotonic() < deadline:
        sample(proc.pid, work)
        time.sleep(0.1)
    children = [pid for pid in tree_work(proc.pid, "", {})[0] if pid != proc.pid]
    os.kill(children[0], 9)
    time.sleep(0.3)
    read = work.rchar
    sample(proc.pid, work)
    assert work.rchar == read and len(tree_work(proc.pid, "", {})[0]) == 1


def test_counters_of_a_process_that_is_gone_are_none():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert proctree.read_counters(proc.pid) is None
    own = proctree.read_counters(os.getpid())
    assert own is not None and own.cpu_seconds > 0 and own.rchar is not None and own.rchar > 0
