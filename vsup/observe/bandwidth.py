"""The memory bandwidth of each NUMA node, measured the way vLLM's threads will use it.

Decode on CPU is bound by memory bandwidth. `measure_bandwidth` runs a STREAM-like triad (a = b +
s·c, counted as 24 bytes per element like STREAM) in one process per CPU, pinned to the CPUs the
plan gives the instances' OpenMP threads on that node (`cpus_per_node`), all started together;
their rates add up to the node's sustainable bandwidth. `vsup doctor` reports it and `vsup tune`
sets each layout against it (vsup.tune.roofline). The worker is this module run as a script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from vsup.topology.model import Machine
from vsup.topology.plan_model import Plan


def cpus_per_node(plan: Plan) -> dict[int, list[int]]:
    """The instances' OpenMP CPUs by memory node: where the triad runs, pinned as vLLM's threads are."""
    out: dict[int, list[int]] = {}
    for inst in plan.instances:
        node = inst.nodes[0] if inst.nodes else -1
        out.setdefault(node, []).extend(inst.omp_cpus)
    return {node: sorted(set(cpus)) for node, cpus in sorted(out.items())}


def cpus_per_node_of(machine: Machine) -> dict[int, list[int]]:
    """Without a plan: one CPU per usable physical core of each node."""
    out: dict[int, list[int]] = {}
    for core in machine.cores:
        if core.cpus:
            out.setdefault(core.node if core.node is not None else -1, []).append(core.cpus[0])
    return {node: sorted(cpus) for node, cpus in sorted(out.items())}


def array_mib(processes: int) -> int:
    """Per array and process: big enough to leave the caches, small enough for many processes."""
    return max(16, min(64, 256 // max(1, processes)))


def measure_bandwidth(groups: Mapping[int, Sequence[int]], seconds: float = 1.0) -> dict[int, float]:
    """Bytes/s per node: one pinned triad process per CPU of the node, started together; nodes one
    after another so they do not share the machine's interconnect."""
    return {node: _measure_node(cpus, seconds) for node, cpus in groups.items() if cpus}


def _measure_node(cpus: Sequence[int], seconds: float) -> float:
    mib = array_mib(len(cpus))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "vsup.observe.bandwidth", str(cpu), str(mib), str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for cpu in cpus]
    try:
        for proc in procs:  # each pinned, its arrays allocated and touched on its own node
            if _read_line(proc).strip() != "ready":
                raise _failed(proc)
        for proc in procs:
            _send(proc, "go\n")
        total = 0.0
        for proc in procs:
            line = _read_line(proc)
            if not line:
                raise _failed(proc)
            result = json.loads(line)
            total += result["bytes"] / result["seconds"]
        return total
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()  # else each worker leaves three pipes open until GC (ResourceWarning)


# The workers' three pipes are always there (Popen with PIPE); these keep the types honest.
def _read_line(proc: subprocess.Popen[str]) -> str:
    return proc.stdout.readline() if proc.stdout is not None else ""


def _send(proc: subprocess.Popen[str], text: str) -> None:
    if proc.stdin is not None:
        proc.stdin.write(text)
        proc.stdin.flush()


def _failed(proc: subprocess.Popen[str]) -> RuntimeError:
    detail = proc.stderr.read().strip()[-300:] if proc.stderr is not None else ""
    return RuntimeError(f"triad worker failed: {detail}")


def _worker(cpu: int, mib: int, seconds: float) -> None:
    import numpy as np

    os.sched_setaffinity(0, {cpu})  # before allocating: first touch places the pages on this node
    n = mib * 1024 * 1024 // 8
    a, b, c = np.full(n, 0.0), np.full(n, 1.0), np.full(n, 2.0)  # written: every page is faulted in now
    chunk = 32 * 1024  # 256 KiB: the temporary stays in cache, so memory sees 2 reads + 1 write
    tmp = np.empty(chunk)

    def triad() -> None:
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            np.multiply(c[start:end], 3.0, out=tmp[: end - start])
            np.add(b[start:end], tmp[: end - start], out=a[start:end])

    triad()  # warm
    print("ready", flush=True)
    sys.stdin.readline()
    began = time.perf_counter()
    moved = 0
    while True:
        triad()
        moved += 24 * n
        elapsed = time.perf_counter() - began
        if elapsed >= seconds:
            break
    print(json.dumps({"bytes": moved, "seconds": elapsed}), flush=True)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
