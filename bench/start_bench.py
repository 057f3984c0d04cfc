"""Full capacity in the time of one load (issue 31), measured with real vLLM CPU and a model of real
shape: one `vsup run` of N instances (default 2, one per core here), and

- the time from `vsup run` to all instances ready (polled through the control socket every
  --poll seconds), each instance's own start (spawn to ready, by vsup's transitions) and how long
  each of its phases took (booting, loading, profiling, compiling, opening, warming: phases.py);
- their ratio, all ready ÷ the slowest own start: 1.0 when the starts overlap fully, ~N when they
  run one after another (the bar: ≤ 1.25);
- what `start.mode` (default auto) picked and why (`vsup plan --format json`, the same choice);
- the memory of each instance's process tree while it loads and once ready, read from /proc every
  --poll seconds: anonymous + shared memory (what the load really holds: the tensors) and
  file-backed pages (the mmap'd checkpoint: page cache, shared by instances of one model and
  reclaimable) — the measured load peak that vsup/topology/startmode.py's estimate stands for.

The model: scripts/build_tiny_model.py with Qwen2-1.5B's shape (1.32 B random fp32 parameters,
5.3 GB; tests/vllm_fixtures.py's REAL_SHAPE), built once into ~/.cache/vsup/real-shape-llama.
Without --enforce-eager (the real compile) unless --eager is given.

    .venv/bin/python bench/start_bench.py                        # docs/bench/start_bench.json
    .venv/bin/python bench/start_bench.py --eager --out-name start_bench-eager.json
    .venv/bin/python bench/start_bench.py --fake                  # the script itself, on the fake vLLM

It needs ~2 × (weights + 1.5 GiB) of free memory: check `free -g` first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)
from vllm_bench import ROOT, VSUP, Layout, free_port  # noqa: E402

from vsup.supervisor.control import request  # noqa: E402
from vsup.supervisor.phases import Phase  # noqa: E402

SERVED = "real-shape"
BOUND = 1.25
REAL_SHAPE = ("--hidden", "1536", "--layers", "28", "--heads", "12", "--kv-heads", "2", "--head-dim", "128",
              "--intermediate", "8960", "--max-positions", "8192")
LOADING = {Phase.BOOTING.value, Phase.LOADING.value}  # the weights are read (booting: the bytes may start before the line)


def tree_memory(pid: int) -> dict[str, int] | None:
    """Bytes of the process tree under `pid`: anon (+ shmem: the tensors, vLLM's shared buffers)
    and file (mapped file pages: the checkpoint, page cache); None when it is gone."""
    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = {"anon": 0, "file": 0}
    for proc in family:
        try:
            lines = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                total["anon"] += int(value.split()[0]) * 1024
            elif key == "RssFile":
                total["file"] += int(value.split()[0]) * 1024
    return total


class Watch:
    """Per instance: its phase readings and its tree's memory, sampled while the fleet starts."""

    def __init__(self, count: int) -> None:
        self.phases: list[list[str]] = [[] for _ in range(count)]  # the phases seen, in order (deduplicated)
        self.took: list[dict[str, float]] = [{} for _ in range(count)]  # the last reading's phase durations
        self.load_peak = [{"anon": 0, "file": 0, "sum": 0} for _ in range(count)]
        self.start_peak = [{"anon": 0, "file": 0, "sum": 0} for _ in range(count)]  # the whole start
        self.machine_low = None  # the least MemAvailable seen (bytes)

    def take(self, status: dict) -> None:
        for inst in status["instances"]:
            i, phase = inst["index"], inst["phase"]
            name = phase["name"] if phase else inst["state"]
            if not self.phases[i] or self.phases[i][-1] != name:
                self.phases[i].append(name)
            if phase:
                self.took[i] = phase["took"]
            if inst["pid"] and inst["state"] in ("starting", "warming"):
                memory = tree_memory(inst["pid"])
                if memory is not None:
                    peaks = [self.start_peak[i]] + ([self.load_peak[i]] if name in LOADING else [])
                    for peak in peaks:
                        for key in ("anon", "file"):
                            peak[key] = max(peak[key], memory[key])
                        peak["sum"] = max(peak["sum"], memory["anon"] + memory["file"])
        available = psutil.virtual_memory().available
        self.machine_low = available if self.machine_low is None else min(self.machine_low, available)


def own_start(inst: dict) -> float:
    spawned = [t["at"] for t in inst["transitions"] if t["to"] == "starting"]
    ready = [t["at"] for t in inst["transitions"] if t["to"] == "ready"]
    return ready[-1] - spawned[-1]


def warming(inst: dict) -> float:
    began = [t["at"] for t in inst["transitions"] if t["to"] == "warming"]
    ready = [t["at"] for t in inst["transitions"] if t["to"] == "ready"]
    return ready[-1] - began[-1]


def config(args, workdir: Path) -> tuple[Path, int]:
    port = free_port()
    if args.fake:  # checks the script, not vLLM: the numbers mean nothing
        model, vllm = "fake-model", {"command": [str(ROOT / "tests" / "fakevllm" / "vllm"), "serve"]}
        placement: dict[str, Any] = {"model_size_gib": 0.01, "overhead_gib": 0.01}
    else:
        vllm_args = ["--dtype", "float32", "--max-model-len", str(args.max_model_len), "--max-num-seqs", "8"]
        model, vllm = str(args.model_dir), {"venv": str(args.venv), "env": {"HF_HUB_OFFLINE": "1",
                                                                             "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")},
                                            "args": vllm_args + (["--enforce-eager"] if args.eager else [])}
        placement = {"overhead_gib": args.overhead_gib}
    data = {
        "model": model,
        "served_model_name": SERVED,
        "instances": args.instances,
        "placement": {"reserve_cores": 0, "kvcache_gib": args.kvcache_gib, **placement},
        "vllm": vllm,
        "proxy": {"port": port},
        "start": {"mode": args.start_mode},
        "health": {"startup_timeout": args.startup_timeout, "interval": 1.0},
        "log": {"dir": str(workdir / "logs"), "echo": False},
        "control": {"socket": str(workdir / "control.sock")},
    }
    path = workdir / "vsup.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, port


