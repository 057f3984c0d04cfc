"""kv_aware: the instance that already holds the longest leading part of the prompt in its prefix
cache (exactly, from its KV events: kv_events.py, kv_index.py), unless it is loaded beyond the
others. docs/kv-events.md.

The request's blocks need its token ids. They come from vLLM's own `/tokenize` of a ready
instance of the model (the least loaded one), with the request's own messages, template
arguments and tools, so the tokens are the ones the instance will compute, whatever the model's
tokenizer and chat template: a few ms of wall time per request (docs/bench/kv_tokenize_bench.json),
the work done in the instance's API server, not in the proxy; a local tokenizer and chat template
would cost less wall time but the proxy's own CPU, and need transformers and every model's files
beside the proxy (docs/kv-events.md). A prompt of token ids needs no call. No
tokens (a /tokenize that fails or is slow, an image in the messages, a batch of prompts):
routed by load alone, as least_outstanding.

Against hot spots and "death spirals" (cache-aware routing piling misses onto a loaded worker):
only instances whose load after the request stays within the bound of prefix_affinity's
bounded-load hashing, ceil((1 + `affinity_load_factor`) x the mean load), are candidates (the
least loaded always is); among them the longest cached prefix wins, ties go to the less loaded. A miss
everywhere is placed by load alone. The load of an instance is prefix_affinity's: the work before
a new first token (load.work, from the probe the server hands it); `load(name, in_flight)` is the
seam that replaces it (tests, benches).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import aiohttp

from vsup.proxy import load
from vsup.proxy.address import Sessions
from vsup.proxy.affinity import within_bound
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.balancer import LeastOutstanding
from vsup.proxy.kv_events import KvEvents
from vsup.proxy.kv_index import block_keys

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT = 2.0  # s; slower than this, the request is routed by load alone
MAX_BLOCKS = 4096  # leading blocks of a prompt looked up (512k tokens at 128 a block)
# The fields of a chat request that change the tokens vLLM computes (its /tokenize takes them).
CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
               "chat_template_kwargs", "tools", "documents", "mm_processor_kwargs")


def in_flight_load(name: str, in_flight: Mapping[str, int]) -> float:
    return in_flight.get(name, 0)


class Tokens:
    """A request's token ids and the untagged extra keys of its blocks (kv_index.block_keys)."""

    __slots__ = ("ids", "extras", "_keys")

    def __init__(self, ids: list[int], extras: list[Any]) -> None:
        self.ids, self.extras = ids, extras
        self._keys: dict[int, list[int]] = {}  # block size -> keys

    def keys(self, block_size: int) -> list[int]:
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = block_keys(self.ids, block_size, self.extras, MAX_BLOCKS)
        return keys


def tokenize_body(document: dict | None) -> dict | list[int] | None:
    """What to ask /tokenize for this request's prompt (or the prompt's token ids themselves);
    None when its blocks cannot be known (no prompt, several prompts, images)."""
    if document is None:
        return None
    model = document.get("model")
    messages = document.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return None  # multimodal parts add extra keys the proxy cannot compute
        body = {k: document[k] for k in CHAT_FIELDS if k in document}
    else:
        prompt = document.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        body = {"prompt": prompt}
        if "add_special_tokens" in document:
            body["add_special_tokens"] = document["add_special_tokens"]
    if isinstance(model, str):
        body["model"] = model
    return body


