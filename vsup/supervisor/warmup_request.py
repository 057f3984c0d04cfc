"""Which warm-up request an instance gets, by its model's kind: a generating model one short
completion (warmup.py), a pooling model (`--runner pooling`, `--convert embed`) one embedding —
a pooling model has no /v1/completions, so a completion would fail every start.

The request goes to the instance itself, like the completion: `POST /v1/embeddings` with the
model's served name and the warm-up prompt as `input`; anything but a 200 with at least one
embedding within health.warmup.timeout is a failed warm-up.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from vsup.config.schema import VsupConfig
from vsup.proxy.health import HealthResult, failure_detail
from vsup.supervisor.warmup import ROUTE as COMPLETIONS
from vsup.supervisor.warmup import warmup_body

EMBEDDINGS = "/v1/embeddings"
EXCERPT = 160  # characters of an error answer quoted in the reason


def _kind(args: Sequence[str]) -> str:
    """TEMPORARY (branch i21-sup): replace with vsup.supervisor.warmup.warmup_kind(args, model_dir)
    once branch i21-vllm lands. "embedding" for a pooling model by its vLLM args, else "completion"."""
    words = [word for arg in args for word in arg.split("=", 1)]
    pooling = any(a == "--runner" and b == "pooling" for a, b in zip(words, words[1:], strict=False))
    return "embedding" if pooling or "--convert" in words else "completion"


def warmup_request(config: VsupConfig) -> tuple[str, dict[str, Any]]:
    """The route and body of `config`'s warm-up (a model's view of the file)."""
    if _kind(config.vllm.args) == "embedding":
        warmup = config.health.warmup
        return EMBEDDINGS, {"model": config.served_model_name or config.model, "input": warmup.prompt}
    return COMPLETIONS, warmup_body(config)


async def warm_up_embeddings(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any],
                             timeout: float) -> HealthResult:
    """One embedding request to the instance at `base_url`; its outcome in a few words."""
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{base_url}{EMBEDDINGS}", json=body, allow_redirects=False) as response:
                raw = await response.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return HealthResult(False, f"POST {EMBEDDINGS}: {failure_detail(exc, timeout)}")
    text = " ".join(raw.decode("utf-8", "replace").split())
    excerpt = text if len(text) <= EXCERPT else f"{text[:EXCERPT - 3]}..."
    if response.status != 200:
        return HealthResult(False, f"POST {EMBEDDINGS}: HTTP {response.status}: {excerpt}")
    try:
        data = json.loads(text).get("data")
    except (ValueError, AttributeError):
        data = None
    if not data:
        return HealthResult(False, f"POST {EMBEDDINGS}: HTTP 200 without an embedding: {excerpt}")
    return HealthResult(True, f"POST {EMBEDDINGS}: HTTP 200, {len(data)} embedding(s)")
