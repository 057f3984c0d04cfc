"""Why placement matters, measured with real vLLM CPU: the same load against three layouts, one run.

  (a) vsup:       2 instances through `vsup run`, each pinned to its own core (numactl/taskset),
                  explicit VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS=1
  (b) unpinned:   2 plain vLLM servers, vLLM's defaults (VLLM_CPU_OMP_THREADS_BIND=auto, no
                  affinity), behind the same proxy (`vsup proxy --upstream ... --upstream ...`)
  (c) one big:    1 instance through `vsup run` on all cores (OpenMP over every core)

Each layout: start, wait until the proxy says every instance is ready, warm up, then N concurrent
streams of fixed prompts with a fixed number of tokens (ignore_eos) for D seconds; tokens/s and
time to first token (p50/p90) are reported side by side, with ratios against (b). Layouts run one
after the other (never more than 2 servers at once). Everything runs on this machine, loopback only.

    .venv/bin/python bench/vllm_bench.py                     # 32 streams x 64 tokens, 60 s per layout
    .venv/bin/python bench/vllm_bench.py --streams 8 --duration 30 --layouts a,c

The model: a random-weight Llama big enough for compute to matter (default hidden 1024, 8 layers,
fp32, ~140 M parameters), built once by scripts/build_tiny_model.py into ~/.cache/vsup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import yaml

from vsup.topology.cpulist import format_list, parse_list

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)

ROOT = Path(__file__).resolve().parents[1]
VSUP = str(ROOT / ".venv" / "bin" / "vsup") if (ROOT / ".venv" / "bin" / "vsup").exists() else "vsup"
SERVED_NAME = "bench-llama"
LAYOUTS = {
    "a": "2 pinned instances (vsup)",
    "b": "2 unpinned instances (vLLM defaults)",
    "c": "1 instance on all cores (vsup)",
}
_WORDS = "the model server answers each request with tokens from its cache while the proxy spreads the load".split()


def prompts(count: int = 8) -> list[str]:
    """Fixed prompts of 16 to 128 words, the same in every run."""
    out = []
    for i in range(count):
        words = 16 * (1 + i % 8)
        out.append(" ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(words)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    for _ in range(100):
        base = free_port()
        if base + count >= 65536:
            continue
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no free ports")


# ---- the load -----------------------------------------------------------------------------------

@dataclass
class Result:
    layout: str
    round: int = 1
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    elapsed: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    startup: float = 0.0
    worker_cpus: list[str] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed else 0.0

    def ttft(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        if len(self.ttfts) == 1:
            return self.ttfts[0]
        return statistics.quantiles(self.ttfts, n=100, method="inclusive")[int(q * 100) - 1]


async def stream_once(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> tuple[float, int]:
    """(seconds to the first streamed event with choices, completion tokens) of one request."""
    began = time.monotonic()
    first = None
    tokens = 0
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if first is None and event.get("choices"):
                first = time.monotonic() - began
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if first is None or tokens != body["max_tokens"]:
        raise RuntimeError(f"incomplete stream: first event {first}, {tokens}/{body['max_tokens']} tokens")
    return first, tokens


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(time to first token, completion tokens) of one streamed completion."""
    payload = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
               "ignore_eos": True, "stream_options": {"include_usage": True}}
    return await stream_once(session, url, "/v1/completions", payload)


async def load(url: str, streams: int, max_tokens: int, duration: float, result: Result) -> None:
    texts = prompts()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # warm-up: every instance sees a couple of requests before the clock starts
        await asyncio.gather(*(one_stream(session, url, texts[i % len(texts)], 8) for i in range(4)))
        began = time.monotonic()
        deadline = began + duration

        async def worker(index: int) -> None:
            n = index
            while time.monotonic() < deadline:
                try:
                    ttft, tokens = await one_stream(session, url, texts[n % len(texts)], max_tokens)
                    result.ttfts.append(ttft)
                    result.tokens += tokens
                    result.requests += 1
                except Exception as exc:  # counted and shown; a layout that errors says so in the table
                    result.errors += 1
                    if len(result.error_samples) < 3:
                        result.error_samples.append(f"{type(exc).__name__}: {exc}"[:200])
                    await asyncio.sleep(0.5)
                n += streams

        await asyncio.gather(*(worker(i) for i in range(streams)))
        result.elapsed = time.monotonic() - began


# ---- the layouts --------------------------------------------------------------------------------

