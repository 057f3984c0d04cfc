"""The requests `vsup tune` sends: from a JSONL file, or synthetic prompts of a given token length.

A file holds one object per line: {"prompt": "...", "max_tokens": N} (sent to /v1/completions) or
{"messages": [{"role": "user", "content": "..."}], "max_tokens": N} (/v1/chat/completions).
Synthetic prompts are random words, different for every prompt (vLLM's prefix cache would
otherwise answer the prefill), sized to the target with the server's own /tokenize, so vsup needs
no tokenizer of its own.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vsup.errors import VsupError

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact model server memory core thread cache node token layer "
          "batch stream request answer question system program river mountain ocean forest garden window table "
          "music picture letter minute morning evening summer winter market village station engine bridge").split()


@dataclass(frozen=True)
class WorkItem:
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int = 64

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "stream": True, "temperature": 0,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if self.messages is not None:
            body["messages"] = list(self.messages)
        else:
            body["prompt"] = self.prompt
        return body


def load_jsonl(path: str | Path, origin: str = "--workload") -> list[WorkItem]:
    """Every line an item; a bad line is a VsupError naming the file, the line and what would work."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise VsupError(f"{origin} {path}: cannot read it: {exc.strerror or exc}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{origin} {path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise VsupError(f"{where}: not JSON ({exc.msg})") from None
        items.append(_item(data, where))
    if not items:
        raise VsupError(f"{origin} {path}: no requests in it; one JSON object per line, e.g. "
                        '{"prompt": "Hello", "max_tokens": 64}')
    return items


def _item(data: Any, where: str) -> WorkItem:
    if not isinstance(data, dict):
        raise VsupError(f"{where}: expected an object with \"prompt\" or \"messages\" and \"max_tokens\"")
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise VsupError(f"{where}: max_tokens: {max_tokens!r} is not a whole number of at least 1")
    if isinstance(data.get("prompt"), str) and data["prompt"]:
        return WorkItem(prompt=data["prompt"], max_tokens=max_tokens)
    messages = data.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return WorkItem(messages=tuple(messages), max_tokens=max_tokens)
    raise VsupError(f"{where}: needs \"prompt\" (a non-empty string) or \"messages\" (a list of {{\"role\", \"content\"}})")


def random_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"{seed}: " + " ".join(rng.choice(_WORDS) for _ in range(max(0, words - 1)))


async def synthetic(count: int, input_len: int, output_len: int, tokenize: Callable[[str], Awaitable[int]]) -> list[WorkItem]:
    """`count` distinct prompts of `input_len` tokens each as the server counts them."""
    items = []
    ratio = 1.0  # words per token, learnt from the first prompt
    for seed in range(count):
        words = max(1, round(input_len * ratio))
        best: tuple[int, str] | None = None
        for _ in range(6):
            text = random_text(seed, words)
            tokens = await tokenize(text)
            if best is None or abs(tokens - input_len) < abs(best[0] - input_len):
                best = (tokens, text)
            if tokens == input_len or tokens <= 0:
                break
            ratio = words / tokens
            step = round((input_len - tokens) * ratio) or (1 if tokens < input_len else -1)
            words = max(1, words + step)
        assert best is not None  # the loop above ran at least once
        items.append(WorkItem(prompt=best[1], max_tokens=output_len))
    return items
