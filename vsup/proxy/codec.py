"""What the forwarder does to the bytes it relays: the client's header lines minus the hop-by-hop
ones (RFC 9110 §7.6.1), the instance's headers sorted into kept and looked-at in one pass, and the
request body's JSON parsed on a fast path that accepts exactly what json.loads accepts.

These run once or more per request on the proxy's hot path: per-name decisions are cached.
"""

from __future__ import annotations

import codecs
import json
import urllib.parse
from collections.abc import Callable
from typing import Any

from multidict import CIMultiDict
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones the proxy sets itself for the next hop.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
_DROP_REQUEST = frozenset(h.encode() for h in HOP_BY_HOP | {"host", "content-length", "expect"})
_DROP_RESPONSE = frozenset(h.encode() for h in HOP_BY_HOP | {"content-length"})
_PROXY_PREFIX = b"proxy-"


def origin_form(target: str) -> str:
    """An absolute-form request target (`http://host:port/path?query`, RFC 9112 §3.2.2) as the
    origin-form an instance expects (`/path?query`); any other target is returned as it is."""
    scheme, sep, rest = target.partition("://")
    if not sep or "/" in scheme:
        return target
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    path = rest[cut:]
    return path if path.startswith("/") else "/" + path


# Query characters forwarded as they are: RFC 3986's unreserved ones and the form syntax vLLM's
# parser reads (& = + and %XX escapes). Any other (`$`, `(`, `'`, `;`, a space, ...) is sent
# percent-encoded: the instance's access log (uvicorn) writes the query raw, and it means the same
# to starlette's parse_qsl, which decodes only those escapes. Names of credentials a client may
# put in a query (never read by vLLM) are dropped: they would land in that log too.
_QUERY_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~&=+%")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SECRET_PARAMS = frozenset({"api_key", "api-key"})


def _encode_query_part(part: bytes) -> bytes:
    out = bytearray()
    n = len(part)
    for i, byte in enumerate(part):
        if byte == 0x25 and not (i + 2 < n and part[i + 1] in _HEX and part[i + 2] in _HEX):  # a lone %
            out += b"%25"
        elif byte in _QUERY_SAFE:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def forwarded_target(origin: str) -> str:
    """The origin-form target sent to an instance: the path as the client sent it, the query without
    credentials (?api_key=) and with every character outside _QUERY_SAFE percent-encoded."""
    path, sep, query = origin.partition("?")
    if not sep:
        return origin
    raw = query.encode("utf-8", "surrogateescape")
    if b"%" not in raw and b"api" not in raw.lower() and _QUERY_SAFE.issuperset(raw):
        return origin  # (the common case: ?model=x)
    kept = []
    for pair in raw.split(b"&"):
        name = urllib.parse.unquote_plus(pair.partition(b"=")[0].decode("latin-1")).strip().lower()
        if name not in _SECRET_PARAMS:
            kept.append(_encode_query_part(pair))
    rest = b"&".join(kept)
    return path + "?" + rest.decode("ascii") if rest else path


def _connection_tokens(value: bytes) -> frozenset[bytes]:
    return frozenset(token.strip().lower() for token in value.split(b",") if token.strip())


# Per header name *as sent* (clients repeat the same spelling on every request), what to do with
# it: one dict lookup per header instead of lower() + set tests + tuple building. Bounded: an odd
# client inventing names cannot grow it without limit.
_KEEP, _DROP, _AUTHORIZATION, _CONNECTION = 0, 1, 2, 3
_NAME_CACHE_SIZE = 1024
_request_names: dict[bytes, int] = {}


def _request_name_kind(key: bytes) -> int:
    low = key.lower()
    if low == b"connection":
        kind = _CONNECTION
    elif low == b"authorization":
        kind = _AUTHORIZATION
    elif low in _DROP_REQUEST or low.startswith(_PROXY_PREFIX):
        kind = _DROP
    else:
        kind = _KEEP
    if len(_request_names) >= _NAME_CACHE_SIZE:
        _request_names.clear()
    _request_names[key] = kind
    return kind


def request_headers(raw_headers: tuple[tuple[bytes, bytes], ...], drop_authorization: bool) -> bytes:
    """The client's header lines, as it sent them, minus hop-by-hop ones (and its Authorization
    when the proxy checked it: the instances listen on loopback without a key)."""
    parts: list[bytes] = []
    named = None
    names = _request_names
    for key, value in raw_headers:
        kind = names.get(key)
        if kind is None:
            kind = _request_name_kind(key)
        if kind == _KEEP or (kind == _AUTHORIZATION and not drop_authorization):
            parts += (key, b": ", value, b"\r\n")
        elif kind == _CONNECTION:
            # Headers the client names in Connection are hop-by-hop too; "keep-alive"/"close"
            # (what clients send) name nothing that is still kept.
            tokens = _connection_tokens(value) - _DROP_REQUEST
            if tokens:
                named = tokens | (named or frozenset())
    if named:  # rare: a second pass without the headers Connection named
        parts = []
        for key, value in raw_headers:
            kind = names.get(key)
            if kind is None:
                kind = _request_name_kind(key)
            if (kind == _KEEP or (kind == _AUTHORIZATION and not drop_authorization)) and key.lower() not in named:
                parts += (key, b": ", value, b"\r\n")
    return b"".join(parts)


