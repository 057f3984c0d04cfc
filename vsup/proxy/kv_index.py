"""Which prompt blocks each instance holds in its prefix cache, learned from vLLM's KV events (pure:
no clock, no I/O, no threads; kv_events.py feeds it, kv_aware.py reads it). docs/kv-events.md.

vLLM hashes a prompt in full blocks of `block_size` tokens, each block's hash chained to the one
before (sha256 of the pickled (parent, tokens, extra keys) by default, seeded per process unless
PYTHONHASHSEED is set), and publishes BlockStored (new hashes, the parent's hash, the blocks'
token ids), BlockRemoved (hashes) and AllBlocksCleared. Here each stored block gets a key of our
own, chained the same way over the *token ids the event carries*: so a request's keys come from
its tokens alone, whatever `--prefix-caching-hash-algo` and seed the instance runs with. vLLM's
hash is kept only to follow parents and removals.

Never claim a block the instance may have dropped: a sequence gap the caller cannot fill, a
sequence that starts again (a restarted publisher) or a batch we cannot read clears the
instance's entries. What is forgotten (the bound, a block whose parent we never saw) only costs a
miss. Blocks of KV-cache groups other than 0 (hybrid models' extra groups) are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

ROOT = hash(("vsup-kv-root",))  # the parent key of a sequence's first block
DEFAULT_CAPACITY = 65536  # blocks per instance (8M tokens at vLLM CPU's 128-token blocks)

OK, GAP, RESTARTED = "ok", "gap", "restarted"


def block_keys(tokens: Sequence[int], block_size: int, extras: Sequence[Any] = (), limit: int | None = None) -> list[int]:
    """The keys of `tokens`' full blocks (at most `limit`), chained as `InstanceIndex` keys stored
    blocks. `extras[i]` is block i's untagged extra keys as vLLM publishes them (LoRA name, cache
    salt on block 0), None or absent for none."""
    keys: list[int] = []
    parent = ROOT
    count = len(tokens) // block_size if block_size > 0 else 0
    if limit is not None:
        count = min(count, limit)
    for i in range(count):
        extra = extras[i] if i < len(extras) else None
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra))
        keys.append(parent)
    return keys


def _extra(value: Any) -> Any:
    """An event's extra keys as a hashable value (msgpack gives lists)."""
    if isinstance(value, list):
        return tuple(_extra(v) for v in value)
    return value


class InstanceIndex:
    """One instance's cached blocks, at most `capacity` (the oldest stored forgotten first)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.block_size = 0  # learned from the first BlockStored
        self.last_seq: int | None = None
        self._by_hash: dict[Any, int] = {}  # vLLM's block hash -> our key, oldest first
        self._keys: dict[int, int] = {}  # our key -> how many of vLLM's hashes stand for it
        self.cleared = 0  # times its entries were dropped (gaps, restarts, AllBlocksCleared, resets)

    def __len__(self) -> int:
        return len(self._keys)

    def reset(self) -> None:
        """Forget everything, the sequence too (the instance left the rotation: it may restart)."""
        self.clear()
        self.last_seq = None

    def clear(self) -> None:
        if self._by_hash:
            self.cleared += 1
        self._by_hash.clear()
        self._keys.clear()

    def check(self, seq: int) -> str:
        """Where batch `seq` stands: OK (the next one, or the first seen), GAP (batches missed:
        replay them or `clear`), RESTARTED (not after the last one: a new publisher)."""
        last = self.last_seq
        if last is None or seq == last + 1:
            return OK
        return GAP if seq > last + 1 else RESTARTED

    def apply(self, seq: int, events: Iterable[Any]) -> str:
        """Batch `seq` (vLLM's events decoded to plain values: dicts with a "type"), after the
        sequence check: a restart clears first; a gap clears too (the caller replays before when
        it can). A batch we cannot read clears, and counts as seen."""
        outcome = self.check(seq)
        if outcome != OK:
            self.clear()
        self.last_seq = seq
        try:
            for event in events:
                self._event(event)
        except (TypeError, ValueError, KeyError, AttributeError):
            self.clear()
        return outcome

    def _event(self, event: Any) -> None:
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            self.clear()
        elif kind == "BlockRemoved":
            if event.get("group_idx") not in (None, 0):
                return
            for block_hash in event["block_hashes"]:
                self._drop(block_hash)
        elif kind == "BlockStored":
            self._stored(event)

    def _stored(self, event: Any) -> None:
        if event.get("group_idx") not in (None, 0):
            return
        hashes = event["block_hashes"]
        tokens = event["token_ids"]
        size = int(event["block_size"])
        if size <= 0 or len(tokens) != size * len(hashes):
            return  # not whole blocks of one size: nothing we can key
        if self.block_size != size:
            if self.block_size:
                self.clear()  # a new block size: keys of the old one would never match
            self.block_size = size
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:
            parent = ROOT
        elif parent_hash in self._by_hash:
            parent = self._by_hash[parent_hash]
        else:
            return  # its parent was never seen (or forgotten): the chain cannot be keyed
        extras = event.get("extra_keys") or ()
        for i, block_hash in enumerate(hashes):
            extra = _extra(extras[i]) if i < len(extras) else None
            parent = hash((parent, tuple(tokens[i * size:(i + 1) * size]), extra))
            self._add(block_hash, parent)

    def _add(self, block_hash: Any, key: int) -> None:
        old = self._by_hash.get(block_hash)
        if old == key:
            return
        if old is not None:
            self._drop(block_hash)
        self._by_hash[block_hash] = key
        self._keys[key] = self._keys.get(key, 0) + 1
        while len(self._by_hash) > self.capacity:
            self._drop(next(iter(self._by_hash)))

    def _drop(self, block_hash: Any) -> None:
        key = self._by_hash.pop(block_hash, None)
        if key is None:
            return
        left = self._keys[key] - 1
        if left:
            self._keys[key] = left
        else:
            del self._keys[key]

    def matched(self, keys: Sequence[int]) -> int:
        """How many of `keys` (a request's, from block_keys) this instance holds, from the first on."""
        held = self._keys
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count
