#!/usr/bin/env python3
"""Proxy overhead, measured in one run: direct to the upstreams vs through `vsup proxy`, through
the proxy of vsup as it was before issue 20 (--baseline), through the Rust vllm-router (--peers)
and through nginx round-robin when `nginx` is installed, at a fixed client concurrency.

The front door's cost (issue 20), one command, a few minutes; then regenerate docs/measured.md's figures:

    .venv/bin/python bench/proxy_bench.py --pin && .venv/bin/python scripts/published_numbers.py

    .venv/bin/python bench/proxy_bench.py [--concurrency 16] [--requests 2000] [--streams 200] [--chunks 63]
                                          [--runs 5] [--pin] [--baseline REF|DIR|none] [--peers vllm-router|none]
                                          [--scrape SECONDS] [--policy round_robin,prefix_affinity] [--system-chars 3000]

Upstreams are minimal aiohttp apps (no delays for requests, a fixed pace between SSE chunks so
each chunk is its own TCP segment, as from vLLM), two processes, so they are not the bottleneck.
For each target it prints requests/s, client latency p50/p99, the latency added over direct,
and the CPU the proxy process used (its CPU clock, all its threads and, for nginx, master and
workers; the user/sys split from /proc/<pid>/stat) per small chat request, per streamed chunk and per streamed request:
  µs/request = CPU during the request phase / requests
  µs/chunk   = (CPU during the stream phase - streams × µs/request) / chunks relayed
  µs/stream  = CPU during the stream phase / streams
(the stream phase's own requests are charged at the small-request rate; chunks relayed counts
every chunk the upstreams wrote, [DONE] included). With --runs N the targets are measured in turn
N times (direct, proxy, nginx, direct, ...) so that load drifting on a shared box hits all of them
alike, and every column is the median over the runs (added latency: median of the per-run
differences to direct).

--pin (needs >= 2 CPUs): the proxy (or nginx) runs alone on the first allowed CPU, the client and
the upstreams on the others, so that its numbers are the proxy's own cost rather than time spent
queued behind the client and upstreams on the same cores. Without --pin every process floats over
all CPUs, as on a box where one core is shared by everything. The direct rows are measured with
the same placement (client and upstreams on the other CPUs).
--baseline REF (default 05508c0, main before issue 20; none: no baseline): also measure the proxy
of that git ref's vsup package (`git archive REF vsup` into a temporary folder; or a directory
holding a vsup source tree) in the same run, as the row "vsup (baseline)", and print the CPU ratios
of this tree's proxy to it: a before/after that a noisy box cannot skew, since both are measured in
turn under the same load (the order of the proxies is reversed every other run).
--peers vllm-router (default; none: no peers): also measure vllm-router (the vLLM project's Rust
router, `--worker-urls` the upstreams, `--policy round_robin`), pinned like the proxy. It is
installed from PyPI into a venv of its own (~/.cache/vsup/bench-peers, or $VSUP_BENCH_PEERS) the
first time; never into the project's venvs. The same client (aiohttp, this process) loads every target.
Unix sockets (default; --no-unix: none; off with several --policy): the upstreams also listen on a
Unix socket each, and the row "vsup proxy, unix" is this tree's ProxyServer (as vsup run has it, in
this file's proxy mode) reaching them over those sockets: vsup run's default (vllm.listen: unix).
The row "vsup proxy" (`vsup proxy --upstream http://...`), the baseline (it predates Unix sockets)
and vllm-router (it speaks TCP only) reach the same upstreams over TCP loopback; the ratios "unix /
tcp" and "unix / vllm-router" compare them per run. The client reaches every proxy over TCP.
--policy P1,P2,...: one proxy per policy (rows "vsup P1", "vsup P2", ...), measured in turn, and the
CPU ratios of each to the first: e.g. prefix_affinity's cost over round_robin's in the same run.
The requests cycle through 64 bodies that differ in their user message (so prefix_affinity spreads
them like distinct conversations); --system-chars N puts a system prompt of N characters in front
of each (longer than proxy.affinity_prefix_chars: they all share it, the policy's costliest key).

--scrape S adds two rows: the same ProxyServer as `vsup run` has, in a process of its own, once
without and once with vsup run's metrics collection (vsup/observe/) every S seconds:
each upstream's /metrics (vLLM's families, made by the fake vLLM's prometheus_client code) and its
process tree's CPU, RSS/PSS and numa_maps, while the client also GETs the proxy's /metrics every S
seconds as Prometheus would. Their difference is what the collection costs the request path.
Speed is machine- and load-dependent: compare the rows of one run, not runs on different days.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")

VARIANTS = 64  # request bodies, cycled: as many conversations


def bodies(text: str, system_chars: int, **extra) -> list[bytes]:
    system = [{"role": "system", "content": ("You are a helpful assistant. " * (system_chars // 29 + 1))[:system_chars]}] if system_chars else []
    return [json.dumps({"model": "bench", "messages": [*system, {"role": "user", "content": f"{text} ({i})"}], **extra}).encode()
            for i in range(VARIANTS)]


CHAT_RESPONSE = json.dumps(
    {
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }
).encode()
CHUNK = b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n'


# ------------------------------------------------------------------------------- the upstream


def run_upstream(port: int, chunks: int, pace: float, socket_path: str | None = None) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream": true' not in body and b'"stream":true' not in body:
            return web.Response(body=CHAT_RESPONSE, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await asyncio.sleep(pace)
            await response.write(CHUNK)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    sys.path.insert(0, str(REPO))
    from tests.fakevllm.metrics import CONTENT_TYPE, VllmMetrics  # vLLM's families, as vLLM makes them

    vllm_metrics = VllmMetrics("bench", lambda: 3, lambda: 1)
    for i in range(1000):  # histograms with data in many buckets, as after a while of serving
        vllm_metrics.ttft.observe(0.01 * (i % 300))
        vllm_metrics.itl.observe(0.001 * (i % 200))
        vllm_metrics.e2e.observe(0.05 * (i % 400))
        vllm_metrics.queue.observe(0.001 * (i % 50))
    vllm_metrics.prompt_tokens.inc(12000)
    vllm_metrics.generation_tokens.inc(100000)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=vllm_metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    # on 127.0.0.1:port and, with socket_path, on that Unix socket too (as an instance under vsup run)
    web.run_app(app, host="127.0.0.1", port=port, path=socket_path, access_log=None, print=None)


def run_proxy(port: int, upstreams: list[str], pids: list[int], interval: float) -> None:
    """vsup run's ProxyServer over the upstreams; with interval > 0 also its metrics collection."""
    sys.path.insert(0, str(REPO))
    import aiohttp

    from vsup.config.schema import ProxyConfig
    from vsup.observe.collector import Collector, Target
    from vsup.proxy import ProxyServer
    from vsup.proxy.backends import Backend, BackendPool
    from vsup.proxy.runloop import run
    from vsup.supervisor.metrics import tree_pids

    async def main() -> None:
        pool = BackendPool(Backend(str(i), url) for i, url in enumerate(upstreams))
        for i in range(len(upstreams)):
            pool.set_state(str(i), "ready", True)
        proxy = ProxyServer(ProxyConfig(port=port), pool)
        await proxy.start()
        if interval > 0:
            session = aiohttp.ClientSession()
            targets = [Target(str(i), url, (0,), leader=pid) for i, (url, pid) in enumerate(zip(upstreams, pids, strict=True))]
            collector = Collector(lambda: targets, session, interval=interval, timeout=2.0, pids=tree_pids)
            proxy.extra_metrics = collector.text
            asyncio.get_running_loop().create_task(collector.run())
        await asyncio.Event().wait()  # until SIGTERM

    run(main())


