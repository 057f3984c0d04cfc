#!/usr/bin/env python3
"""The OpenAI Batch API under `vsup run`: an interactive chat beside a batch, the batch's
throughput against the best client-side loop, and the batch surviving a kill -9 of vsup, in one
run over the same instances (issue 32 §3 and its "Done when").

    .venv/bin/python bench/batch_bench.py --fake --quick            # fake vLLM, well under a minute
    .venv/bin/python bench/batch_bench.py --lines 1000 --kill-halfway
        # real vLLM (the tiny model of scripts/build_tiny_model.py): docs/bench/batch_bench.json
    .venv/bin/python bench/batch_bench.py --lines 1000 --kill-halfway --endpoint /v1/embeddings
        # a chat model and an embedding model of the same weights: docs/bench/batch_bench-embeddings.json

One `vsup run` (batch on, its store in a folder of the run) serves every phase, in this order:
  alone      --chats interactive chats, one at a time (a person asking), streamed: TTFT p50/p90
             client side, through vsup's proxy, to the first streamed event with content.
  loop       the best a client can do without the Batch API: --lines lines (fresh text) sent through
             the proxy by an asyncio loop keeping C requests in flight, for each C of --concurrency
             (default: a few around the instances' slots); the best lines/s is the baseline.
  batch      the same number of lines (fresh text) as a batch through the openai SDK
             (client.files.create, client.batches.create), nothing else running: lines/s from
             batches.create to the status `completed` seen by polling (every 0.1 s, every 0.02 s after 90 % of its lines). It starts
             batch.quiet_after seconds (--quiet-after) after the loop's last request: an idle box,
             whose every slot batch lines may take (until then one stays free for a colleague).
  again      the loop at the best concurrency of `loop`, once more (fresh text), right after the
             batch: the throughput ratio's baseline. The sweep's best figure is the largest of
             several noisy measurements (the winner's curse: it overstates that loop by about its
             noise, ±15 % a phase on a shared 2-core box); measured again it is an honest one,
             and next to the batch in time. The ratio against the sweep's best is kept too.
  beside     another batch (--beside-lines), and the interactive chats again while it runs (from its
             first finished line until --chats chats or 95 % of its lines): TTFT p50/p90 beside a
             batch. (The chats end early when the batch does: the figures say how many there were.)
  kill       (--kill-halfway) another batch; at half its lines vsup (the supervisor process: its
             proxy and batch runner live in it) is killed with SIGKILL, as the OOM killer would;
             its instances die with it (PR_SET_PDEATHSIG). The same `vsup run` is started again
             with the same config and store; the bench polls the same batch id to its end and
             reads its output and error files: every custom_id must be there, exactly once.
alone, loop, batch, again and beside make a turn; with --repeat N the run takes N turns, each ratio below
is taken within a turn (against that turn's own baselines: a shared machine's speed drifts over
minutes) and the figure is the median of the N (the lower middle of an even N); the result file
shows the turn of the median throughput ratio, and every turn. The issue's bars, as ratios of this run: beside's TTFT p50 / alone's <= 1.5; batch lines/s / the
best loop's >= 0.9; and kill: one result per custom_id, none missing.

With --endpoint /v1/embeddings the batch runs on an embedding model (the chat model's weights,
`--runner pooling --convert embed`) with instances of its own, and the chats on the chat model's:
there the chat shares the machine (CPUs, memory bandwidth, the proxy) with the batch, not its
instances.

Two experiments on what trades the bars (docs/batch.md): --slots-per-instance N sets
batch.slots_per_instance (above --max-num-seqs the lines fill vLLM's own queue too, as the best
loop does); --vllm-priority P turns on vLLM's priority scheduler (--scheduling-policy priority)
and gives every line (the loop's too) vLLM priority P, so a chat (0) goes ahead of queued lines.

--fake: fake vLLM instances (tests/fakevllm, real processes, its batched engine model: a decode
step of --step-time s growing by --seq-cost per extra sequence, --max-num-seqs at once, the rest
queued), so the figures are vsup's scheduling against that model, not vLLM's speed. The fake
answers embeddings at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import openai
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from result import Recorder  # noqa: E402  (bench/result.py: docs/bench/<name>.json)

from vsup.config.schema import BatchConfig  # noqa: E402

# the `vsup` of the Python running the bench (a test's venv), else this checkout's .venv, else PATH's
VSUP = next((str(p) for p in (Path(sys.executable).with_name("vsup"), ROOT / ".venv" / "bin" / "vsup") if p.exists()), "vsup")
CHAT, EMBED = "chat", "embed"
CHAT_ENDPOINT, EMBED_ENDPOINT = "/v1/chat/completions", "/v1/embeddings"
POOLING_ARGS = ["--runner", "pooling", "--convert", "embed"]
TTFT_BAR = 1.5        # a chat's TTFT p50 beside a batch at most this many times its p50 alone
THROUGHPUT_BAR = 0.9  # a batch alone at least this fraction of the best client loop's lines/s
TERMINAL = {"completed", "failed", "expired", "cancelled"}
POLL = 0.1            # seconds between two batches.retrieve
# ... and near a timed batch's end (batch alone): its end is seen this late at most (at POLL, up to
# 5 % of a 2 s batch); only there, so the bench's own requests do not load the proxy the chats use
FINE_POLL = 0.02
WORDS = ("the a of to in on for with model server request token stream core node memory cache process "
         "thread worker engine queue batch prompt answer question river mountain city window garden music "
         "paper light water stone bird tree road and or but if then when while because so").split()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least q of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


def ttft_figures(ttfts: list[float]) -> dict:
    return {"requests": len(ttfts), "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "ttft_p90_s": round(percentile(ttfts, 0.9), 4) if ttfts else None}


# ---- the lines ------------------------------------------------------------------------------------

def line_bodies(args, salt: str, lines: int | None = None) -> list[dict]:
    """`lines` (--lines) request bodies of the batch's endpoint, fresh text per salt (no phase
    meets a prefix cache another filled)."""
    rng = random.Random(f"{args.seed}/{salt}")
    count = args.lines if lines is None else lines
    # --vllm-priority: vLLM's own priority (lower first) on every line, for its priority scheduler
    extra = {"priority": args.vllm_priority} if args.vllm_priority is not None else {}
    if args.endpoint == EMBED_ENDPOINT:
        return [{"model": EMBED, "input": text(rng, args.prompt_words), **extra} for _ in range(count)]
    return [{"model": CHAT, "messages": [{"role": "user", "content": "Summarize: " + text(rng, args.prompt_words)}],
             "max_tokens": args.batch_tokens, "ignore_eos": True, "temperature": 0, **extra} for _ in range(count)]


def jsonl(bodies: list[dict], endpoint: str, salt: str) -> tuple[bytes, list[str]]:
    """The batch input file (OpenAI's line format) and its custom_ids in order."""
    ids = [f"{salt}-{n:05d}" for n in range(len(bodies))]
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body}) + "\n"
                   for cid, body in zip(ids, bodies, strict=True))
    return data.encode(), ids


