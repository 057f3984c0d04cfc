"""The warm-up request: one short completion an instance answers before it joins the rotation.

The first requests after a (re)start of vLLM are slow (lazy allocations, first-call paths of the
model code); `health.warmup` makes the instance pay that before a client does. The request goes
to the instance itself (never through the proxy): `POST /v1/completions` with the configured
prompt and `max_tokens`, greedy. Anything but a 200 with at least one choice within the timeout
is a failed warm-up, which the lifecycle counts as a failed start.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from vsup.config.schema import VsupConfig
from vsup.proxy.health import HealthResult, failure_detail

ROUTE = "/v1/completions"
EXCERPT = 160  # characters of an error answer quoted in the reason


def warmup_body(config: VsupConfig) -> dict[str, Any]:
    """The request body: the model by the name clients use, the prompt, max_tokens, greedy."""
    warmup = config.health.warmup
    return {"model": config.served_model_name or config.model, "prompt": warmup.prompt,
            "max_tokens": warmup.max_tokens, "temperature": 0}


async def warm_up(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], timeout: float) -> HealthResult:
    """Send the warm-up request to the instance at `base_url`; its outcome in a few words."""
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{base_url}{ROUTE}", json=body, allow_redirects=False) as response:
                raw = await response.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return HealthResult(False, f"POST {ROUTE}: {failure_detail(exc, timeout)}")
    text = raw.decode("utf-8", "replace")
    if response.status != 200:
        return HealthResult(False, f"POST {ROUTE}: HTTP {response.status}: {_excerpt(text)}")
    try:
        choices = json.loads(text).get("choices")
    except (ValueError, AttributeError):
        choices = None
    if not choices:
        return HealthResult(False, f"POST {ROUTE}: HTTP 200 without a completion: {_excerpt(text)}")
    return HealthResult(True, f"POST {ROUTE}: HTTP 200, {body['max_tokens']} token(s) asked")


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT else f"{text[:EXCERPT - 3]}..."
