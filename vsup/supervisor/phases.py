"""Where a starting vLLM instance is, and whether it is getting anywhere: pure, standard library only.

A start goes through phases (`Phase`): **booting** (the processes start: Python imports, the engine
and its worker), **loading** (reading the weights), **profiling** (sizing and allocating the KV
cache), **compiling** (the warm-up vLLM runs for torch.compile), **opening** (the engine is up, the
API server starts listening), then **warming** (vsup's own warm-up request: the lifecycle's
`warming` state). vLLM's CPU worker compiles inside its memory profiling, so its output goes
loading → profiling → compiling → profiling → opening; with `--enforce-eager` and an explicit KV
cache there is no compiling.

`PATTERNS` is the one table of the output lines that name a phase, as vLLM 0.30–0.32 writes them
(vllm/model_executor/model_loader, vllm/v1/worker/cpu_model_runner.py, vllm/v1/engine/core.py,
vllm/compilation), matched anywhere in a line (vLLM prefixes its processes' lines with
`(Worker pid=N)`, `(EngineCore pid=N)`). A line marked `waiting` is one vLLM repeats while one of
its processes waits for another — shm_broadcast's "No available shared memory broadcast block found
in 60 seconds … processes are hanging" during a compile is the famous one —: it never counts as
progress (a hung engine prints it too), and `NOTES` explains it next to the phase it came in.

`OutputReader` is fed every line of an instance's output (the process's own reader does it,
vsup/supervisor/processes.py) and keeps what the output said: the phase it last named, the lines
that were not waiting lines, the shard progress of the load. `Progress` is one reading of a
starting instance — that, and its tree's CPU time and bytes read so far — which the lifecycle
takes through its Operations seam; `StartWatch` turns the readings into the phase and how long it
lasts, the load's bytes read against the weights, and when the start last moved: a phase change,
a line of output, CPU time (at least `CPU_MOVING` of a core) or bytes read (`IO_MOVING`). The
lifecycle stops a start that has not moved for `health.startup_stall` (docs/supervisor.md).

The instance's text a reading carries (a waiting line) is as it came: whoever shows it escapes it
(vsup.safetext.printable).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Phase(StrEnum):
    BOOTING = "booting"
    LOADING = "loading"
    PROFILING = "profiling"
    COMPILING = "compiling"
    OPENING = "opening"
    WARMING = "warming"


# What each phase is, in words (status, top, the /status page, docs).
PHASE_TEXT: dict[Phase, str] = {
    Phase.BOOTING: "the processes start: Python imports, vLLM's engine and worker",
    Phase.LOADING: "reading the weights",
    Phase.PROFILING: "profiling memory and allocating the KV cache",
    Phase.COMPILING: "torch.compile's warm-up (once per configuration; --enforce-eager skips it)",
    Phase.OPENING: "the engine is up; the API server starts listening",
    Phase.WARMING: "vsup's own warm-up request (health.warmup)",
}


@dataclass(frozen=True)
class Pattern:
    name: str
    needles: tuple[str, ...]  # literals, one of which every matching line contains (checked first: most lines contain none)
    regex: re.Pattern[str]
    phase: Phase | None  # the phase the line starts; None: it does not change the phase
    waiting: bool = False  # repeated while a process waits: never progress, explained by NOTES


def _pattern(name: str, needles: str | tuple[str, ...], regex: str, phase: Phase | None, *, waiting: bool = False) -> Pattern:
    return Pattern(name, (needles,) if isinstance(needles, str) else needles, re.compile(regex), phase, waiting)


_NUMBER = r"\d+(?:\.\d+)?"
PATTERNS: tuple[Pattern, ...] = (
    # cpu_model_runner.py / gpu_model_runner.py load_model: "Starting to load model %s..."
    _pattern("load_started", "Starting to load model", r"Starting to load model ", Phase.LOADING),
    # weight_utils.py's tqdm bars, one line per update ("{desc}: {percentage:3.0f}% Completed | {n}/{total} [...]"):
    # safetensors (" (eager)" with that load strategy), pt and np_cache checkpoints, the multi-thread loaders
    _pattern("shards", "% Completed |",
             r"(?:Loading (?:safetensors|pt|np_cache) checkpoint shards(?: \(eager\))?|Multi-thread loading (?:pt checkpoint )?shards"
             r"|Loading safetensors using [\w ]+?):\s*(?P<percent>\d{1,3})% Completed \| (?P<done>\d+)/(?P<total>\d+)",
             Phase.LOADING),
    # default_loader.py / sharded_state_loader.py: "Loading weights took %.2f seconds"
    _pattern("weights_loaded", "Loading weights took", rf"Loading weights took (?P<seconds>{_NUMBER}) seconds", Phase.PROFILING),
    # the model runner after the load: "Model loading took %s GiB memory and %.6f seconds" (0.30: "%.4f GiB and")
    _pattern("model_loaded", "Model loading took",
             rf"Model loading took (?P<gib>{_NUMBER}) GiB(?: memory)? and (?P<seconds>{_NUMBER}) seconds", Phase.PROFILING),
    # cpu_model_runner.py warming_up_model (CPU compiles here, inside determine_available_memory)
    _pattern("compile_started", "Warming up model for the compilation", r"Warming up model for the compilation", Phase.COMPILING),
    # compilation/backends.py: a graph compiled, traced, or taken from the compile cache
    _pattern("compile_step", ("Dynamo bytecode transform time", "Compiling a graph for ", "Directly load the compiled graph"),
             r"Dynamo bytecode transform time|Compiling a graph for |Directly load the compiled graph",
             Phase.COMPILING),
    _pattern("compile_done", "Warming up done", r"Warming up done\.", Phase.PROFILING),
    # cpu_worker.py determine_available_memory; kv_cache_utils.py (0.30-0.32 say "GPU" on CPU too)
    _pattern("kv_cache", "KV cache",
             r"(?:Explicitly|Auto) set \(\S+\) GiB for KV cache|(?:GPU|CPU) KV cache size: [\d,]+ tokens", Phase.PROFILING),
    # v1/engine/core.py: "... took %.2f s" (0.32, maybe "(compilation: %.2f s)" after it), "... took %.2f seconds" (0.30-0.31)
    _pattern("engine_ready", "init engine (profile, create kv cache, warmup model) took",
             rf"init engine \(profile, create kv cache, warmup model\) took (?P<seconds>{_NUMBER}) s", Phase.OPENING),
    # the API server: "Starting vLLM server on %s" (0.32), "Starting vLLM API server %d on %s" (0.30-0.31), uvicorn
    _pattern("api_started", ("Starting vLLM", "Application startup complete"), r"Starting vLLM (?:API )?server|Application startup complete", Phase.OPENING),
    # distributed/device_communicators/shm_broadcast.py, every 60 s a reader or writer waits
    _pattern("shm_wait", "No available shared memory broadcast block found",
             r"No available shared memory broadcast block found in (?P<seconds>\d+) seconds", None, waiting=True),
)

# What a waiting line means, by the phase it came in (None: any other phase).
NOTES: dict[tuple[str, Phase | None], str] = {
    ("shm_wait", Phase.COMPILING): "normal while compiling: vLLM's engine waits for its worker, busy in torch.compile; "
                                   "not hung while the tree's CPU time grows",
    ("shm_wait", Phase.LOADING): "normal while the weights load from a slow disk: the engine waits for its worker; "
                                 "not hung while the tree reads",
    ("shm_wait", None): "vLLM's engine waits for its worker: a hang only if the tree's CPU and I/O stay flat too "
                        "(vsup stops a start that shows no progress for health.startup_stall)",
}

# Progress a reading must show to count as moving, between two readings.
CPU_MOVING = 0.02  # CPU seconds per second of the tree (2 % of one core): a hung tree uses about none
IO_MOVING = 64 * 1024  # bytes read


def match(line: str) -> tuple[Pattern, re.Match[str]] | None:
    """The first pattern of `PATTERNS` the line matches, and its match."""
    for pattern in PATTERNS:
        if any(needle in line for needle in pattern.needles) and (found := pattern.regex.search(line)) is not None:
            return pattern, found
    return None


def note(name: str, phase: Phase | None) -> str:
    return NOTES.get((name, phase)) or NOTES.get((name, None)) or ""


@dataclass(frozen=True)
class Waiting:
    """The last waiting line of the output: its pattern, the line as it came, the phase it came in,
    how many came in that phase."""

    name: str
    line: str
    phase: Phase | None
    count: int


@dataclass(frozen=True)
class Output:
    """What an instance's output has said so far (a snapshot of an `OutputReader`)."""

    phase: Phase | None = None  # the phase the output last named (None: none yet: booting)
    lines: int = 0  # lines so far, waiting lines left out
    shards: tuple[int, int] | None = None  # (done, total) of the last shard progress line
    percent: int | None = None  # its percentage
    waiting: Waiting | None = None
    took: tuple[tuple[str, float], ...] = ()  # ("weights_loaded", 30.1): what vLLM said a step took


