"""The doctor's checks of the machine itself: CPU features, the kernel's NUMA settings, limits,
/dev/shm, other processes pinned to vsup's CPUs, and the memory bandwidth. Each is a function of the
facts it needs (an FsRoot under which sysfs and proc are read, a limit, a measurement), so tests
run them on fake trees.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import resource
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vsup.doctor.result import FAIL, PASS, SKIP, WARN, Result
from vsup.supervisor.placement import status_fields
from vsup.topology.cpulist import format_list, parse_list
from vsup.topology.fsroot import FsRoot
from vsup.topology.isa import AVX2_FLOOR, X86_ARCHES, BuildNeeds, shortfall
from vsup.topology.model import Isa

RECOMMENDED_NOFILE = 65536
MIN_SHM_BYTES = 1024**3


# ---------------------------------------------------------------- CPU, kernel, limits

def check_isa(isa: Isa, needs: BuildNeeds = AVX2_FLOOR) -> Result:
    """The CPU against what the installed vLLM build executes (`needs`, read by
    vsup.supervisor.vllm_command.build_needs); the words are the ones `vsup plan`/`run`/`reload`
    refuse with (vsup.topology.isa.shortfall)."""
    arch = isa.arch or platform.machine()
    if arch and arch not in X86_ARCHES:
        return Result("cpu-isa", PASS, f"{arch}: the AVX2 requirement is x86-only (vLLM has {arch} CPU builds)")
    missing = shortfall(isa, needs)
    if missing is not None:
        return Result("cpu-isa", FAIL, *missing)
    faster = [name for name, present in (("AVX-512", isa.avx512f), ("AVX512-BF16", isa.avx512_bf16), ("AMX", isa.amx_bf16 and isa.amx_tile)) if present]
    summary = "AVX2 present" + (f"; faster paths: {', '.join(faster)}" if faster else "; no AVX-512/AMX (AVX2 kernels, slower)")
    if needs.flags != AVX2_FLOOR.flags:
        summary += f"; {needs.build} needs {', '.join(needs.flags)}: present"
    if isa.amx_bf16:
        summary += "; if bf16 crashes on AMX, use --dtype float32"
    return Result("cpu-isa", PASS, summary)


def check_numactl(path_env: str, launcher: str = "auto") -> Result:
    found = shutil.which("numactl", path=path_env)
    if found:
        return Result("numactl", PASS, f"numactl at {found}: memory is bound to each instance's node")
    fix = "apt-get install numactl (dnf install numactl)"
    if launcher == "numactl":
        return Result("numactl", FAIL, "placement.launcher is numactl but numactl is not installed", fix)
    if launcher in ("taskset", "none"):
        return Result("numactl", SKIP, f"placement.launcher is {launcher}: numactl is not used")
    return Result("numactl", WARN, "numactl not found: vsup falls back to taskset (CPUs pinned, memory not bound to the node)", fix)


_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "s390x": 270}


def check_numa_syscalls() -> Result:
    """Call set_mempolicy(MPOL_DEFAULT) on ourselves: harmless, and refused with EPERM where a
    seccomp profile blocks the NUMA calls (Docker's default one does, unless the container has
    CAP_SYS_NICE) - then numactl --membind and vLLM's own binding fail."""
    number = _SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return Result("numa-syscalls", SKIP, f"no probe for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, None, 0) == 0:
        return Result("numa-syscalls", PASS, "set_mempolicy allowed: memory binding works")
    err = ctypes.get_errno()
    if err == 38:  # ENOSYS: kernel without NUMA support, nothing to bind
        return Result("numa-syscalls", SKIP, "kernel without NUMA support")
    return Result(
        "numa-syscalls", WARN, f"set_mempolicy refused ({os.strerror(err)}): NUMA memory binding silently does nothing",
        "in a container, add the capability: docker run --cap-add SYS_NICE (or allow mbind/set_mempolicy in its seccomp profile)",
    )


def check_numa_balancing(fs: FsRoot, numa_nodes: int) -> Result:
    value = fs.read_nonblank("proc/sys/kernel/numa_balancing")
    if value is None:
        return Result("numa-balancing", SKIP, "kernel.numa_balancing not present (kernel without NUMA balancing)")
    if value == "0":
        return Result("numa-balancing", PASS, "kernel.numa_balancing=0")
    if numa_nodes < 2:
        return Result("numa-balancing", PASS, f"kernel.numa_balancing={value}, harmless with one NUMA node")
    return Result(
        "numa-balancing", WARN,
        f"kernel.numa_balancing={value}: the kernel migrates pages of pinned instances and spends CPU scanning",
        "sysctl -w kernel.numa_balancing=0; to keep it: echo kernel.numa_balancing=0 > /etc/sysctl.d/90-vsup.conf",
    )


def check_transparent_hugepages(fs: FsRoot) -> Result:
    text = fs.read_nonblank("sys/kernel/mm/transparent_hugepage/enabled")
    if text is None:
        return Result("transparent-hugepages", SKIP, "sys/kernel/mm/transparent_hugepage/enabled not readable")
    match = re.search(r"\[(\w+)\]", text)
    mode = match.group(1) if match else text
    if mode in ("always", "madvise"):
        return Result("transparent-hugepages", PASS, f"transparent hugepages: {mode}")
    return Result(
        "transparent-hugepages", WARN,
        f"transparent hugepages: {mode}: GBs of weights and KV cache on 4 KiB pages mean more TLB misses",
        "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (or transparent_hugepage=madvise on the kernel command line)",
    )


def check_open_files(soft: int, hard: int) -> Result:
    shown = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    if soft == resource.RLIM_INFINITY or soft >= RECOMMENDED_NOFILE:
        return Result("open-files", PASS, f"open-file limit {shown}")
    fix = "the systemd unit sets LimitNOFILE=65536; in a shell: ulimit -n 65536"
    if hard != resource.RLIM_INFINITY and hard < RECOMMENDED_NOFILE:
        fix += f" (hard limit is {hard}: raise it in /etc/security/limits.conf)"
    return Result("open-files", WARN, f"open-file limit {shown} < {RECOMMENDED_NOFILE}: vLLM warns and many connections fail", fix)


def check_governor(fs: FsRoot) -> Result:
    governors: dict[str, list[int]] = {}
    for path in sorted(fs.path("sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor")):
        value = fs.read_nonblank(str(path.relative_to(fs.root)))
        if value:
            governors.setdefault(value, []).append(int(path.parent.parent.name[3:]))
    if not governors:
        return Result("cpu-governor", SKIP, "no cpufreq governor readable (VM or container)")
    if set(governors) == {"performance"}:
        return Result("cpu-governor", PASS, "governor: performance")
    described = ", ".join(f"{name} on CPUs {format_list(cpus)}" for name, cpus in sorted(governors.items()))
    return Result(
        "cpu-governor", WARN, f"governor: {described}: clocks ramp up late, first tokens are slower",
        "cpupower frequency-set -g performance (package linux-cpupower / kernel-tools)",
    )


def check_shm(path: str | Path, min_bytes: int = MIN_SHM_BYTES) -> Result:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Result("dev-shm", FAIL, f"{path}: {exc.strerror}: vLLM's processes exchange data through it", "mount a tmpfs on /dev/shm")
    size = st.f_frsize * st.f_blocks
    if size < min_bytes:
        return Result(
            "dev-shm", WARN, f"{path} is only {size / 1024**2:.0f} MiB: vLLM's inter-process buffers may not fit",
            "docker run --shm-size=4g (or remount: mount -o remount,size=4G /dev/shm)",
        )
    return Result("dev-shm", PASS, f"{path}: {size / 1024**3:.1f} GiB")


# ---------------------------------------------------------------- other processes' affinity

@dataclass(frozen=True)
class ProcAffinity:
    pid: int
    ppid: int
    name: str
    cpus: frozenset[int]
    kernel_thread: bool


def read_affinities(fs: FsRoot) -> list[ProcAffinity]:
    out = []
    proc = fs.path("proc")
    try:
        entries = [e for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            text = (entry / "status").read_text()
        except OSError:
            continue  # exited meanwhile, or hidden
        fields = status_fields(text)
        try:
            cpus = parse_list(fields["Cpus_allowed_list"])
            ppid = int(fields.get("PPid", "0"))
        except (KeyError, ValueError):
            continue
        # kernel threads (per-CPU kworkers, ksoftirqd) have no memory map and are pinned by design
        kernel = "VmSize" not in fields or fields.get("Kthread", "0") == "1"
        out.append(ProcAffinity(int(entry.name), ppid, fields.get("Name", "?"), frozenset(cpus), kernel))
    return out


def check_foreign_affinity(procs: list[ProcAffinity], planned: frozenset[int], machine: frozenset[int], own_pid: int) -> Result:
    """User processes pinned to part of the machine that overlaps the CPUs vsup would use: another
    pinned vLLM, a benchmark, a forgotten taskset. vsup's own tree is not counted."""
    by_pid = {p.pid: p for p in procs}

    def under_vsup(p: ProcAffinity) -> bool:
        seen = set()
        q: ProcAffinity | None = p
        while q is not None and q.pid not in seen:
            if q.pid == own_pid or q.name == "vsup":
                return True
            seen.add(q.pid)
            q = by_pid.get(q.ppid)
        return False

    clashes = [
        p for p in procs
        if not p.kernel_thread and p.cpus < machine and p.cpus & planned and not under_vsup(p)
    ]
    if not clashes:
        return Result("cpu-affinity", PASS, f"no other process is pinned to CPUs {format_list(sorted(planned))}")
    shown = "; ".join(f"pid {p.pid} ({p.name}) on {format_list(sorted(p.cpus))}" for p in sorted(clashes, key=lambda p: p.pid)[:5])
    more = f" and {len(clashes) - 5} more" if len(clashes) > 5 else ""
    return Result(
        "cpu-affinity", WARN,
        f"{len(clashes)} other process(es) pinned to CPUs vsup uses: {shown}{more}",
        "stop them, or keep vsup off their CPUs (placement.cores_per_instance / reserve_cores, or a cpuset for vsup)",
    )


# ---------------------------------------------------------------- memory bandwidth

def check_memory_bandwidth(groups: Mapping[int, list[int]], measure: Callable[[Mapping[int, list[int]]], dict[int, float]]) -> Result:
    """The roofline of decode: each NUMA node's sustainable bandwidth, a STREAM-like triad pinned
    the way the plan pins the instances' OpenMP threads (vsup/observe/bandwidth.py)."""
    if not groups:
        return Result("memory-bandwidth", SKIP, "no CPUs to measure on")
    try:
        measured = measure(groups)
    except (OSError, RuntimeError, ValueError) as exc:
        return Result("memory-bandwidth", SKIP, f"triad not measured: {exc}")
    parts = [f"node {node}: {rate / 1e9:.1f} GB/s on CPUs {format_list(groups[node])}" if node >= 0 else
             f"{rate / 1e9:.1f} GB/s on CPUs {format_list(groups[node])}" for node, rate in measured.items()]
    return Result("memory-bandwidth", PASS, "triad " + "; ".join(parts)
                  + " (decode streams the weights once per step: this is its limit; `vsup tune` reports each layout against it)")
