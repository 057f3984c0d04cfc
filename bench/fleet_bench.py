#!/usr/bin/env python3
"""What routing by model costs the proxy (issue 21): the proxy's CPU per request with two models
behind it against one, measured in turn in one run, over fake vLLM instances (tests/fakevllm, real
processes, each with its `--served-model-name`).

    .venv/bin/python bench/fleet_bench.py --pin            # ~1 minute; writes docs/bench/fleet_bench.json

    .venv/bin/python bench/fleet_bench.py [--pin] [--runs 5] [--requests 2000] [--streams 200] [--chunks 16]
                                          [--concurrency 16] [--tree REF|DIR] [--out DIR]

Three fakes: A and B serve "chat", C serves "embed". Each row is vsup run's ProxyServer (in a
process of its own, its CPU read from /proc) over two of them:

- "one model": A and B, no routing by model (ProxyServer(config, pool), Backend(name, url)): the
  single-model proxy as it was.
- "one model, routed": A and B as the instances of the one model "chat" (models={"chat": ...},
  Backend(name, url, model="chat")): a fleet of one.
- "two models": A ("chat") and C ("embed"), models={"chat": ..., "embed": ...}.

Every row gets the same requests: small requests alternating a chat completion and an embedding
(`/v1/embeddings`), then streamed chat completions; in "two models" every other request names
"embed" (the same bodies otherwise), in the others all name "chat". So the upstream work is the
same in every row and the difference is the proxy's routing. The CPU per small request and per
stream is the proxy's CPU over the phase / its requests (as in bench/proxy_bench.py); the rows are
measured in turn, --runs times, the order reversed every other run, and the ratio "two models /
one model" is the median of the per-run ratios (the goal: within 1.1x).

The two routed rows need the fleet proxy (`ProxyServer(..., models=)`, `Backend(..., model=)`,
branch i21-proxy); a tree without it measures "one model" alone and says so. --tree REF|DIR runs
the proxy of that git ref's vsup package (`git archive REF vsup`) or of a directory holding a vsup
source tree, instead of this checkout's.
--pin (needs >= 2 CPUs): the proxy alone on the first allowed CPU, the client and the fakes on
the others.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.append(str(REPO))  # tests.fakevllm; last, so that a --tree on PYTHONPATH is the vsup that runs
# bench/proxy_bench.py: the same measuring
from proxy_bench import baseline_tree, cpu_seconds, format_cpus, free_port, load, median, on_cpus, pct, pin  # noqa: E402

ONE, ROUTED, TWO = "one model", "one model, routed", "two models"
GOAL = 1.1  # two models may cost the proxy at most this much of one model's CPU per request
NO_FLEET = 3  # the proxy mode's exit status when the tree's ProxyServer takes no models=


# ------------------------------------------------------------------------------- the proxy process

def fleet_api() -> bool:
    """This interpreter's vsup has the fleet proxy: ProxyServer(..., models=), Backend(..., model=)."""
    from vsup.proxy import ProxyServer
    from vsup.proxy.backends import Backend

    return "models" in inspect.signature(ProxyServer).parameters and "model" in inspect.signature(Backend).parameters


def run_proxy(port: int, upstreams: list[str], names: list[str]) -> None:
    """vsup run's ProxyServer over `upstreams`; `names` (one per upstream): route by model, each
    upstream an instance of its name; none: no routing by model."""
    from vsup.config.schema import ProxyConfig
    from vsup.proxy import ProxyServer
    from vsup.proxy.backends import Backend, BackendPool
    from vsup.proxy.runloop import run

    if names and not fleet_api():
        print("this tree's ProxyServer takes no models= (the fleet proxy of issue 21)", file=sys.stderr)
        raise SystemExit(NO_FLEET)

    async def main() -> None:
        config = ProxyConfig(port=port)
        if names:
            pool = BackendPool(Backend(str(i), url, model=name) for i, (url, name) in enumerate(zip(upstreams, names, strict=True)))
            proxy = ProxyServer(config, pool, models={name: config for name in names})
        else:
            pool = BackendPool(Backend(str(i), url) for i, url in enumerate(upstreams))
            proxy = ProxyServer(config, pool)
        for i in range(len(upstreams)):
            pool.set_state(str(i), "ready", True)
        await proxy.start()
        await asyncio.Event().wait()  # until SIGTERM

    run(main())


