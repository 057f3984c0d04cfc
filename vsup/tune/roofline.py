"""How close to the machine's limit: memory bandwidth per NUMA node, and decode against it.

Decode on CPU is bound by memory bandwidth: every step streams the weights (and the KV cache of
the running sequences) once. `measure_bandwidth` runs a STREAM-like triad (a = b + s·c, counted
as 24 bytes per element like STREAM) in one process per CPU, pinned to the CPUs the plan gives
the instances' OpenMP threads on that node, all started together; their rates add up to the node's
sustainable bandwidth. `decode_roofline` sets a candidate's figures against it:

    steps/s (all instances)  = instances / mean ITL            (each stream gets a token per step)
    sequences per step       = tokens/s × mean ITL / instances
    bytes per step           = weights + KV bytes/token × sequences × mean context length
    % of the limit           = steps/s × bytes per step / Σ bandwidth of the nodes used
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from vsup.topology.model import Machine
from vsup.topology.plan_model import Plan

if TYPE_CHECKING:  # numpy (through metrics) loads only where the load is measured, not in `vsup doctor`
    from vsup.tune.metrics import LevelMetrics

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "bf16": 2, "fp16": 2, "fp32": 4,
               "float64": 8, "fp8": 1, "int8": 1}


# ---- measuring -------------------------------------------------------------------------------------

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
    procs = [subprocess.Popen([sys.executable, "-m", "vsup.tune.roofline", str(cpu), str(mib), str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for cpu in cpus]
    try:
        for proc in procs:  # each pinned, its arrays allocated and touched on its own node
            if _pipe(proc.stdout).readline().strip() != "ready":
                raise RuntimeError(f"triad worker failed: {_pipe(proc.stderr).read().strip()[-300:]}")
        for proc in procs:
            _pipe(proc.stdin).write("go\n")
            _pipe(proc.stdin).flush()
        total = 0.0
        for proc in procs:
            line = _pipe(proc.stdout).readline()
            if not line:
                raise RuntimeError(f"triad worker failed: {_pipe(proc.stderr).read().strip()[-300:]}")
            result = json.loads(line)
            total += result["bytes"] / result["seconds"]
        return total
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                _pipe(stream).close()


def _pipe(stream: IO[str] | None) -> IO[str]:
    assert stream is not None, "the workers are started with every stream a pipe"
    return stream


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


# ---- decode against the limit ----------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFacts:
    weights_bytes: int | None  # per instance, in memory
    kv_bytes_per_token: int | None  # K and V of every layer; None: unknown (not counted)


def model_facts(model: str, weights_on_disk: int | None, vllm_args: Sequence[str]) -> ModelFacts:
    """From a local model's config.json: KV bytes per token, and the weights at the dtype vLLM runs."""
    config_path = Path(model).expanduser() / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return ModelFacts(weights_on_disk, None)
    text = cfg.get("text_config", cfg)
    stored = DTYPE_BYTES.get(str(text.get("torch_dtype") or cfg.get("torch_dtype") or "").replace("torch.", ""), None)
    run = stored
    for i, arg in enumerate(vllm_args):
        value = vllm_args[i + 1] if arg == "--dtype" and i + 1 < len(vllm_args) else arg.split("=", 1)[1] if arg.startswith("--dtype=") else None
        if value is not None and value in DTYPE_BYTES:
            run = DTYPE_BYTES[value]
    weights = weights_on_disk
    if weights is not None and stored and run and stored != run:
        weights = weights * run // stored
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return ModelFacts(weights, None)
    return ModelFacts(weights, 2 * layers * kv_heads * head_dim * (run or 2))


@dataclass(frozen=True)
class Roofline:
    level: str
    steps_per_s: float  # all instances together
    bytes_per_step: float  # per instance
    achieved: float  # bytes/s
    limit: float  # bytes/s of the nodes used
    kv_counted: bool

    @property
    def fraction(self) -> float:
        return self.achieved / self.limit if self.limit > 0 else float("nan")

    def to_json(self) -> dict:
        return {"level": self.level, "steps_per_s": round(self.steps_per_s, 3), "bytes_per_step": round(self.bytes_per_step),
                "achieved_gbs": round(self.achieved / 1e9, 3), "limit_gbs": round(self.limit / 1e9, 3),
                "fraction": round(self.fraction, 4) if math.isfinite(self.fraction) else None, "kv_counted": self.kv_counted}


def decode_roofline(plan: Plan, levels: Sequence[LevelMetrics], bandwidth: Mapping[int, float], facts: ModelFacts) -> Roofline | None:
    """Against the level with the most tokens/s; None when it cannot be said (no ITL, no weights size)."""
    usable = [lv for lv in levels if lv.completed and lv.get("itl", "mean") > 0]
    if not usable or not facts.weights_bytes:
        return None
    lv = max(usable, key=lambda x: x.output_throughput)
    n = len(plan.instances)
    itl = lv.get("itl", "mean")
    steps = n / itl
    batch = lv.output_throughput * itl / n
    context = (lv.input_tokens + lv.output_tokens / 2) / lv.completed
    per_step = facts.weights_bytes + (facts.kv_bytes_per_token or 0) * batch * context
    nodes = {node for inst in plan.instances for node in (inst.nodes or (-1,))}
    limit = sum(bandwidth.get(node, 0.0) for node in nodes) or sum(bandwidth.values())
    return Roofline(lv.level, steps, per_step, steps * per_step, limit, facts.kv_bytes_per_token is not None)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
