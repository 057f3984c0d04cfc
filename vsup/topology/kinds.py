"""Hybrid CPUs: which CPUs are performance cores and which are efficiency cores.

Core kinds come from *tiers*, never from the single highest value: firmware reports slightly
different capacities for cores of one type (boost bins, favoured cores; NVIDIA GB10's Cortex-X925
cores read 997, 1017 and 1024), and "the maximum is performance, the rest efficiency" would leave
one performance core. The first source that applies decides:
1. Intel hybrid PMUs (Linux >= 5.13): /sys/devices/cpu_core/cpus are performance cores,
   cpu_atom/cpus (and cpu_lowpower/cpus, Meteor Lake's low-power island) efficiency cores.
2. Arm core types: cpuN/regs/identification/midr_el1, grouped by implementer + part number (the
   stepping is ignored), ranked by each type's lowest cpu_capacity (as hwloc ranks its cpukinds),
   else by cpufreq/cpuinfo_max_freq. One part number on every CPU means one core type: uniform,
   whatever the capacities say (Snapdragon X's identical cores boost to different clocks).
3. cpuN/cpu_capacity (Arm without the MIDR files, x86 on newer kernels): sorted values split into
   tiers wherever the next value is more than TIER_GAP below the previous one.
4. cpuN/cpufreq/base_frequency in exactly two tiers (Intel hybrid parts on kernels older than the
   hybrid PMUs, like the Lakefield dump). Maximum (turbo) frequencies are not used: favoured cores
   make them differ on uniform parts.
Anything else is uniform.

With two tiers the slower is "efficiency". With more (phone SoCs: prime + big + little cores)
only the slowest tier is "efficiency": the prime and big cores together are the performance cores,
because a prime core alone would make a one-core instance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vsup.topology.cpulist import format_list
from vsup.topology.errors import TopologyError
from vsup.topology.fsroot import FsRoot
from vsup.topology.model import EFFICIENCY, PERFORMANCE

CPU_DIR = "sys/devices/system/cpu"
MIDR_FILE = "regs/identification/midr_el1"
# A capacity or base frequency more than this far below the next higher one starts a slower tier.
# Bins of one core type lie within a few % (GB10: 997-1024 = 2.6 %, Snapdragon X boost clusters
# about 12 %); big and little cores are 25 % (GB10: 731 vs 997) to 60 % apart.
TIER_GAP = 0.15

# Arm Ltd (implementer 0x41) part numbers, for humans comparing with lscpu's "Model name".
ARM_PARTS = {
    0xD03: "Cortex-A53", 0xD04: "Cortex-A35", 0xD05: "Cortex-A55", 0xD07: "Cortex-A57",
    0xD08: "Cortex-A72", 0xD09: "Cortex-A73", 0xD0A: "Cortex-A75", 0xD0B: "Cortex-A76",
    0xD0C: "Neoverse-N1", 0xD0D: "Cortex-A77", 0xD40: "Neoverse-V1", 0xD41: "Cortex-A78",
    0xD44: "Cortex-X1", 0xD46: "Cortex-A510", 0xD47: "Cortex-A710", 0xD48: "Cortex-X2",
    0xD49: "Neoverse-N2", 0xD4D: "Cortex-A715", 0xD4E: "Cortex-X3", 0xD4F: "Neoverse-V2",
    0xD80: "Cortex-A520", 0xD81: "Cortex-A720", 0xD82: "Cortex-X4", 0xD84: "Neoverse-V3",
    0xD85: "Cortex-X925", 0xD87: "Cortex-A725", 0xD8E: "Neoverse-N3",
}

Kinds = tuple[dict[int, str], str]  # (cpu -> kind, empty when uniform; which source decided, for humans)


def read_kinds(fs: FsRoot, online: frozenset[int]) -> Kinds:
    """(cpu -> kind for the CPUs that are not uniform, a sentence saying which source decided)."""
    if not online:
        return {}, "uniform (no online CPU)"
    readers: tuple[Callable[[FsRoot, frozenset[int]], Kinds | None], ...] = (
        _from_pmus, _from_midr, _from_capacity, _from_base_frequency,
    )
    for reader in readers:
        decided = reader(fs, online)
        if decided is not None:
            return decided
    return {}, "uniform (no cpu_core/cpu_atom PMUs, midr_el1, cpu_capacity or base_frequency difference)"


def tiers(values: dict[int, int]) -> list[frozenset[int]]:
    """CPUs grouped by value into tiers, fastest first: a new tier starts wherever the next lower
    distinct value is more than TIER_GAP below the previous one."""
    result: list[set[int]] = []
    previous = None
    for value in sorted(set(values.values()), reverse=True):
        if previous is None or value < previous * (1 - TIER_GAP):
            result.append(set())
        result[-1].update(cpu for cpu, v in values.items() if v == value)
        previous = value
    return [frozenset(t) for t in result]


def _kinds(ranked: list[frozenset[int]]) -> dict[int, str]:
    """Fastest first -> kinds: the slowest tier is efficiency, every faster one performance."""
    kinds = {cpu: PERFORMANCE for tier in ranked[:-1] for cpu in tier}
    kinds.update({cpu: EFFICIENCY for cpu in ranked[-1]})
    return kinds


def _from_pmus(fs: FsRoot, online: frozenset[int]) -> Kinds | None:
    performance = fs.cpu_list("sys/devices/cpu_core/cpus") or frozenset()
    efficiency = (fs.cpu_list("sys/devices/cpu_atom/cpus") or frozenset()) | (
        fs.cpu_list("sys/devices/cpu_lowpower/cpus") or frozenset()
    )
    if not (performance and efficiency):
        return None
    kinds = {cpu: PERFORMANCE for cpu in performance}
    kinds.update({cpu: EFFICIENCY for cpu in efficiency})
    return kinds, (
        f"{fs.path('sys/devices/cpu_core/cpus')} + cpu_atom/cpus (Intel hybrid PMUs): performance "
        f"CPUs {format_list(performance & online)}, efficiency CPUs {format_list(efficiency & online)}"
    )


def _values(fs: FsRoot, online: Iterable[int], name: str) -> dict[int, int] | None:
    """cpuN/<name> of every online CPU, or None when any is missing."""
    values = {}
    for cpu in online:
        value = fs.integer(f"{CPU_DIR}/cpu{cpu}/{name}")
        if value is None:
            return None
        values[cpu] = value
    return values


def _midr(fs: FsRoot, cpu: int) -> int | None:
    rel = f"{CPU_DIR}/cpu{cpu}/{MIDR_FILE}"
    text = fs.read_nonblank(rel)
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        raise TopologyError(f"{fs.path(rel)}: {text[:40]!r}; expected a hex register value like 0x00000000410fd4f1") from None


def _part_name(implementer: int, part: int) -> str:
    name = ARM_PARTS.get(part) if implementer == 0x41 else None
    text = f"0x{part:03x}" if implementer == 0x41 else f"0x{implementer:02x}/0x{part:03x}"
    return f"{text} {name}" if name else text


def _from_midr(fs: FsRoot, online: frozenset[int]) -> Kinds | None:
    types: dict[tuple[int, int], set[int]] = {}
    for cpu in sorted(online):
        midr = _midr(fs, cpu)
        if midr is None:
            return None  # not Arm, an old kernel or a partial dump: the next source decides
        types.setdefault(((midr >> 24) & 0xFF, (midr >> 4) & 0xFFF), set()).add(cpu)
    where = f"{fs.path(CPU_DIR)}/cpuN/{MIDR_FILE}"
    names = {key: _part_name(*key) for key in types}
    if len(types) == 1:
        (key,) = types
        return {}, f"uniform: one core type, {names[key]} on every CPU ({where})"

    ranking = None
    for name, label in (("cpu_capacity", "cpu_capacity"), ("cpufreq/cpuinfo_max_freq", "cpuinfo_max_freq")):
        values = _values(fs, online, name)
        if values is not None:
            lowest = {key: min(values[cpu] for cpu in cpus) for key, cpus in types.items()}
            if len(set(lowest.values())) > 1:
                ranking = (lowest, label)
                break
    if ranking is None:
        listed = ", ".join(f"{names[key]} (CPUs {format_list(cpus)})" for key, cpus in types.items())
        return {}, (
            f"uniform: core types {listed} ({where}), but neither cpu_capacity nor cpuinfo_max_freq "
            "says which is faster, so they are planned alike"
        )
    lowest, label = ranking
    order = sorted(types, key=lambda key: (-lowest[key], min(types[key])))
    slowest = lowest[order[-1]]
    ranked = [frozenset(types[key]) for key in order if lowest[key] != slowest]
    ranked.append(frozenset(cpu for key in order if lowest[key] == slowest for cpu in types[key]))
    listed = " > ".join(f"{names[key]} (CPUs {format_list(types[key])}, {label} {lowest[key]})" for key in order)
    return _kinds(ranked), f"core types from {where}: {listed}"


def _from_capacity(fs: FsRoot, online: frozenset[int]) -> Kinds | None:
    values = _values(fs, online, "cpu_capacity")
    if values is None:
        return None
    where = f"{fs.path(CPU_DIR)}/cpuN/cpu_capacity"
    ranked = tiers(values)
    if len(ranked) == 1:
        lo, hi = min(values.values()), max(values.values())
        spread = f"{lo}" if lo == hi else f"{lo}-{hi}, within {TIER_GAP:.0%}"
        return {}, f"uniform: cpu_capacity {spread} on every CPU ({where})"
    return _kinds(ranked), f"capacity tiers from {where}: " + _describe(ranked, values)


def _from_base_frequency(fs: FsRoot, online: frozenset[int]) -> Kinds | None:
    values = _values(fs, online, "cpufreq/base_frequency")
    if values is None:
        return None
    ranked = tiers(values)
    if len(ranked) != 2:
        return None  # one tier is uniform; three base clocks are no hybrid signature vsup knows
    where = f"{fs.path(CPU_DIR)}/cpuN/cpufreq/base_frequency"
    return _kinds(ranked), f"base frequency tiers from {where}: " + _describe(ranked, values)


def _describe(ranked: list[frozenset[int]], values: dict[int, int]) -> str:
    parts = []
    for tier in ranked:
        lo, hi = min(values[c] for c in tier), max(values[c] for c in tier)
        parts.append(f"{lo if lo == hi else f'{lo}-{hi}'} (CPUs {format_list(tier)})")
    return " > ".join(parts)
