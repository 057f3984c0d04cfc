"""prefix_affinity: requests that share a prefix go to the instance that already holds it.

vLLM's prefix cache (on by default) skips the prefill of every leading KV block (128 tokens on its
CPU backend, 16 on GPUs) that an instance has computed before, but only on that instance; on CPU
that prefill is most of a long prompt's time to first token. This policy picks the instance from what a request starts with, so
requests that share a system prompt, a document or a conversation's opening meet the same cache:

  key       an explicit session first: the X-Session-ID header, else the body's OpenAI `user`;
            otherwise the request's prefix (`prefix_text`): for chat, the leading messages up to
            and including the first user message, for completions the prompt, at most
            `prefix_chars` characters, with the model name. No key (not a JSON object, no
            messages or prompt): the least loaded instance, as least_loaded.
  instance  a key the proxy has placed goes back to the instance it placed it on: that
            instance's cache holds its prefix. A key new to the proxy (or one whose instance left
            the ready set, or failed this request) is cached nowhere, so any instance costs the
            same prefill: the least loaded takes it and keeps it (placed, an LRU of PLACED_MAX
            keys). Ties go to the key's best rendezvous (highest random weight) score: each
            instance scores a hash of (key, instance name), so at rest, and for proxies that
            restart or run side by side, placement is rendezvous hashing. An instance that leaves
            moves only its own keys (placed again by load); one that joins takes new keys only,
            nothing that is cached elsewhere. With weights (a front proxy over vsups) the score is
            -weight / ln(u), u the hash mapped to (0, 1), and the load is per unit of weight.
  bound     bounded-load consistent hashing (Mirrokni, Thorup & Zadimoghaddam 2018): an instance
            takes the request only while its load after it stays within
            ceil((1 + load_factor) * mean load) (the mean with this request counted; per unit of
            weight: its share of the total), the load being the work before this request's
            first token in whole units of its own prefill (load.work: the prompt tokens of the
            proxy's requests there still without a first byte, other clients' waiting requests
            from the engine's aged sample, decoding streams half a prefill each), so a session stays
            beside streams in decode and moves from a queue of prefill.
            Otherwise the key's best-scored instance within its bound takes it (the key stays
            placed where it was), so a hot key's overflow keeps going to the same second
            instance (whose cache then holds it too) and different keys overflow to different
            instances, not all onto one neighbour. Some instance is always within its bound (were
            every one over, the loads would sum to more than they do).
  hot key   the bound alone lets one instance hold every stream of a prompt that fronts many
            requests (a shared system prompt): in decode they weigh little, yet another instance
            idles beside them. So once a key has HOT_IN_FLIGHT requests in flight at its instance,
            the next goes to an instance with fewer in flight than that one would then have (the
            one that took the key's overflow before, whose cache holds it too): `spread`.

Why a bounded prefix of characters, not tokens or a radix tree (docs/proxy.md compares vllm-router
and SGLang): the proxy has no tokenizer, and it keeps one small entry per key, not a tree of texts. Requests that agree on
their first `prefix_chars` characters (2048 by default, roughly 400-600 tokens: 3-4 of the CPU
backend's 128-token blocks) share an instance; a prefix shared for less than that (a one-line
system prompt) saves little prefill (nothing under one block) and must not pull every
conversation onto one instance: the distinct rest of the key spreads them. The first user message is part of a chat key because it stays the
same for every later turn of that conversation, whose whole history is then cached where it went.

Cheap on purpose: the forwarder has parsed the body already (it validates every JSON body), so
the key costs a few dict lookups, a bounded string join and one 8-byte BLAKE2b (stable across
processes and restarts, unlike hash(): two front proxies, or a restarted one, route alike at rest), one lookup in the placement table; each candidate then costs one 64-bit mix.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Mapping
from hashlib import blake2b
from typing import NamedTuple

from vsup.proxy.backends import Backend
from vsup.proxy.balancer import LeastLoaded

SESSION_HEADER = "X-Session-ID"
# A token id stands for about four characters of text (the key of a prompt given as token ids).
CHARS_PER_TOKEN = 4

# Keys the proxy remembers the instance of (per balancer: per model), least recently used out first:
# about 125 bytes each, so at most ~4 MB; far more prefixes than CPU instances cache (a few dozen
# long prompts each). A key that falls out is placed again as if new: one extra prefill at most.
PLACED_MAX = 32768
# A key with this many requests in flight at its instance is hot: the next one may spread (above).
# Two, not more: a session asks one question at a time, so only a prompt many clients share gets here.
HOT_IN_FLIGHT = 2

_MASK = (1 << 64) - 1
_SEPARATOR = "\x1e"  # between messages; role and text are joined by \x1f, content parts by \x1d


class Key(NamedTuple):
    digest: int  # 64-bit hash of the key
    kind: str  # "session" or "affinity": the decision counted when the key's winner is taken


def _digest(text: str) -> int:
    # surrogatepass: JSON may carry lone surrogates ("\\ud800"), which plain UTF-8 refuses
    return int.from_bytes(blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _content_text(content: object, budget: int) -> str:
    """A message's content as text: a string, or the parts of a list (text parts' text, an image
    or audio part's URL or data: their first characters tell two images apart), up to `budget`."""
    if isinstance(content, str):
        return content[:budget]
    if not isinstance(content, list):
        return ""
    pieces: list[str] = []
    size = 0
    for part in content:
        if size >= budget:
            break
        if isinstance(part, str):
            piece = part
        elif isinstance(part, dict):
            piece = _part_text(part)
        else:
            continue
        piece = piece[: budget - size]
        pieces.append(piece)
        size += len(piece) + 1
    return "\x1d".join(pieces)