class OutputReader:
    """Fed every line of one process's output (both streams, in order)."""

    def __init__(self) -> None:
        self.phase: Phase | None = None
        self.lines = 0
        self.shards: tuple[int, int] | None = None
        self.percent: int | None = None
        self.waiting: Waiting | None = None
        self.took: dict[str, float] = {}

    def feed(self, lines: Iterable[str]) -> None:
        for line in lines:
            found = match(line)
            if found is None:
                self.lines += 1
                continue
            pattern, m = found
            if pattern.waiting:
                same = self.waiting is not None and self.waiting.name == pattern.name and self.waiting.phase is self.phase
                self.waiting = Waiting(pattern.name, line, self.phase, self.waiting.count + 1 if same and self.waiting else 1)
                continue
            self.lines += 1
            if pattern.phase is not None:
                self.phase = pattern.phase
            groups = m.groupdict()
            if groups.get("total") is not None:
                self.shards = (int(groups["done"]), int(groups["total"]))
                self.percent = min(100, int(groups["percent"]))
            if groups.get("seconds") is not None:
                self.took[pattern.name] = float(groups["seconds"])

    def snapshot(self) -> Output:
        return Output(self.phase, self.lines, self.shards, self.percent, self.waiting, tuple(self.took.items()))


@dataclass(frozen=True)
class Progress:
    """One reading of a starting instance (Operations.progress): what its output said, and what its
    process tree has done so far (summed over its processes, never going down; None: unreadable)."""

    output: Output = field(default_factory=Output)
    cpu_seconds: float | None = None  # user + system CPU time
    rchar: int | None = None  # bytes read by read() and friends (/proc/<pid>/io rchar: from the page cache too)
    read_bytes: int | None = None  # bytes fetched from storage (/proc/<pid>/io read_bytes: mmap faults too)

    @property
    def read(self) -> int | None:
        """Bytes read, by whichever counter saw more (mmap'd weights show in read_bytes, read() in rchar)."""
        known = [v for v in (self.rchar, self.read_bytes) if v is not None]
        return max(known) if known else None


