"""The warm-up request: one short request an instance answers before it joins the rotation.

The first requests after a (re)start of vLLM are slow (lazy allocations, first-call paths of the
model code); `health.warmup` makes the instance pay that before a client does. The request goes
to the instance itself (never through the proxy) and fits what the model does (`warmup_kind`):

- "completion" (a generating model): `POST /v1/completions` with the configured prompt and
  `max_tokens`, greedy; the answer must hold at least one choice.
- "embedding" (`--runner pooling` / `--convert embed`, or an embedding architecture):
  `POST /v1/embeddings {model, input}`; the answer must hold an embedding.
- "score" (a classifier or reranker: `--convert classify`, `*ForSequenceClassification`):
  `POST /pooling {model, input}`. Not `/score`: vLLM 0.32 mounts that for a classifier only
  when `num_labels == 1`, while `/pooling` answers every pooling model (docs/fleet-vllm-notes.md).

Anything but a 200 with that content within the timeout is a failed warm-up, which the
lifecycle counts as a failed start.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import aiohttp

from vsup.config.schema import VsupConfig
from vsup.proxy.health import HealthResult, failure_detail

WarmupKind = Literal["completion", "embedding", "score"]
ROUTES: dict[WarmupKind, str] = {"completion": "/v1/completions", "embedding": "/v1/embeddings", "score": "/pooling"}
ROUTE = ROUTES["completion"]
EXCERPT = 160  # characters of an error answer quoted in the reason

# vLLM's spellings: --convert (0.32: embed, classify; older: reward, score), --task (before 0.11)
_CONVERT: dict[str, WarmupKind] = {"embed": "embedding", "classify": "score", "score": "score", "reward": "score"}
_TASK: dict[str, WarmupKind] = {"generate": "completion", "embed": "embedding", "embedding": "embedding",
                                "classify": "score", "score": "score", "reward": "score"}
# vLLM 0.32's architecture-name rules (vllm/config/model.py _SUFFIX_TO_DEFAULTS), first match wins
_GENERATING = ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel")
_SCORING = ("ForSequenceClassification", "ForTokenClassification", "ForAudioClassification",
            "ForImageClassification", "ForVideoClassification", "ClassificationModel",
            "RewardModel", "ForRewardModeling")  # reward models pool per token: no /v1/embeddings
_EMBEDDING = ("ForTextEncoding", "EmbeddingModel", "Model")
# registered in vLLM 0.32 (model_executor/models/registry.py) against what their name suggests
_REGISTERED: dict[str, WarmupKind] = {
    **dict.fromkeys(("ChatGLMModel", "UltravoxModel", "Qwen2_5OmniModel", "MiDashengLMModel", "MossAudioModel"),
                    "completion"),
    **dict.fromkeys(("JinaForRanking", "JinaVLForRanking", "HF_ColBERT", "ColPaliForRetrieval", "ColQwen3",
                     "ColQwen3_5", "ColModernVBertForRetrieval", "BertForMaskedLM", "Terratorch"), "score"),
}


def warmup_kind(args: Sequence[str], model_dir: str | None) -> WarmupKind:
    """What the model at `model_dir`, started with the vLLM `args`, answers: the flags decide
    when they say (`--runner`, `--convert`, `--task`); else the architectures of its config.json
    (or `--hf-overrides`), when it is a local directory; else "completion", as before."""
    flags = _flags(args)
    architectures = _overridden_architectures(flags.get("--hf-overrides"))
    if architectures is None and model_dir is not None:
        architectures = _architectures(Path(model_dir).expanduser() / "config.json")
    return kind_of(flags, architectures or [])


def kind_of(flags: dict[str, str], architectures: Sequence[str]) -> WarmupKind:
    """The pure decision of `warmup_kind`, from the last value of each flag and the architectures."""
    runner = flags.get("--runner", "auto")
    if runner in ("generate", "draft"):
        return "completion"
    if (convert := _CONVERT.get(flags.get("--convert", "auto"))) is not None:
        return convert
    if runner == "auto" and (task := _TASK.get(flags.get("--task", "auto"))) is not None:
        return task
    for arch in architectures:
        if (kind := _by_name(arch, pooling=runner == "pooling")) is not None:
            return kind
    return "embedding" if runner == "pooling" else "completion"  # vLLM's own defaults


def _by_name(arch: str, *, pooling: bool) -> WarmupKind | None:
    if arch in _REGISTERED and (pooling is False or _REGISTERED[arch] != "completion"):
        return _REGISTERED[arch]
    if arch.endswith(_GENERATING):
        return None if pooling else "completion"  # --runner pooling on a generating model: embed
    if arch.endswith(_SCORING):
        return "score"
    if arch.endswith(_EMBEDDING):
        return "embedding"
    return None


def _flags(args: Sequence[str]) -> dict[str, str]:
    """The last value of each `--flag value` / `--flag=value` in vLLM's arguments."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            out[key] = value
        elif arg.startswith("--") and i + 1 < len(args):
            out[arg] = args[i + 1]
    return out


def _overridden_architectures(text: str | None) -> list[str] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    names = value.get("architectures") if isinstance(value, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def _architectures(path: Path) -> list[str] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a hub name, or no readable config: the flags alone decide
    names = data.get("architectures") if isinstance(data, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def warmup_body(config: VsupConfig, kind: WarmupKind = "completion") -> dict[str, Any]:
    """The request body: the model by the name clients use and the prompt; for a completion
    also max_tokens, greedy."""
    warmup = config.health.warmup
    model = config.served_model_name or config.model
    if kind != "completion":
        return {"model": model, "input": warmup.prompt}
    return {"model": model, "prompt": warmup.prompt, "max_tokens": warmup.max_tokens, "temperature": 0}


async def warm_up(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], timeout: float,
                  kind: WarmupKind = "completion") -> HealthResult:
    """Send the warm-up request of `kind` to the instance at `base_url`; its outcome in a few words."""
    route = ROUTES[kind]
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{base_url}{route}", json=body, allow_redirects=False) as response:
                raw = await response.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return HealthResult(False, f"POST {route}: {failure_detail(exc, timeout)}")
    text = raw.decode("utf-8", "replace")
    if response.status != 200:
        return HealthResult(False, f"POST {route}: HTTP {response.status}: {_excerpt(text)}")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if kind == "completion":
        if not (isinstance(answer, dict) and answer.get("choices")):
            return HealthResult(False, f"POST {route}: HTTP 200 without a completion: {_excerpt(text)}")
        return HealthResult(True, f"POST {route}: HTTP 200, {body['max_tokens']} token(s) asked")
    key = "embedding" if kind == "embedding" else "data"
    size = _pooled_size(answer, key)
    if not size:
        return HealthResult(False, f"POST {route}: HTTP 200 without data[0].{key}: {_excerpt(text)}")
    return HealthResult(True, f"POST {route}: HTTP 200, {size} value(s)")


def _pooled_size(answer: object, key: str) -> int:
    """Length of the list at data[0][key] (an embedding; a pooled result, per token for token
    pooling models); 0 when there is none."""
    data = answer.get("data") if isinstance(answer, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    value = first.get(key) if isinstance(first, dict) else None
    return len(value) if isinstance(value, list) else 0


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT else f"{text[:EXCERPT - 3]}..."
