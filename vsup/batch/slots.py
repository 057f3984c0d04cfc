"""How many requests one instance of a model runs at once, for the batch lines' share
(batch.slots_per_instance; pure): a number as written; auto: the model's admission limit
(proxy.max_in_flight_per_instance), else the --max-num-seqs of its vllm.args, else vLLM's CPU
default — for a pooling model (embeddings, classification, scores) without an admission limit,
twice that: its engine answers a request in one step, so a line queued in vLLM behind the running
ones waits one step (not a whole generation, as a chat line would make a chat wait), and that
queue is what keeps the engine from idling between a step's end and the next lines' arrival."""

from __future__ import annotations

from vsup.config.admission import flag_int, instance_limit
from vsup.config.schema import BatchConfig, VsupConfig

# vLLM's --max-num-seqs on a CPU API server when its args set none (its CPU platform's default, vLLM 0.30-0.32).
CPU_DEFAULT_SLOTS = 128
# auto for a pooling model without an admission limit: its running slots and as many queued in vLLM
POOLING_QUEUE = 2


def slots_of(view: VsupConfig, batch: BatchConfig, pooling: bool = False) -> int:
    """One model's (a single-model view: vsup/config/fleet.py) slots per instance; `pooling`: it
    answers pooling requests (the caller knows: vsup/supervisor/warmup.py's warmup_kind)."""
    if isinstance(batch.slots_per_instance, int):
        return batch.slots_per_instance
    limit = instance_limit(view)
    if limit:  # the proxy admits no more than this at once: a queue in vLLM would block interactive requests
        return limit
    seqs = flag_int(view.vllm.args)
    running = seqs if seqs is not None and seqs > 0 else CPU_DEFAULT_SLOTS
    return running * POOLING_QUEUE if pooling else running
