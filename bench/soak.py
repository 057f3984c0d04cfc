#!/usr/bin/env python3
"""Soak: `vsup run` over fake vLLM instances under mixed load for a long time, with instances
killed now and then. Does vsup itself stay flat, and is every request either answered or told?

    .venv/bin/python bench/soak.py                         # 30 min, a kill -9 every 4 min
    .venv/bin/python bench/soak.py --duration 120 --kill-every 30 --json /tmp/soak.json --chart soak.png

The load: --concurrency closed-loop clients through vsup's proxy, half streamed chat completions
(20-120 tokens) and half plain ones, each from a fresh or a reused connection. Every --kill-every
seconds one instance's API server gets SIGKILL (in turn). Every --sample seconds vsup's own RSS,
open file descriptors, threads and (when the proxy exports it) asyncio tasks are read.

Each request ends as one of:
  ok          200 and a complete answer (a stream ends with `data: [DONE]`)
  told        an OpenAI-shaped error: a JSON error body with a 4xx/5xx status, or, after a stream
              started, a final `data: {"error": ...}` event (the instance died mid-stream)
  lost        anything else: a connection broken without an error, a malformed answer — a defect
At the end vsup gets SIGTERM; then no process of the run may be left, no port bound, no /dev/shm
file of the fakes left behind. Exit code 0 only when nothing was lost or left behind.
Loopback only; bounded in time; it stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.vsup_harness import VsupRun, make_config, port_is_free  # noqa: E402  (the fake vLLM set-up)
from vsup.supervisor.shm import files_in_use  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)


@dataclass
class Outcomes:
    ok: int = 0
    told: int = 0
    lost: int = 0
    told_by: dict[str, int] = field(default_factory=dict)
    lost_by: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, why: str = "") -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind in ("told", "lost"):
            bucket = self.told_by if kind == "told" else self.lost_by
            bucket[why] = bucket.get(why, 0) + 1


def body(stream: bool, tokens: int) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "soak"}], "max_tokens": tokens,
            "stream": stream}


async def one_request(session: aiohttp.ClientSession, url: str, stream: bool, tokens: int, out: Outcomes) -> None:
    try:
        async with session.post(url, json=body(stream, tokens)) as response:
            if response.status != 200:
                try:
                    error = (await response.json(content_type=None))["error"]
                    out.add("told", f"{response.status} {error.get('type', '?')}")
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    out.add("lost", f"{response.status} without an OpenAI error body")
                return
            if not stream:
                reply = await response.json(content_type=None)
                out.add("ok" if reply.get("choices") else "lost", "" if reply.get("choices") else "200 without choices")
                return
            last = b""
            async for line in response.content:
                if line.startswith(b"data: "):
                    last = line.strip()
                    if last == b"data: [DONE]":
                        out.add("ok")
                        return
                    if b'"error"' in last:
                        out.add("told", "error event mid-stream")
                        return
            out.add("lost", "stream ended without [DONE] or an error event")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.add("lost", type(exc).__name__)


async def client_loop(url: str, deadline: float, out: Outcomes, seed: int) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    session = aiohttp.ClientSession(timeout=timeout)
    try:
        while time.monotonic() < deadline:
            if rng.random() < 0.1:  # now and then a fresh connection
                await session.close()
                session = aiohttp.ClientSession(timeout=timeout)
            await one_request(session, url, stream=rng.random() < 0.5, tokens=rng.randint(20, 120), out=out)
    finally:
        await session.close()


def asyncio_tasks(proxy_port: int) -> int | None:
    """vsup's asyncio task count, when its proxy exports `vsup_asyncio_tasks`."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("vsup_asyncio_tasks "):
                    return int(float(line.split()[1]))
    except OSError:
        return None
    return None


def sample(run: VsupRun) -> dict:
    process = psutil.Process(run.proc.pid)
    return {"t": time.monotonic(), "rss_mib": process.memory_info().rss / 2**20, "fds": process.num_fds(),
            "threads": process.num_threads(), "tasks": asyncio_tasks(run.proxy_port)}


async def soak(args, run: VsupRun) -> tuple[Outcomes, list[dict], int]:
    url = f"http://127.0.0.1:{run.proxy_port}/v1/chat/completions"
    out = Outcomes()
    start = time.monotonic()
    deadline = start + args.duration
    clients = [asyncio.create_task(client_loop(url, deadline, out, seed)) for seed in range(args.concurrency)]
    samples, kills, next_kill, next_sample = [sample(run)], 0, start + args.kill_every, start + args.sample
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = time.monotonic()
        if now >= next_kill:
            index = kills % args.instances
            pid = (await asyncio.to_thread(run.instance, index))["pid"]
            if pid:
                os.kill(pid, signal.SIGKILL)
                kills += 1
                print(f"[{now - start:6.0f}s] kill -9 instance {index} (pid {pid})", flush=True)
            next_kill += args.kill_every
        if now >= next_sample:
            samples.append(await asyncio.to_thread(sample, run))
            s = samples[-1]
            print(f"[{now - start:6.0f}s] rss {s['rss_mib']:.1f} MiB, fds {s['fds']}, threads {s['threads']}, "
                  f"tasks {s['tasks']}; ok {out.ok}, told {out.told}, lost {out.lost}", flush=True)
            next_sample += args.sample
    await asyncio.gather(*clients)
    samples.append(await asyncio.to_thread(sample, run))
    return out, samples, kills