# ------------------------------------------------------------------------------- baseline and peers

UNIX_ROW = "vsup proxy, unix"  # this tree's proxy over Unix sockets to the upstreams: vsup run's default
DEFAULT_BASELINE = "05508c0"  # main before issue 20 (security): the front door's cost is held to it
VLLM_ROUTER = "vllm-router==0.1.17"  # the Rust router of the vLLM project, a Python wheel on PyPI
PEERS_VENV = Path(os.environ.get("VSUP_BENCH_PEERS", Path.home() / ".cache" / "vsup" / "bench-peers"))


def baseline_tree(ref: str, workdir: Path) -> tuple[Path, str]:
    """The vsup package of `ref` (a git ref of this repository, or a directory holding a vsup
    source tree) and what it is called in the results: `git archive REF vsup` into workdir."""
    if Path(ref).is_dir():
        return Path(ref).resolve(), str(Path(ref).resolve())
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "--verify", f"{ref}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--baseline {ref!r}: neither a directory nor a commit of {REPO} (e.g. --baseline {DEFAULT_BASELINE}, or none)")
    commit = found.stdout.strip()
    tree = workdir / f"baseline-{commit}"
    tree.mkdir()
    with subprocess.Popen(["git", "-C", str(REPO), "archive", commit, "vsup"], stdout=subprocess.PIPE) as archive:
        subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {ref!r}: git archive {commit} vsup failed")
    return tree, commit


