"""A stand-in for vLLM's prefix cache: which leading blocks of a prompt this instance has seen.

vLLM hashes a prompt's tokens in blocks of 16, each block's hash chained to the one before, and
skips the prefill of every leading block it still holds; its /metrics count the prompt tokens
looked up (vllm:prefix_cache_queries) and those found (vllm:prefix_cache_hits). Here tokens are
whitespace words, as the fake counts them everywhere; their token ids are openai_api.token_ids'.
With `events` (a list the caller drains: kv_events.py publishes them) it records what vLLM's KV
events say: BlockStored for the blocks a prompt added (hashes, the parent's hash, token ids),
BlockRemoved for the ones evicted. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict

from .openai_api import token_ids

BLOCK = 16
MASK = (1 << 64) - 1  # vLLM publishes the low 64 bits of its hashes


class PrefixCache:
    def __init__(self, capacity_blocks: int, events: list[dict] | None = None) -> None:
        self.capacity = capacity_blocks
        self.events = events
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def lookup(self, tokens: list[str]) -> int:
        """How many of `tokens` were cached (whole leading blocks); then every full block of them
        is cached, the least recently used evicted beyond the capacity."""
        hashes = []
        chained = 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            chained = hash((chained, *tokens[start:start + BLOCK])) & MASK
            hashes.append(chained)
        hits = 0
        for block in hashes:
            if block not in self._blocks:
                break
            hits += BLOCK
        blocks = self._blocks
        cached = hits // BLOCK
        if self.events is not None and cached < len(hashes):
            self.events.append({
                "type": "BlockStored", "block_hashes": hashes[cached:],
                "parent_block_hash": hashes[cached - 1] if cached else None,
                "token_ids": token_ids(" ".join(tokens[cached * BLOCK:len(hashes) * BLOCK])),
                "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": [None] * (len(hashes) - cached), "group_idx": 0,
            })
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            evicted, _ = blocks.popitem(last=False)
            if self.events is not None:
                self.events.append({"type": "BlockRemoved", "block_hashes": [evicted], "medium": "GPU", "group_idx": 0})
        return hits

    def clear(self) -> None:
        self._blocks.clear()
        if self.events is not None:
            self.events.append({"type": "AllBlocksCleared"})
