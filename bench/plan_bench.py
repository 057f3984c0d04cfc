"""Planning time on a generated 512-CPU machine (8 NUMA nodes × 32 cores × SMT2, 4 L3 per node).

    .venv/bin/python bench/plan_bench.py

Prints the median time of vsup.topology.planner.plan for several instance counts, and its ratio to a
baseline measured in the same run: a naive round-robin split of the same cores into N CPU lists
(what any planner must at least do). Target from issue 3: ≤ 50 ms per plan.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.machines import GiB, make_machine  # noqa: E402
from vsup.topology.cpulist import format_list  # noqa: E402
from vsup.topology.plan_model import PlanSettings  # noqa: E402
from vsup.topology.planner import plan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)

REPEATS = 21
TARGET_S = 0.050


def median_time(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        fn()
        times.append(time.monotonic() - start)
    return statistics.median(times)


def round_robin(machine, count: int) -> list[str]:
    lists: list[list[int]] = [[] for _ in range(count)]
    for i, core in enumerate(machine.cores):
        lists[i % count].extend(core.cpus)
    return [format_list(cpus) for cpus in lists]


def main() -> int:
    machine = make_machine(sockets=2, nodes_per_socket=4, cores_per_node=32, smt=2, l3_per_node=4, node_memory=256 * GiB)
    assert len(machine.cpus_usable) == 512
    print(f"machine: {len(machine.cpus_usable)} CPUs, {len(machine.nodes)} nodes, {len(machine.cores)} cores, SMT2")
    print(f"{'instances':>44}  {'plan (ms)':>9}  {'round-robin (ms)':>16}  {'ratio':>6}")
    worst = 0.0
    recorder = Recorder("plan_bench")
    rows = []
    cases = [("auto", {}), (8, {}), (16, {}), (64, {}), (128, {}), (255, {}), (60, {"cores_per_instance": 4}),
             (4, {}), (16, {"housekeeping_core": True, "smt": True})]
    for count, extra in cases:
        settings = PlanSettings(instances=count, model_size_bytes=GiB, kvcache_gib=0.5, **extra)
        planned = median_time(partial(plan, machine, settings))
        n = len(plan(machine, settings).instances)
        baseline = median_time(partial(round_robin, machine, n))
        worst = max(worst, planned)
        label = f"{count}" + (f" {extra}" if extra else "")
        rows.append({"instances": label, "planned": n, "plan_ms": round(planned * 1000, 3),
                     "round_robin_ms": round(baseline * 1000, 4), "ratio": round(planned / baseline, 1)})
        print(f"{label:>44}  {planned * 1000:9.2f}  {baseline * 1000:16.3f}  {planned / baseline:6.1f}x")
    verdict = "within" if worst <= TARGET_S else "OVER"
    print(f"slowest plan {worst * 1000:.1f} ms: {verdict} the {TARGET_S * 1000:.0f} ms target")
    recorder.write({"machine_planned": {"cpus": len(machine.cpus_usable), "nodes": len(machine.nodes),
                                        "cores": len(machine.cores), "smt": 2},
                    "repeats": REPEATS, "target_ms": TARGET_S * 1000, "rows": rows,
                    "fastest_ms": min(r["plan_ms"] for r in rows), "slowest_ms": round(worst * 1000, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