def vllm_router_binary() -> Path | None:
    """vllm-router in the bench's own venv of peers (never the project's venvs), installed from the
    package index the first time; None, with a line saying why, when it cannot be."""
    binary = PEERS_VENV / "bin" / "vllm-router"
    if binary.exists():
        return binary
    print(f"vllm-router is not installed: installing {VLLM_ROUTER} into {PEERS_VENV} (once; needs the package index)", flush=True)
    try:
        if not (PEERS_VENV / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run([str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install", "-q", VLLM_ROUTER], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"could not install {VLLM_ROUTER} into {PEERS_VENV} ({exc}): no vllm-router row; "
              f"install it by hand with `{PEERS_VENV}/bin/pip install {VLLM_ROUTER}`, or pass --peers none")
        return None
    return binary if binary.exists() else None


def on_cpus(cpus: set[int] | None):
    """preexec_fn placing a child (and every thread it will start) on `cpus` from its first instruction."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def start_vllm_router(binary: Path, upstreams: list[str], cpus: set[int] | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *upstreams, "--policy", "round_robin",
         "--log-level", "warning"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=on_cpus(cpus),
    )
    wait_http(port, "/health")
    return proc, port


# ------------------------------------------------------------------------------- measuring


def pin(pids: list[int], cpus: set[int] | None) -> None:
    """Move these processes (every thread) onto `cpus`; no-op when None."""
    if cpus is None:
        return
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pids: list[int]) -> tuple[float, float, float]:
    """(user, system, total) CPU seconds of these processes, all their threads: user and system in
    clock ticks (/proc/<pid>/stat, 10 ms each), the total to the nanosecond from the process's CPU
    clock (clock_getcpuclockid's clock id for a pid, which Python does not wrap)."""
    user = system = 0
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        user += int(fields[11])
        system += int(fields[12])
        total += time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    return user / CLK_TCK, system / CLK_TCK, total


def upstream_tcp_connections(pids: list[int], ports: set[int]) -> int:
    """TCP connections of these processes to any of the upstreams' ports."""
    import psutil

    return sum(1 for pid in pids for c in psutil.Process(pid).net_connections("tcp") if c.raddr and c.raddr.port in ports)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def wait_unix(path: str, timeout: float = 30.0) -> None:
    """Until the Unix socket at `path` accepts a connection."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"nothing accepted on the Unix socket {path} within {timeout:g} s") from None
            time.sleep(0.05)


def wait_http(port: int, path: str = "/health", timeout: float = 30.0) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            try:
                conn.request("GET", path)
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing answered 200 on 127.0.0.1:{port}{path} within {timeout:g} s")
        time.sleep(0.05)


async def load(session, urls: list[str], body: list[bytes], total: int, concurrency: int, streaming: bool) -> tuple[list[float], int, float]:
    """`total` POSTs, `concurrency` at a time, cycling over `urls` and the bodies; latencies, chunks read, wall."""
    latencies: list[float] = []
    chunks = 0
    counter = iter(range(total))
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        nonlocal chunks
        for i in counter:
            url = urls[i % len(urls)]
            t0 = time.perf_counter()
            async with session.post(url, data=body[i % len(body)], headers=headers) as response:
                if response.status != 200:
                    raise SystemExit(f"{url}: HTTP {response.status}: {(await response.read())[:200]!r}")
                if streaming:
                    async for _ in response.content.iter_any():
                        chunks += 1
                else:
                    await response.read()
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, chunks, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


NGINX_CONF = """
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream vllm {{ {servers} keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://vllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(upstream_ports: list[int], workdir: Path) -> tuple[subprocess.Popen, int] | None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx is None:
        return None
    port = free_port()
    servers = " ".join(f"server 127.0.0.1:{p};" for p in upstream_ports)
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=workdir, servers=servers, port=port))
    proc = subprocess.Popen([nginx, "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"], start_new_session=True)
    wait_http(port, "/health")
    return proc, port


async def poll_metrics(session, url: str, interval: float, scrapes: list[int]) -> None:
    """GET url every `interval` seconds (Prometheus's part), counting the scrapes."""
    while True:
        async with session.get(url) as response:
            await response.read()
            if response.status != 200:
                raise SystemExit(f"{url}: HTTP {response.status}")
        scrapes[0] += 1
        await asyncio.sleep(interval)


async def measure(name: str, base_urls: list[str], pids: list[int] | None, args, results: list[dict],
                  scrape: float = 0.0) -> None:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    scrapes = [0]
    async with aiohttp.ClientSession(connector=connector) as session:
        chat_urls = [u + "/v1/chat/completions" for u in base_urls]
        chat = bodies("Say hello in one word.", args.system_chars, max_tokens=8)
        stream = bodies("Count.", args.system_chars, max_tokens=100, stream=True)
        poller = asyncio.create_task(poll_metrics(session, base_urls[0] + "/metrics", scrape, scrapes)) if scrape else None
        await load(session, chat_urls, chat, 200, args.concurrency, False)  # warm-up: connections, caches
        cpu0 = cpu_seconds(pids) if pids else (0.0, 0.0, 0.0)
        lat, _, wall = await load(session, chat_urls, chat, args.requests, args.concurrency, False)
        cpu1 = cpu_seconds(pids) if pids else (0.0, 0.0, 0.0)
        slat, chunks, swall = await load(session, chat_urls, stream, args.streams, args.concurrency, True)
        cpu2 = cpu_seconds(pids) if pids else (0.0, 0.0, 0.0)
        if poller is not None:
            poller.cancel()
        # how the proxy reached the upstreams: its kept-alive TCP connections to their ports (none
        # for a proxy on their Unix sockets)
        upstream_tcp = upstream_tcp_connections(pids, args.upstream_ports) if pids else 0
    row = {
        "target": name,
        "rps": args.requests / wall,
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "stream_p50_ms": pct(slat, 0.5) * 1e3,
        "chunks_read": chunks,
        "scrapes": scrapes[0],
    }
    if pids:
        row["upstream_tcp_connections"] = upstream_tcp
    if pids:
        # The totals from the nanosecond clock; their user/sys split in the proportion of the ticks
        # (a phase of a second is only ~100 ticks: too coarse for the totals, enough for a split).
        upstream_chunks = args.streams * (args.chunks + 1)
        phases = {"request": (cpu0, cpu1), "stream": (cpu1, cpu2)}
        spent = {name: b[2] - a[2] for name, (a, b) in phases.items()}
        share = {name: ((b[0] - a[0]) / ((b[0] - a[0]) + (b[1] - a[1])) if (b[0] - a[0]) + (b[1] - a[1]) else 1.0)
                 for name, (a, b) in phases.items()}
        per_request = spent["request"] / args.requests
        totals = {
            "us_per_request": (per_request, "request"),
            "us_per_chunk": (max(0.0, spent["stream"] - args.streams * per_request) / upstream_chunks, "stream"),
            "us_per_stream": (spent["stream"] / args.streams, "stream"),
        }
        for figure, (seconds, phase) in totals.items():
            row[figure] = seconds * 1e6
            row[f"{figure}_user"] = seconds * share[phase] * 1e6
            row[f"{figure}_sys"] = seconds * (1 - share[phase]) * 1e6
    results.append(row)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summarize(runs: list[list[dict]]) -> list[dict]:
    """Per target (in the first run's order), the median of every column over the runs; added
    latency as the median of each run's difference to that run's direct row."""
    out = []
    for row in runs[0]:
        rows = [next(r for r in run if r["target"] == row["target"]) for run in runs]
        summary = {"target": row["target"]}
        for key in row:
            if key != "target":
                summary[key] = median([r[key] for r in rows])
        summary["added_p50_ms"] = median([r["p50_ms"] - run[0]["p50_ms"] for r, run in zip(rows, runs, strict=True)])
        summary["added_p99_ms"] = median([r["p99_ms"] - run[0]["p99_ms"] for r, run in zip(rows, runs, strict=True)])
        out.append(summary)
    return out


def print_table(results: list[dict], args) -> None:
    direct = results[0]
    placement = (f"proxy/nginx pinned to CPU {args.proxy_cpus}, client+upstreams to CPU {args.other_cpus}"
                 if args.pin else "no pinning")
    print(f"\nconcurrency {args.concurrency}; {args.requests} small chat requests; {args.streams} streams x {args.chunks + 1} chunks "
          f"(upstream pace {args.pace * 1e3:g} ms); {placement}; median of {args.runs} run(s); "
          f"loadavg before: {args.loadavg}, after: {args.loadavg_after}")
    print(f"{'target':<22} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'CPU µs/req':>11} {'(user+sys)':>12} {'CPU µs/chunk':>13} {'(user+sys)':>12} {'CPU µs/stream':>14}")
    for row in results:
        added50 = row["added_p50_ms"]
        added99 = row["added_p99_ms"]
        req = f"{row['us_per_request']:.0f}" if "us_per_request" in row else "-"
        req_split = f"{row['us_per_request_user']:.0f}+{row['us_per_request_sys']:.0f}" if "us_per_request" in row else ""
        chunk = f"{row['us_per_chunk']:.1f}" if "us_per_chunk" in row else "-"
        chunk_split = f"{row['us_per_chunk_user']:.1f}+{row['us_per_chunk_sys']:.1f}" if "us_per_chunk" in row else ""
        stream = f"{row['us_per_stream']:.0f}" if "us_per_stream" in row else "-"
        extra = "" if row is direct else f"{added50:8.2f} {added99:8.2f}"
        print(f"{row['target']:<22} {row['rps']:8.0f} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {extra:>17} {req:>11} {req_split:>12} {chunk:>13} {chunk_split:>12} {stream:>14}")


async def bench(args) -> None:
    procs: list[subprocess.Popen] = []
    workdir = Path(tempfile.mkdtemp(prefix="vsup-proxy-bench-"))
    runs: list[list[dict]] = []
    proxy_cpus = other_cpus = None
    if args.pin:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        proxy_cpus, other_cpus = {allowed[0]}, set(allowed[1:])
        args.proxy_cpus, args.other_cpus = format_cpus(proxy_cpus), format_cpus(other_cpus)
        pin([os.getpid()], other_cpus)  # the client; children started from here inherit it
    try:
        ports = [free_port() for _ in range(args.upstreams)]
        # every upstream also listens on a Unix socket, as an instance does under vsup run (vllm.listen: unix)
        sockets = [str(workdir / f"{i}.sock") for i in range(args.upstreams)] if args.unix else []
        for i, port in enumerate(ports):
            on_socket = ["--socket", sockets[i]] if sockets else []
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "upstream", "--port", str(port), "--chunks", str(args.chunks), "--pace", str(args.pace),
                 *on_socket],
                start_new_session=True,
            ))
        for port in ports:
            wait_http(port)
        for path in sockets:
            wait_unix(path)
        direct = [f"http://127.0.0.1:{p}" for p in ports]
        args.upstream_ports = set(ports)

        proxies = [(name, REPO, policy) for name, policy in zip(args.policy_rows, args.policies, strict=True)]
        if args.baseline:
            tree, args.baseline_commit = baseline_tree(args.baseline, workdir)
            proxies.append(("vsup (baseline)", tree, args.policies[0]))
        started: list[tuple[str, subprocess.Popen, int]] = []
        for name, source, policy in proxies:
            proxy_port = free_port()
            env = dict(os.environ, PYTHONPATH=str(source))
            policy_args = [] if policy == "round_robin" else ["--policy", policy]  # a baseline tree may predate --policy
            proxy = subprocess.Popen(
                [sys.executable, "-c", "from vsup.cli.main import main; main()", "proxy", "--port", str(proxy_port), *policy_args, *[a for u in direct for a in ("--upstream", u)]],
                env=env, start_new_session=True, stderr=subprocess.DEVNULL, preexec_fn=on_cpus(proxy_cpus),
            )
            procs.append(proxy)
            wait_http(proxy_port, "/ready")
            started.append((name, proxy, proxy_port))
        if sockets:
            # vsup as it ships: vsup run's ProxyServer (this file's proxy mode) over the instances'
            # Unix sockets; `vsup proxy --upstream` takes http URLs only, and vllm-router TCP only
            proxy_port = free_port()
            proxy = subprocess.Popen(
                [sys.executable, __file__, "proxy", "--port", str(proxy_port), *[a for p in sockets for a in ("--upstream", f"unix:{p}")]],
                env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True, stderr=subprocess.DEVNULL,
                preexec_fn=on_cpus(proxy_cpus),
            )
            procs.append(proxy)
            wait_http(proxy_port, "/ready")
            started.append((UNIX_ROW, proxy, proxy_port))

        observed: list[tuple[str, int, float, int]] = []  # (row name, port, collection interval, pid)
        if args.scrape:
            upstream_pids = [p.pid for p in procs[: len(ports)]]
            for row, interval in (("proxy, no scrape", 0.0), (f"proxy, scrape {args.scrape:g}s", args.scrape)):
                port = free_port()
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "proxy", "--port", str(port), "--scrape", str(interval),
                     *[a for u in direct for a in ("--upstream", u)], *[a for p in upstream_pids for a in ("--upstream-pid", str(p))]],
                    env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True, stderr=subprocess.DEVNULL,
                    preexec_fn=on_cpus(proxy_cpus),
                ))
                wait_http(port, "/ready")
                observed.append((row, port, interval, procs[-1].pid))

        nginx = start_nginx(ports, workdir)
        nginx_pids: list[int] = []
        if nginx is not None:
            procs.append(nginx[0])
            nginx_pids = [nginx[0].pid, *children_of(nginx[0].pid)]
            pin(nginx_pids, proxy_cpus)
        else:
            print("nginx is not installed: no nginx row (apt-get install -y nginx)")

        peers: list[tuple[str, list[int], int]] = []  # (row, pids, port)
        if "vllm-router" in args.peers:
            binary = vllm_router_binary()
            if binary is not None:
                router, router_port = start_vllm_router(binary, direct, proxy_cpus)
                procs.append(router)
                peers.append(("vllm-router", [router.pid, *children_of(router.pid)], router_port))

        for run in range(args.runs):
            results: list[dict] = []
            await measure("direct", direct, None, args, results)
            # this tree and its baseline (and the peers) in turn, the order reversed every other
            # run: a load that drifts during a run favours neither
            turn = [(name, [proxy.pid], port) for name, proxy, port in started] + peers
            for name, pids, proxy_port in (turn if run % 2 == 0 else turn[::-1]):
                await measure(name, [f"http://127.0.0.1:{proxy_port}"], pids, args, results)
            for row, port, interval, pid in observed:
                await measure(row, [f"http://127.0.0.1:{port}"], [pid], args, results, scrape=interval)
            if nginx is not None:
                await measure("nginx", [f"http://127.0.0.1:{nginx[1]}"], nginx_pids, args, results)
            runs.append(results)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)
    args.loadavg_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    summary = summarize(runs)
    print_table(summary, args)
    ratios: dict[str, dict] = {}
    first = args.policy_rows[0]
    for other in args.policy_rows[1:]:
        ratios[f"{other} / {first}"] = print_ratios(runs, other, first, f"{other} / {first}")
    if args.baseline:
        ratios["this tree / baseline"] = print_ratios(runs, first, "vsup (baseline)", "this tree / baseline")
    if peers:
        ratios["this tree / vllm-router"] = print_ratios(runs, first, "vllm-router", "this tree / vllm-router")
    if args.unix:
        ratios["unix / tcp"] = print_ratios(runs, UNIX_ROW, first, "unix / tcp")
        if peers:
            ratios["unix / vllm-router"] = print_ratios(runs, UNIX_ROW, "vllm-router", "unix / vllm-router")
    if args.json:
        print(json.dumps({"summary": summary, "runs": runs}))
    settings = {key: getattr(args, key) for key in ("concurrency", "requests", "streams", "chunks", "pace", "upstreams",
                                                     "runs", "pin", "scrape", "policies", "system_chars", "unix")}
    settings["nginx"] = nginx is not None
    settings["baseline"] = getattr(args, "baseline_commit", None)
    settings["peers"] = [name for name, _, _ in peers]
    settings["vllm_router"] = VLLM_ROUTER if peers else None
    args.recorder.write({"settings": settings, "summary": summary, "ratios": ratios, "runs": runs},
                        out_dir=Path(args.out) if args.out else None, file_name=result_name(args))


