"""Tenants stay apart (issue 30 §1, §2): a name belongs to the model that owns it, and only an
admin key opens the admin routes, /metrics and /status. Tried as a tenant would: real fake-vLLM
processes of two models behind one ProxyServer, real sockets, another tenant's key."""

from __future__ import annotations

import base64
import logging
from collections import Counter

import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, MESSAGES, client, running_proxy
from tests.test_observe import SAMPLE_STATUS
from tests.test_proxy_fleet import post
from vsup.config.names import ALIAS, Name, model_names
from vsup.config.schema import ApiKeyConfig, ProxyConfig, parse_config
from vsup.errors import ConfigError
from vsup.observe.page import status_page
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool
from vsup.proxy.routing import ModelRouter

MODELS = {"a": ProxyConfig(), "b": ProxyConfig()}
KEYS = [ApiKeyConfig(name="low", key="k-low", priority=-5), ApiKeyConfig(name="ops", key="k-ops", admin=True),
        ApiKeyConfig(name="prom", key="k-prom", metrics=True)]
ADMIN_ROUTES = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache"]


@pytest.fixture(scope="module")
def fakes():
    """a0, a1: model a (also served as the alias `a-old`); b0: model b; a2: model a, whose vLLM
    was started with an adapter called `b` (an instance that reports another model's name)."""
    started = []
    try:
        for name, served, args in (("a0", ["a", "a-old"], ()), ("a1", ["a", "a-old"], ()), ("b0", ["b"], ()),
                                   ("a2", ["a"], ("--lora-modules", "b=/adapters/evil"))):
            started.append(start_fake(name=name, served_model_names=served, args=args, env=LEAN))
        for fake in started:
            fake.wait_ready()
        yield {fake.name: fake for fake in started}
    finally:
        for fake in started:
            fake.cleanup()


def pool_of(*fakes) -> BackendPool:
    pool = BackendPool()
    for fake in fakes:
        pool.add(Backend(fake.name, fake.url, fake.name[0]))
        pool.set_state(fake.name, "ready", True)
    return pool


def tenant_proxy(pool: BackendPool, **config):
    return running_proxy(pool, models=MODELS, names={"a-old": Name("a", ALIAS)}, **config)


call = post  # (status, headers, JSON or text), Bearer `key` or a whole `auth` value


async def answered_by(proxy, model: str, key: str, times: int = 6) -> Counter:
    c = client(proxy, key=key)
    served = Counter()
    for _ in range(times):
        raw = await c.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=2)
        served[raw.headers["x-fake-instance"]] += 1
    return served


async def listed(proxy, key: str) -> dict[str, dict]:
    status, _, body = await call(proxy, "/v1/models", key=key, method="GET")
    assert status == 200
    return {entry["id"]: entry for entry in body["data"]}


# ------------------------------------------------------------------------------- names belong to models


async def test_a_tenant_cannot_take_over_another_models_name_through_the_admin_route(fakes):
    async with tenant_proxy(pool_of(fakes["a0"], fakes["a1"], fakes["b0"]), api_keys=KEYS, admin_routes=ADMIN_ROUTES) as proxy:
        before = await listed(proxy, "k-low")
        evil = {"model": "a", "lora_name": "b", "lora_path": "/adapters/evil"}
        # the low-priority tenant: the admin route is not its to use
        status, headers, body = await call(proxy, "/v1/load_lora_adapter", evil, key="k-low")
        assert status == 403 and body["error"]["code"] == "forbidden" and "X-Fake-Instance" not in headers
        # even an admin key cannot give model a the name of model b: 409 in OpenAI's shape, never forwarded
        status, headers, body = await call(proxy, "/v1/load_lora_adapter", evil, key="k-ops")
        assert status == 409 and "X-Fake-Instance" not in headers
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "lora_name"
        assert "the name of the model 'b'" in body["error"]["message"]
        # nor the alias of model a (it is a base name), nor through the alias as the target
        for name, target in (("a-old", "a"), ("b", "a-old")):
            status, _, body = await call(proxy, "/v1/load_lora_adapter", {"model": target, "lora_name": name, "lora_path": "/x"}, key="k-ops")
            assert status == 409, (name, target)
        for fake in ("a0", "a1", "b0"):
            assert not fakes[fake].events("lora_adapter"), fake
        # every request for b reaches model b; /v1/models is what it was
        assert await answered_by(proxy, "b", "k-low") == Counter({"b0": 6})
        assert await listed(proxy, "k-low") == before and before["b"]["parent"] is None