# ------------------------------------------------------------------------------- measuring

def ready(proc: subprocess.Popen, port: int, timeout: float = 30.0) -> bool:
    """Until the proxy answers /ready with 200 (True), or exits or the timeout passes (False)."""
    import http.client
    import time

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        try:
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return True
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)
    return False


def bodies(models: list[str], **extra) -> list[bytes]:
    return [json.dumps({"model": m, "messages": [{"role": "user", "content": f"Say hello ({i})"}], **extra}).encode()
            for i, m in enumerate(models)]


async def measure(row: str, port: int, pid: int, models: list[str], expected: dict[str, str], args) -> dict:
    """One row: a warm-up, the small requests, the streams; the proxy's CPU per request and stream."""
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    small_urls = [f"{base}/v1/chat/completions", f"{base}/v1/embeddings"]
    small = [json.dumps({"model": models[0], "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 1}).encode(),
             json.dumps({"model": models[1], "input": "Say hello"}).encode()]
    streams = bodies(models, max_tokens=args.chunks, stream=True)
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        await load(session, small_urls, small, 100, args.concurrency, False)  # connections, caches, the model lists
        for url, body in zip(small_urls, small, strict=True):  # each model's requests reach its own fakes
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                served_by = response.headers.get("X-Fake-Instance", "?")
                if served_by not in expected[json.loads(body)["model"]]:
                    raise SystemExit(f"{row}: a request for {json.loads(body)['model']!r} reached fake {served_by}")
        cpu0 = cpu_seconds([pid])[2]
        latencies, _, wall = await load(session, small_urls, small, args.requests, args.concurrency, False)
        cpu1 = cpu_seconds([pid])[2]
        stream_latencies, chunks, _ = await load(session, small_urls[:1], streams, args.streams, args.concurrency, True)
        cpu2 = cpu_seconds([pid])[2]
    return {"row": row, "rps": args.requests / wall, "p50_ms": pct(latencies, 0.5) * 1e3, "p99_ms": pct(latencies, 0.99) * 1e3,
            "stream_p50_ms": pct(stream_latencies, 0.5) * 1e3, "chunks_read": chunks,
            "us_per_request": (cpu1 - cpu0) / args.requests * 1e6, "us_per_stream": (cpu2 - cpu1) / args.streams * 1e6}


def start_fakes(cpus: set[int] | None) -> tuple[list, dict[str, str]]:
    """Fakes A, B ("chat") and C ("embed"), quick (1 ms a token), on `cpus`; their URLs by letter."""
    from tests.fakevllm.fixtures import start_fake

    fakes, urls = [], {}
    for letter, name in (("A", "chat"), ("B", "chat"), ("C", "embed")):
        fake = start_fake(name=letter, served_model_names=[name], env={"FAKE_VLLM_TOKEN_DELAY": "0.001", "FAKE_VLLM_EVENTS": ""})
        fakes.append(fake)
    for fake, letter in zip(fakes, "ABC", strict=True):
        fake.wait_ready()
        pin(fake.pids(), cpus)
        urls[letter] = fake.url
    return fakes, urls


async def bench(args) -> dict:
    proxy_cpus = other_cpus = None
    if args.pin:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        proxy_cpus, other_cpus = {allowed[0]}, set(allowed[1:])
        pin([os.getpid()], other_cpus)  # the client; the fakes are moved there too
    workdir = Path(tempfile.mkdtemp(prefix="vsup-fleet-bench-"))
    tree, tree_name = (baseline_tree(args.tree, workdir) if args.tree else (REPO, "this checkout"))
    fakes, urls = start_fakes(other_cpus)
    # row: (its fakes, their model names for routing, the models its requests name, where each model's requests may go)
    rows = {ONE: (["A", "B"], [], ["chat", "chat"], {"chat": "AB"}),
            ROUTED: (["A", "B"], ["chat", "chat"], ["chat", "chat"], {"chat": "AB"}),
            TWO: (["A", "C"], ["chat", "embed"], ["chat", "embed"], {"chat": "A", "embed": "C"})}
    proxies: dict[str, tuple[subprocess.Popen, int]] = {}
    skipped = None
    try:
        for row, (letters, names, _models, _expected) in rows.items():
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, __file__, "proxy", "--port", str(port), *[a for x in letters for a in ("--upstream", urls[x])],
                 *[a for n in names for a in ("--name", n)]],
                env=dict(os.environ, PYTHONPATH=str(tree)), start_new_session=True, preexec_fn=on_cpus(proxy_cpus))
            if not ready(proc, port):
                if proc.returncode != NO_FLEET:
                    raise SystemExit(f"the proxy of the row {row!r} did not get ready (exit status {proc.returncode})")
                skipped = (f"the rows {ROUTED!r} and {TWO!r} are skipped: {tree_name}'s ProxyServer takes no models= "
                           "(the fleet proxy of branch i21-proxy); re-run after the merge, or with --tree i21-proxy")
                print(skipped)
                break
            proxies[row] = (proc, port)
        runs: list[dict[str, dict]] = []
        for run in range(args.runs):
            order = list(proxies) if run % 2 == 0 else list(reversed(proxies))
            measured = {row: await measure(row, proxies[row][1], proxies[row][0].pid, rows[row][2], rows[row][3], args)
                        for row in order}
            runs.append(measured)
            print(f"run {run + 1}/{args.runs}: " + ", ".join(f"{row} {m['us_per_request']:.0f} µs/req {m['us_per_stream']:.0f} µs/stream"
                                                            for row, m in measured.items()), flush=True)
    finally:
        for proc, _port in proxies.values():
            proc.terminate()
            proc.wait(10)
        for fake in fakes:
            fake.cleanup()
    summary = {row: {key: median([run[row][key] for run in runs]) for key in runs[0][row] if key != "row"} for row in proxies}
    ratios = {}
    for row in (TWO, ROUTED):
        if row in proxies:
            for figure in ("us_per_request", "us_per_stream"):
                ratios[f"{row} / {ONE}, {figure}"] = median([run[row][figure] / run[ONE][figure] for run in runs])
    return {"tree": tree_name, "pin": args.pin, "proxy_cpus": format_cpus(proxy_cpus) if proxy_cpus else None,
            "concurrency": args.concurrency, "requests": args.requests, "streams": args.streams, "chunks": args.chunks,
            "runs": args.runs, "rows": summary, "ratios": ratios, "goal": GOAL, "skipped": skipped,
            "within_goal": all(v <= GOAL for k, v in ratios.items() if k.startswith(TWO)) if TWO in proxies else None}


