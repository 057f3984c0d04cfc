"""kv_index: one instance's cached blocks from vLLM's KV events (the event shapes are those vLLM
0.32 published in docs/kv-events/*.jsonl), the request side's keys, and the rules that keep the
index from claiming blocks an instance may have dropped: gaps, restarts, AllBlocksCleared,
unreadable batches, the bound."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vsup.proxy.kv_index import GAP, OK, RESTARTED, InstanceIndex, block_keys

BS = 4
EVIDENCE = Path(__file__).resolve().parents[1] / "docs" / "kv-events"


def stored(hashes, tokens, parent=None, size=BS, extra=None):
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "token_ids": list(tokens),
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": extra if extra is not None else [None] * len(hashes), "group_idx": 0}


def removed(*hashes):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", "group_idx": 0}


PROMPT = list(range(100, 112))  # three blocks of 4


def filled() -> InstanceIndex:
    index = InstanceIndex()
    assert index.apply(0, [stored([11, 12], PROMPT[:8])]) == OK
    assert index.apply(1, [stored([13], PROMPT[8:12], parent=12)]) == OK  # a later event, chained by its parent
    return index


def test_stored_blocks_chain_across_events_and_match_the_request_side():
    index = filled()
    assert index.matched(block_keys(PROMPT, BS)) == 3
    assert index.matched(block_keys(PROMPT[:8] + [0, 0, 0, 0], BS)) == 2  # diverges in the third block
    assert index.matched(block_keys([1] + PROMPT[1:], BS)) == 0  # the first block differs: nothing
    assert index.block_size == BS


def test_removed_blocks_are_no_longer_claimed():
    index = filled()
    index.apply(2, [removed(13)])
    assert index.matched(block_keys(PROMPT, BS)) == 2
    index.apply(3, [removed(12), removed(11)])
    assert index.matched(block_keys(PROMPT, BS)) == 0 and len(index) == 0


def test_all_blocks_cleared():
    index = filled()
    index.apply(2, [{"type": "AllBlocksCleared"}, stored([21], [7, 7, 7, 7])])
    assert index.matched(block_keys(PROMPT, BS)) == 0
    assert index.matched(block_keys([7, 7, 7, 7], BS)) == 1  # what came after the clear, in the same batch


def test_a_gap_clears_the_index():
    index = filled()
    assert index.check(5) == GAP
    assert index.apply(5, [stored([31], [9, 9, 9, 9])]) == GAP  # batches 2-4 (a removal maybe) are lost
    assert index.matched(block_keys(PROMPT, BS)) == 0
    assert index.matched(block_keys([9, 9, 9, 9], BS)) == 1 and index.last_seq == 5
    assert index.cleared == 1


def test_a_sequence_that_starts_again_is_a_restarted_publisher():
    index = filled()
    assert index.apply(0, [stored([41], [5, 5, 5, 5])]) == RESTARTED
    assert index.matched(block_keys(PROMPT, BS)) == 0
    assert index.matched(block_keys([5, 5, 5, 5], BS)) == 1


def test_reset_forgets_the_sequence_too():
    index = filled()
    index.reset()
    assert len(index) == 0 and index.last_seq is None
    assert index.apply(7, [stored([51], PROMPT[:4])]) == OK  # the first batch seen of a new process
    assert index.matched(block_keys(PROMPT, BS)) == 1


def test_an_unreadable_batch_clears_and_counts_as_seen():
    index = filled()
    index.apply(2, [{"type": "BlockStored", "block_hashes": "nonsense"}])
    assert len(index) == 0 and index.last_seq == 2


def test_a_block_whose_parent_was_never_seen_is_not_claimed():
    index = InstanceIndex()
    index.apply(0, [stored([61], PROMPT[4:8], parent=999)])
    assert len(index) == 0
    assert index.matched(block_keys(PROMPT, BS)) == 0


def test_blocks_not_whole_or_of_another_group_are_left_out():
    index = InstanceIndex()
    index.apply(0, [stored([71, 72], PROMPT[:6])])  # 6 tokens for two blocks of 4
    other = stored([73], PROMPT[:4])
    other["group_idx"] = 1
    index.apply(1, [other])
    assert len(index) == 0


def test_extra_keys_take_part_in_the_key():
    index = InstanceIndex()
    index.apply(0, [stored([81], PROMPT[:4], extra=[["salt-a"]])])
    assert index.matched(block_keys(PROMPT, BS)) == 0  # the same tokens without the salt
    assert index.matched(block_keys(PROMPT, BS, [("salt-a",)])) == 1


def test_the_bound_forgets_the_oldest_blocks_first():
    index = InstanceIndex(capacity=3)
    for seq in range(5):
        index.apply(seq, [stored([1000 + seq], [seq] * BS)])
    assert len(index) == 3
    assert index.matched(block_keys([0] * BS, BS)) == 0 and index.matched(block_keys([1] * BS, BS)) == 0
    assert all(index.matched(block_keys([s] * BS, BS)) == 1 for s in (2, 3, 4))


def test_a_new_block_size_starts_afresh():
    index = filled()
    index.apply(2, [stored([91], list(range(8)), size=8)])
    assert index.matched(block_keys(PROMPT, BS)) == 0 and index.block_size == 8


@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 7)), max_size=60),
       st.integers(1, 6))
def test_never_claims_a_block_the_instance_does_not_hold(ops, capacity):
    """Against a model of the instance's cache (a set of prompt prefixes): whatever it stores,
    evicts and clears, every key the index claims is a block the model holds."""
    index = InstanceIndex(capacity=capacity)
    held: dict[int, tuple[int, ...]] = {}  # vLLM hash -> the tokens of the prefix up to that block
    prompts = {n: [n] * BS + [n + 1] * BS for n in range(8)}
    for seq, (op, n) in enumerate(ops):
        tokens = prompts[n]
        if op == "store":
            index.apply(seq, [stored([n * 10, n * 10 + 1], tokens)])
            held[n * 10], held[n * 10 + 1] = tuple(tokens[:BS]), tuple(tokens)
        elif op == "remove":
            index.apply(seq, [removed(n * 10 + 1)])
            held.pop(n * 10 + 1, None)
        else:
            index.apply(seq, [{"type": "AllBlocksCleared"}])
            held.clear()
        for m, prompt in prompts.items():
            claimed = index.matched(block_keys(prompt, BS))
            really = 2 if m * 10 + 1 in held and m * 10 in held else (1 if m * 10 in held else 0)
            assert claimed <= really


def test_the_evidence_vllm_published_is_indexed_as_the_tokens_say():
    """The batches vLLM 0.32 published in docs/kv-events.md's runs, through the index: the blocks
    of a prompt are found from its /tokenize token ids (kept in the same folder)."""
    index = InstanceIndex()
    for line in (EVIDENCE / "run1-parent-and-chat.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("via") == "replay" and "batch" in record:
            index.apply(record["seq"], record["batch"][1])
    tokens = json.loads((EVIDENCE / "tokenize-completion.json").read_text())["tokens"]
    assert index.block_size == 128
    assert index.matched(block_keys(tokens, 128)) == 5  # 669 tokens: five full blocks cached
    chat = json.loads((EVIDENCE / "tokenize-chat.json").read_text())["tokens"]
    assert index.matched(block_keys(chat, 128)) == 5
