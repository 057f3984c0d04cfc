"""A start in vLLM's phases (FAKE_VLLM_PHASES), before the API server binds: the lines vLLM 0.32's
CPU build prints at each step, in its format, and the work behind them a supervisor can see in
/proc — CPU time, bytes read — or the lack of it.

    boot:S     CPU busy S seconds, no line (Python imports)
    load:S     "Starting to load model M...", FAKE_VLLM_SHARDS progress lines of the checkpoint
               shards over S seconds while the model directory's weight files are read (when MODEL
               is a directory), "Loading weights took S seconds"
    profile:S  CPU busy S seconds, then "Explicitly set (…) GiB for KV cache on node 0."
    compile:S  "Warming up model for the compilation...", CPU busy S seconds, "Warming up done."
    stall:S    nothing at all for S seconds: no line, no CPU, no read (a hung start)

In compile and stall, shm_broadcast's waiting line comes every FAKE_VLLM_WAIT_LINE_EVERY seconds
(vLLM: 60), as vLLM's engine prints it while its worker is busy — or hung. After the phases:
"init engine (profile, create kv cache, warmup model) took T s". A SIGTERM (the `stop` future)
ends the phases at once.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
SLICE = 0.05  # seconds of busy work between two looks at the event loop
SHM_WAIT = ("No available shared memory broadcast block found in {n} seconds. This typically happens when some "
            "processes are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache quantization).")


def _stamp() -> str:
    return time.strftime("%m-%d %H:%M:%S")


class Start:
    def __init__(self, model: str, shards: int, wait_line_every: float | None, stop: asyncio.Future,
                 say: Callable[[str], None]) -> None:
        self.model = model
        self.shards = shards
        self.wait_line_every = wait_line_every
        self.stop = stop
        self.say = say
        self.pid = os.getpid()
        self._next_wait_line: float | None = None

    def line(self, process: str, where: str, message: str) -> None:
        self.say(f"({process} pid={self.pid}) INFO {_stamp()} [{where}] {message}")

    async def run(self, phases: tuple[tuple[str, float], ...]) -> None:
        began = time.monotonic()
        for name, seconds in phases:
            if self.stop.done():
                return
            await getattr(self, f"_{name}")(seconds)
        if not self.stop.done():
            self.line("EngineCore", "core.py:403",
                      f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - began:.2f} s")

    async def _wait(self, seconds: float, *, busy: bool, waiting: bool) -> None:
        """`seconds` of CPU work (busy) or of nothing, the waiting line on its schedule (waiting)."""
        end = time.monotonic() + seconds
        waited_since = time.monotonic()
        if waiting and self.wait_line_every:
            self._next_wait_line = waited_since + self.wait_line_every
        while not self.stop.done() and (now := time.monotonic()) < end:
            if waiting and self._next_wait_line is not None and now >= self._next_wait_line:
                self.line("EngineCore", "shm_broadcast.py:466", SHM_WAIT.format(n=max(1, round(now - waited_since))))
                self._next_wait_line = now + (self.wait_line_every or 0)
            if busy:
                stop_at = min(end, now + SLICE)
                while time.monotonic() < stop_at:
                    pass
                await asyncio.sleep(0)
            else:
                await asyncio.wait((self.stop,), timeout=min(SLICE * 4, max(0.0, end - now)))
        self._next_wait_line = None

    async def _boot(self, seconds: float) -> None:
        await self._wait(seconds, busy=True, waiting=False)

    async def _load(self, seconds: float) -> None:
        began = time.monotonic()
        self.line("Worker", "cpu_model_runner.py:68", f"Starting to load model {self.model}...")
        files = sorted(p for p in Path(self.model).glob("*") if p.suffix in WEIGHT_SUFFIXES) if os.path.isdir(self.model) else []
        chunks = [(p, offset) for p in files for offset in range(0, p.stat().st_size, 1 << 20)]
        per_shard = -(-len(chunks) // self.shards) if chunks else 0
        for shard in range(self.shards + 1):
            percent = round(100 * shard / self.shards)
            elapsed = time.monotonic() - began
            self.say(f"Loading safetensors checkpoint shards: {percent:3d}% Completed | {shard}/{self.shards} "
                     f"[00:{int(elapsed):02d}<00:00, {elapsed / max(shard, 1):.2f}s/it]")
            if shard == self.shards or self.stop.done():
                break
            for path, offset in chunks[shard * per_shard:(shard + 1) * per_shard]:
                with open(path, "rb") as f:  # read() calls: the tree's rchar grows by the weights
                    f.seek(offset)
                    f.read(1 << 20)
            await self._wait(seconds / self.shards - (time.monotonic() - began - seconds * shard / self.shards),
                             busy=False, waiting=False)
        if not self.stop.done():
            self.line("Worker", "default_loader.py:502", f"Loading weights took {time.monotonic() - began:.2f} seconds")

    async def _profile(self, seconds: float) -> None:
        await self._wait(seconds, busy=True, waiting=False)
        self.line("Worker", "cpu_worker.py:260", "Explicitly set (1.0/15.51) GiB for KV cache on node 0.")

    async def _compile(self, seconds: float) -> None:
        self.line("Worker", "cpu_model_runner.py:87", "Warming up model for the compilation...")
        await self._wait(seconds, busy=True, waiting=True)
        if not self.stop.done():
            self.line("Worker", "cpu_model_runner.py:91", "Warming up done.")

    async def _stall(self, seconds: float) -> None:
        await self._wait(seconds, busy=False, waiting=True)