class Layout:
    """Processes of one layout, each in its own session; stop() leaves nothing behind."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True, cwd=self.workdir))
        log.close()

    def wait_ready(self, proxy_url: str, instances: int, timeout: float) -> None:
        import urllib.request
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}); see {self.workdir}")
            try:
                with urllib.request.urlopen(f"{proxy_url}/ready", timeout=5) as response:
                    if json.load(response).get("instances_ready") == instances:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"not ready within {timeout:.0f}s; see the logs in {self.workdir}")

    def worker_cpus(self) -> list[str]:
        """Per vLLM Worker of this layout: the CPUs its threads may run on (union of the threads')."""
        found = []
        for proc in self.procs:
            try:
                family = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for child in family:
                try:
                    if Path(f"/proc/{child.pid}/comm").read_text().strip() != "VLLM::Worker":
                        continue
                    cpus: set[int] = set()
                    for task in Path(f"/proc/{child.pid}/task").iterdir():
                        for line in (task / "status").read_text().splitlines():
                            if line.startswith("Cpus_allowed_list:"):
                                cpus |= parse_list(line.split(":", 1)[1].strip())
                    found.append(format_list(cpus))
                except OSError:
                    continue
        return found

    def stop(self) -> None:
        for proc in self.procs:  # SIGTERM first: vsup stops its instances' trees itself
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            try:  # whatever of its session is left (unpinned vLLM's EngineCore/Worker)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def vsup_config(args, instances: int, workdir: Path) -> tuple[Path, int]:
    port = free_port()
    config = {
        "model": str(args.model_dir),
        "served_model_name": SERVED_NAME,
        "instances": instances,
        "placement": {"reserve_cores": 0, "kvcache_gib": args.kvcache_gib},
        "vllm": {"venv": str(args.venv), "args": vllm_args(args), "env": {"HF_HUB_OFFLINE": "1"},
                 "base_port": free_ports(instances)},
        "proxy": {"port": port},
        "health": {"startup_timeout": args.startup_timeout},
        "start": {"mode": "parallel"},
        "log": {"dir": str(workdir / "logs"), "echo": False},
        "control": {"socket": str(workdir / "control.sock")},
    }
    path = workdir / "vsup.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def vllm_args(args) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", str(max(args.streams, 8))]