# ---- vsup run -------------------------------------------------------------------------------------

def vsup_config(args, workdir: Path) -> dict:
    """One `vsup run`: the chat model (and with --endpoint /v1/embeddings an embedding model of the
    same weights), the batch store in the run's folder."""
    slots = ["--max-num-seqs", str(args.max_num_seqs)]
    if args.vllm_priority is not None:  # vLLM's waiting queue by priority: a chat (0) before queued lines
        slots += ["--scheduling-policy", "priority"]
    if args.fake:
        vllm: dict = {"command": [sys.executable, str(ROOT / "tests" / "fake_per_port.py"), "serve"], "args": slots,
                      "env": {"FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0", "FAKE_VLLM_ACCESS_LOG": "0",
                              "FAKE_VLLM_STEP_TIME": str(args.step_time), "FAKE_VLLM_SEQ_COST": str(args.seq_cost),
                              "FAKE_VLLM_SATURATE_THREADS": "1", "FAKE_VLLM_PREFILL_DELAY": str(args.prefill_delay),
                              "FAKE_VLLM_PREFIX_CACHE_BLOCKS": "0"}}
        placement: dict = {"launcher": "taskset", "reserve_cores": 0, "model_size_gib": 0.01, "kvcache_gib": 0.01,
                           "overhead_gib": 0.01, "memory_reserve_gib": 0.1}
        model = "fake-model"
    else:
        vllm = {"venv": str(args.venv), "env": {"HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")},
                "args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", *slots]}
        placement = {"reserve_cores": 0, "kvcache_gib": args.kvcache_gib, "overhead_gib": 1.5}
        model = str(args.model_dir)
    config: dict = {
        "placement": placement,
        "vllm": vllm,
        "proxy": {"host": "127.0.0.1", "port": args.port, "first_byte_timeout": 900, "drain_timeout": 2},
        "health": {"startup_timeout": args.startup_timeout},
        "start": {"mode": "parallel"},
        "stop": {"timeout": 10},
        "log": {"dir": str(workdir / "logs"), "echo": True},
        "control": {"socket": str(workdir / "control.sock")},
        "batch": {"dir": str(workdir / "batches"), "quiet_after": args.quiet_after, "beside_interactive": args.beside_interactive,
                  **({"slots_per_instance": args.slots_per_instance} if args.slots_per_instance else {})},
    }
    if args.endpoint == EMBED_ENDPOINT:
        config["models"] = [
            {"model": model, "served_model_name": CHAT, "instances": args.chat_instances,
             "placement": {"cores_per_instance": 1}},
            {"model": model, "served_model_name": EMBED, "instances": args.instances, "placement": {"cores_per_instance": 1},
             "vllm": {"args": [*vllm["args"], *POOLING_ARGS]}},  # an entry's list replaces the top level's
        ]
    else:
        config.update(model=model, served_model_name=CHAT, instances=args.instances)
    return config