def measure(args, workdir: Path) -> dict[str, Any]:
    path, _port = config(args, workdir)
    planned = json.loads(subprocess.run([VSUP, "plan", "--config", str(path), "--format", "json"], check=True,
                                        capture_output=True, text=True, timeout=120).stdout)
    layout = Layout(workdir)
    watch = Watch(args.instances)
    socket = workdir / "control.sock"
    began = time.monotonic()
    layout.spawn([VSUP, "run", "--config", str(path)], "vsup")
    try:
        while True:
            if time.monotonic() - began > args.startup_timeout:
                raise RuntimeError(f"not ready within {args.startup_timeout:.0f}s; see {workdir}")
            if layout.procs[0].poll() is not None:
                raise RuntimeError(f"vsup exited ({layout.procs[0].returncode}); see {workdir}/vsup.log")
            try:
                status = asyncio.run(request(socket, "GET", "/status", timeout=10))
            except Exception:  # not listening yet
                time.sleep(args.poll)
                continue
            watch.take(status)
            if all(inst["state"] == "ready" for inst in status["instances"]):
                all_ready = time.monotonic() - began
                load_at_ready = [round(x, 2) for x in os.getloadavg()]
                break
            if any(inst["state"] in ("failed", "backoff") for inst in status["instances"]):
                raise RuntimeError(f"an instance failed to start; see {workdir}")
            time.sleep(args.poll)
        time.sleep(2)
        ready_memory = [tree_memory(inst["pid"]) for inst in status["instances"]]
        log = (workdir / "vsup.log").read_text(errors="replace")
    except Exception:
        for name in sorted(workdir.rglob("*.log")):
            print(f"--- {name.name} (tail)\n{name.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        raise
    finally:
        layout.stop()
    own = [own_start(inst) for inst in status["instances"]]
    instances = []
    for inst in status["instances"]:
        i = inst["index"]
        phases = {name: seconds for name, seconds in watch.took[i].items() if name != "warming"}
        phases["warming"] = round(warming(inst), 1)
        instances.append({"index": i, "own_start_s": round(own[i], 1), "phases_s": phases, "phases_seen": watch.phases[i],
                          "load_peak_bytes": watch.load_peak[i], "start_peak_bytes": watch.start_peak[i],
                          "ready_bytes": ready_memory[i], "restarts": inst["restarts"]})
    plan_inst = planned["instances"][0]
    line = next((ln for ln in log.splitlines() if "start: " in ln and "start.mode" in ln), "")
    return {
        "all_ready_s": round(all_ready, 1),
        "slowest_own_s": round(max(own), 1),
        "ratio": round(all_ready / max(own), 3),
        "bound": BOUND,
        "met": all_ready / max(own) <= BOUND,
        "load_average_at_ready": load_at_ready,
        "start": planned["start"],
        "start_log_line": line.split("start: ", 1)[-1],
        "plan": {"weights_bytes": plan_inst["weights_bytes"], "kvcache_bytes": plan_inst["kvcache_bytes"],
                 "overhead_bytes": plan_inst["overhead_bytes"]},
        "least_mem_available_bytes": watch.machine_low,
        "instances": instances,
    }


def show(figures: dict) -> str:
    gib = 1024**3
    lines = [f"start.mode {figures['start']['asked']} picked {figures['start']['mode']}: {figures['start']['reason']}",
             f"vsup run -> all ready {figures['all_ready_s']} s; slowest own start {figures['slowest_own_s']} s; "
             f"ratio {figures['ratio']:.2f} (bar {BOUND}: {'met' if figures['met'] else 'NOT met'})"]
    for inst in figures["instances"]:
        peak = inst["load_peak_bytes"]
        lines.append(f"  instance {inst['index']}: own {inst['own_start_s']} s, phases {inst['phases_s']}; load peak "
                     f"anon {peak['anon'] / gib:.2f} GiB + file {peak['file'] / gib:.2f} GiB; ready anon "
                     f"{(inst['ready_bytes'] or {}).get('anon', 0) / gib:.2f} GiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--start-mode", choices=("auto", "parallel", "staggered"), default="auto")
    parser.add_argument("--eager", action="store_true", help="pass --enforce-eager (no compile)")
    parser.add_argument("--kvcache-gib", type=float, default=0.5, help="placement.kvcache_gib (default 0.5)")
    parser.add_argument("--overhead-gib", type=float, default=1.5, help="placement.overhead_gib (default 1.5)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between readings (default 0.5)")
    parser.add_argument("--startup-timeout", type=float, default=3600.0, help="seconds to all ready (default 3600: a compile on a shared core took over 30 min here)")
    parser.add_argument("--venv", type=Path, default=None, help="vLLM's venv (default: scripts/vllm-env's)")
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "vsup" / "real-shape-llama")
    parser.add_argument("--out-name", default="start_bench.json", help="the result file in docs/bench/")
    parser.add_argument("--fake", action="store_true", help="run against the fake vLLM: checks the script only")
    args = parser.parse_args(argv)
    if args.instances < 1 or args.poll <= 0:
        parser.error("--instances must be at least 1 and --poll above 0")
    if not args.fake:
        if args.venv is None:
            args.venv = Path(subprocess.run([str(ROOT / "scripts" / "vllm-env")], check=True, capture_output=True,
                                            text=True).stdout.strip().splitlines()[-1])
        subprocess.run([str(args.venv / "bin" / "python"), str(ROOT / "scripts" / "build_tiny_model.py"), *REAL_SHAPE,
                        "--out", str(args.model_dir)], check=True, stdout=subprocess.DEVNULL)
    recorder = Recorder("start_bench", [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory(prefix="start-bench-") as tmp:
        figures = measure(args, Path(tmp))
    figures["settings"] = {"instances": args.instances, "start_mode": args.start_mode, "eager": args.eager,
                           "kvcache_gib": args.kvcache_gib, "overhead_gib": args.overhead_gib,
                           "max_model_len": args.max_model_len, "poll_s": args.poll, "model": "real-shape-llama "
                           "(hidden 1536, 28 layers, 12 heads / 2 KV heads of 128, MLP 8960, fp32)", "fake": args.fake}
    print(show(figures))
    if not args.fake:  # the fake's numbers mean nothing: never overwrite the published ones with them
        recorder.write(figures, file_name=args.out_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