def _part_text(part: dict) -> str:
    text = part.get("text")
    if isinstance(text, str):
        return text
    kind = part.get("type")
    kind = kind if isinstance(kind, str) else ""
    payload = part.get(kind) if kind else None  # {"type": "image_url", "image_url": {"url": ...}}
    if isinstance(payload, dict):
        payload = payload.get("url", payload.get("data", payload.get("file_data")))
    return kind + ":" + payload if isinstance(payload, str) else kind


def _messages_text(messages: list, limit: int) -> str:
    """The leading messages up to and including the first user message, as role + text, at most
    `limit` characters."""
    pieces: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            break
        role = message.get("role")
        role = role if isinstance(role, str) else ""
        piece = role + "\x1f" + _content_text(message.get("content"), limit - size) + _SEPARATOR
        pieces.append(piece)
        size += len(piece)
        if role == "user" or size >= limit:
            break
    return "".join(pieces)[:limit]


def _prompt_text(prompt: object, limit: int) -> str:
    """A completion prompt's first `limit` characters: a string, the first of a batch of strings,
    or token ids (limit / CHARS_PER_TOKEN of them, the first list of a batch)."""
    if isinstance(prompt, str):
        return prompt[:limit]
    if not isinstance(prompt, list) or not prompt:
        return ""
    first = prompt[0]
    if isinstance(first, str):
        return first[:limit]
    tokens = first if isinstance(first, list) else prompt
    ids = tokens[: max(1, limit // CHARS_PER_TOKEN)]
    if not all(type(t) is int for t in ids):
        return ""
    return "\x1ftokens:" + ",".join(map(str, ids))


def prefix_text(document: Mapping, limit: int) -> str:
    """What a request starts with, at most `limit` characters ("" when it has no prompt): chat
    `messages`, completion `prompt`, or the Responses API's `instructions` and `input`."""
    messages = document.get("messages")
    if isinstance(messages, list):
        return _messages_text(messages, limit)
    prompt = document.get("prompt")
    if prompt is not None:
        return _prompt_text(prompt, limit)
    instructions = document.get("instructions")
    text = instructions[:limit] + _SEPARATOR if isinstance(instructions, str) and instructions else ""
    given = document.get("input")
    if isinstance(given, str):
        text += given
    elif isinstance(given, list) and len(text) < limit:
        text += _messages_text(given, limit - len(text)) if given and isinstance(given[0], dict) else _prompt_text(given, limit - len(text))
    return text[:limit]


def routing_key(document: object, headers: Mapping[str, str] | None, prefix_chars: int) -> Key | None:
    """A request's routing key: its session (header, then `user`), else its prefix; None when it
    has neither."""
    session = headers.get(SESSION_HEADER) if headers is not None else None
    if session:
        return Key(_digest("session\x00" + session), "session")
    if not isinstance(document, dict):
        return None
    user = document.get("user")
    if isinstance(user, str) and user:
        return Key(_digest("user\x00" + user), "session")
    text = prefix_text(document, prefix_chars)
    if not text:
        return None
    model = document.get("model")
    return Key(_digest((model if isinstance(model, str) else "") + "\x00" + text), "affinity")


def within_bound(load: float, total: float, weight: float, weights: float, factor: float) -> bool:
    """Whether an instance of `load` may take one more request: its load after it stays within
    ceil((1 + factor) * (total + 1) * weight / weights), total being every candidate's load and
    weights their weights' sum (all 1: the mean load with this request counted)."""
    bound = math.ceil((1.0 + factor) * (total + 1.0) * weight / weights - 1e-9)  # 1e-9: 2.5000000001 is 2.5
    return load + 1.0 <= bound + 1e-9


class PrefixAffinity(LeastLoaded):
    """A key the proxy has placed goes back to its instance while that one is within its bounded
    load (else to the key's best-scored instance within it); a key new to the proxy, or whose
    instance is gone, goes to the least loaded instance (ties: the key's best-scored) and is
    remembered there; no key: the least loaded (LeastLoaded, whose weights, rotation and load
    source this shares)."""

    name = "prefix_affinity"

    def __init__(self, prefix_chars: int = 2048, load_factor: float = 0.25, placed_max: int = PLACED_MAX) -> None:
        super().__init__()
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self._seeds: dict[str, int] = {}  # instance name -> its 64-bit hash (names are few and stable)
        self._placed: OrderedDict[int, str] = OrderedDict()  # key digest -> instance, least recent first
        self._placed_max = placed_max
        self._sizes: dict[int, int] = {}  # key digest -> body bytes of its last request on its instance
        self._prefill = 0  # prefill_bytes() of the request just chosen for
        self._digest: int | None = None  # the key of the request just chosen for (hold() counts it)
        self._flights: dict[tuple[str, int], int] = {}  # (instance, key digest) -> its requests in flight there
        self._spread: dict[int, str] = {}  # a hot key's digest -> the instance that took its overflow last
        self.hot_in_flight = HOT_IN_FLIGHT

    def key(self, document: dict | None, headers: Mapping[str, str] | None) -> Key | None:
        return routing_key(document, headers, self.prefix_chars)

    def placed(self, key: Key) -> str | None:
        """The instance `key` was placed on, if the proxy still remembers it."""
        return self._placed.get(key.digest)

    def _seed(self, name: str) -> int:
        seed = self._seeds[name] = _digest("instance\x00" + name)
        return seed

    def _place(self, digest: int, name: str) -> None:
        placed = self._placed
        placed[digest] = name
        placed.move_to_end(digest)
        if len(placed) > self._placed_max:
            gone = placed.popitem(last=False)[0]
            self._sizes.pop(gone, None)
            self._spread.pop(gone, None)

    def _home(self, digest: int, size: int) -> None:
        """The request goes to its key's instance: that cache holds the key's last request, so
        only what this one adds is prefill (a conversation's new turn); remembered for the next."""
        sizes = self._sizes
        self._prefill = size - min(sizes.get(digest, 0), size)
        sizes[digest] = size

    def prefill_bytes(self, size: int) -> int:
        return self._prefill

    def hold(self, name: str) -> tuple[str, int] | None:
        digest = self._digest
        if digest is None:
            return None
        held = (name, digest)
        self._flights[held] = self._flights.get(held, 0) + 1
        return held

    def release(self, held: tuple[str, int]) -> None:
        left = self._flights.get(held, 0) - 1
        if left > 0:
            self._flights[held] = left
        else:
            self._flights.pop(held, None)

    def _spare(self, digest: int, home: Backend, candidates: list[tuple[float, Backend]],
               in_flight: Mapping[str, int]) -> Backend | None:
        """Where a hot key's request goes instead of its instance: another instance that has fewer
        requests in flight than the home would have with it (per weight), the one that took the
        key's overflow before first (its cache holds the prefix too), else the least busy (ties:
        the key's best-scored). None: every other instance is as busy, the home keeps it."""
        weight = self.weight
        limit = in_flight.get(home.name, 0) / weight(home.name)
        spare: Backend | None = None
        best = (0.0, 0.0)
        before = self._spread.get(digest)
        for score, backend in candidates:
            name = backend.name
            if name == home.name:
                continue
            busy = (in_flight.get(name, 0) + 1) / weight(name)
            if busy > limit:
                continue
            if name == before:
                return backend
            if spare is None or (busy, -score) < best:
                spare, best = backend, (busy, -score)
        return spare

    def choose(self, ready: tuple[Backend, ...], in_flight: Mapping[str, int], tried: Collection[str] = (), key: Key | None = None, size: int = 0) -> Backend | None:
        if key is None:
            self._digest = None
            backend, _ = self._least(ready, in_flight, tried)
            if backend is not None:
                self._count("no_prefix")
            return backend
        digest = self._digest = key.digest
        self._prefill = size  # a miss: all of it
        weights = self._weights
        seeds = self._seeds
        home_name = self._placed.get(digest)
        home: Backend | None = None
        candidates: list[tuple[float, Backend]] = []
        top: Backend | None = None
        top_score = 0.0
        for backend in ready:
            name = backend.name
            if name in tried:
                continue
            # the instance's score u in (0, 1): splitmix64's finalizer of key ^ instance, its top
            # 53 bits (never 0 or 1); inlined, as it runs per instance and per request
            x = digest ^ (seeds.get(name) or self._seed(name))
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
            score = (((x ^ (x >> 31)) >> 11) + 0.5) / 9007199254740992.0
            if weights:  # -weight / ln(u); with all weights 1 it orders the instances as u does
                score = -weights.get(name, 1) / math.log(score)
            candidates.append((score, backend))
            if top is None or score > top_score:
                top, top_score = backend, score
            if name == home_name:
                home = backend
        if top is None:
            return None
        if len(candidates) == 1:
            if home is None:
                self._place(digest, top.name)
                self._sizes[digest] = size
                self._count("placed")
            else:
                self._placed.move_to_end(digest)
                self._home(digest, size)
                self._count(key.kind)
            return top
        # the work before this request's first token, in whole units of its own prefill (load.work):
        # the bound counts whole requests, so a few decoding streams (a fraction each) move nothing
        work = self.works([b.name for _, b in candidates], in_flight, size)
        values = {name: float(math.floor(value + 1e-9)) for name, value in work.items()}
        total = sum(values.values())
        weight = self.weight
        if home is None:
            # Nowhere cached yet (or its instance left, or failed this request): any instance
            # costs the same prefill, so the least loaded takes it, and keeps it. Placing new keys
            # by their hash instead lets chance pile them up (8 keys on 2 instances hash 6 : 2 or
            # worse 29 % of the time); equal loads go by the hash, so at rest this is rendezvous hashing.
            # (by the work itself, not whole requests: a half-busy instance is not a tie)
            least = min(candidates, key=lambda c: (work[c[1].name] / weight(c[1].name), -c[0]))[1]
            self._place(digest, least.name)
            self._sizes[digest] = size
            self._count("placed")
            return least
        weights_sum = float(sum(weight(b.name) for _, b in candidates)) if weights else float(len(candidates))
        factor = self.load_factor
        if within_bound(values[home.name], total, weight(home.name), weights_sum, factor):  # the common case
            if self._flights.get((home.name, digest), 0) >= self.hot_in_flight:
                # A hot key (one prompt in front of many requests): its decoding streams weigh
                # little against the bound, and all of them on one instance leave another idle.
                # The overflow goes where fewer are in flight, the same instance each time.
                spare = self._spare(digest, home, candidates, in_flight)
                if spare is not None:
                    cached = self._spread.get(digest) == spare.name
                    self._spread[digest] = spare.name
                    self._prefill = size - min(self._sizes.get(digest, 0), size) if cached else size
                    self._count("spread")
                    return spare
            self._placed.move_to_end(digest)
            self._home(digest, size)
            self._count(key.kind)
            return home
        # Over its bound: the key's best-scored instance within it takes this request, and the key
        # stays placed where its cache is.
        best: Backend | None = None
        best_score = 0.0
        for score, backend in candidates:
            if (best is None or score > best_score) and within_bound(values[backend.name], total, weight(backend.name), weights_sum, factor):
                best, best_score = backend, score
        if best is None:  # only by rounding: the least loaded, as the bound's own argument would pick
            best = min((b for _, b in candidates), key=lambda b: values[b.name] / weight(b.name))
        self._count("escaped")
        return best
