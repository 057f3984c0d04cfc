"""OpenAI-shaped request checks and response bodies, the way vLLM's OpenAI server writes them.

Pure functions: no I/O, no clock except the `created` stamps passed in. Generated text is the
words "tok0 tok1 ..." so tests can predict it; token counts are whitespace words.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zlib
from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 16
VOCAB = 2048
EMBEDDING_DIM = 8


class ApiError(Exception):
    def __init__(self, status: int, err_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.err_type, self.message, self.param = status, err_type, message, param

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "BadRequestError", message, param)


def count_words(text: str) -> int:
    return len(text.split())


def token_ids(text: str) -> list[int]:
    return [zlib.crc32(word.encode()) % VOCAB for word in text.split()]


def token_text(index: int) -> str:
    """The index-th generated token as it appears in the stream ("tok0", " tok1", ...)."""
    return f"tok{index}" if index == 0 else f" tok{index}"


def generated_text(count: int) -> str:
    return "".join(token_text(i) for i in range(count))


@dataclass(frozen=True)
class Generation:
    """What a chat or completion request asks for, after validation."""

    kind: str  # "chat" or "completion"
    model: str
    prompt_tokens: int
    prompts: int  # choices: n per prompt (completion: of each prompt of a list; chat: one prompt)
    max_tokens: int
    stream: bool
    include_usage: bool
    token_delay: float | None  # per-request override from body "fake": {"token_delay": s}
    first_token_delay: float | None


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def prompt_words(kind: str, body: dict) -> list[list[str]]:
    """The words of each prompt of a validated chat or completion request, as the prefix cache
    sees them: a chat is one prompt, each message opened by its role (as a chat template does)."""
    if kind == "chat":
        words: list[str] = []
        for message in body["messages"]:
            words.append(f"<|{message['role']}|>")
            words += _message_text(message).split()
        return [words]
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt.split()]
    if all(isinstance(p, str) for p in prompt):
        return [p.split() for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [[str(t) for t in prompt]]
    return [[str(t) for t in p] for p in prompt]


def _resolve_model(body: dict, names: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None or model == "":
        return names[0]
    if not isinstance(model, str) or model not in names:
        raise ApiError(404, "NotFoundError", f"The model `{model}` does not exist.")
    return model


def _integer(body: dict, key: str) -> int | None:
    """An integer field as vLLM's pydantic models read it in lax mode: 5000, 5000.0, "5000" and
    true are integers; 5000.5 and "lots" are a 400."""
    value = body.get(key)
    if value is None or (isinstance(value, int)):
        return None if value is None else int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise bad_request(f"{key}: Input should be a valid integer, got {value!r}", key)


def _max_tokens(body: dict) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = _integer(body, key)
        if value is None:
            continue
        if value < 1:
            raise bad_request(f"max_tokens must be at least 1, got {value}.", key)
        return value
    return DEFAULT_MAX_TOKENS


def _choices(body: dict) -> int:
    n = _integer(body, "n")
    if n is not None and n < 1:
        raise bad_request(f"n must be at least 1, got {n}.", "n")
    return 1 if n is None else n


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream: Input should be a valid boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    return stream, include_usage


def _fake_delays(body: dict) -> tuple[float | None, float | None]:
    fake = body.get("fake")
    if not isinstance(fake, dict):
        return None, None
    out = []
    for key in ("token_delay", "first_token_delay"):
        value = fake.get(key)
        if value is not None and (not isinstance(value, (int, float)) or value < 0):
            raise bad_request(f"fake.{key}: expected seconds >= 0, got {value!r}", f"fake.{key}")
        out.append(None if value is None else float(value))
    return out[0], out[1]


def _check_context(prompt_tokens: int, max_tokens: int, max_model_len: int, what: str) -> None:
    if prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, {max_tokens} in the "
            f"completion). Please reduce the length of the {what} or completion."
        )


def parse_chat(body: object, names: tuple[str, ...], max_model_len: int) -> Generation:
    if not isinstance(body, dict):
        raise bad_request("Input should be a valid dictionary or object to extract fields from")
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages: Field required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: Input should be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages.{i}: each message needs a string 'role'", "messages")
    model = _resolve_model(body, names)
    max_tokens = _max_tokens(body)
    stream, include_usage = _stream_flags(body)
    token_delay, first_token_delay = _fake_delays(body)
    prompt_tokens = max(1, sum(count_words(_message_text(m)) for m in messages))
    _check_context(prompt_tokens, max_tokens, max_model_len, "messages")
    return Generation("chat", model, prompt_tokens, _choices(body), max_tokens, stream, include_usage, token_delay,
                      first_token_delay)


def _prompt_list(prompt: object) -> list[int]:
    """Token counts of each prompt: a string, a list of strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [max(1, count_words(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [max(1, count_words(p)) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [len(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [len(p) for p in prompt]
    raise bad_request("prompt: expected a string, a list of strings, or token ids", "prompt")


def parse_completion(body: object, names: tuple[str, ...], max_model_len: int) -> Generation:
    if not isinstance(body, dict):
        raise bad_request("Input should be a valid dictionary or object to extract fields from")
    if body.get("prompt") is None:
        raise bad_request("prompt: Field required", "prompt")
    counts = _prompt_list(body["prompt"])
    model = _resolve_model(body, names)
    max_tokens = _max_tokens(body)
    stream, include_usage = _stream_flags(body)
    token_delay, first_token_delay = _fake_delays(body)
    for count in counts:
        _check_context(count, max_tokens, max_model_len, "prompt")
    return Generation(
        "completion", model, sum(counts), len(counts) * _choices(body), max_tokens, stream, include_usage, token_delay, first_token_delay
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def full_response(gen: Generation, rid: str, created: int, fingerprint: str, tokens: int) -> dict:
    text = generated_text(tokens)
    finish = "length" if tokens >= gen.max_tokens else "abort"
    if gen.kind == "chat":
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            for i in range(gen.prompts)
        ]
        obj = "chat.completion"
    else:
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
             "prompt_logprobs": None}
            for i in range(gen.prompts)
        ]
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": gen.model,
        "choices": choices,
        "usage": usage(gen.prompt_tokens, tokens * gen.prompts),
        "system_fingerprint": fingerprint,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def _chunk(gen: Generation, rid: str, created: int, fingerprint: str, choices: list) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
        "created": created,
        "model": gen.model,
        "system_fingerprint": fingerprint,
        "choices": choices,
    }


def role_chunk(gen: Generation, rid: str, created: int, fingerprint: str, index: int = 0) -> dict:
    """vLLM's first chat chunk of each choice: the assistant role with empty content."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return _chunk(gen, rid, created, fingerprint, [choice])


def token_chunk(gen: Generation, rid: str, created: int, fingerprint: str, index: int, prompt_index: int = 0) -> dict:
    last = index + 1 >= gen.max_tokens
    finish = "length" if last else None
    if gen.kind == "chat":
        choice = {"index": prompt_index, "delta": {"content": token_text(index)}, "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}
    else:
        choice = {"index": prompt_index, "text": token_text(index), "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}
    return _chunk(gen, rid, created, fingerprint, [choice])


def usage_chunk(gen: Generation, rid: str, created: int, fingerprint: str, tokens: int) -> dict:
    chunk = _chunk(gen, rid, created, fingerprint, [])
    chunk["usage"] = usage(gen.prompt_tokens, tokens * gen.prompts)
    return chunk


def embedding_vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round((b - 127.5) / 127.5, 6) for b in digest[:EMBEDDING_DIM]]


def embeddings_response(body: object, names: tuple[str, ...], rid: str, created: int) -> dict:
    if not isinstance(body, dict):
        raise bad_request("Input should be a valid dictionary or object to extract fields from")
    raw = body.get("input")
    if raw is None:
        raise bad_request("input: Field required", "input")
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        inputs = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
        inputs = [" ".join(map(str, raw))]
    elif isinstance(raw, list) and raw and all(isinstance(x, list) for x in raw):
        inputs = [" ".join(map(str, x)) for x in raw]
    else:
        raise bad_request("input: expected a string, a list of strings, or token ids", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"encoding_format: expected 'float' or 'base64', got {fmt!r}", "encoding_format")
    model = _resolve_model(body, names)
    data = []
    for i, text in enumerate(inputs):
        vector = embedding_vector(text)
        if fmt == "base64":
            encoded: object = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        else:
            encoded = vector
        data.append({"index": i, "object": "embedding", "embedding": encoded})
    prompt_tokens = sum(max(1, count_words(t)) for t in inputs)
    return {"id": rid, "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def pooling_response(body: object, names: tuple[str, ...], rid: str, created: int) -> dict:
    """POST /pooling as vLLM 0.32 answers it for an embedding model: the embeddings' vectors as
    `data` items of object "pooling" (docs/fleet-vllm-notes.md)."""
    answer = embeddings_response(body, names, rid, created)
    answer["data"] = [{"index": item["index"], "object": "pooling", "data": item["embedding"]} for item in answer["data"]]
    return answer


def tokenize_response(body: object, max_model_len: int) -> dict:
    if not isinstance(body, dict):
        raise bad_request("Input should be a valid dictionary or object to extract fields from")
    if isinstance(body.get("prompt"), str):
        text = body["prompt"]
    elif isinstance(body.get("messages"), list):  # as the chat template renders it: each message opened by its role
        text = " ".join(" ".join([f"<|{m.get('role')}|>", _message_text(m)]) for m in body["messages"] if isinstance(m, dict))
    else:
        raise bad_request("prompt: Field required (a string), or messages", "prompt")
    tokens = token_ids(text)
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": None}
