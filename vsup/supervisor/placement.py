"""Where an instance's threads may actually run and allocate, read from /proc, compared to the plan.

Per thread (`/proc/<pid>/task/<tid>/`):
- `status`: `Cpus_allowed_list` (the affinity mask: taskset, numactl --physcpubind, vLLM's
  per-OpenMP-thread binding) and `Mems_allowed_list` (the cpuset's memory nodes);
- `numa_maps`, first mapping: the thread's memory policy (`bind:1`, `preferred:0`, `default`).
  `numactl --membind` changes only this policy, not Mems_allowed_list, so both are needed to know
  which nodes memory may come from.

vLLM binds each OpenMP thread of its Worker to ONE CPU of the list it is given, so a thread whose
CPUs are a subset of the plan is fine; drift is a thread allowed on a CPU or node outside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vsup.errors import VsupError
from vsup.topology.cpulist import format_list, parse_list

# Longest first: "prefer (many)" and "weighted interleave" contain spaces and other names.
_POLICIES = ("weighted interleave", "prefer (many)", "interleave", "preferred", "default", "local", "bind")


@dataclass(frozen=True)
class ThreadPlacement:
    pid: int
    tid: int
    comm: str  # the thread's name
    cpus_allowed: frozenset[int]
    mems_allowed: frozenset[int]
    process_comm: str = ""  # the process's name (its main thread's comm)
    mem_policy: str | None = None  # "bind", "preferred", "default", ...; None when unreadable
    policy_nodes: frozenset[int] | None = None  # the policy's nodes; None for default/local

    @property
    def memory_nodes(self) -> frozenset[int]:
        """Nodes this thread's memory may come from: the policy's nodes within the cpuset's."""
        if self.policy_nodes:
            return self.policy_nodes & self.mems_allowed if self.mems_allowed else self.policy_nodes
        return self.mems_allowed


def parse_mem_policy(numa_maps_line: str) -> tuple[str, frozenset[int] | None] | None:
    """'7f00 bind=static:0-1 anon=3' -> ('bind', {0, 1}); 'default' -> ('default', None)."""
    _, _, rest = numa_maps_line.partition(" ")
    for name in _POLICIES:
        if rest.startswith(name):
            tail = rest[len(name) :].split(" ", 1)[0]  # "=static:0-1", ":0", ""
            _, colon, nodes = tail.partition(":")
            return name, (parse_list(nodes) if colon else None)
    return None


def status_fields(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


def _first_line(path: Path) -> str | None:
    # numa_maps is generated (and its pages counted) as it is read: read one small chunk only.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunk = os.read(fd, 4096).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    return chunk.split("\n", 1)[0] or None


def read_placement(pids: Iterable[int], proc_root: str | Path = "/proc") -> list[ThreadPlacement]:
    """Every thread of every given process that still exists (vanished ones are skipped)."""
    root = Path(proc_root)
    placements: list[ThreadPlacement] = []
    for pid in pids:
        task_dir = root / str(pid) / "task"
        try:
            tids = sorted(int(name) for name in os.listdir(task_dir) if name.isdigit())
            process_comm = (root / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
        for tid in tids:
            try:
                fields = status_fields((task_dir / str(tid) / "status").read_text())
            except OSError:
                continue  # the thread ended between listdir and read
            policy = None
            line = _first_line(task_dir / str(tid) / "numa_maps")
            if line is not None:
                policy = parse_mem_policy(line)
            placements.append(
                ThreadPlacement(
                    pid=pid,
                    tid=tid,
                    comm=fields.get("Name", ""),
                    cpus_allowed=parse_list(fields.get("Cpus_allowed_list", "")),
                    mems_allowed=parse_list(fields.get("Mems_allowed_list", "")),
                    process_comm=process_comm,
                    mem_policy=policy[0] if policy else None,
                    policy_nodes=policy[1] if policy else None,
                )
            )
    return placements


def placement_drift(placements: Iterable[ThreadPlacement], cpus: Iterable[int], nodes: Iterable[int] | None) -> list[str]:
    """One human line per thread allowed outside the planned CPUs or memory nodes; [] = all inside.

    nodes None skips the memory check (a plan that does not bind memory, e.g. launcher taskset).
    """
    plan_cpus = frozenset(cpus)
    plan_nodes = frozenset(nodes) if nodes is not None else None
    lines = []
    for t in placements:
        who = f"pid {t.pid} ({t.process_comm or t.comm})" + (f" thread {t.tid} ({t.comm})" if t.tid != t.pid else "")
        problems = []
        if not t.cpus_allowed <= plan_cpus:
            problems.append(f"CPUs {format_list(t.cpus_allowed)} outside plan {format_list(plan_cpus)}")
        if plan_nodes is not None and not t.memory_nodes <= plan_nodes:
            how = f"memory policy {t.mem_policy}" if t.mem_policy else "memory"
            problems.append(f"{how} on nodes {format_list(t.memory_nodes)} outside plan {format_list(plan_nodes)}")
        if problems:
            lines.append(f"{who}: " + "; ".join(problems))
    return lines


def pin_self(cpus: Iterable[int]) -> None:
    """Pin every thread of vsup's own process to `cpus` (the plan's reserved CPUs).

    os.sched_setaffinity(0, ...) would move only the calling thread; threads asyncio or libraries
    already started keep their mask, so each thread of /proc/self/task is set. Children inherit the
    mask of the thread that forks them: the plan's numactl/taskset prefix re-pins each instance.
    """
    wanted = frozenset(cpus)
    if not wanted:
        raise VsupError("cannot pin vsup to an empty CPU set; give placement reserved CPUs or leave pinning off")
    before = os.sched_getaffinity(0)
    _set_thread_affinity(0, wanted)
    got = frozenset(os.sched_getaffinity(0))
    if got != wanted:  # the kernel silently drops CPUs outside the cpuset / offline ones
        os.sched_setaffinity(0, before)
        raise VsupError(
            f"cannot pin vsup to CPUs {format_list(wanted)}: CPUs {format_list(wanted - got)} are not available "
            f"here (this process may use {format_list(before)}); check placement.reserve_cores and the cgroup's cpuset"
        )
    for name in os.listdir("/proc/self/task"):
        _set_thread_affinity(int(name), wanted)


def _set_thread_affinity(tid: int, cpus: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except ProcessLookupError:
        pass  # the thread ended meanwhile
    except OSError as exc:  # EINVAL: no CPU of the set is online or in this cgroup's cpuset
        raise VsupError(
            f"cannot pin vsup to CPUs {format_list(cpus)} ({exc.strerror}); "
            f"it may use {format_list(os.sched_getaffinity(0))}: check placement.reserve_cores"
        ) from None
