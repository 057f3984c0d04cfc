"""What one huge instance /metrics costs vsup's collection, with and without the series cap
(issue 20 §4: 200,000 series per instance took the collector's RSS from ~58 to ~402 MiB).

An aiohttp server in this process answers GET /metrics with SERIES series (many families of
short lines, like an exporter gone wild); for each setting of metrics.max_series_per_instance a
fresh child process runs one Collector round against it and reports its RSS before the round,
its peak RSS (ru_maxrss) and the round's time. The uncapped row sets the cap above the series
count, which parses everything, as the collector did before the cap.

    .venv/bin/python bench/metrics_cap_bench.py [--series 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.result import Recorder  # noqa: E402

CHILD = r"""
import asyncio, json, resource, sys, time
import aiohttp
from vsup.observe.collector import Collector, Target

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

async def main(url, cap):
    async with aiohttp.ClientSession() as session:
        collector = Collector(lambda: [Target("0", url, (0,))], session, interval=1.0, timeout=60.0, pids=lambda t: [], max_series=cap)
        before = rss_mib()
        began = time.monotonic()
        snapshot = await collector.collect()
        took = time.monotonic() - began
    kept = sum(1 for line in snapshot.text.decode().splitlines() if line.startswith("fam_"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rss_before_mib": round(before, 1), "rss_peak_mib": round(peak, 1), "round_s": round(took, 2), "series_kept": kept}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def metrics_text(series: int, per_family: int = 100) -> str:
    lines = []
    for family in range(series // per_family):
        lines += [f"# HELP fam_{family} a family", f"# TYPE fam_{family} gauge"]
        lines += [f'fam_{family}{{i="{i}"}} {i}' for i in range(per_family)]
    return "\n".join(lines) + "\n"


async def serve(text: str) -> tuple[web.AppRunner, str]:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"  # the instance address: the collector asks for /metrics


async def main(series: int) -> dict:
    text = metrics_text(series)
    runner, url = await serve(text)
    rows = []
    try:
        for label, cap in (("uncapped (cap above the series count)", series * 10), ("default cap", 20000)):
            child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, url, str(cap), stdout=subprocess.PIPE,
                                                         cwd=str(Path(__file__).resolve().parents[1]))
            out, _ = await child.communicate()
            rows.append({"setting": label, "max_series_per_instance": cap, **json.loads(out)})
            print(rows[-1], file=sys.stderr)
    finally:
        await runner.cleanup()
    return {"series": series, "body_bytes": len(text.encode()), "rows": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", type=int, default=200_000)
    args = parser.parse_args()
    recorder = Recorder("metrics_cap_bench")
    recorder.write(asyncio.run(main(args.series)))
