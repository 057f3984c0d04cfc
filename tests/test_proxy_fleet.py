"""Several models behind one ProxyServer (issue 21): two groups of fake vLLM processes, each run
with `--served-model-name`, requests routed by their `model`, with the real `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections import Counter

import aiohttp
import openai
import pytest

from tests.fakevllm.cli import LoraModule, UsageError, parse_args
from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, MESSAGES, client, metric_value, metrics_text, running_proxy, url
from vsup.config.schema import ProxyConfig
from vsup.proxy import bodyparse, codec
from vsup.proxy.backends import Backend, BackendPool

MODELS = {"chat": ProxyConfig(), "embed": ProxyConfig(policy="least_outstanding")}
POOLING = ["/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/pooling", "/classify", "/tokenize", "/detokenize"]


def start_group(model: str, names: list[str], args: tuple[str, ...] = ()):
    fakes = [start_fake(name=name, served_model_names=[model], args=args, env=LEAN) for name in names]
    for fake in fakes:
        fake.wait_ready()
    return fakes


@pytest.fixture(scope="module")
def groups():
    """chat: c0, c1 (c1 also serves the LoRA adapter `sql`); embed: e0."""
    started = []
    try:
        started += start_group("chat", ["c0"])
        started += start_group("chat", ["c1"], ("--lora-modules", "sql=/adapters/sql"))
        started += start_group("embed", ["e0"])
        yield {fake.name: fake for fake in started}
    finally:
        for fake in started:
            fake.cleanup()


def pool_of(fakes, tagged: bool = True) -> BackendPool:
    pool = BackendPool()
    for fake in fakes:
        model = fake.name.rstrip("0123456789").replace("c", "chat").replace("e", "embed") if tagged else ""
        pool.add(Backend(fake.name, fake.url, model))
        pool.set_state(fake.name, "ready", True)
    return pool


@contextlib.asynccontextmanager
async def fleet_proxy(pool: BackendPool, models=MODELS, api_key: str | None = None, **config):
    async with running_proxy(pool, api_key, models=models, **config) as proxy:
        yield proxy


async def post(proxy, path: str, body=None, key: str | None = None, method: str = "POST",
               auth: str | None = None) -> tuple[int, dict, dict | str]:
    """(status, headers, JSON or text) of one request; `auth`: a whole Authorization value instead of Bearer `key`."""
    headers = {"Authorization": auth or f"Bearer {key}"} if key or auth else {}
    async with aiohttp.ClientSession() as session:
        data = json.dumps(body) if body is not None else None
        if data is not None:
            headers["Content-Type"] = "application/json"
        async with session.request(method, url(proxy, path), data=data, headers=headers) as response:
            text = await response.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return response.status, dict(response.headers), parsed


async def chat_by(c: openai.AsyncOpenAI, model: str) -> str:
    raw = await c.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=2)
    assert raw.parse().model == model
    return raw.headers["x-fake-instance"]


# ------------------------------------------------------------------------------- the fake's LoRA


def test_fake_lora_modules_parse_as_vllm_does():
    args = parse_args(["serve", "/m", "--lora-modules", "sql=/a/sql", '{"name": "news", "path": "/a/n", "base_model_name": "b"}',
                       "--port", "8001"])
    assert args.lora_modules == (LoraModule("sql", "/a/sql"), LoraModule("news", "/a/n", "b")) and args.port == 8001
    with pytest.raises(UsageError, match="Invalid format for --lora-modules: sql. Expected format 'name=path' or JSON."):
        parse_args(["serve", "/m", "--lora-modules", "sql"])


# ------------------------------------------------------------------------------- routing by model


async def test_chat_and_embeddings_on_one_base_url_go_to_their_models(groups):
    async with fleet_proxy(pool_of(groups.values())) as proxy:
        c = client(proxy)
        assert Counter([await chat_by(c, "chat") for _ in range(6)]) == {"c0": 3, "c1": 3}  # round robin over chat's two
        for _ in range(3):
            raw = await c.embeddings.with_raw_response.create(model="embed", input=["one", "two"])
            assert raw.headers["x-fake-instance"] == "e0"
            assert raw.parse().model == "embed" and len(raw.parse().data) == 2
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_requests_total", route="/v1/chat/completions", instance="c0", model="chat") == 3
        assert metric_value(text, "vsup_proxy_requests_total", route="/v1/embeddings", instance="e0", model="embed") == 3
        assert metric_value(text, "vsup_instance_ready", instance="e0", model="embed") == 1
        assert 'vsup_proxy_policy_decisions_total' in text


@pytest.mark.parametrize("path", POOLING)
async def test_pooling_routes_go_by_model(groups, path):
    async with fleet_proxy(pool_of(groups.values())) as proxy:
        body = {"input": "a b", "prompt": "a b", "tokens": [1, 2], "query": "q", "documents": ["d"], "text_1": "a", "text_2": "b"}
        _, headers, _ = await post(proxy, path, {**body, "model": "embed"})
        assert headers["X-Fake-Instance"] == "e0"  # whatever the fake answers on this route: it reached embed's instance
        _, headers, _ = await post(proxy, path, {**body, "model": "chat"})
        assert headers["X-Fake-Instance"] in {"c0", "c1"}


async def test_an_audio_upload_goes_by_its_forms_model_field(groups):
    async with fleet_proxy(pool_of(groups.values())) as proxy:
        for model, where in (("embed", {"e0"}), ("chat", {"c0", "c1"})):
            # the fake serves no audio route: its 404 still says which instance the upload reached
            with pytest.raises(openai.NotFoundError) as caught:
                await client(proxy).audio.transcriptions.create(model=model, file=("a.wav", b"RIFF" + b"\0" * 2000))
            assert caught.value.response.headers["x-fake-instance"] in where


def test_form_field_reads_the_field_vllm_reads_from_the_parsed_form():
    field = b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\n%b\r\n'
    upload = b'--b0\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n%b\r\n'
    body = field % b"embed" + upload % b"RIFF" + b"--b0--\r\n"
    assert codec.form_field(body, 'multipart/form-data; boundary="b0"', "model") == "embed"
    assert codec.form_field(body, "multipart/form-data; boundary=b0", "file") is None  # a file, not a field
    assert codec.form_field(body, "application/octet-stream", "model") is None
    assert codec.form_field(body, "multipart/form-data", "model") is None  # no boundary
    # a field sent twice: the last, as starlette's FormData.get gives vLLM
    assert codec.form_field(field % b"embed" + field % b"chat" + b"--b0--\r\n", "multipart/form-data; boundary=b0", "model") == "chat"
    # the text of a field inside an uploaded file is the file's bytes, not a field
    inside = upload % (b'--b0x\r\nContent-Disposition: form-data; name="model"\r\n\r\nembed\r\n') + field % b"chat" + b"--b0--\r\n"
    assert codec.form_field(inside, "multipart/form-data; boundary=b0", "model") == "chat"
    assert codec.form_field(upload % b"x" + b"--b0--\r\n", "multipart/form-data; boundary=b0", "model") is None
    # far into the body (after a large file) as well
    assert codec.form_field(upload % (b"\0" * 300_000) + field % b"embed" + b"--b0--\r\n", "multipart/form-data; boundary=b0", "model") == "embed"


async def test_an_upload_whose_file_holds_a_model_field_goes_by_the_real_field(groups):
    async with fleet_proxy(pool_of(groups.values())) as proxy, aiohttp.ClientSession() as session:
        planted = b'\r\nContent-Disposition: form-data; name="model"\r\n\r\nembed\r\n'
        for _ in range(2):
            form = aiohttp.FormData()
            form.add_field("file", b"RIFF" + planted + b"\0" * 100, filename="a.wav", content_type="audio/wav")
            form.add_field("model", "chat")
            async with session.post(url(proxy, "/v1/audio/transcriptions"), data=form) as response:
                assert response.headers["x-fake-instance"] in {"c0", "c1"}  # the fake's 404 says which instance


async def test_an_unknown_model_is_404_naming_the_served_models(groups):
    async with fleet_proxy(pool_of(groups.values())) as proxy:
        with pytest.raises(openai.NotFoundError) as caught:
            await client(proxy).chat.completions.create(model="gpt-4o", messages=MESSAGES)
        assert caught.value.code == "model_not_found" and caught.value.response.headers.get("x-fake-instance") is None
        message = caught.value.message
        assert "'gpt-4o'" in message and "'chat'" in message and "'embed'" in message and "'sql'" in message
        status, _, answer = await post(proxy, "/v1/embeddings", {"model": "\x1b]0;evil\x07" + "z" * 300, "input": "x"})
        assert status == 404 and "\\x1b]0;evil\\x07" in answer["error"]["message"] and "z" * 101 not in answer["error"]["message"]
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_model_refusals_total", model="", reason="unknown_model") == 2
        assert metric_value(text, "vsup_proxy_requests_total", route="/v1/embeddings", status="404", instance="", model="") == 1


async def test_without_a_model_several_models_answer_400_and_a_query_parameter_names_one(groups):
    async with fleet_proxy(pool_of(groups.values())) as proxy:
        status, headers, answer = await post(proxy, "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 400 and answer["error"]["code"] == "model_required" and "X-Fake-Instance" not in headers
        assert "'chat'" in answer["error"]["message"] and "'embed'" in answer["error"]["message"]
        status, headers, answer = await post(proxy, "/v1/responses/resp_1", None, method="GET")  # no body at all
        assert status == 400 and "query parameter" in answer["error"]["message"]
        _, headers, _ = await post(proxy, "/v1/responses/resp_1?model=embed", None, method="GET")
        assert headers["X-Fake-Instance"] == "e0"
        text = await metrics_text(proxy)
        assert metric_value(text, "vsup_proxy_model_refusals_total", model="", reason="no_model") == 2


async def test_with_one_model_a_request_without_one_goes_to_it(groups):
    chat = [groups["c0"], groups["c1"]]
    async with fleet_proxy(pool_of(chat), models={"chat": ProxyConfig()}) as proxy:
        status, headers, _ = await post(proxy, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 200 and headers["X-Fake-Instance"] in {"c0", "c1"}


async def test_a_model_without_ready_instances_is_503_while_the_other_serves(groups):
    own = start_group("embed", ["e9"])[0]  # this test stops it
    try:
        pool = pool_of([groups["c0"], groups["c1"], own])
        async with fleet_proxy(pool) as proxy:
            c = client(proxy)
            assert (await c.embeddings.with_raw_response.create(model="embed", input="x")).headers["x-fake-instance"] == "e9"
            own.proc.send_signal(signal.SIGKILL)
            own.proc.wait(10)
            pool.set_state("e9", "exited", False)  # as the supervisor reports it
            for _ in range(2):
                with pytest.raises(openai.InternalServerError) as caught:
                    await c.embeddings.create(model="embed", input="x")
                assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
                assert "'embed'" in caught.value.message and caught.value.code == "no_ready_instance"
                assert await chat_by(c, "chat") in {"c0", "c1"}  # the other model keeps serving
            status, _, ready = await post(proxy, "/ready", None, method="GET")
            assert status == 200 and ready["models"] == {"chat": 2, "embed": 0}  # ready: a model still serves
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_model_refusals_total", model="embed", reason="no_ready_instance") == 2
            assert metric_value(text, "vsup_instance_state", instance="e9", state="exited", model="embed") == 1
    finally:
        own.cleanup()


async def test_an_instance_killed_before_its_owner_noticed_is_ejected_and_its_model_answers_503(groups):
    own = start_group("embed", ["e8"])[0]
    try:
        pool = pool_of([groups["c0"], own])
        async with fleet_proxy(pool) as proxy:
            own.proc.send_signal(signal.SIGKILL)
            own.proc.wait(10)
            status, headers, answer = await post(proxy, "/v1/embeddings", {"model": "embed", "input": "x"})
            assert status == 503 and headers["Retry-After"] == "1" and "could be reached" in answer["error"]["message"]
            assert not pool.is_ready("e8") and pool.is_ejected("e8")
            text = await metrics_text(proxy)
            assert metric_value(text, "vsup_proxy_ejections_total", instance="e8", model="embed") == 1
            assert metric_value(text, "vsup_proxy_upstream_errors_total", instance="e8", kind="connect", model="embed") == 1
            assert (await post(proxy, "/v1/completions", {"model": "chat", "prompt": "x", "max_tokens": 1}))[0] == 200
    finally:
        own.cleanup()


# ------------------------------------------------------------------------------- LoRA adapters


async def test_a_lora_adapter_routes_to_the_instances_that_serve_it(groups):
    async with fleet_proxy(pool_of(groups.values())) as proxy:
        c = client(proxy)
        # at once after the start: the model lists are being fetched, the request waits for them
        assert {await chat_by(c, "sql") for _ in range(6)} == {"c1"}
        listed = {m.id: m for m in (await c.models.list()).data}
        assert set(listed) == {"chat", "embed", "sql"}
        assert listed["sql"].model_extra["parent"] == "chat" and listed["chat"].model_extra["parent"] is None
        # its instance restarting: the adapter is known, none ready -> 503 (not 404)
        proxy.pool.set_state("c1", "restarting", False)
        status, headers, _ = await post(proxy, "/v1/chat/completions", {"model": "sql", "messages": MESSAGES})
        assert status == 503 and headers["Retry-After"] == "1"
        proxy.pool.set_state("c1", "ready", True)
        assert await chat_by(c, "sql") == "c1"


async def test_an_adapter_loaded_through_the_admin_route_is_routed_at_once(groups):
    pool = pool_of([groups["c0"], groups["c1"], groups["e0"]])
    async with fleet_proxy(pool, api_key="k", admin_routes=["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]) as proxy:
        c = client(proxy, key="k")
        loaded = {"model": "chat", "lora_name": "news", "lora_path": "/adapters/news"}  # "model": which model's instance
        status, headers, _ = await post(proxy, "/v1/load_lora_adapter", loaded, key="k")
        where = headers["X-Fake-Instance"]
        assert status == 200 and where in {"c0", "c1"}
        try:
            assert {await chat_by(c, "news") for _ in range(4)} == {where}
            assert "news" in {m.id for m in (await c.models.list()).data}
        finally:
            # unloaded where it was loaded (the other chat instance answers 404 as vLLM does)
            for _ in range(4):
                status, headers, _ = await post(proxy, "/v1/unload_lora_adapter", {"model": "chat", "lora_name": "news"}, key="k")
                if status == 200:
                    break
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="news", messages=MESSAGES)


# ------------------------------------------------------------------------------- as before


async def test_without_models_the_body_is_forwarded_untouched_and_labels_stay(groups):
    # no models given (and, separately, models given over untagged backends): vLLM answers its own 404
    for pool, models in ((pool_of(groups.values()), None), (pool_of(groups.values(), tagged=False), MODELS)):
        async with fleet_proxy(pool, models=models) as proxy:
            status, headers, answer = await post(proxy, "/v1/chat/completions", {"model": "gpt-4o", "messages": MESSAGES})
            assert status == 404 and "X-Fake-Instance" in headers and "does not exist" in answer["error"]["message"]
            text = await metrics_text(proxy)
            assert "vsup_proxy_model_refusals_total" not in text or models is not None
            if models is not None:  # untagged: the per-backend families keep their labels
                assert 'model="' not in text.split("vsup_proxy_model_refusals")[0]


async def test_reconfigure_turns_routing_by_model_on_and_off(groups):
    async with fleet_proxy(pool_of(groups.values()), models=None) as proxy:
        body = {"model": "gpt-4o", "prompt": "x", "max_tokens": 1}
        assert "X-Fake-Instance" in (await post(proxy, "/v1/completions", body))[1]
        proxy.reconfigure(proxy.config, None, models=MODELS)
        status, _, answer = await post(proxy, "/v1/completions", body)
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        proxy.reconfigure(proxy.config, None)  # models not given: kept
        assert (await post(proxy, "/v1/completions", body))[0] == 404
        proxy.reconfigure(proxy.config, None, models={"chat": ProxyConfig(policy="least_outstanding"), "embed": ProxyConfig()})
        assert proxy._router.balancer("chat").name == "least_outstanding"
        proxy.reconfigure(proxy.config, None, models={})  # off
        assert "X-Fake-Instance" in (await post(proxy, "/v1/completions", body))[1]


async def test_the_body_is_parsed_once_per_request(groups, monkeypatch):
    calls = []
    real = bodyparse.parse_json

    def counting(body):
        calls.append(body)
        return real(body)

    monkeypatch.setattr(bodyparse, "parse_json", counting)  # small bodies: parsed inline there
    async with fleet_proxy(pool_of(groups.values())) as proxy:
        c = client(proxy)
        await asyncio.gather(chat_by(c, "chat"), chat_by(c, "sql"), c.embeddings.create(model="embed", input="x"))
    assert len(calls) == 3
