"""Hybrid CPUs: which CPUs are performance cores and which are efficiency cores.

Sources, first that applies:
1. /sys/devices/cpu_core/cpus and /sys/devices/cpu_atom/cpus (Intel hybrid PMUs, Linux >= 5.13);
2. cpu/cpuN/cpu_capacity (Arm big.LITTLE, and x86 on newer kernels): the highest capacity is
   "performance", anything lower "efficiency";
3. cpu/cpuN/cpufreq/base_frequency when it takes exactly two values (Intel hybrid parts on kernels
   older than the hybrid PMUs, like the Lakefield dump): the lower base clock is "efficiency".
   Maximum (turbo) frequencies are not used: "favoured cores" make them differ on uniform parts.
Anything else is uniform."""

from __future__ import annotations

from vsup.topology.fsroot import FsRoot
from vsup.topology.model import EFFICIENCY, PERFORMANCE

CPU_DIR = "sys/devices/system/cpu"


def read_kinds(fs: FsRoot, online: frozenset[int]) -> tuple[dict[int, str], str]:
    """(cpu -> kind for the CPUs that are not uniform, the source used). Empty when uniform."""
    performance = fs.cpu_list("sys/devices/cpu_core/cpus") or frozenset()
    efficiency = fs.cpu_list("sys/devices/cpu_atom/cpus") or frozenset()
    if performance and efficiency:
        kinds = {cpu: PERFORMANCE for cpu in performance}
        kinds.update({cpu: EFFICIENCY for cpu in efficiency})
        return kinds, str(fs.path("sys/devices/cpu_core/cpus")) + " + cpu_atom/cpus"

    for name in ("cpu_capacity", "cpufreq/base_frequency"):
        values = {cpu: fs.integer(f"{CPU_DIR}/cpu{cpu}/{name}") for cpu in online}
        known = {cpu: v for cpu, v in values.items() if v is not None}
        if len(known) != len(online) or not online:
            continue
        distinct = set(known.values())
        if len(distinct) == 1 and name == "cpu_capacity":
            break  # the kernel's own answer: all CPUs alike
        if len(distinct) < 2 or (name != "cpu_capacity" and len(distinct) != 2):
            continue
        top = max(distinct)
        kinds = {cpu: PERFORMANCE if value == top else EFFICIENCY for cpu, value in known.items()}
        return kinds, f"{fs.path(CPU_DIR)}/cpuN/{name}"
    return {}, "uniform (no cpu_core/cpu_atom, cpu_capacity or base_frequency difference)"
