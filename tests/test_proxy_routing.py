"""Routing by model (vsup/proxy/routing.py): per-model tables and balancers, the refusals — units,
no sockets (the fleet behind a real ProxyServer is tests/test_proxy_fleet.py)."""

from __future__ import annotations

import json
from collections import Counter

from vsup.config.schema import ProxyConfig
from vsup.proxy.affinity import PrefixAffinity
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.balancer import LeastOutstanding, RoundRobin
from vsup.proxy.routing import WAIT, ModelRouter, Route

CONFIGS = {"chat": ProxyConfig(), "embed": ProxyConfig(policy="least_outstanding")}


def fleet(ready=("0", "1", "2"), models=CONFIGS) -> tuple[BackendPool, ModelRouter]:
    """Instances 0 and 1 serve chat, 2 serves embed."""
    pool = BackendPool([Backend("0", "u0", "chat"), Backend("1", "u1", "chat"), Backend("2", "u2", "embed")])
    for name in ready:
        pool.set_state(name, "ready", True)
    return pool, ModelRouter(pool, ProxyConfig(), models)


def choose(router: ModelRouter, model: str, in_flight=None, tried=(), document=None) -> str | None:
    balancer = router.balancer(model)
    backend = balancer.choose(router.ready(model), in_flight or {}, tried, balancer.key(document, {}))
    return backend.name if backend else None


def body(response) -> dict:
    return json.loads(response.body)["error"]


def test_each_model_goes_only_to_its_instances_with_its_own_policy():
    pool, router = fleet()
    assert isinstance(router.pick("chat", False), Route)
    assert [b.name for b in router.ready("chat")] == ["0", "1"] and [b.name for b in router.ready("embed")] == ["2"]
    assert isinstance(router.balancer("chat"), RoundRobin) and isinstance(router.balancer("embed"), LeastOutstanding)
    assert Counter(choose(router, "chat") for _ in range(10)) == {"0": 5, "1": 5}
    assert {choose(router, "embed") for _ in range(5)} == {"2"}
    # a retry stays in the model: once its instances are tried, nothing is left (not another model's)
    assert choose(router, "chat", tried=["0", "1"]) is None
    assert choose(router, "embed", tried=["2"]) is None


def test_round_robin_rotations_are_per_model():
    # embed's requests do not move chat's rotation: chat alternates exactly, whatever comes between
    pool, router = fleet(models={"chat": ProxyConfig(), "embed": ProxyConfig()})
    picks = []
    for _ in range(6):
        picks.append(choose(router, "chat"))
        choose(router, "embed")
    assert picks == ["0", "1", "0", "1", "0", "1"]


def test_least_outstanding_counts_only_the_models_instances():
    pool, router = fleet(models={"chat": ProxyConfig(policy="least_outstanding"), "embed": ProxyConfig()})
    # instance 2 (embed) idle, 0 busy: chat still goes to 1, never to the idle embed instance
    assert {choose(router, "chat", in_flight={"0": 3, "2": 0}) for _ in range(4)} == {"1"}


def test_prefix_affinity_per_model_keeps_a_prefix_on_one_instance():
    pool, router = fleet(models={"chat": ProxyConfig(policy="prefix_affinity", affinity_prefix_chars=64), "embed": ProxyConfig()})
    assert isinstance(router.balancer("chat"), PrefixAffinity) and router.balancer("chat").prefix_chars == 64
    document = {"model": "chat", "messages": [{"role": "user", "content": "the same long prompt"}]}
    assert len({choose(router, "chat", document=document) for _ in range(8)}) == 1
    assert router.balancer("chat").decisions == {"placed": 1, "affinity": 7}
    assert not router.balancer("embed").decisions


def test_readiness_changes_reach_the_tables_without_a_rebuild_per_request():
    pool, router = fleet()
    router.pick("chat", False)
    built = router._routes
    router.ready("chat")
    assert router._routes is built  # an unchanged pool: the same tables, one int compared
    pool.set_state("0", "restarting", False)
    assert [b.name for b in router.ready("chat")] == ["1"]
    pool.set_state("2", "restarting", False)
    assert router.ready("embed") == () and "embed" in router._routes  # known, none ready


