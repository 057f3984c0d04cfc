"""Reading a batch's input JSONL (pure): each line `{"custom_id", "method": "POST", "url", "body"}`.

A line that is not JSON, lacks or repeats a `custom_id`, names another endpoint or method, a model
nobody serves, `"stream": true`, or a body that is not an object is an error in OpenAI's shape
`{code, message, param, line}` (line 1-based, counting every line of the file). Blank lines are
skipped. `scan` reads the file in pieces (a store's content), so no input is held whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypedDict

# The endpoints a batch may name: OpenAI's three and the pooling routes vsup forwards (config/proxy_routes.SERVING).
ENDPOINTS: tuple[str, ...] = (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
    "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/v2/embed", "/pooling", "/classify",
)

MAX_ERRORS = 1000  # OpenAI's errors list is kept short; the first thousand say enough


@dataclass(frozen=True)
class Line:
    number: int          # 1-based line of the input file
    custom_id: str
    model: str
    body: bytes          # the request body, re-serialized JSON


class LineError(TypedDict):
    code: str
    message: str
    param: str | None
    line: int | None


def error(code: str, message: str, param: str | None, line: int | None) -> LineError:
    return {"code": code, "message": message, "param": param, "line": line}


def parse(data: bytes, endpoint: str, models: Callable[[str], bool] | None) -> tuple[list[Line], list[LineError]]:
    """The valid lines and the errors (at most MAX_ERRORS) of a whole input file."""
    good: list[Line] = []
    bad: list[LineError] = []
    for item in scan([data], endpoint, models):
        if isinstance(item, Line):
            good.append(item)
        elif len(bad) < MAX_ERRORS:
            bad.append(item)
    return good, bad


def split(pieces: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of a file given in pieces."""
    number = 0
    head: list[bytes] = []  # the start of a line that continues in the next piece (never re-scanned)
    for piece in pieces:
        *whole, rest = piece.split(b"\n")
        for raw in whole:
            if head:
                raw = b"".join([*head, raw])
                head = []
            number += 1
            yield number, raw
        if rest:
            head.append(rest)
    if head:
        yield number + 1, b"".join(head)


def scan(pieces: Iterable[bytes], endpoint: str, models: Callable[[str], bool] | None) -> Iterator[Line | LineError]:
    """Each non-blank line of the file as a Line or its LineError, in order; an empty file is one error."""
    seen: set[str] = set()
    any_line = False
    for number, raw in split(pieces):
        if not raw.strip():
            continue
        any_line = True
        yield check_line(number, raw, endpoint, models, seen)
    if not any_line:
        yield error("empty_file", "The input file has no lines; each line is one request as JSON", None, None)


def check_line(number: int, raw: bytes, endpoint: str, models: Callable[[str], bool] | None, seen: set[str]) -> Line | LineError:
    """One line, checked; a good line's custom_id joins `seen`."""
    try:
        item = json.loads(raw)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return error("invalid_json_line", "This line is not valid JSON; each line must be one JSON object", None, number)
    if not isinstance(item, dict):
        return error("invalid_json_line", "This line is not a JSON object; each line must be one JSON object", None, number)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return error("missing_required_parameter", "custom_id is missing or not a non-empty string", "custom_id", number)
    if not _encodable(custom_id):
        return error("invalid_request", "custom_id is not valid Unicode text", "custom_id", number)
    if custom_id in seen:
        return error("duplicate_custom_id", "The custom_id of this line is used on an earlier line; each must be unique",
                     "custom_id", number)
    if item.get("method") != "POST":
        return error("invalid_method", "method must be \"POST\"", "method", number)
    if item.get("url") != endpoint:
        return error("invalid_url", f"url must be the batch's endpoint, {endpoint!r}", "url", number)
    body = item.get("body")
    if not isinstance(body, dict):
        return error("invalid_request", "body must be a JSON object (the request)", "body", number)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return error("missing_required_parameter", "body.model is missing or not a string", "body.model", number)
    if not _encodable(model):
        return error("invalid_request", "body.model is not valid Unicode text", "body.model", number)
    if models is not None and not models(model):
        return error("model_not_found", "No model of this name is served here; /v1/models lists those that are",
                     "body.model", number)
    if body.get("stream") is True:
        return error("invalid_request", "body.stream must not be true: a batch line is answered whole",
                     "body.stream", number)
    seen.add(custom_id)
    data = json.dumps(body, separators=(",", ":")).encode()  # (ASCII: a lone surrogate stays an escape)
    return Line(number, custom_id, model, data)


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800") parses but cannot be stored as UTF-8
        return False
    return True
