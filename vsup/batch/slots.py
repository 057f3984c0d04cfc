"""How many requests one instance of a model runs at once, for the batch lines' share
(batch.slots_per_instance; pure): a number as written; auto: the model's admission limit
(proxy.max_in_flight_per_instance), else the --max-num-seqs of its vllm.args, else vLLM's CPU
default."""

from __future__ import annotations

from vsup.config.admission import flag_int, instance_limit
from vsup.config.schema import BatchConfig, VsupConfig

# vLLM's --max-num-seqs on a CPU API server when its args set none (its CPU platform's default, vLLM 0.30-0.32).
CPU_DEFAULT_SLOTS = 128


def slots_of(view: VsupConfig, batch: BatchConfig) -> int:
    """One model's (a single-model view: vsup/config/fleet.py) slots per instance."""
    if isinstance(batch.slots_per_instance, int):
        return batch.slots_per_instance
    limit = instance_limit(view)
    if limit:
        return limit
    seqs = flag_int(view.vllm.args)
    return seqs if seqs is not None and seqs > 0 else CPU_DEFAULT_SLOTS