def print_result(result: dict) -> None:
    print(f"\nproxy CPU, median of {result['runs']} run(s); {result['requests']} small requests (chat + embeddings), "
          f"{result['streams']} streams x {result['chunks']} tokens, concurrency {result['concurrency']}; proxy: {result['tree']}"
          + (f", pinned to CPU {result['proxy_cpus']}" if result["pin"] else ""))
    print(f"{'row':<20} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU µs/req':>11} {'CPU µs/stream':>14}")
    for row, m in result["rows"].items():
        print(f"{row:<20} {m['rps']:8.0f} {m['p50_ms']:8.2f} {m['p99_ms']:8.2f} {m['us_per_request']:11.0f} {m['us_per_stream']:14.0f}")
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.3f}x" + (f" (goal <= {GOAL}x)" if name.startswith(TWO) else ""))
    if result["skipped"]:
        print(result["skipped"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "proxy"])
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--name", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000, help="small requests per row and run (half chat, half embeddings)")
    parser.add_argument("--streams", type=int, default=200, help="streamed chat requests per row and run")
    parser.add_argument("--chunks", type=int, default=16, help="tokens per stream (one SSE chunk each)")
    parser.add_argument("--runs", type=int, default=5, help="measure the rows this many times, in turn; report medians")
    parser.add_argument("--pin", action="store_true", help="the proxy on the first CPU, the client and the fakes on the others")
    parser.add_argument("--tree", metavar="REF|DIR", help="the proxy of this git ref's vsup package, or of a vsup source tree")
    parser.add_argument("--out", metavar="DIR", help="write the result file into DIR (default docs/bench)")
    args = parser.parse_args()
    if args.mode == "proxy":
        run_proxy(args.port, args.upstream, args.name)
        return
    for flag in ("concurrency", "requests", "streams", "chunks", "runs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: must be at least 1")
    from result import Recorder  # bench/result.py: docs/bench/<name>.json

    recorder = Recorder("fleet_bench")
    result = asyncio.run(bench(args))
    print_result(result)
    recorder.write(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
