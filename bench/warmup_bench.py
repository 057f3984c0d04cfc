"""What `health.warmup` buys, measured with real vLLM CPU: the time to first token (TTFT) of the
first client request after an instance (re)starts, with the warm-up on and off, in one run.

For each mode (on, off; interleaved over --rounds): `vsup run` with one instance; then, --restarts
times, `vsup restart 0` (it returns once the instance is ready: after the warm-up when it is on)
and at once one streamed completion through the proxy — the "first" request — followed by
--steady more, one after another, whose median TTFT is the steady-state baseline of the same
run. The table gives the first request's TTFT (median over the restarts), the steady TTFT, their
ratio, and the first request's TTFT against the warm-up-off mode. Loopback only; nothing but the
one vsup runs at a time.

    .venv/bin/python bench/warmup_bench.py                       # 2 rounds x 5 restarts
    .venv/bin/python bench/warmup_bench.py --rounds 1 --restarts 3 --max-tokens 16
    .venv/bin/python bench/warmup_bench.py --fake --rounds 1 --restarts 2   # the script itself, on the fake vLLM

The model: the random-weight Llama of bench/vllm_bench.py (built once into ~/.cache/vsup).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)
from vllm_bench import ROOT, SERVED_NAME, VSUP, Layout, ensure_model, free_port, free_ports, one_stream, prompts  # noqa: E402


@dataclass
class Run:
    mode: str  # "on" / "off"
    round: int
    first: list[float] = field(default_factory=list)  # TTFT of the first request after each (re)start
    steady: list[float] = field(default_factory=list)
    restart_seconds: list[float] = field(default_factory=list)  # how long `vsup restart 0` took


def config(args, workdir: Path, warmup: bool) -> tuple[Path, int]:
    port = free_port()
    if args.fake:  # checks the script, not vLLM: the numbers mean nothing
        model, vllm = "fake-model", {"command": [str(ROOT / "tests" / "fakevllm" / "vllm"), "serve"]}
        placement = {"model_size_gib": 0.01, "overhead_gib": 0.01}
    else:
        model, vllm = str(args.model_dir), {"venv": str(args.venv), "env": {"HF_HUB_OFFLINE": "1"},
                                            "args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]}
        placement = {}
    data = {
        "model": model,
        "served_model_name": SERVED_NAME,
        "instances": 1,
        "placement": {"reserve_cores": 0, "kvcache_gib": args.kvcache_gib, **placement},
        "vllm": {**vllm, "base_port": free_ports(1)},
        "proxy": {"port": port},
        "health": {"startup_timeout": args.startup_timeout, "interval": 1.0,
                   "warmup": {"enabled": warmup, "max_tokens": args.warmup_tokens}},
        "log": {"dir": str(workdir / "logs"), "echo": False},
        "control": {"socket": str(workdir / "control.sock")},
    }
    path = workdir / "vsup.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, port


async def measure(url: str, args, run: Run) -> None:
    texts = prompts()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        ttft, _ = await one_stream(session, url, texts[3], args.max_tokens)
        run.first.append(ttft)
        for i in range(args.steady):
            ttft, _ = await one_stream(session, url, texts[(4 + i) % len(texts)], args.max_tokens)
            run.steady.append(ttft)


def one_run(mode: str, round_no: int, args) -> Run:
    run = Run(mode, round_no)
    with tempfile.TemporaryDirectory(prefix=f"warmup-bench-{mode}-") as tmp:
        workdir = Path(tmp)
        path, port = config(args, workdir, warmup=mode == "on")
        url = f"http://127.0.0.1:{port}"
        layout = Layout(workdir)
        layout.spawn([VSUP, "run", "--config", str(path)], "vsup")
        try:
            layout.wait_ready(url, 1, args.startup_timeout)
            asyncio.run(measure(url, args, run))  # the first start counts as the first (re)start
            for _ in range(args.restarts - 1):
                began = time.monotonic()
                subprocess.run([VSUP, "restart", "0", "--socket", str(workdir / "control.sock")], check=True,
                               stdout=subprocess.DEVNULL, timeout=args.startup_timeout + 60)
                run.restart_seconds.append(time.monotonic() - began)
                asyncio.run(measure(url, args, run))
            print(f"  warm-up {mode}, round {round_no}: first {ms(statistics.median(run.first))}, "
                  f"steady {ms(statistics.median(run.steady))}", file=sys.stderr)
        except Exception:
            for log in sorted(workdir.rglob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            raise
        finally:
            layout.stop()
    return run


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def table(runs: list[Run], args) -> str:
    lines = [
        f"one instance, {args.restarts} (re)starts per run, the first request after each and {args.steady} steady ones, "
        f"{args.max_tokens} tokens each; warm-up {args.warmup_tokens} token(s); {os.cpu_count()} CPUs",
        "",
        "| warm-up | round | first request TTFT (median) | steady TTFT (median) | first / steady | first vs off | restart took |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        off = next((r for r in runs if r.mode == "off" and r.round == run.round), None)
        first, steady = statistics.median(run.first), statistics.median(run.steady)
        versus = f"{first / statistics.median(off.first):.2f}x" if off else "-"
        took = f"{statistics.median(run.restart_seconds):.1f} s" if run.restart_seconds else "-"
        lines.append(f"| {run.mode} | {run.round} | {ms(first)} | {ms(steady)} | {first / steady:.2f}x | {versus} | {took} |")
    return "\n".join(lines)


def figures(runs: list[Run], args) -> dict:
    """What docs/bench/warmup_bench.json holds: the settings and, per run, the medians the table shows."""
    return {
        "settings": {"rounds": args.rounds, "restarts": args.restarts, "steady": args.steady, "max_tokens": args.max_tokens,
                     "warmup_tokens": args.warmup_tokens, "hidden": args.hidden, "layers": args.layers, "fake": args.fake},
        "runs": [{"warmup": run.mode, "round": run.round,
                  "first_ttft_s": round(statistics.median(run.first), 4),
                  "steady_ttft_s": round(statistics.median(run.steady), 4),
                  "restart_s": round(statistics.median(run.restart_seconds), 2) if run.restart_seconds else None,
                  "first_ttfts_s": [round(t, 4) for t in run.first]} for run in runs],
    }


def main(argv: list[str] | None = None) -> int:
    home = Path(os.environ.get("HOME", "."))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs, interleaved (default 2)")
    parser.add_argument("--restarts", type=int, default=5, help="(re)starts measured per run (default 5)")
    parser.add_argument("--steady", type=int, default=5, help="requests after the first one, the baseline (default 5)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--warmup-tokens", type=int, default=4, help="health.warmup.max_tokens (default 4)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kvcache-gib", type=float, default=0.5)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--venv", type=Path, default=None, help="vLLM's venv (default: scripts/vllm-env's)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default ~/.cache/vsup/bench-llama-h<hidden>-l<layers>")
    parser.add_argument("--fake", action="store_true", help="run against the fake vLLM (tests/fakevllm): checks the script only")
    args = parser.parse_args(argv)
    if min(args.rounds, args.restarts, args.steady, args.max_tokens, args.warmup_tokens) < 1:
        parser.error("--rounds, --restarts, --steady, --max-tokens and --warmup-tokens must be at least 1")
    if not args.fake:
        if args.venv is None:
            args.venv = Path(subprocess.run([str(ROOT / "scripts" / "vllm-env")], check=True, capture_output=True,
                                            text=True).stdout.strip().splitlines()[-1])
        if args.model_dir is None:
            args.model_dir = home / ".cache" / "vsup" / f"bench-llama-h{args.hidden}-l{args.layers}"
        ensure_model(args)
    recorder = Recorder("warmup_bench", [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    runs = []
    for round_no in range(1, args.rounds + 1):
        for mode in ("off", "on") if round_no % 2 else ("on", "off"):
            runs.append(one_run(mode, round_no, args))
    print(table(runs, args))
    if not args.fake:  # the fake's numbers mean nothing: never overwrite the published ones with them
        recorder.write(figures(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