def start_layout(key: str, args, workdir: Path) -> tuple[Layout, str, int]:
    layout = Layout(workdir)
    if key in ("a", "c"):
        instances = 2 if key == "a" else 1
        config, port = vsup_config(args, instances, workdir)
        layout.spawn([VSUP, "run", "--config", str(config)], "vsup")
        return layout, f"http://127.0.0.1:{port}", instances
    # (b): vLLM as a user would start it by hand, twice, with its own defaults for CPU placement
    base = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CPU_", "OMP_", "GOMP_", "KMP_"))}
    env["HF_HUB_OFFLINE"] = "1"
    kv_bytes = str(int(args.kvcache_gib * 1024**3))
    for i in range(2):
        layout.spawn([str(args.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                      str(args.model_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                      "--port", str(base + i), "--kv-cache-memory-bytes", kv_bytes, *vllm_args(args)], f"vllm{i}", env)
    port = free_port()
    layout.spawn([VSUP, "proxy", "--port", str(port), "--upstream", f"http://127.0.0.1:{base}",
                  "--upstream", f"http://127.0.0.1:{base + 1}"], "proxy")
    return layout, f"http://127.0.0.1:{port}", 2


def run_layout(key: str, args, round_no: int) -> Result:
    result = Result(layout=key, round=round_no)
    with tempfile.TemporaryDirectory(prefix=f"vllm-bench-{key}-") as tmp:
        workdir = Path(tmp)
        began = time.monotonic()
        layout, url, instances = start_layout(key, args, workdir)
        try:
            layout.wait_ready(url, instances, args.startup_timeout)
            result.startup = time.monotonic() - began
            result.worker_cpus = layout.worker_cpus()
            print(f"  ({key}) {LAYOUTS[key]}: ready after {result.startup:.0f} s; load for {args.duration:.0f} s", file=sys.stderr)
            asyncio.run(load(url, args.streams, args.max_tokens, args.duration, result))
        except Exception:
            for log in sorted(workdir.glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            raise
        finally:
            layout.stop()
    return result


# ---- main ---------------------------------------------------------------------------------------

def ensure_model(args) -> None:
    build = [str(args.venv / "bin" / "python"), str(ROOT / "scripts" / "build_tiny_model.py"), "--out", str(args.model_dir),
             "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads)]
    subprocess.run(build, check=True, stdout=subprocess.DEVNULL)


def table(results: list[Result], args) -> str:
    lines = [
        f"{args.streams} concurrent streams x {args.max_tokens} tokens, {args.duration:.0f} s per layout and round, "
        f"{args.rounds} round(s) (layouts interleaved); model: random Llama hidden {args.hidden}, {args.layers} layers, "
        f"fp32, eager; {os.cpu_count()} CPUs",
        "",
        "| layout | round | Worker CPUs | tok/s | vs (b) | TTFT p50 | TTFT p90 | requests | errors | start-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        baseline = next((b for b in results if b.layout == "b" and b.round == r.round), None)
        ratio = f"{r.tokens_per_s / baseline.tokens_per_s:.2f}x" if baseline and baseline.tokens_per_s else "-"
        lines.append(f"| ({r.layout}) {LAYOUTS[r.layout]} | {r.round} | {' / '.join(r.worker_cpus) or '?'} | "
                     f"{r.tokens_per_s:.1f} | {ratio} | {r.ttft(0.5) * 1000:.0f} ms | {r.ttft(0.9) * 1000:.0f} ms | "
                     f"{r.requests} | {r.errors} | {r.startup:.0f} s |")
    if args.rounds > 1:
        lines += ["", "| layout | mean tok/s | vs (b) | TTFT p50 (all rounds) | TTFT p90 (all rounds) |", "|---|---|---|---|---|"]
        merged = {}
        for key in dict.fromkeys(r.layout for r in results):
            mine = [r for r in results if r.layout == key]
            merged[key] = Result(layout=key, tokens=sum(r.tokens for r in mine), elapsed=sum(r.elapsed for r in mine),
                                 ttfts=[t for r in mine for t in r.ttfts])
        base = merged.get("b")
        for key, m in merged.items():
            ratio = f"{m.tokens_per_s / base.tokens_per_s:.2f}x" if base and base.tokens_per_s else "-"
            lines.append(f"| ({key}) {LAYOUTS[key]} | {m.tokens_per_s:.1f} | {ratio} | {m.ttft(0.5) * 1000:.0f} ms | "
                         f"{m.ttft(0.9) * 1000:.0f} ms |")
    for r in results:
        for sample in r.error_samples:
            lines.append(f"({r.layout}, round {r.round}) error: {sample}")
    return "\n".join(lines)


def figures(results: list[Result], args) -> dict:
    """What docs/bench/vllm_bench.json holds: the settings, every layout and round, and the layouts over all rounds
    with their ratios to (b) and to each other — ratios of one run are what the docs quote."""
    def row(r: Result) -> dict:
        return {"layout": r.layout, "round": r.round, "name": LAYOUTS[r.layout], "worker_cpus": r.worker_cpus,
                "tokens_per_s": round(r.tokens_per_s, 1), "ttft_p50_s": round(r.ttft(0.5), 3),
                "ttft_p90_s": round(r.ttft(0.9), 3), "requests": r.requests, "errors": r.errors,
                "startup_s": round(r.startup, 1)}
    merged = {}
    for key in dict.fromkeys(r.layout for r in results):
        mine = [r for r in results if r.layout == key]
        merged[key] = row(Result(layout=key, tokens=sum(r.tokens for r in mine), elapsed=sum(r.elapsed for r in mine),
                                 requests=sum(r.requests for r in mine), errors=sum(r.errors for r in mine),
                                 ttfts=[t for r in mine for t in r.ttfts]))
        del merged[key]["round"], merged[key]["startup_s"], merged[key]["worker_cpus"]
    return {"settings": {"streams": args.streams, "max_tokens": args.max_tokens, "duration_s": args.duration,
                         "rounds": args.rounds, "hidden": args.hidden, "layers": args.layers,
                         "kvcache_gib": args.kvcache_gib},
            "runs": [row(r) for r in results], "layouts": merged}


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The bench model and vLLM install (shared with bench/affinity_bench.py)."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kvcache-gib", type=float, default=0.5, help="KV cache per instance (default 0.5)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--venv", type=Path, default=None, help="vLLM's venv (default: scripts/vllm-env's)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default ~/.cache/vsup/bench-llama-h<hidden>-l<layers>")


def resolve_model(args) -> None:
    """vLLM's venv (built by scripts/vllm-env when missing) and the bench model (built once)."""
    if args.venv is None:
        args.venv = Path(subprocess.run([str(ROOT / "scripts" / "vllm-env")], check=True, capture_output=True,
                                        text=True).stdout.strip().splitlines()[-1])
    if args.model_dir is None:
        home = Path(os.environ.get("HOME", "."))
        args.model_dir = home / ".cache" / "vsup" / f"bench-llama-h{args.hidden}-l{args.layers}"
    ensure_model(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="a,b,c", help="which layouts, in order (default a,b,c)")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per layout (default 60)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the layouts, interleaved (a,b,c,a,b,c...), to even out background load")
    add_model_options(parser)
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.layouts.split(",") if k.strip()]
    unknown = [k for k in keys if k not in LAYOUTS]
    if unknown or not keys:
        parser.error(f"--layouts {args.layouts!r}: choose from a, b, c (e.g. a,b,c)")
    if args.streams < 1 or args.max_tokens < 1 or args.duration <= 0 or args.rounds < 1:
        parser.error("--streams, --max-tokens, --duration and --rounds must be positive")
    resolve_model(args)

    recorder = Recorder("vllm_bench", [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    results = []
    for round_no in range(1, args.rounds + 1):
        for key in keys:
            results.append(run_layout(key, args, round_no))
    print(table(results, args))
    recorder.write(figures(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