def result_name(args) -> str:
    """docs/bench/proxy_bench[-pin][-scrape][-policy].json: one file per kind of run the docs quote (the
    baseline and peer rows are extra rows of the same run)."""
    parts = ["proxy_bench"] + (["pin"] if args.pin else []) + (["scrape"] if args.scrape else []) + \
        (["policy"] if len(args.policies) > 1 else [])
    return "-".join(parts) + ".json"


def print_ratios(runs: list[list[dict]], target: str, reference: str, what: str) -> dict:
    """One proxy's CPU over another's, per run (both measured in turn in each run)."""
    out = {}
    for key, label in (("us_per_request", "CPU per request"), ("us_per_chunk", "CPU per chunk"), ("us_per_stream", "CPU per stream")):
        ratios = []
        for run in runs:
            rows = {row["target"]: row for row in run}
            # µs/chunk is 0 when the stream phase cost less than its requests at the small-request
            # rate (a tiny run on a loaded box): that run has no ratio for it
            if rows[reference][key] > 0:
                ratios.append(rows[target][key] / rows[reference][key])
        if not ratios:
            print(f"{label}, {what}: not measured (the reference's figure was 0 in every run)")
            continue
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{label}, {what}: median {median(ratios):.2f} (runs: {shown})")
        out[key] = {"median": round(median(ratios), 3), "runs": [round(r, 3) for r in ratios]}
    return out