def left_behind(run: VsupRun, family: set[int], shm: set[str]) -> list[str]:
    problems = []
    alive = [pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    if alive:
        problems.append(f"processes still running: {sorted(alive)}")
    ports = [run.proxy_port, *(run.port(i) for i in run.config_instances())]
    if bound := [p for p in ports if not port_is_free(p)]:
        problems.append(f"ports still bound: {bound}")
    if leftover := sorted(name for name in shm if os.path.exists(name)):
        problems.append(f"/dev/shm files left: {leftover}")
    return problems


def summary(samples: list[dict]) -> dict:
    out = {}
    for key in ("rss_mib", "fds", "threads", "tasks"):
        values = [s[key] for s in samples if s[key] is not None]
        if values:
            out[key] = {"start": values[0], "end": values[-1], "max": max(values)}
    return out


def chart(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0]["t"]
    minutes = [(s["t"] - t0) / 60 for s in samples]
    keys = [k for k in ("rss_mib", "fds", "threads", "tasks") if any(s[k] is not None for s in samples)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2.2 * len(keys)), sharex=True)
    for ax, key in zip(axes, keys, strict=True):
        ax.plot(minutes, [s[key] for s in samples], marker=".")
        ax.set_ylabel(key)
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("minutes")
    fig.suptitle("vsup under soak: its own resources over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    parser.add_argument("--kill-every", type=float, default=240.0, help="seconds between kill -9s (default 240)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between resource samples")
    parser.add_argument("--json", type=Path, help="write the result file here instead of docs/bench/soak.json")
    parser.add_argument("--chart", type=Path, help="write a PNG of vsup's resources over time (needs matplotlib)")
    args = parser.parse_args()

    recorder = Recorder("soak")
    with tempfile.TemporaryDirectory(prefix="vsup-soak-") as tmp:
        config = make_config(Path(tmp), instances=args.instances,
                             health={"startup_timeout": 60},
                             log={"dir": str(Path(tmp) / "logs"), "echo": False, "level": "warning"})
        run = VsupRun(Path(tmp), config, env={"FAKE_VLLM_TOKEN_DELAY": "0.005", "FAKE_VLLM_ACCESS_LOG": "0"})
        try:
            run.wait_ready(timeout=60)
            print(f"vsup pid {run.proc.pid}, proxy :{run.proxy_port}, {args.instances} fake instances; "
                  f"{args.duration:.0f} s of load at concurrency {args.concurrency}", flush=True)
            outcomes, samples, kills = asyncio.run(soak(args, run))
            family = set(run.all_descendants()) | run.seen_pids
            for pid in list(family):
                family.update(run.tree(pid))
            shm = {f"/dev/shm/{name}" for name in files_in_use(family)}
            code = run.terminate(timeout=60)
            problems = left_behind(run, family, shm) + ([] if code == 0 else [f"vsup exited {code} on SIGTERM"])
        finally:
            run.close()

    t0 = samples[0]["t"]
    after_10 = next((s["rss_mib"] for s in samples if s["t"] - t0 >= 600), None)
    figures = {"rss_mib_after_10_min": after_10, "rss_mib_end": samples[-1]["rss_mib"],
               "rss_mib_series": [[round(s["t"] - t0), round(s["rss_mib"], 2)] for s in samples],
               "duration_s": args.duration, "kills": kills, "requests": {"ok": outcomes.ok, "told": outcomes.told,
               "lost": outcomes.lost, "told_by": outcomes.told_by, "lost_by": outcomes.lost_by},
               "vsup": summary(samples), "left_behind": problems}
    print("\n| vsup's own | start | end | max |\n|---|---|---|---|")
    for key, v in figures["vsup"].items():
        print(f"| {key} | {v['start']:.1f} | {v['end']:.1f} | {v['max']:.1f} |")
    print(f"\nrequests: {outcomes.ok} ok, {outcomes.told} told ({outcomes.told_by}), {outcomes.lost} lost "
          f"({outcomes.lost_by}); {kills} kill -9; left behind: {problems or 'nothing'}")
    recorder.write(figures, *((args.json.parent, args.json.name) if args.json else ()))
    if args.chart:
        chart(samples, args.chart)
    return 0 if outcomes.lost == 0 and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
