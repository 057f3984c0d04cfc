"""OpenAI-shaped error responses: `{"error": {"message", "type", "param", "code"}}`.

Clients use the `openai` SDK, which maps the status code to an exception class and shows
`error.message`; keeping vLLM's own shape means a client cannot tell the proxy's errors from an
instance's, and every SDK (and LangChain on top of it) understands them.
"""

from __future__ import annotations

import json

from vsup.proxy.messages import Response

_JSON = "application/json"
RETRY_AFTER_SECONDS = 1


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(status=status, body=error_body(message, type_, code, param), content_type=_JSON, headers=headers)


def sse_error_event(message: str, type_: str, code: str | None = None) -> bytes:
    """The last event of a stream that failed after its first byte: the openai SDK raises APIError on it."""
    return b"data: " + error_body(message, type_, code) + b"\n\n"


# The ones the proxy sends itself, named so handlers and tests agree on type/code.
def bad_request(message: str, param: str | None = None) -> Response:
    return error_response(400, message, "invalid_request_error", "invalid_request", param=param)


def unauthorized() -> Response:
    return error_response(
        401,
        "invalid API key: send it as `Authorization: Bearer <key>`",
        "invalid_request_error",
        "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def forbidden(what: str) -> Response:
    return error_response(
        403,
        f"this key may not use {what}: it needs an admin key (proxy.api_key, or a key of proxy.api_keys with admin: true)",
        "invalid_request_error",
        "forbidden",
    )


def metrics_only(name: str) -> Response:
    return error_response(
        403, f"the key {name!r} is a metrics key (metrics: true): it reads /metrics and nothing else",
        "invalid_request_error", "forbidden")


def not_found(path: str) -> Response:
    return error_response(
        404,
        f"no route for {path}: the proxy serves vLLM's OpenAI API routes (/v1/chat/completions, /v1/completions,"
        " /v1/embeddings, /v1/models, ..., /tokenize; docs/proxy.md lists them), /health, /ready and /metrics;"
        " vLLM's admin routes only where proxy.admin_routes opens them",
        "invalid_request_error",
        "not_found",
    )


def too_large(size: int | None, limit: int) -> Response:
    got = f"{size} bytes" if size is not None else "the request body"
    return error_response(
        413,
        f"{got} is over the proxy's limit of {limit} bytes (proxy.max_body_bytes)",
        "invalid_request_error",
        "request_too_large",
    )


def unavailable(message: str, retry_after: int) -> Response:
    return error_response(503, message, "service_unavailable", "no_ready_instance", headers={"Retry-After": str(retry_after)})


def no_ready_instance() -> Response:
    return unavailable("no ready instance: all instances are starting, restarting or unhealthy", RETRY_AFTER_SECONDS)


def no_reachable_instance(failures: list[str]) -> Response:
    return unavailable(
        "no instance could be reached (" + "; ".join(failures) + "); they are out of the rotation until their next good"
        " health check: retry shortly",
        RETRY_AFTER_SECONDS,
    )


def bad_gateway(message: str) -> Response:
    return error_response(502, message, "upstream_error", "upstream_error")


def gateway_timeout(message: str) -> Response:
    return error_response(504, message, "upstream_error", "upstream_timeout")