async def test_an_instance_that_lists_another_models_name_is_not_routed_it(fakes, caplog):
    caplog.set_level(logging.WARNING, "vsup.proxy")
    async with tenant_proxy(pool_of(fakes["a2"], fakes["b0"])) as proxy:
        assert await answered_by(proxy, "b", "any", times=8) == Counter({"b0": 8})
        models = await listed(proxy, "any")
        assert set(models) == {"a", "b"} and models["b"]["parent"] is None and models["b"]["root"] != "/adapters/evil"
        assert await answered_by(proxy, "a", "any", times=2) == Counter({"a2": 2})  # its own name still routes there
    warned = [r.getMessage() for r in caplog.records if "belongs to the model" in r.getMessage()]
    assert warned and "instance a2 (model 'a') lists the model name 'b'" in warned[0]


async def test_an_alias_routes_to_its_models_instances_and_is_listed(fakes):
    async with tenant_proxy(pool_of(fakes["a0"], fakes["a1"], fakes["b0"])) as proxy:
        assert set(await answered_by(proxy, "a-old", "any")) == {"a0", "a1"}
        models = await listed(proxy, "any")
        assert set(models) == {"a", "a-old", "b"} and models["a-old"]["parent"] is None


def _fleet(a_extra: str, b_extra: str = "") -> str:
    return ("models:\n"
            "  - model: /m/a\n    served_model_name: a\n" + a_extra +
            "  - model: /m/b\n    served_model_name: b\n" + b_extra)


@pytest.mark.parametrize(("a_extra", "b_extra", "first", "second"), [
    ("    vllm:\n      args: [--lora-modules, b=/adapters/b]\n", "", "models[0].vllm.args[1]", "models[1].served_model_name"),
    ("    vllm:\n      args: [--max-model-len, '64', --lora-modules, 'x=/x', '{\"name\": \"b2\", \"path\": \"/p\"}']\n",
     "    aliases: [b2]\n", "models[0].vllm.args[4]", "models[1].aliases[0]"),
    ("    aliases: [shared]\n", "    aliases: [shared]\n", "models[0].aliases[0]", "models[1].aliases[0]"),
    ("    vllm:\n      args: ['--lora-modules=b=/adapters/b']\n", "", "models[0].vllm.args[0]", "models[1].served_model_name"),
])
def test_a_name_claimed_by_two_models_is_refused_at_load_naming_both(a_extra, b_extra, first, second):
    with pytest.raises(ConfigError) as caught:
        parse_config(_fleet(a_extra, b_extra), "fleet.yaml")
    message = str(caught.value)
    lines = {key: f"fleet.yaml:{n}: {key}" for key, n in ((first, None), (second, None))}
    for key in lines:
        assert f": {key}" in message and "fleet.yaml:" in message, message
    assert "each name belongs to one model" in message and "\n" not in message


def test_the_config_names_the_lines_of_both_entries():
    text = _fleet("    vllm:\n      args: [--lora-modules, b=/adapters/b]\n")
    with pytest.raises(ConfigError, match=r"^fleet.yaml:7: models\[1\].served_model_name: 'b' \(the served name of the model 'b'\) is "
                       r"also a LoRA adapter .* of the model 'a' \(fleet.yaml:5: models\[0\].vllm.args\[1\]\)"):
        parse_config(text, "fleet.yaml")


def test_aliases_are_owned_passed_to_vllm_and_checked():
    cfg = parse_config(_fleet("    aliases: [a-old, gpt-4o]\n    vllm:\n      args: [--lora-modules, sql=/s]\n"))
    assert model_names(cfg) == {"a-old": Name("a", ALIAS), "gpt-4o": Name("a", ALIAS), "sql": Name("a", "adapter")}
    from tests.test_launch import instance
    from vsup.config.fleet import view_of
    from vsup.supervisor.launch import build_command

    argv, _ = build_command(instance(launcher="none"), view_of(cfg, "a").config, {})
    assert argv[argv.index("--served-model-name"):][:4] == ["--served-model-name", "a", "a-old", "gpt-4o"]
    with pytest.raises(ConfigError, match=r"aliases: set it in each entry of models"):
        parse_config("aliases: [x]\n" + _fleet(""))
    with pytest.raises(ConfigError, match=r"'a' \(an alias of the model 'a'\) is also the served name its own"):
        parse_config("model: /m/a\nserved_model_name: a\naliases: [a]\n")


# ------------------------------------------------------------------------------- admin by key


