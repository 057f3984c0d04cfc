"""How close to the machine's limit: decode against the memory bandwidth per NUMA node.

Decode on CPU is bound by memory bandwidth: every step streams the weights (and the KV cache of
the running sequences) once. vsup.observe.bandwidth measures each node's sustainable bandwidth
(a pinned STREAM-like triad); `decode_roofline` sets a candidate's figures against it:

    steps/s (all instances)  = instances / mean ITL            (each stream gets a token per step)
    sequences per step       = tokens/s × mean ITL / instances
    bytes per step           = weights + KV bytes/token × sequences × mean context length
    % of the limit           = steps/s × bytes per step / Σ bandwidth of the nodes used
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vsup.topology.plan_model import Plan

if TYPE_CHECKING:  # numpy (through metrics) loads only where the load is measured, not in `vsup doctor`
    from vsup.tune.metrics import LevelMetrics

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "bf16": 2, "fp16": 2, "fp32": 4,
               "float64": 8, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelFacts:
    weights_bytes: int | None  # per instance, in memory
    kv_bytes_per_token: int | None  # K and V of every layer; None: unknown (not counted)


def model_facts(model: str, weights_on_disk: int | None, vllm_args: Sequence[str]) -> ModelFacts:
    """From a local model's config.json: KV bytes per token, and the weights at the dtype vLLM runs."""
    config_path = Path(model).expanduser() / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return ModelFacts(weights_on_disk, None)
    text = cfg.get("text_config", cfg)
    stored = DTYPE_BYTES.get(str(text.get("torch_dtype") or cfg.get("torch_dtype") or "").replace("torch.", ""), None)
    run = stored
    for i, arg in enumerate(vllm_args):
        value = vllm_args[i + 1] if arg == "--dtype" and i + 1 < len(vllm_args) else arg.split("=", 1)[1] if arg.startswith("--dtype=") else None
        if value is not None and value in DTYPE_BYTES:
            run = DTYPE_BYTES[value]
    weights = weights_on_disk
    if weights is not None and stored and run and stored != run:
        weights = weights * run // stored
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return ModelFacts(weights, None)
    return ModelFacts(weights, 2 * layers * kv_heads * head_dim * (run or 2))


@dataclass(frozen=True)
class Roofline:
    level: str
    steps_per_s: float  # all instances together
    bytes_per_step: float  # per instance
    achieved: float  # bytes/s
    limit: float  # bytes/s of the nodes used
    kv_counted: bool

    @property
    def fraction(self) -> float:
        return self.achieved / self.limit if self.limit > 0 else float("nan")

    def to_json(self) -> dict:
        return {"level": self.level, "steps_per_s": round(self.steps_per_s, 3), "bytes_per_step": round(self.bytes_per_step),
                "achieved_gbs": round(self.achieved / 1e9, 3), "limit_gbs": round(self.limit / 1e9, 3),
                "fraction": round(self.fraction, 4) if math.isfinite(self.fraction) else None, "kv_counted": self.kv_counted}


def decode_roofline(plan: Plan, levels: Sequence[LevelMetrics], bandwidth: Mapping[int, float], facts: ModelFacts) -> Roofline | None:
    """Against the level with the most tokens/s; None when it cannot be said (no ITL, no weights size)."""
    usable = [lv for lv in levels if lv.completed and lv.get("itl", "mean") > 0]
    if not usable or not facts.weights_bytes:
        return None
    lv = max(usable, key=lambda x: x.output_throughput)
    n = len(plan.instances)
    itl = lv.get("itl", "mean")
    steps = n / itl
    batch = lv.output_throughput * itl / n
    context = (lv.input_tokens + lv.output_tokens / 2) / lv.completed
    per_step = facts.weights_bytes + (facts.kv_bytes_per_token or 0) * batch * context
    nodes = {node for inst in plan.instances for node in (inst.nodes or (-1,))}
    limit = sum(bandwidth.get(node, 0.0) for node in nodes) or sum(bandwidth.values())
    return Roofline(lv.level, steps, per_step, steps * per_step, limit, facts.kv_bytes_per_token is not None)
