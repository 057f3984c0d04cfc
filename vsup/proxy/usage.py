"""What a request may make vLLM generate, read as vLLM reads it, and what it did generate (the
`usage` vLLM returns): the token limits' reservation and settlement (ratelimit.py, gate.py).

vLLM validates a request with pydantic in its lax mode, so `"max_tokens": "5000"` and `5000.0` are
5000 to it (`5000.5` and `"lots"` a 400), and so they are here (pydantic's own TypeAdapter). What a
request may generate (vllm/entrypoints/openai/*/protocol.py, 0.32):
  /v1/chat/completions  max_completion_tokens, else max_tokens (the larger of both is reserved:
                        which one wins is an implementation detail of the vLLM version), times n;
                        neither: up to max_model_len - the prompt (UNBOUNDED)
  /v1/completions       max_tokens (null or absent: 16) times n, per prompt of a list of prompts
  /v1/responses         max_output_tokens; absent: UNBOUNDED
  any other route       nothing (pooling: embeddings, score, rerank, tokenize)
A field vLLM would refuse (a 400: nothing generated) counts as UNBOUNDED too: this module is not the
judge of what vLLM accepts, and an older or newer vLLM may accept more.

Settlement reads the usage of the answer: a JSON body's `usage`, or in an event stream the chunk
vLLM sends last with `stream_options.include_usage` (`"choices": []` and the usage of every
choice), or the Responses API's `response.completed` event. The proxy asks for that chunk
(`stream_request`) and takes it out of the stream of a client that did not ask (`UsageSink`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

UNBOUNDED = None  # requested(): no bound in the request (vLLM's default: max_model_len - the prompt)
COMPLETIONS_DEFAULT = 16  # vLLM's max_tokens of /v1/completions
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
# Routes whose answers stream the usage chunk when asked (stream_options.include_usage).
STREAMS_USAGE = frozenset({CHAT, COMPLETIONS})

_INT = TypeAdapter(int | None)
_EVENT_END = re.compile(rb"(\r?\n\r?\n)")
_BOOL = TypeAdapter(bool | None)


class Invalid(ValueError):
    """A field vLLM would refuse."""


def _int(document: Mapping[str, Any], key: str) -> int | None:
    try:
        return _INT.validate_python(document.get(key))
    except ValidationError:
        raise Invalid(key) from None


def _bool(value: object) -> bool | None:
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        raise Invalid(repr(value)) from None


def _prompts(prompt: object) -> int:
    """How many prompts a /v1/completions `prompt` holds (a list of strings or of token lists)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def requested(path: str, document: Mapping[str, Any] | None) -> int | None:
    """The most tokens this request may make vLLM generate, or UNBOUNDED."""
    if path not in (CHAT, COMPLETIONS, RESPONSES):
        return 0
    if document is None:
        return UNBOUNDED
    try:
        if path == RESPONSES:
            return max(0, limit) if (limit := _int(document, "max_output_tokens")) is not None else UNBOUNDED
        n = _int(document, "n")
        n = max(1, n if n is not None else 1)
        if path == COMPLETIONS:
            if "prompt" in getattr(document, "trimmed", ()):
                return UNBOUNDED  # a large body's view holds only the first prompts of its list (bodyparse.py)
            limit = _int(document, "max_tokens")
            return max(0, limit if limit is not None else COMPLETIONS_DEFAULT) * n * _prompts(document.get("prompt"))
        asked = [v for v in (_int(document, "max_tokens"), _int(document, "max_completion_tokens")) if v is not None]
    except Invalid:
        return UNBOUNDED
    return max(0, max(asked)) * n if asked else UNBOUNDED


def sequences(path: str, document: Mapping[str, Any] | None) -> int | None:
    """How many sequences vLLM runs for an unbounded request (n; 1 for the Responses API), each at
    most max_model_len tokens with its prompt; None when n is something vLLM refuses."""
    if path == RESPONSES:
        return 1
    try:
        n = _int(document, "n") if document is not None else None
    except Invalid:
        return None
    return max(1, n if n is not None else 1)


def streams(document: Mapping[str, Any] | None) -> bool:
    """Whether vLLM will stream the answer (`"stream": "true"` is True to it too)."""
    if document is None:
        return False
    try:
        return bool(_bool(document.get("stream")))
    except Invalid:
        return False