async def test_only_admin_keys_open_the_admin_routes_metrics_and_status(fakes):
    async with tenant_proxy(pool_of(fakes["a0"], fakes["b0"]), api_keys=KEYS, admin_routes=ADMIN_ROUTES) as proxy:
        proxy.add_page("/status", status_page(lambda: SAMPLE_STATUS, 5.0))
        basic = "Basic " + base64.b64encode(b"anyone:k-low").decode()
        for path, method, auth in (("/metrics", "GET", None), ("/status", "GET", None), ("/status", "GET", basic),
                                   ("/reset_prefix_cache", "POST", None)):
            status, headers, body = await call(proxy, path, {"model": "a"} if method == "POST" else None, key="k-low",
                                               method=method, auth=auth)
            assert status == 403 and body["error"]["code"] == "forbidden" and "X-Fake-Instance" not in headers, (path, auth)
        for path in ("/metrics", "/status"):
            assert (await call(proxy, path, key="k-ops", method="GET"))[0] == 200, path
        status, headers, _ = await call(proxy, "/reset_prefix_cache", {"model": "a"}, key="k-ops")
        assert status == 200 and headers["X-Fake-Instance"] == "a0"
        # the metrics key: /metrics, nothing else
        status, _, text = await call(proxy, "/metrics", key="k-prom", method="GET")
        assert status == 200 and "vsup_proxy_requests_total" in text
        for path, body in (("/v1/chat/completions", {"model": "a", "messages": MESSAGES}), ("/reset_prefix_cache", {"model": "a"})):
            status, headers, answer = await call(proxy, path, body, key="k-prom")
            assert status == 403 and "metrics key" in answer["error"]["message"] and "X-Fake-Instance" not in headers
        assert (await call(proxy, "/status", key="k-prom", method="GET"))[0] == 403
        # the tenant still serves; no key at all is 401 everywhere
        assert await answered_by(proxy, "a", "k-low", times=1) == Counter({"a0": 1})
        assert (await call(proxy, "/metrics", method="GET"))[0] == 401


async def test_the_single_api_key_is_an_admin_key_beside_named_ones(fakes):
    async with tenant_proxy(pool_of(fakes["a0"], fakes["b0"]), api_key="root", api_keys=KEYS[:1], admin_routes=ADMIN_ROUTES) as proxy:
        assert (await call(proxy, "/metrics", key="root", method="GET"))[0] == 200
        assert (await call(proxy, "/metrics", key="k-low", method="GET"))[0] == 403


def test_admin_routes_with_named_keys_and_no_admin_key_refuse_to_start():
    with pytest.raises(Exception, match=r"admin: true on a key of proxy.api_keys"):
        ProxyServer(ProxyConfig(port=0, api_keys=KEYS[:1], admin_routes=ADMIN_ROUTES), BackendPool())


def test_a_key_is_admin_or_metrics_not_both():
    with pytest.raises(ConfigError, match=r"set admin or metrics, not both"):
        parse_config("model: m\nproxy:\n  api_keys: [{name: x, key_env: X, admin: true, metrics: true}]\n")


def test_an_adapter_the_config_gives_a_model_is_routed_only_once_its_instance_lists_it():
    pool = BackendPool()
    for name in ("a0", "b0"):
        pool.add(Backend(name, f"http://127.0.0.1:1/{name}", name[0]))
        pool.set_state(name, "ready", True)
    router = ModelRouter(pool, ProxyConfig(), MODELS, {"sql": Name("b", "adapter"), "a-old": Name("a", ALIAS)})
    assert router.pick("a-old", False).ready == (pool.get("a0"),)  # an alias: every instance of its model, at once
    assert router.pick("sql", True).status == 404  # not listed yet: no route (a request waits for the lists)
    assert router.learn("a0", ["a", "sql", "b"]) == {"a"}  # model a's instance cannot take b's names
    assert router.learn("b0", ["b", "sql"]) == {"b", "sql"}
    assert router.pick("sql", False).ready == (pool.get("b0"),) and router.pick("b", False).ready == (pool.get("b0"),)
    assert router.adapter_refused(router.pick("a", False), "sql").status == 409
    assert router.adapter_refused(router.pick("b", False), "sql") is None  # its own: vLLM says whether it is loaded
    # a reload that gives the name to another model takes it from the instance that listed it
    router.configure(ProxyConfig(), MODELS, {"sql": Name("a", "adapter")})
    assert "sql" not in router.learned["b0"]