def _grew(before: float | None, after: float | None, by: float) -> bool:
    return before is not None and after is not None and after - before >= by


class StartWatch:
    """One start, from the spawn to ready: its phase and since when, when it last moved and by
    what, the load's bytes read, how long each phase took. Fed `Progress` readings (`update`) and
    the lifecycle's own phase (`enter`: warming); times are the lifecycle's clock."""

    def __init__(self, now: float, weights_bytes: int | None = None) -> None:
        self.started = now
        self.phase = Phase.BOOTING
        self.phase_since = now
        self.moved_at = now  # the last reading that showed progress (the spawn counts)
        self.moved_by = "start"  # what it was: "phase", "output", "cpu", "io"
        self.weights_bytes = weights_bytes  # the model's weight files (the plan's), to measure the load against
        self.output = Output()
        self.judged = False  # the last reading had the tree's CPU time: a start without progress can be told
        self.durations: dict[Phase, float] = {}  # phase -> seconds spent in it (the current one not yet)
        self._last: Progress | None = None
        self._last_at = now
        self._load_base: int | None = None  # bytes read when the load began
        self.loaded: int | None = None  # bytes read since
        self.ready_at: float | None = None  # when the start ended in ready (finish)

    def enter(self, phase: Phase, now: float) -> None:
        if self.ready_at is None and phase is not self.phase:
            self.durations[self.phase] = self.durations.get(self.phase, 0.0) + now - self.phase_since
            self.phase, self.phase_since = phase, now

    def update(self, now: float, progress: Progress) -> list[str]:
        """Take one reading; returns what moved since the previous one ([] when nothing did)."""
        last, output = self._last, progress.output
        moved = []
        phase = output.phase or Phase.BOOTING
        if phase is not self.phase and self.phase is not Phase.WARMING and self.ready_at is None:
            if phase is Phase.LOADING and self._load_base is None:
                # the bytes read since the reading before the load's first line: the load began in between
                self._load_base = last.read if last is not None else progress.read
            self.enter(phase, now)
            moved.append("phase")
        if output.lines > self.output.lines:
            moved.append("output")
        self.judged = progress.cpu_seconds is not None
        if last is not None:
            if _grew(last.cpu_seconds, progress.cpu_seconds, CPU_MOVING * max(now - self._last_at, 0.0)):
                moved.append("cpu")
            if _grew(last.read, progress.read, IO_MOVING):
                moved.append("io")
        if self._load_base is not None and progress.read is not None:
            self.loaded = max(0, progress.read - self._load_base)
        if moved or last is None:
            self.moved_at, self.moved_by = now, (moved[0] if moved else "start")
        self.output, self._last, self._last_at = output, progress, now
        return moved

    def finish(self, now: float) -> None:
        """The start reached ready: its phases' times stop here (a later reading changes nothing)."""
        if self.ready_at is None:
            self.durations[self.phase] = self.durations.get(self.phase, 0.0) + now - self.phase_since
            self.phase_since = self.ready_at = now

    def record(self) -> dict[str, Any] | None:
        """A finished start, for the status JSON's `start` (what `vsup tune` compares): seconds
        from the spawn to ready, and each phase's; None until it reached ready."""
        if self.ready_at is None:
            return None
        return {"ready_s": round(self.ready_at - self.started, 2),
                "took": {phase.value: round(self.durations[phase], 2) for phase in Phase if phase in self.durations}}

    def idle(self, now: float) -> float:
        """Seconds since the start last moved."""
        return max(0.0, now - self.moved_at)

    def took(self, now: float) -> list[tuple[Phase, float]]:
        """Each phase gone through so far and its seconds, in `Phase` order (the current one until now)."""
        spent = dict(self.durations)
        if self.ready_at is None:
            spent[self.phase] = spent.get(self.phase, 0.0) + now - self.phase_since
        return [(phase, spent[phase]) for phase in Phase if phase in spent]

    def summary(self, now: float) -> str:
        """ "booting 40s, loading 30s, compiling 2m10s": what a finished start's transition names."""
        return ", ".join(f"{phase.value} {_short(seconds)}" for phase, seconds in self.took(now))

    def waiting(self) -> Waiting | None:
        """The output's last waiting line, while the phase it came in lasts."""
        waiting = self.output.waiting
        return waiting if waiting is not None and waiting.phase is self.phase else None

    def to_json(self, now: float) -> dict[str, Any]:
        """The status JSON's `phase` of a starting or warming instance."""
        loading = self.phase is Phase.LOADING
        waiting = self.waiting()
        return {
            "name": self.phase.value,
            "text": PHASE_TEXT[self.phase],
            "for": round(now - self.phase_since, 1),
            "idle": round(self.idle(now), 1),  # seconds since the start last moved (judged: the tree's counters are read)
            "judged": self.judged,
            "shards": list(self.output.shards) if loading and self.output.shards else None,
            "percent": self.output.percent if loading else None,
            "read_bytes": self.loaded if loading else None,
            "weights_bytes": self.weights_bytes if loading else None,
            "waiting": None if waiting is None else {"line": waiting.line, "count": waiting.count,
                                                     "note": note(waiting.name, waiting.phase)},
            "took": {phase.value: round(seconds, 1) for phase, seconds in self.took(now)},
        }


def _short(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole}s" if whole < 60 else f"{whole // 60}m{whole % 60:02d}s"