def format_cpus(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "upstream", "proxy"])
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--upstream-pid", type=int, action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--no-unix", dest="unix", action="store_false",
                        help=f"no row {UNIX_ROW!r} (this tree's proxy over the upstreams' Unix sockets, as vsup run ships)")
    parser.add_argument("--scrape", type=float, default=0.0,
                        help="also measure vsup run's proxy without and with metrics collection every SECONDS")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000, help="small chat requests per target")
    parser.add_argument("--streams", type=int, default=200, help="streamed requests per target")
    parser.add_argument("--chunks", type=int, default=63, help="SSE chunks per stream (plus [DONE])")
    parser.add_argument("--pace", type=float, default=0.002, help="seconds between two chunks of one stream")
    parser.add_argument("--upstreams", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5, help="measure every target this many times, in turn; report medians")
    parser.add_argument("--pin", action="store_true", help="proxy/nginx on the first CPU, client and upstreams on the others")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("--out", metavar="DIR", help="write the result file into DIR (default docs/bench)")
    parser.add_argument("--baseline", metavar="REF", default=DEFAULT_BASELINE,
                        help=f"also measure the proxy of this git ref's vsup (or of the vsup source tree in a directory), in turn "
                             f"(default {DEFAULT_BASELINE}, main before issue 20; none: no baseline)")
    parser.add_argument("--peers", default="vllm-router", metavar="P1,P2",
                        help=f"other proxies measured in turn: vllm-router ({VLLM_ROUTER}, installed into {PEERS_VENV} when "
                             "missing); none: no peers (nginx is measured whenever it is installed)")
    parser.add_argument("--policy", default="round_robin", metavar="P1,P2",
                        help="proxy policies, one proxy each, measured in turn (default round_robin)")
    parser.add_argument("--system-chars", type=int, default=0, metavar="N",
                        help="a system prompt of N characters in every request (default none)")
    args = parser.parse_args()
    if args.mode == "upstream":
        run_upstream(args.port, args.chunks, args.pace, args.socket)
        return
    if args.mode == "proxy":
        run_proxy(args.port, args.upstream, args.upstream_pid, args.scrape)
        return
    args.policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if args.baseline == "none":
        args.baseline = None
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"]
    if any(p != "vllm-router" for p in args.peers):
        parser.error(f"--peers {','.join(args.peers)!r}: vllm-router or none")
    from typing import get_args

    from vsup.config.schema import ProxyConfig

    known = get_args(ProxyConfig.model_fields["policy"].annotation)
    if not args.policies or any(p not in known for p in args.policies) or len(set(args.policies)) != len(args.policies):
        parser.error(f"--policy {args.policy!r}: a comma-separated list of distinct policies from {', '.join(known)}")
    # one policy: the row keeps its old name; several: one row per policy
    args.policy_rows = ["vsup proxy"] if len(args.policies) == 1 else [f"vsup {p}" for p in args.policies]
    args.unix = args.unix and len(args.policies) == 1  # the unix row is round_robin's
    args.loadavg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    sys.path.insert(0, str(REPO / "bench"))
    from result import Recorder  # bench/result.py: docs/bench/<name>.json

    args.recorder = Recorder("proxy_bench")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