def stream_request(document: Mapping[str, Any], body: bytes) -> tuple[bytes, bool] | None:
    """The body asking vLLM for the usage chunk of a stream (stream_options.include_usage), and
    whether the client asked for it itself (then the chunk is its own); None when the body is left
    as it is (its stream_options are something vLLM refuses anyway, or too large to have been
    read whole). The client's body is kept byte for byte: the new stream_options are added as the
    object's last member, and of a repeated key vLLM's JSON parser keeps the last. A client's
    continuous_usage_stats without include_usage is turned off: vLLM ignores it then, and it would
    show usage on every chunk once include_usage is on."""
    options = document.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict) or "stream_options" in getattr(document, "trimmed", ()):
        return None
    try:
        asked = bool(_bool(options.get("include_usage")))
        continuous = bool(_bool(options.get("continuous_usage_stats")))
    except Invalid:
        return None
    if asked:
        return body, True
    options = {**options, "include_usage": True}
    if continuous:
        options["continuous_usage_stats"] = False
    end = body.rstrip().rfind(b"}")
    if end < 0:
        return None
    member = b'"stream_options":' + json.dumps(options, separators=(",", ":")).encode()
    return body[:end] + b"," + member + body[end:], False


def total(usage: object) -> int | None:
    """The tokens a `usage` object counts: prompt and generated (chat, completions: prompt_tokens +
    completion_tokens; Responses: input_tokens + output_tokens); None when it is not one."""
    if not isinstance(usage, dict):
        return None
    whole = usage.get("total_tokens")
    if type(whole) is int and whole >= 0:
        return whole
    for prompt, generated in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
        a, b = usage.get(prompt), usage.get(generated)
        if type(a) is int and type(b) is int and a >= 0 and b >= 0:
            return a + b
    return None


def of_body(body: bytes) -> int | None:
    """The usage of a JSON answer (None: not JSON, or none in it: an error, a pooling answer)."""
    if b'"usage"' not in body:
        return None
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return total(document.get("usage")) if isinstance(document, dict) else None


def _of_event(data: bytes) -> tuple[int | None, bool]:
    """(the usage an SSE event's data carries, whether it is the usage-only chunk include_usage adds)."""
    if b'"usage"' not in data:
        return None, False
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, False
    if not isinstance(document, dict):
        return None, False
    if document.get("type") == "response.completed" and isinstance(document.get("response"), dict):
        return total(document["response"].get("usage")), False
    if document.get("choices") == [] and "usage" in document:
        return total(document["usage"]), True
    return None, False


class UsageSink:
    """Between the instance's event stream and the client's sink: finds the usage event, and drops
    it when `strip` (the client did not ask for it). Events pass whole and at once: the bytes up to
    the last blank line of what came go on; a partial event waits for its end."""

    __slots__ = ("sink", "strip", "usage", "_rest")

    def __init__(self, sink: Any, strip: bool) -> None:
        self.sink = sink
        self.strip = strip
        self.usage: int | None = None
        self._rest = b""

    def write(self, data: bytes) -> bool:
        data = self._rest + data if self._rest else data
        end = max(data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n"))
        if end < 0:
            self._rest = data
            return False
        end += 4 if data.startswith(b"\r\n\r\n", end) else 2
        whole, self._rest = data[:end], data[end:]
        if b'"usage"' in whole:
            whole = self._events(whole)
        return self.sink.write(whole) if whole else False

    def _events(self, whole: bytes) -> bytes:
        parts = _EVENT_END.split(whole)  # [event, its end, event, its end, ..., the rest]
        kept = []
        for i in range(0, len(parts), 2):
            event = parts[i]
            data = b"\n".join(line.rstrip(b"\r")[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
            found, extra = _of_event(data)
            if found is not None:
                self.usage = found
            if not (extra and self.strip):
                kept.append(event + (parts[i + 1] if i + 1 < len(parts) else b""))
        return b"".join(kept)

    def end(self, data: bytes) -> None:
        """The stream's last bytes (with the end of its framing): what is left goes on with them."""
        data = self._rest + data if self._rest else data
        self._rest = b""
        self.sink.end(self._events(data) if b'"usage"' in data else data)

    async def drain(self) -> None:
        await self.sink.drain()
