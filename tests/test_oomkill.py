"""Who killed an instance with SIGKILL: the kernel's OOM killer or someone else. On kernel-shaped
files under a directory (cgroup v1, v2, /proc/vmstat, /dev/kmsg), and, as root where a memory
cgroup of its own can be made, with a real OOM kill."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from vsup.supervisor import oomkill, processes
from vsup.supervisor.logs import InstanceLog
from vsup.topology.fsroot import FsRoot

pytestmark = pytest.mark.timeout(60)
PID = 4242
V1_MOUNTINFO = "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
V2_MOUNTINFO = "30 25 0:26 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def machine(root: Path, *, v: int | None, cgroup_kills: int = 0, vmstat_kills: int = 3) -> FsRoot:
    write(root, "proc/vmstat", f"pgfault 100\noom_kill {vmstat_kills}\nthp_fault_alloc 0\n")
    if v == 1:
        write(root, "proc/self/mountinfo", V1_MOUNTINFO)
        write(root, f"proc/{PID}/cgroup", "5:cpu:/\n4:memory:/vsup.service\n0::/\n")
        write(root, "sys/fs/cgroup/memory/vsup.service/memory.oom_control",
              f"oom_kill_disable 0\nunder_oom 0\noom_kill {cgroup_kills}\n")
    elif v == 2:
        write(root, "proc/self/mountinfo", V2_MOUNTINFO)
        write(root, f"proc/{PID}/cgroup", "0::/system.slice/vsup.service\n")
        write(root, "sys/fs/cgroup/system.slice/vsup.service/memory.events",
              f"low 0\nhigh 0\nmax 2\noom 1\noom_kill {cgroup_kills}\noom_group_kill 0\n")
    return FsRoot(root)


@pytest.mark.parametrize("v, where", [(1, "/sys/fs/cgroup/memory/vsup.service/memory.oom_control"),
                                      (2, "/sys/fs/cgroup/system.slice/vsup.service/memory.events")])
def test_the_cgroup_counter_tells_the_oom_killer_apart(tmp_path, v, where):
    fs = machine(tmp_path, v=v, cgroup_kills=1)
    before = oomkill.read_counts(fs, PID)
    assert before == oomkill.OomCounts(vmstat=3, cgroup=1, cgroup_file=where.lstrip("/"))
    (tmp_path / f"proc/{PID}").rename(tmp_path / "proc/gone")  # the process is gone: the file read at its start counts
    machine(tmp_path, v=v, cgroup_kills=1, vmstat_kills=9)  # another cgroup's OOM kill moves only the machine's count
    assert oomkill.sigkill_cause(fs, PID, before) == (
        f"killed by SIGKILL from outside vsup (not the OOM killer: oom_kill unchanged at 1 in {where})")
    machine(tmp_path, v=v, cgroup_kills=2)
    assert oomkill.sigkill_cause(fs, PID, before) == (
        f"killed by the kernel's OOM killer (oom_kill 1 -> 2 in {where}); check the memory plan")


def test_without_a_memory_cgroup_the_machines_counter_decides(tmp_path):
    fs = machine(tmp_path, v=None, vmstat_kills=3)
    before = oomkill.read_counts(fs, PID)
    assert before == oomkill.OomCounts(vmstat=3, cgroup=None, cgroup_file=None)
    assert oomkill.sigkill_cause(fs, PID, before) == (
        "killed by SIGKILL from outside vsup (not the OOM killer: oom_kill unchanged at 3 in /proc/vmstat)")
    machine(tmp_path, v=None, vmstat_kills=4)
    assert oomkill.sigkill_cause(fs, PID, before) == (
        "killed by the kernel's OOM killer (oom_kill 3 -> 4 in /proc/vmstat); check the memory plan")


def test_the_kernel_log_names_the_victim(tmp_path):
    fs = machine(tmp_path, v=None, vmstat_kills=3)
    before = oomkill.read_counts(fs, PID)
    write(tmp_path, "dev/kmsg", "6,1200,5000,-;eth0: link up\n"
                                f"3,1201,6000,-;Memory cgroup out of memory: Killed process {PID} (python3) total-vm:1000kB\n")
    assert oomkill.sigkill_cause(fs, PID, before) == (
        f"killed by the kernel's OOM killer (kernel log: Memory cgroup out of memory: Killed process {PID} (python3) total-vm:1000kB)")
    # readable, the count moved, but the victim was another process
    write(tmp_path, "dev/kmsg", "3,1201,6000,-;Out of memory: Killed process 777 (java)\n")
    machine(tmp_path, v=None, vmstat_kills=4)
    assert oomkill.sigkill_cause(fs, PID, before) == (
        f"killed by SIGKILL; the OOM killer ran meanwhile (oom_kill 3 -> 4 in /proc/vmstat) but the kernel log does not name pid {PID}")


def test_nothing_readable_keeps_the_old_hint(tmp_path):
    fs = FsRoot(tmp_path)
    assert oomkill.read_counts(fs, PID) == oomkill.OomCounts(None, None, None)
    assert oomkill.sigkill_cause(fs, PID, oomkill.read_counts(fs, PID)) == oomkill.UNKNOWN


# ---- a real OOM kill in a memory cgroup of the test's own (never the session's) ----------------------

def own_memory_cgroup(tmp_name: str) -> Path:
    """A new memory cgroup with a 64 MiB limit, or skip where none can be made (not root, no controller)."""
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup of its own needs root")
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        group, limit = v1 / tmp_name, "memory.limit_in_bytes"
    elif "memory" in ((v2 / "cgroup.subtree_control").read_text() if (v2 / "cgroup.subtree_control").exists() else ""):
        group, limit = v2 / tmp_name, "memory.max"
    else:
        pytest.skip("no memory cgroup controller to make a cgroup of its own in")
    try:
        group.mkdir()
        (group / limit).write_text(str(64 << 20))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(64 << 20))  # no swap way out
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
    except OSError as exc:
        group.rmdir() if group.exists() else None
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    return group


async def test_a_real_oom_kill_is_named_and_a_kill_9_is_not(tmp_path):
    group = own_memory_cgroup(f"vsup-test-oom-{os.getpid()}")
    log = InstanceLog("0", tmp_path, max_bytes=1 << 20, backups=0, echo=False, logger=logging.getLogger("test"))
    # moves itself into the limited cgroup, then allocates past its limit
    hog = [sys.executable, "-c", f"import os; open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
                                 "b = []\nwhile True: b.append(bytearray(8 << 20))"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        child = await processes.spawn(hog, dict(os.environ), log=log)
        assert await child.wait() == -signal.SIGKILL
        assert child.sigkill_cause().startswith("killed by the kernel's OOM killer (")
        await processes.stop_tree(child, 1.0)

        other = await processes.spawn(sleeper, dict(os.environ), log=log)
        os.kill(other.pid, signal.SIGKILL)
        assert await other.wait() == -signal.SIGKILL
        assert other.sigkill_cause().startswith("killed by SIGKILL from outside vsup (not the OOM killer: oom_kill unchanged at ")
        await processes.stop_tree(other, 1.0)
    finally:
        log.close()
        group.rmdir()
