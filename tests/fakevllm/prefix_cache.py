"""A stand-in for vLLM's prefix cache: which leading blocks of a prompt this instance has seen.

vLLM hashes a prompt's tokens in blocks of 16, each block's hash chained to the one before, and
skips the prefill of every leading block it still holds; its /metrics count the prompt tokens
looked up (vllm:prefix_cache_queries) and those found (vllm:prefix_cache_hits). Here tokens are
whitespace words, as the fake counts them everywhere. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 16


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def lookup(self, tokens: list[str]) -> int:
        """How many of `tokens` were cached (whole leading blocks); then every full block of them
        is cached, the least recently used evicted beyond the capacity."""
        hashes = []
        chained = 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            chained = hash((chained, *tokens[start:start + BLOCK]))
            hashes.append(chained)
        hits = 0
        for block in hashes:
            if block not in self._blocks:
                break
            hits += BLOCK
        blocks = self._blocks
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return hits