class Vsup:
    """`vsup run` as a child in its own session, its output to a file; kill9() and start() again
    with the same config; stop() leaves nothing behind (what a killed vsup's instances left too)."""

    def __init__(self, config: dict, workdir: Path, instances: int) -> None:
        self.workdir, self.instances = workdir, instances
        self.path = workdir / "vsup.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{config['proxy']['port']}"
        self.proc: subprocess.Popen | None = None
        self.family: set[psutil.Process] = set()  # every descendant seen: swept at the end (psutil checks a
        # process is still the one seen before it signals it, so a reused pid is never hit)
        self.starts = 0

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_VLLM_", "PORT"))}
        env["TMPDIR"] = str(self.workdir)  # its own runtime folder: the state file a restart reads
        self.starts += 1
        with open(self.workdir / f"vsup-{self.starts}.log", "ab") as log:
            self.proc = subprocess.Popen([VSUP, "run", "--config", str(self.path)], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, cwd=self.workdir, env=env)

    def note_family(self) -> None:
        if self.proc is not None:
            try:
                self.family |= set(psutil.Process(self.proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass

    async def wait_ready(self, timeout: float) -> float:
        """Seconds until the proxy's /ready counts every instance ready."""
        began = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() - began < timeout:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vsup run exited ({self.proc.returncode}); see {self.log_tail()}")
                try:
                    async with session.get(self.url + "/ready") as response:
                        if response.status == 200 and (await response.json()).get("instances_ready") == self.instances:
                            self.note_family()
                            return time.monotonic() - began
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"vsup run not ready within {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def kill9(self) -> None:
        """SIGKILL the supervisor alone (its proxy and batch runner are in it), as the OOM killer would."""
        assert self.proc is not None
        self.note_family()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.note_family()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        alive = []
        for process in self.family:
            try:
                process.kill()
                alive.append(process)
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of vsup's own process (proxy, batch runner, its writer thread), of its
        instances (every descendant: vLLM's API servers and engines) and of this bench (the client)."""
        def used(process: psutil.Process) -> float:
            try:
                times = process.cpu_times()
                return times.user + times.system
            except psutil.Error:
                return 0.0

        out = {"vsup": 0.0, "vllm": 0.0, "client": used(psutil.Process())}
        if self.proc is not None and self.proc.poll() is None:
            main = psutil.Process(self.proc.pid)
            out["vsup"] = used(main)
            out["vllm"] = sum(used(child) for child in main.children(recursive=True))
        return out

    def log_tail(self) -> str:
        logs = sorted(self.workdir.glob("vsup-*.log"))
        return logs[-1].read_text(errors="replace")[-3000:] if logs else "(no log)"


# ---- interactive chats ----------------------------------------------------------------------------

async def chat_ttft(session: aiohttp.ClientSession, url: str, rng: random.Random, tokens: int) -> float:
    body = {"model": CHAT, "messages": [{"role": "user", "content": "quick question: " + text(rng, 12)}],
            "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    began, first = time.monotonic(), None
    async with session.post(url + CHAT_ENDPOINT, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"interactive chat: HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.strip()
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.monotonic() - began
    if first is None:
        raise RuntimeError("interactive chat: a stream without content")
    return first


async def chats(url: str, args, salt: str, go_on=lambda: True) -> list[float]:
    """--chats chats one at a time, with a person's pause between; stops early when go_on() turns
    false, and then the chat that was in flight is not counted."""
    rng = random.Random(f"{args.seed}/{salt}")
    ttfts: list[float] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while len(ttfts) < args.chats and go_on():
            ttft = await chat_ttft(session, url, rng, args.chat_tokens)
            if not go_on():
                break
            ttfts.append(ttft)
            await asyncio.sleep(rng.uniform(0.05, 0.15))
    return ttfts


# ---- the client-side loop -------------------------------------------------------------------------

def cpu_spent(vsup: Vsup, before: dict[str, float], lines: int) -> dict[str, float]:
    """CPU milliseconds per line of each part since `before` (vsup.cpu()): where a phase's work went
    on a machine whose cores the instances share with vsup and the client."""
    after = vsup.cpu()
    return {part: round((after[part] - before[part]) * 1000 / lines, 2) for part in after}


async def client_loop(url: str, endpoint: str, bodies: list[dict], concurrency: int) -> dict:
    """Every body through the proxy, `concurrency` in flight (what a script does without the Batch API)."""
    queue = iter(bodies)
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            for body in queue:
                async with session.post(url + endpoint, json=body) as response:
                    await response.read()
                    if response.status != 200:
                        errors.append(f"HTTP {response.status}")

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - began
    return {"concurrency": concurrency, "lines": len(bodies), "errors": len(errors), "seconds": round(elapsed, 2),
            "lines_per_s": round((len(bodies) - len(errors)) / elapsed, 3)}


# ---- batches through the openai SDK --------------------------------------------------------------

async def submit(client: openai.AsyncOpenAI, args, salt: str, lines: int | None = None) -> tuple[str, list[str], float]:
    """Upload a fresh input file and create its batch: (batch id, custom_ids, upload seconds)."""
    data, ids = jsonl(line_bodies(args, salt, lines), args.endpoint, salt)
    began = time.monotonic()
    uploaded = await client.files.create(file=(f"{salt}.jsonl", data), purpose="batch")
    upload_s = time.monotonic() - began
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=args.endpoint,  # type: ignore[arg-type]
                                        completion_window="24h", metadata={"bench": salt})
    return batch.id, ids, upload_s


async def poll(client: openai.AsyncOpenAI, batch_id: str, until, timeout: float, state: dict | None = None,
               every: float = POLL):
    """batches.retrieve every `every` s until until(batch) (a terminal status always ends it);
    connection failures are waited out (vsup being started again)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            batch = await client.batches.retrieve(batch_id)
        except openai.APIConnectionError:
            await asyncio.sleep(every)
            continue
        if state is not None:
            state["batch"] = batch
        if batch.status in TERMINAL or until(batch):
            return batch
        await asyncio.sleep(every)
    raise RuntimeError(f"batch {batch_id}: not done within {timeout:.0f} s")


def done_lines(batch) -> int:
    counts = batch.request_counts
    return (counts.completed + counts.failed) if counts else 0


async def results(client: openai.AsyncOpenAI, batch) -> tuple[list[dict], list[dict]]:
    """The lines of its output file and of its error file."""
    out = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            data = (await client.files.content(file_id)).content
            out.append([json.loads(line) for line in data.splitlines() if line.strip()])
        else:
            out.append([])
    return out[0], out[1]


def one_per_custom_id(ids: list[str], output: list[dict], errors: list[dict]) -> dict:
    """Whether the output holds exactly one result per custom_id, and every one (the error file
    counted with it: a line there is a result too, and must not also be in the output)."""
    seen = Counter(str(line.get("custom_id")) for line in output + errors)
    wanted = set(ids)
    duplicates = sorted(cid for cid, n in seen.items() if n > 1)
    missing = sorted(wanted - set(seen))
    strangers = sorted(set(seen) - wanted)
    ok_answers = sum(1 for line in output if (line.get("response") or {}).get("status_code") == 200)
    return {"custom_ids": len(ids), "output_results": len(output), "error_results": len(errors),
            "output_answers_200": ok_answers, "duplicates": len(duplicates), "missing": len(missing),
            "unknown": len(strangers), "examples": (duplicates + missing + strangers)[:5],
            "met": not duplicates and not missing and not strangers and len(output) == len(ids) and ok_answers == len(ids)}


def turn_ratios(row: dict) -> dict:
    """One turn's ratios: its chats' TTFT p50 beside its batch over alone; its batch's lines/s over
    the best loop's, measured again right after the batch (`again`: the sweep's best concurrency,
    fresh text) — the sweep's own best figure is the largest of several noisy measurements, so it
    overstates that loop by about its noise (the winner's curse); that ratio is kept too
    (`batch_over_sweep_best`). A turn without `again` (a result file of an earlier bench) has the sweep's."""
    batch = row["batch"]["lines_per_s"]

    def over(loop: dict) -> float:
        return round(batch / loop["lines_per_s"], 3) if loop["lines_per_s"] else float("nan")

    swept = over(row["best_loop"])
    return {"ttft_p50_beside_over_alone": round(row["beside"]["ttft_p50_s"] / row["alone"]["ttft_p50_s"], 3),
            "batch_over_best_loop": over(row["again"]) if "again" in row else swept, "batch_over_sweep_best": swept}


async def batch_alone(client: openai.AsyncOpenAI, args, salt: str = "batch") -> dict:
    batch_id, ids, upload_s = await submit(client, args, salt)
    began = time.monotonic()
    await poll(client, batch_id, lambda b: done_lines(b) >= 0.9 * args.lines, args.batch_timeout)
    batch = await poll(client, batch_id, lambda b: False, args.batch_timeout, every=FINE_POLL)
    elapsed = time.monotonic() - began
    output, errors = await results(client, batch)
    check = one_per_custom_id(ids, output, errors)
    if batch.status != "completed" or not check["met"]:
        raise RuntimeError(f"batch alone: status {batch.status}, {check}")
    return {"batch_id": batch_id, "lines": args.lines, "upload_s": round(upload_s, 3), "seconds": round(elapsed, 2),
            "lines_per_s": round(args.lines / elapsed, 3), "status": batch.status, "failed": batch.request_counts.failed}


async def beside(client: openai.AsyncOpenAI, url: str, args, salt: str = "beside") -> dict:
    """A batch and the chats beside it: from its first finished line until --chats chats or 95 %."""
    batch_id, ids, _ = await submit(client, args, salt, args.beside_lines)
    began = time.monotonic()
    state: dict = {}
    watcher = asyncio.create_task(poll(client, batch_id, lambda b: False, args.batch_timeout, state))
    await poll(client, batch_id, lambda b: done_lines(b) >= 1, args.batch_timeout)  # the instances are full

    def running() -> bool:  # (the watcher's last look may be older than the wait's: validating counts as running)
        batch = state.get("batch")
        return not watcher.done() and (batch is None or (batch.status in ("validating", "in_progress")
                                                          and done_lines(batch) < 0.95 * args.beside_lines))

    ttfts = await chats(url, args, salt, running)
    if not ttfts:
        raise RuntimeError("no chat was measured beside the batch: it ended first (raise --beside-lines)")
    chats_done = done_lines(state["batch"]) if "batch" in state else 0
    batch = await watcher
    elapsed = time.monotonic() - began
    output, errors = await results(client, batch)
    check = one_per_custom_id(ids, output, errors)
    if batch.status != "completed" or not check["met"]:
        raise RuntimeError(f"batch beside the chats: status {batch.status}, {check}")
    return {**ttft_figures(ttfts), "batch_id": batch_id, "batch_lines_done_when_chats_ended": chats_done,
            "batch_lines": args.beside_lines, "batch_seconds": round(elapsed, 2),
            "batch_lines_per_s": round(args.beside_lines / elapsed, 3)}


async def kill_halfway(client: openai.AsyncOpenAI, vsup: Vsup, args) -> dict:
    """A batch; SIGKILL vsup at half its lines; the same vsup run again; the same batch to its end;
    one result per custom_id."""
    batch_id, ids, _ = await submit(client, args, "kill")
    began = time.monotonic()
    half = args.lines // 2
    batch = await poll(client, batch_id, lambda b: done_lines(b) >= half, args.batch_timeout)
    if batch.status in TERMINAL:
        raise RuntimeError(f"kill halfway: the batch ended ({batch.status}) before half its lines")
    killed_pid = vsup.pid
    vsup.kill9()
    killed_exit = vsup.returncode
    at_kill = done_lines(batch)
    killed = time.monotonic()
    print(f"  kill -9 vsup at {at_kill} of {args.lines} lines; starting it again", file=sys.stderr)
    vsup.start()
    ready_s = await vsup.wait_ready(args.startup_timeout)
    batch = await poll(client, batch_id, lambda b: False, args.batch_timeout)
    ended = time.monotonic()
    output, errors = await results(client, batch)
    check = one_per_custom_id(ids, output, errors)
    counts = batch.request_counts
    return {"batch_id": batch_id, "lines": args.lines, "lines_done_at_kill": at_kill, "killed_exit": killed_exit,
            "new_supervisor": vsup.pid != killed_pid, "restart_ready_s": round(ready_s, 2),
            "seconds_after_kill": round(ended - killed, 2), "seconds": round(ended - began, 2), "status": batch.status,
            "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed} if counts else None,
            **check, "met": check["met"] and batch.status == "completed"}


# ---- the run --------------------------------------------------------------------------------------

def concurrencies(args) -> list[int]:
    if args.concurrency:
        return sorted({int(c) for c in args.concurrency.split(",")})
    slots = args.instances * args.max_num_seqs
    return sorted({max(1, slots // 2), slots - args.instances, slots, 2 * slots, 4 * slots})


async def warm_up(url: str, args) -> None:
    """A short chat (and an embedding) first: first-request costs land in no phase."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(2):
            await chat_ttft(session, url, random.Random(0), 2)
        if args.endpoint == EMBED_ENDPOINT:
            async with session.post(url + EMBED_ENDPOINT, json={"model": EMBED, "input": "warm up"}) as response:
                await response.read()


async def run(args, vsup: Vsup) -> dict:
    vsup.start()
    ready_s = await vsup.wait_ready(args.startup_timeout)
    print(f"vsup run ready in {ready_s:.1f} s ({vsup.instances} instances)", file=sys.stderr)
    await warm_up(vsup.url, args)
    client = openai.AsyncOpenAI(base_url=vsup.url + "/v1", api_key="batch-bench", max_retries=0, timeout=900)
    out: dict = {"ready_s": round(ready_s, 1)}
    turns: list[dict] = []
    for turn in range(args.repeat):  # each turn's ratios against its own baselines: the machine's speed drifts
        row: dict = {"alone": ttft_figures(await chats(vsup.url, args, f"alone-{turn}"))}
        print(f"  alone: {row['alone']}", file=sys.stderr)
        row["loop"] = []
        for c in concurrencies(args):
            before = vsup.cpu()
            row["loop"].append(await client_loop(vsup.url, args.endpoint, line_bodies(args, f"loop-{c}-{turn}"), c))
            row["loop"][-1]["cpu_ms_per_line"] = cpu_spent(vsup, before, args.lines)
            print(f"  loop: {row['loop'][-1]}", file=sys.stderr)
        await asyncio.sleep(args.quiet_after + 0.5)  # no interactive request for batch.quiet_after: an idle box
        before = vsup.cpu()
        row["batch"] = await batch_alone(client, args, f"batch-{turn}")
        row["batch"]["cpu_ms_per_line"] = cpu_spent(vsup, before, args.lines)
        print(f"  batch: {row['batch']}", file=sys.stderr)
        row["best_loop"] = max(row["loop"], key=lambda r: r["lines_per_s"])
        best = row["best_loop"]["concurrency"]  # the sweep's best, measured again beside the batch (see turn_ratios)
        before = vsup.cpu()
        row["again"] = await client_loop(vsup.url, args.endpoint, line_bodies(args, f"again-{best}-{turn}"), best)
        row["again"]["cpu_ms_per_line"] = cpu_spent(vsup, before, args.lines)
        print(f"  again: {row['again']}", file=sys.stderr)
        await asyncio.sleep(args.quiet_after + 0.5)  # beside's batch starts on a quiet box too (its first chat preempts)
        row["beside"] = await beside(client, vsup.url, args, f"beside-{turn}")
        print(f"  beside: {row['beside']}", file=sys.stderr)
        row["ratios"] = turn_ratios(row)
        print(f"  turn {turn + 1}: {row['ratios']}", file=sys.stderr)
        turns.append(row)
    out["turns"] = turns
    if args.kill_halfway:
        out["kill"] = await kill_halfway(client, vsup, args)
        print(f"  kill: {out['kill']}", file=sys.stderr)
    await client.close()
    return out


def figures(out: dict, args) -> dict:
    """The median turn's figures; each ratio the median of the turns' (the lower middle of an even count)."""
    turns = out.pop("turns")
    middle = (len(turns) - 1) // 2

    def median(key: str) -> float:
        return sorted(t["ratios"][key] for t in turns)[middle]

    ttft_ratio, throughput = median("ttft_p50_beside_over_alone"), median("batch_over_best_loop")
    swept = median("batch_over_sweep_best")
    shown = sorted(turns, key=lambda t: t["ratios"]["batch_over_best_loop"])[middle]
    out.update({k: shown[k] for k in ("alone", "loop", "batch", "again", "beside")})
    best = shown["best_loop"]
    if len(turns) > 1:
        out["turns"] = turns
    bars = [
        {"what": "interactive TTFT p50 beside a batch / alone", "value": round(ttft_ratio, 2), "bar": f"<= {TTFT_BAR:g}",
         "met": ttft_ratio <= TTFT_BAR},
        {"what": "batch lines/s / the best client loop's", "value": round(throughput, 2), "bar": f">= {THROUGHPUT_BAR:g}",
         "met": throughput >= THROUGHPUT_BAR},
    ]
    if "kill" in out:
        k = out["kill"]
        bars.append({"what": "after kill -9 halfway: one result per custom_id, none missing",
                     "value": f"{k['output_results']} results for {k['custom_ids']} custom_ids, {k['duplicates']} duplicated, "
                              f"{k['missing']} missing", "bar": "exactly one each", "met": k["met"]})
    settings = {k: v for k, v in vars(args).items() if k not in ("result", "quick", "venv", "port", "seed")}
    settings["model_dir"] = str(args.model_dir).replace(str(Path.home()), "~") if args.model_dir else None
    settings["concurrency"] = concurrencies(args)
    if args.fake:
        settings.pop("model_dir")
    else:
        for key in ("step_time", "seq_cost", "prefill_delay"):
            settings.pop(key)
    return {"backend": "fake" if args.fake else "vllm", "settings": settings, **out, "best_loop": best,
            "ratios": {"ttft_p50_beside_over_alone": round(ttft_ratio, 3), "batch_over_best_loop": round(throughput, 3),
                       "batch_over_sweep_best": round(swept, 3)},
            "bars": bars, "met": all(b["met"] for b in bars)}


def report(f: dict) -> str:
    lines = [f"alone:  chat TTFT p50 {f['alone']['ttft_p50_s']:.3f} s, p90 {f['alone']['ttft_p90_s']:.3f} s ({f['alone']['requests']} chats)",
             f"beside: chat TTFT p50 {f['beside']['ttft_p50_s']:.3f} s, p90 {f['beside']['ttft_p90_s']:.3f} s ({f['beside']['requests']} chats), "
             f"the batch {f['beside']['batch_lines_per_s']:.2f} lines/s",
             "loop:   " + ", ".join(f"c={r['concurrency']}: {r['lines_per_s']:.2f}" for r in f["loop"]) + " lines/s",
             f"batch:  {f['batch']['lines_per_s']:.2f} lines/s alone",
             f"again:  c={f['again']['concurrency']}: {f['again']['lines_per_s']:.2f} lines/s (the best loop measured again "
             f"after the batch; the batch / the sweep's best: {f['ratios']['batch_over_sweep_best']:.2f})"]
    if "kill" in f:
        k = f["kill"]
        lines.append(f"kill:   -9 at {k['lines_done_at_kill']}/{k['lines']} lines, ready again in {k['restart_ready_s']:.1f} s, "
                     f"{k['status']}: {k['output_results']} results, {k['error_results']} errors, {k['duplicates']} duplicated, "
                     f"{k['missing']} missing")
    for b in f["bars"]:
        value = f"{b['value']:.2f}" if isinstance(b["value"], float) else b["value"]
        lines.append(f"- {b['what']}: {value} ({'meets' if b['met'] else 'MISSES'} {b['bar']})")
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------------

def build_step(argv: list[str], what: str) -> Path:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"batch_bench: {what} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake", action="store_true", help="fake vLLM instances (tests/fakevllm) instead of vLLM")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 lines, 10 chats beside 150 lines")
    parser.add_argument("--endpoint", choices=(CHAT_ENDPOINT, EMBED_ENDPOINT), default=CHAT_ENDPOINT, help="the batch's endpoint")
    parser.add_argument("--lines", type=int, default=None, help="lines per batch and per loop pass (default 200; --quick 40)")
    parser.add_argument("--beside-lines", type=int, default=None, help="lines of the batch the chats are measured beside "
                        "(default: --lines; --quick 150): it must outlast --chats chats")
    parser.add_argument("--chats", type=int, default=None, help="interactive chats per measurement (default 40; --quick 15)")
    parser.add_argument("--kill-halfway", action="store_true", help="also: kill -9 vsup at half a batch, start it again, "
                        "check one result per custom_id")
    parser.add_argument("--instances", type=int, default=None, help="instances of the batch's model (default 2 for chat; "
                        "1 for embeddings, beside --chat-instances of the chat model)")
    parser.add_argument("--chat-instances", type=int, default=1, help="--endpoint /v1/embeddings: instances of the chat model")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="each instance's --max-num-seqs: its slots (default 16; --fake 4)")
    parser.add_argument("--slots-per-instance", type=int, default=None, help="batch.slots_per_instance (default: auto, "
                        "the --max-num-seqs: batch lines take what interactive requests leave)")
    parser.add_argument("--vllm-priority", type=int, default=None, help="an experiment: vLLM's --scheduling-policy "
                        "priority, and this priority (lower runs first; chats have 0) in every line's body (the loop's too)")
    parser.add_argument("--concurrency", default=None, help="the client loop's concurrencies, comma-separated (default: half "
                        "the slots, the batch's share, all slots, twice and four times the slots: vLLM queues the rest)")
    parser.add_argument("--quiet-after", type=float, default=None, help="batch.quiet_after: seconds after an interactive "
                        "request that a slot stays free of batch lines; the batch alone starts this long after the loop "
                        "(default: vsup's, 30; --quick 1)")
    parser.add_argument("--beside-interactive", type=float, default=None, help="batch.beside_interactive: the share of "
                        "each instance's slots lines may hold while chats are recent (default: vsup's, 0.125)")
    parser.add_argument("--repeat", type=int, default=1, help="turns of alone, loop, batch and beside; each ratio is "
                        "the median of the turns'")
    parser.add_argument("--prompt-words", type=int, default=64, help="words of a line's prompt (or input)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="tokens a chat line generates (default 32; --fake 8)")
    parser.add_argument("--chat-tokens", type=int, default=16, help="tokens an interactive chat generates")
    parser.add_argument("--step-time", type=float, default=0.01, help="--fake: FAKE_VLLM_STEP_TIME")
    parser.add_argument("--seq-cost", type=float, default=0.1, help="--fake: FAKE_VLLM_SEQ_COST")
    parser.add_argument("--prefill-delay", type=float, default=0.0005, help="--fake: FAKE_VLLM_PREFILL_DELAY")
    parser.add_argument("--venv", type=Path, default=None, help="vLLM's venv (default: scripts/vllm-env's)")
    parser.add_argument("--model-dir", type=Path, default=None, help="the model (default: scripts/build_tiny_model.py's, built once)")
    parser.add_argument("--kvcache-gib", type=float, default=0.0625, help="each vLLM instance's KV cache (placement.kvcache_gib)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--batch-timeout", type=float, default=3600.0, help="seconds one batch may take")
    parser.add_argument("--seed", default=None, help="salt of the generated text (default: a new one per run)")
    parser.add_argument("--result", type=Path, default=None, help="the result file (default: docs/bench/batch_bench.json, "
                        "or batch_bench-embeddings.json, for a real-vLLM run; none for --fake)")
    args = parser.parse_args(argv)
    args.seed = args.seed or random.Random().randbytes(4).hex()
    defaults = {"lines": 40 if args.quick else 200, "chats": 10 if args.quick else 40,
                "quiet_after": 1.0 if args.quick else BatchConfig().quiet_after,
                "beside_interactive": BatchConfig().beside_interactive,
                "instances": 2 if args.endpoint == CHAT_ENDPOINT else 1,
                "max_num_seqs": 4 if args.fake else 16, "batch_tokens": 8 if args.fake else 32}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.beside_lines is None:
        args.beside_lines = max(args.lines, 150) if args.quick else args.lines
    for name in ("lines", "beside_lines", "chats", "instances", "chat_instances", "prompt_words", "batch_tokens", "chat_tokens",
                 "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.slots_per_instance is not None and args.slots_per_instance < 1:
        parser.error("--slots-per-instance must be at least 1")
    if args.max_num_seqs < 2:
        parser.error("--max-num-seqs must be at least 2 (one slot of each instance stays for interactive requests while they come)")
    if args.quiet_after < 0:
        parser.error("--quiet-after must be 0 or more")
    if not 0 <= args.beside_interactive <= 1:
        parser.error("--beside-interactive must be between 0 and 1 (a share of the slots)")
    if args.kill_halfway and args.lines < 4:
        parser.error("--kill-halfway needs --lines 4 or more")
    if args.concurrency:
        try:
            assert all(int(c) >= 1 for c in args.concurrency.split(","))
        except (ValueError, AssertionError):
            parser.error("--concurrency: comma-separated whole numbers of at least 1, e.g. 4,8,16")
    args.port = free_port()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recorder = Recorder("batch_bench", [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    if not args.fake:
        if args.venv is None:
            args.venv = build_step([str(ROOT / "scripts" / "vllm-env")], "scripts/vllm-env")
        if args.model_dir is None:
            args.model_dir = build_step([str(args.venv / "bin" / "python"), str(ROOT / "scripts" / "build_tiny_model.py")],
                                        "scripts/build_tiny_model.py")
    instances = args.instances + (args.chat_instances if args.endpoint == EMBED_ENDPOINT else 0)
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        workdir = Path(tmp)
        vsup = Vsup(vsup_config(args, workdir), workdir, instances)
        try:
            out = asyncio.run(run(args, vsup))
        except BaseException:
            print(f"--- vsup run's log (tail)\n{vsup.log_tail()}", file=sys.stderr)
            raise
        finally:
            vsup.stop()
    result = figures(out, args)
    print(report(result))
    target = args.result
    if target is None and not args.fake:
        target = ROOT / "docs" / "bench" / ("batch_bench.json" if args.endpoint == CHAT_ENDPOINT else "batch_bench-embeddings.json")
    if target is not None:
        recorder.write(result, target.parent, target.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
