"""The fake's speed model (FAKE_VLLM_STEP_TIME): one batched engine per server, like vLLM's
scheduler, whose step time depends on where the server runs, so that `vsup tune` tests have a
layout that is known to be best.

Every running sequence waits for the next engine step and gets one token at its end; a step takes

    STEP_TIME × (1 + SEQ_COST × (batch - 1)) / min(threads, cpus, SATURATE_THREADS)
      × BUSY_PENALTY        when the OpenMP threads take every CPU of the mask (nothing left for
                            the API server / EngineCore)
      × 2 × threads / cpus  when there are more threads than CPUs (oversubscribed)
      / PRELOAD_SPEEDUP     when LD_PRELOAD is set
      / COMPILED_SPEEDUP    without --enforce-eager (torch.compile's kernels)

with threads = OMP_NUM_THREADS (else the CPU count) and cpus = the process's affinity. Sleeps, not
work: the model holds on a busy 2-core machine too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping

from .settings import Faults


def step_time(f: Faults, batch: int, threads: int, cpus: int, preload: bool, compiled: bool = False) -> float:
    useful = min(threads, cpus, f.saturate_threads or threads)
    seconds = f.step_time * (1 + f.seq_cost * max(0, batch - 1)) / max(1, useful)
    if threads >= cpus:
        seconds *= f.busy_penalty
    if threads > cpus:
        seconds *= 2 * threads / cpus
    if preload:
        seconds /= f.preload_speedup
    if compiled:
        seconds /= f.compiled_speedup
    return seconds


def placement(env: Mapping[str, str] = os.environ) -> tuple[int, int, bool]:
    """(OpenMP threads, CPUs in the affinity mask, LD_PRELOAD set) of this process."""
    cpus = len(os.sched_getaffinity(0))
    try:
        threads = int(env.get("OMP_NUM_THREADS", ""))
    except ValueError:
        threads = cpus
    return threads, cpus, bool(env.get("LD_PRELOAD", "").strip())


class BatchEngine:
    """Sequences call `token()` once per token; all waiting sequences advance together."""

    def __init__(self, faults: Faults, stop: asyncio.Future, *, compiled: bool = False) -> None:
        self.faults = faults
        self.stop = stop
        self.compiled = compiled  # started without --enforce-eager
        self.threads, self.cpus, self.preload = placement()
        self.waiting: list[asyncio.Future] = []
        self.task: asyncio.Task | None = None
        self.steps = 0

    async def token(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())
        await asyncio.wait((fut, self.stop), return_when=asyncio.FIRST_COMPLETED)

    async def _run(self) -> None:
        while self.waiting and not self.stop.done():
            seconds = step_time(self.faults, len(self.waiting), self.threads, self.cpus, self.preload, self.compiled)
            await asyncio.wait((self.stop,), timeout=seconds)
            batch, self.waiting = self.waiting, []
            self.steps += 1
            for fut in batch:
                if not fut.done():
                    fut.set_result(None)
            # let the sequences write their token and queue for the next step
            for _ in range(3):
                await asyncio.sleep(0)
