"""What least_loaded's load sampling (vsup/proxy/load.py) costs, per instance per sample: the
proxy's CPU for one GET /metrics and its byte scan, the instance's CPU to render its /metrics, and
the scan alone beside a full Prometheus parse (what the collector of vsup/observe/ does).

The instance is a child process serving the fake vLLM's families (tests/fakevllm/metrics.py,
made with prometheus_client as vLLM makes them) padded with histograms to --kib KiB (a vLLM 0.32
/metrics is ~100 KiB); the proxy side is this process running LoadProbe rounds back to back.

    .venv/bin/python bench/load_probe_bench.py [--kib 100] [--samples 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.result import Recorder  # noqa: E402

SERVER = r"""
import sys
from aiohttp import web
from prometheus_client import Histogram
from tests.fakevllm.metrics import CONTENT_TYPE, LATENCY_BUCKETS, LABELS, VllmMetrics
metrics = VllmMetrics("/srv/models/bench-model", lambda: 3, lambda: 2)
target = int(sys.argv[1]) * 1024
n = 0
while len(metrics.render()) < target:  # vLLM's many histograms (tokens, iteration, prefill/decode time, ...)
    h = Histogram(f"vllm:padding_{n}_seconds", "Histogram standing in for vLLM's other families.", LABELS,
                  buckets=LATENCY_BUCKETS, registry=metrics.registry).labels("/srv/models/bench-model", "0")
    h.observe(0.5)
    n += 1
async def handle(request):
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})
app = web.Application()
app.router.add_get("/metrics", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=lambda *a: print("ready", flush=True))
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def probe_cost(url: str, samples: int) -> dict:
    from vsup.proxy.address import Sessions
    from vsup.proxy.backends import Backend
    from vsup.proxy.load import LoadProbe

    sessions = Sessions(connector={"limit": 0, "limit_per_host": 4})
    backend = Backend("0", url)
    probe = LoadProbe(lambda: (backend,), {}, sessions, interval=1.0)
    await probe.round()  # the connection opened
    began, cpu = time.monotonic(), time.process_time()
    for _ in range(samples):
        await probe.round()
    wall, cpu = time.monotonic() - began, time.process_time() - cpu
    await sessions.close()
    assert "0" in probe.samples, probe.failures
    return {"proxy_cpu_ms_per_sample": round(cpu / samples * 1000, 3), "wall_ms_per_sample": round(wall / samples * 1000, 3),
            "figures": list(probe.samples["0"][1:3])}


def scan_vs_parse(body: bytes, repeat: int = 200) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    from vsup.proxy.load import parse

    began = time.process_time()
    for _ in range(repeat):
        parse(body)
    scan = (time.process_time() - began) / repeat
    began = time.process_time()
    for _ in range(max(1, repeat // 10)):
        list(text_string_to_metric_families(body.decode()))
    full = (time.process_time() - began) / max(1, repeat // 10)
    return {"scan_ms": round(scan * 1000, 3), "prometheus_parse_ms": round(full * 1000, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kib", type=int, default=100)
    parser.add_argument("--samples", type=int, default=400)
    args = parser.parse_args()
    recorder = Recorder("load_probe_bench")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(args.kib), str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        import urllib.request
        url = f"http://127.0.0.1:{port}"
        body = urllib.request.urlopen(url + "/metrics", timeout=10).read()
        before = cpu_seconds(server.pid)
        probe = asyncio.run(probe_cost(url, args.samples))
        instance_ms = (cpu_seconds(server.pid) - before) / (args.samples + 1) * 1000
    finally:
        server.terminate()
        server.wait(10)
    figures = {"body_bytes": len(body), "samples": args.samples, **probe, "instance_cpu_ms_per_sample": round(instance_ms, 3),
               **scan_vs_parse(body)}
    # at proxy.load_interval 1 s: CPU per instance per second, in percent of one core
    figures["proxy_cpu_percent_per_instance_at_1s"] = round(figures["proxy_cpu_ms_per_sample"] / 10, 3)
    figures["instance_cpu_percent_at_1s"] = round(figures["instance_cpu_ms_per_sample"] / 10, 3)
    print(figures)
    recorder.write(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