def test_pick_names_the_model_or_refuses_in_openais_shape():
    pool, router = fleet()
    assert router.pick("chat", False).name == "chat"
    unknown = router.pick("gpt-4o", False)
    assert unknown.status == 404
    error = body(unknown)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")
    assert "'gpt-4o'" in error["message"] and "'chat', 'embed'" in error["message"]
    missing = router.pick(None, False)
    assert missing.status == 400 and "'chat', 'embed'" in body(missing)["message"] and body(missing)["param"] == "model"
    assert router.pick(7, False).status == 400 and "must be a string" in body(router.pick(7, False))["message"]
    assert router.refused == {("", "unknown_model"): 1, ("", "no_model"): 3}


def test_a_client_given_name_is_escaped_and_cut_in_the_message():
    pool, router = fleet()
    name = "\x1b[31mred\n" + "x" * 500
    message = body(router.pick(name, False))["message"]
    assert "\x1b" not in message and "\n" not in message and "\\x1b[31mred\\n" in message
    assert repr(name[:100] + "...") in message and "x" * 92 not in message  # 100 characters of the name


def test_one_model_takes_requests_that_name_none():
    pool = BackendPool([Backend("0", "u0", "chat")])
    pool.set_state("0", "ready", True)
    router = ModelRouter(pool, ProxyConfig(), {"chat": ProxyConfig()})
    assert router.pick(None, False).name == "chat" and router.pick("", False).name == "chat"


def test_none_ready_is_503_with_retry_after_naming_the_model():
    pool, router = fleet(ready=("0", "1"))
    refused = router.none_ready("embed")
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert "'embed'" in body(refused)["message"] and router.refused == {("embed", "no_ready_instance"): 1}


def test_learned_names_route_to_the_instances_that_listed_them():
    pool, router = fleet()
    router.learn("1", ["chat", "sql-lora"])  # instance 1 serves an adapter too
    assert router.pick("sql-lora", False).name == "sql-lora"
    assert [b.name for b in router.ready("sql-lora")] == ["1"]
    assert router.balancer("sql-lora") is router.balancer("chat")  # the base model's balancer
    pool.set_state("1", "restarting", False)
    assert router.ready("sql-lora") == () and router.pick("sql-lora", False).name == "sql-lora"  # known: 503, not 404
    router.forget("1")
    assert router.pick("sql-lora", False).status == 404


def test_an_unknown_name_waits_for_model_lists_on_their_way():
    pool, router = fleet()
    router.learning["1"] = object()  # type: ignore[assignment]  # a fetch in progress (server.py's task)
    assert router.pick("sql-lora", False) is WAIT
    assert router.pick("sql-lora", True).status == 404  # after waiting: refused
    assert router.pick("chat", False).name == "chat"  # a configured name never waits


def test_untagged_backends_route_as_before():
    # models given, but no backend has a model (a standalone proxy's upstreams): pick() says "as before"
    pool = BackendPool([Backend("http://a", "http://a"), Backend("http://b", "http://b")])
    pool.set_state("http://a", "ready", True)
    router = ModelRouter(pool, ProxyConfig(), CONFIGS)
    assert router.pick("chat", False) is None and router.pick(None, False) is None and router.pick("x", False) is None
    assert ModelRouter(fleet()[0], ProxyConfig(), {}).pick("chat", False) is None


def test_a_model_the_pool_names_before_the_config_gets_default_settings():
    pool, router = fleet(models={"chat": ProxyConfig()})
    assert router.pick("embed", False).name == "embed"
    assert isinstance(router.balancer("embed"), RoundRobin)


def test_configure_keeps_a_models_balancer_when_its_policy_stays():
    pool, router = fleet(models={"chat": ProxyConfig(policy="prefix_affinity"), "embed": ProxyConfig()})
    chat, embed = router.balancer("chat"), router.balancer("embed")
    router.configure(ProxyConfig(), {"chat": ProxyConfig(policy="prefix_affinity", affinity_load_factor=0.5),
                                     "embed": ProxyConfig(policy="least_outstanding")})
    assert router.balancer("chat") is chat and chat.load_factor == 0.5
    assert router.balancer("embed") is not embed and isinstance(router.balancer("embed"), LeastOutstanding)