# Per response header name: whether to forward it, and whether it is one the forwarder looks at.
_PLAIN, _IS_CONNECTION, _IS_CONTENT_TYPE, _IS_CONTENT_LENGTH = 0, 1, 2, 3
_response_names: dict[bytes, tuple[bool, int]] = {}


def _response_name(key: bytes) -> tuple[bool, int]:
    low = key.lower()
    flag = {b"connection": _IS_CONNECTION, b"content-type": _IS_CONTENT_TYPE, b"content-length": _IS_CONTENT_LENGTH}.get(low, _PLAIN)
    entry = (not (low in _DROP_RESPONSE or low.startswith(_PROXY_PREFIX)), flag)
    if len(_response_names) >= _NAME_CACHE_SIZE:
        _response_names.clear()
    _response_names[key] = entry
    return entry


def response_head(raw_headers: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], bytes, bool]:
    """One pass over the instance's headers: those to forward (hop-by-hop ones dropped, as sent),
    its Content-Type, and whether it sent a Content-Length."""
    out: list[tuple[bytes, bytes]] = []
    content_type = b""
    has_length = False
    named = None
    names = _response_names
    for pair in raw_headers:
        entry = names.get(pair[0])
        if entry is None:
            entry = _response_name(pair[0])
        keep, flag = entry
        if flag:
            if flag == _IS_CONTENT_TYPE:
                content_type = pair[1]
            elif flag == _IS_CONTENT_LENGTH:
                has_length = True
            else:
                tokens = _connection_tokens(pair[1]) - _DROP_RESPONSE
                if tokens:
                    named = tokens | (named or frozenset())
        if keep:
            out.append(pair)
    if named:
        out = [(name, value) for name, value in out if name.lower() not in named]
    return out, content_type, has_length


def header_lines(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join([b"%b: %b\r\n" % pair for pair in pairs])


def str_headers(pairs: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(name.decode("latin-1"), value.decode("utf-8", "replace")) for name, value in pairs]


def response_headers(raw_headers: list[tuple[bytes, bytes]]) -> CIMultiDict[str]:
    return CIMultiDict(str_headers(response_head(raw_headers)[0]))


_json_types: dict[str, bool] = {}


def is_json(content_type: str) -> bool:
    # application/json, application/json; charset=utf-8, application/vnd.x+json
    known = _json_types.get(content_type)
    if known is None:
        base = content_type.split(";", 1)[0].strip().lower()
        known = base == "application/json" or base.endswith("+json")
        if len(_json_types) >= _NAME_CACHE_SIZE:
            _json_types.clear()
        _json_types[content_type] = known
    return known


def parse_json(body: bytes) -> Any:
    """json.loads(body), minus its encoding detection and whitespace regexes in the common case (a
    UTF-8 object, as every OpenAI request is); anything else, including every error, goes through
    json.loads itself, so what is accepted and the error message are exactly json.loads's."""
    if body[:1] == b"{":
        try:
            text = body.decode("utf-8")
            document, end = _scan_once(text, 0)
        except (ValueError, UnicodeDecodeError, StopIteration):
            pass
        else:
            if end == len(text) or not text[end:].strip(_JSON_WHITESPACE):
                return document
    return json.loads(body)


# The decoder's C scanner, which JSONDecoder sets up in __init__ (typeshed does not declare it).
_scan_once: Callable[[str, int], tuple[Any, int]] = vars(json.JSONDecoder())["scan_once"]
_JSON_WHITESPACE = " \t\n\r"


def form_field(body: bytes, content_type: str, name: str) -> str | None:
    """The value of the field `name` of a multipart/form-data body (an audio upload's "model") as
    vLLM reads it: parsed by python-multipart, as starlette (vLLM's form parser) parses it, and of
    a field sent twice the last (starlette's FormData.get). None when there is none, when that
    last one is a file, or when the body is no form that parser reads (vLLM then refuses it). The
    body is bounded already (proxy.max_body_bytes, read whole before routing)."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        return None
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    try:
        charset = codecs.lookup(charset).name
    except LookupError:
        charset = "latin-1"
    wanted = name.encode()
    found: list[bytes | None] = []  # the field's values in order (None: a file of that name)
    part: dict = {}

    def on_part_begin() -> None:
        part.clear()
        part.update(header=b"", value=b"", disposition=b"", data=[])

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part["header"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        part["value"] += data[start:end]

    def on_header_end() -> None:
        if part["header"].lower() == b"content-disposition":
            part["disposition"] = part["value"]
        part["header"] = part["value"] = b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(part["disposition"])
        part["mine"] = options.get(b"name") == wanted
        part["file"] = b"filename" in options

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part.get("mine") and not part.get("file"):
            part["data"].append(data[start:end])

    def on_part_end() -> None:
        if part.get("mine"):
            found.append(None if part["file"] else b"".join(part["data"]))

    callbacks = {"on_part_begin": on_part_begin, "on_header_field": on_header_field, "on_header_value": on_header_value,
                 "on_header_end": on_header_end, "on_headers_finished": on_headers_finished,
                 "on_part_data": on_part_data, "on_part_end": on_part_end}
    try:
        parser = MultipartParser(params[b"boundary"], callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except (MultipartParseError, ValueError):
        return None
    if not found or found[-1] is None:
        return None
    return found[-1].decode(charset, "replace")