class KvAware(LeastOutstanding):
    name = "kv_aware"
    uses_load = True  # the server hands it a load.LoadProbe (`probe`): the bound's prefill work

    def __init__(self, load_factor: float = 0.25, events: KvEvents | None = None) -> None:
        super().__init__()
        self.load_factor = load_factor
        self.events = events or KvEvents()
        self.load: Callable[[str, Mapping[str, int]], float] = in_flight_load
        self.decisions = {"hit": 0, "miss": 0, "escaped": 0, "no_tokens": 0}
        self.hit_blocks = 0  # blocks the chosen instances held (a running sum: /metrics, the bench)
        self._sessions: Sessions | None = None
        self._model: str | None = None
        self.probe: load.LoadProbe | None = None

    # -- lifecycle: which instances to follow, and when to forget what they held
    def attach(self, pool: BackendPool, model: str | None = None) -> None:
        """Follow `pool`'s instances (only those of `model` when given) from now on: their events
        from the start, before the first request."""
        self._model = model
        pool.subscribe(self._changed)
        for backend in pool.all():
            self._changed(backend, pool.state(backend.name), pool.is_ready(backend.name))

    def _changed(self, backend: Backend, state: str, ready: bool) -> None:
        if not backend.kv_events or (self._model is not None and backend.model != self._model):
            return
        if state == "removed":
            self.events.forget(backend.name)
        elif ready:
            self.events.watch(backend.name, backend.kv_events)
        else:  # out of the rotation: it may be restarting, with an empty cache
            self.events.reset(backend.name)

    def close(self) -> None:
        """Stop following the instances (a reload replaced this balancer); its /tokenize
        sessions close with it, in the background."""
        self.events.close()
        if self._sessions is not None:
            sessions, self._sessions = self._sessions, None
            try:
                asyncio.get_running_loop().create_task(sessions.close())
            except RuntimeError:
                pass  # no loop any more: the sessions go with it

    async def aclose(self) -> None:
        """The proxy stops."""
        self.events.close()
        if self._sessions is not None:
            sessions, self._sessions = self._sessions, None
            await sessions.close()

    # -- per request
    def key(self, document: dict | None, headers: Mapping[str, str]) -> Any:
        """(what to tokenize, the request's cache_salt) or None."""
        body = tokenize_body(document)
        if body is None:
            return None
        salt = document.get("cache_salt") if document is not None else None
        return body, (salt if isinstance(salt, str) and salt else None)

    async def prepare(self, key: Any, ready: tuple[Backend, ...], in_flight: Mapping[str, int]) -> Tokens | None:
        """The request's tokens (forward.py awaits this before choose())."""
        if key is None:
            return None
        body, salt = key
        extras = [(salt,)] if salt else []  # vLLM's extra keys: the salt on the first block
        if isinstance(body, list):
            return Tokens(body, extras)
        if not any(b.kv_events for b in ready):
            return None  # no instance publishes its blocks (a standalone proxy's upstreams): no call
        target = min(ready, key=lambda b: self.load(b.name, in_flight))
        if self._sessions is None:
            self._sessions = Sessions(timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT), trust_env=False,
                                      cookie_jar=aiohttp.DummyCookieJar())
        session, base = self._sessions.get(target.url)
        try:
            async with session.post(base + "/tokenize", json=body) as response:
                if response.status != 200:
                    return None
                answer = await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        ids = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(ids, list):
            return None
        return Tokens(ids, extras)

    def works(self, names: list[str], in_flight: Mapping[str, int], size: int) -> dict[str, float]:
        """The bound's load: each instance's work before this request's first token (load.work)."""
        return load.probed_works(self.probe, names, in_flight, size)

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = (), key: Any = None,
               size: int = 0) -> Backend | None:
        candidates = list(self._candidates(ready, tried))  # rotated: ties spread
        if not candidates:
            return None
        if self.load is in_flight_load:
            exact = self.works([b.name for b in candidates], in_flight, size)
            work = {n: float(math.floor(v + 1e-9)) for n, v in exact.items()}  # the bound counts whole requests
        else:  # a load seam given (tests, a bench): its figures
            exact = work = {b.name: self.load(b.name, in_flight) for b in candidates}
        least = min(candidates, key=lambda b: exact[b.name])
        if not isinstance(key, Tokens):
            self.decisions["no_tokens"] += 1
            return least
        events = self.events
        held = {}
        for b in candidates:
            size = events.block_size(b.name)
            held[b.name] = events.matched(b.name, key.keys(size)) if size else 0
        # the bounded-load rule (affinity.py): no instance above ceil((1 + ε) x the mean), this request counted
        total = sum(work.values())
        eligible = [b for b in candidates if within_bound(work[b.name], total, 1.0, float(len(candidates)), self.load_factor)] or [least]
        best = max(eligible, key=lambda b: (held[b.name], -work[b.name]))  # max keeps the first of equals
        top = max(held.values())
        if top > held[best.name]:
            self.decisions["escaped"] += 1  # the instance holding more is too loaded
        elif top == 0:
            self.decisions["miss"] += 1
            return least
        else:
            self.decisions["hit"] += 1
        self.hit_blocks += held[best.name]
        return best
