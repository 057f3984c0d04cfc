"""The routes the proxy forwards to an instance: one table, the only source of truth.

(Here in config, not proxy/, because proxy.admin_routes is checked against it when the
configuration is read, and config comes before proxy in the parts order.)

SERVING: the OpenAI (and Anthropic, Cohere) API routes vLLM 0.32 serves, with their methods (from
vllm/entrypoints/**/api_router.py), always forwarded. ADMIN: vLLM's routes that change or reveal
an instance's state; forwarded only when `proxy.admin_routes` names them, and only to an admin key
(proxy.api_key, or a named key with `admin: true`; vsup/proxy/auth.py). Anything else gets 404 from the proxy and never reaches an instance. docs/proxy.md lists
both tables; tests/test_proxy_routes.py checks that the doc and this module agree.

The check is one dict lookup per request (server.py); only /v1/responses/{id}[/cancel] needs a
second look, and only for paths under /v1/responses/.
"""

from __future__ import annotations

from typing import NamedTuple

from vsup.errors import VsupError

_POST = frozenset({"POST"})
_GET = frozenset({"GET"})


class Route(NamedTuple):
    methods: frozenset[str]
    admin: bool


# path -> methods. What each is for is in docs/proxy.md's table.
SERVING: dict[str, frozenset[str]] = {
    "/v1/chat/completions": _POST,
    "/v1/completions": _POST,
    "/v1/embeddings": _POST,
    "/v1/models": _GET,  # answered by the proxy, merged from the ready instances
    "/v1/responses": _POST,
    "/v1/audio/transcriptions": _POST,
    "/v1/audio/translations": _POST,
    "/v1/score": _POST,
    "/score": _POST,
    "/v1/rerank": _POST,
    "/rerank": _POST,
    "/v2/rerank": _POST,
    "/v2/embed": _POST,
    "/pooling": _POST,
    "/classify": _POST,
    "/tokenize": _POST,  # vsup tune sizes its prompts with it, through the proxy
    "/detokenize": _POST,
    "/v1/messages": _POST,
    "/v1/messages/count_tokens": _POST,
}

# /v1/responses/{response_id} (GET) and /v1/responses/{response_id}/cancel (POST).
RESPONSES_PREFIX = "/v1/responses/"

# path -> (methods, why it is not open to every client)
ADMIN: dict[str, tuple[frozenset[str], str]] = {
    "/v1/load_lora_adapter": (_POST, "loads any adapter from the instance's disk or a hub into every client's model list"),
    "/v1/unload_lora_adapter": (_POST, "removes an adapter other clients are using"),
    "/start_profile": (_POST, "starts the torch profiler: slows the instance, writes traces to its disk"),
    "/stop_profile": (_POST, "stops the profiler (and writes its traces)"),
    "/collective_rpc": (_POST, "calls any method on the instance's workers (needs VLLM_SERVER_DEV_MODE)"),
    "/reset_prefix_cache": (_POST, "empties the prefix cache: every client's next prompt is prefilled again"),
    "/reset_mm_cache": (_POST, "empties the multimodal cache"),
    "/reset_encoder_cache": (_POST, "empties the encoder cache"),
    "/sleep": (_POST, "offloads the weights: the instance stops serving"),
    "/wake_up": (_POST, "reloads the weights of a sleeping instance"),
    "/is_sleeping": (_GET, "reveals the instance's sleep state"),
    "/release_kv_cache_memory": (_POST, "frees the KV cache: the instance stops serving"),
    "/server_info": (_GET, "reveals the instance's full configuration and environment"),
    "/pause": (_POST, "pauses generation on the instance"),
    "/resume": (_POST, "resumes generation"),
    "/is_paused": (_GET, "reveals the pause state"),
    "/abort_requests": (_POST, "aborts other clients' requests"),
    "/scale_elastic_ep": (_POST, "rescales the instance's expert parallelism"),
    "/is_scaling_elastic_ep": (_POST, "reveals the scaling state"),
    "/init_weight_transfer_engine": (_POST, "RL weight transfer: replaces the model's weights"),
    "/shutdown_weight_transfer_engine": (_POST, "RL weight transfer"),
    "/start_weight_update": (_POST, "RL weight transfer: replaces the model's weights"),
    "/start_draft_weight_update": (_POST, "RL weight transfer: replaces the draft model's weights"),
    "/update_weights": (_POST, "RL weight transfer: replaces the model's weights"),
    "/finish_weight_update": (_POST, "RL weight transfer"),
    "/update_weight_version": (_POST, "RL weight transfer"),
    "/weight_info": (_GET, "RL weight transfer: reveals the weights' layout"),
    "/weight_checker": (_POST, "RL weight transfer"),
    "/get_world_size": (_GET, "reveals the instance's parallel layout"),
    "/fault_tolerance/apply": (_POST, "changes the engine's fault-tolerance state"),
    "/fault_tolerance/status": (_GET, "reveals the engine's fault-tolerance state"),
}


def check_admin_routes(paths: list[str]) -> list[str]:
    """The schema's check of proxy.admin_routes: every entry a route of the ADMIN table."""
    unknown = [path for path in paths if path not in ADMIN]
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} is not an admin route vsup knows; valid: {', '.join(ADMIN)}")
    return paths


def require_key(admin_routes: list[str], admin_key: bool) -> None:
    """Admin routes open only behind an admin key (one line naming the settings)."""
    if admin_routes and not admin_key:
        raise VsupError(
            f"proxy.admin_routes opens {', '.join(admin_routes)}, which need an API key: set proxy.api_key "
            "(or VSUP_API_KEY / --api-key) or admin: true on a key of proxy.api_keys, or empty proxy.admin_routes"
        )


def table(admin_routes: list[str]) -> dict[str, Route]:
    """What the proxy forwards: the serving routes and the admin routes opened."""
    routes = {path: Route(methods, False) for path, methods in SERVING.items()}
    for path in admin_routes:
        routes[path] = Route(ADMIN[path][0], True)
    return routes


_RESPONSE = Route(_GET, False)
_CANCEL = Route(_POST, False)


def templated(path: str) -> Route | None:
    """The routes with a path parameter: /v1/responses/{id} and /v1/responses/{id}/cancel."""
    if not path.startswith(RESPONSES_PREFIX):
        return None
    rest = path[len(RESPONSES_PREFIX):].split("/")
    if len(rest) == 1 and rest[0]:
        return _RESPONSE
    if len(rest) == 2 and rest[0] and rest[1] == "cancel":
        return _CANCEL
    return None
