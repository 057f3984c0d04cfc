"""The warm-up by kind (vsup/supervisor/warmup.py): which request a model gets (`warmup_kind`, from
vLLM's flags or the model's config.json), the bodies (the completion one unchanged), and each
request against the fake vLLM, a real process on a real socket. The same against real vLLM is in
tests/test_vllm_fleet.py (marker `vllm`)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from vsup.config.schema import VsupConfig
from vsup.supervisor.warmup import ROUTES, kind_of, warm_up, warmup_body, warmup_kind

pytestmark = pytest.mark.timeout(60)


def config(**health) -> VsupConfig:
    return VsupConfig.model_validate({"model": "/srv/m", "served_model_name": "chat", "health": {"warmup": health}})


# ---- which kind ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "kind"), [
    ([], "completion"),
    (["--dtype", "float32", "--enforce-eager"], "completion"),
    (["--runner", "pooling"], "embedding"),                      # 0.32 converts a *ForCausalLM to embed
    (["--runner", "pooling", "--convert", "embed"], "embedding"),
    (["--convert", "embed"], "embedding"),                       # the runner follows the convert
    (["--runner=pooling", "--convert=classify"], "score"),
    (["--enforce-eager", "--convert", "classify"], "score"),
    (["--convert", "reward"], "score"),                          # older vLLMs' spellings
    (["--task", "embed"], "embedding"),
    (["--task", "embedding"], "embedding"),
    (["--task", "score"], "score"),
    (["--task", "generate"], "completion"),
    (["--runner", "generate", "--convert", "embed"], "completion"),
    (["--runner", "pooling", "--runner", "generate"], "completion"),  # the last one wins, as in argparse
])
def test_the_flags_decide(args, kind):
    assert warmup_kind(args, None) == kind


@pytest.mark.parametrize(("architectures", "kind"), [
    (["LlamaForCausalLM"], "completion"),
    (["Qwen2VLForConditionalGeneration"], "completion"),
    (["GPT2LMHeadModel"], "completion"),
    (["InternVLChatModel"], "completion"),
    (["BertModel"], "embedding"),
    (["XLMRobertaModel"], "embedding"),
    (["Qwen3ForTextEncoding"], "embedding"),
    (["BertForSequenceClassification"], "score"),
    (["Qwen3ForSequenceClassification"], "score"),
    (["Qwen2ForRewardModel"], "score"),
    (["JinaForRanking"], "score"),
    (["ChatGLMModel"], "completion"),                            # generating, though its name ends in Model
    (["UltravoxModel"], "completion"),
    (["SomethingNew"], "completion"),                            # vLLM's default runner: generate
    ([], "completion"),
    (["Unknown", "BertModel"], "embedding"),                     # the first that decides
])
def test_the_architectures_decide_when_the_flags_do_not(architectures, kind):
    assert kind_of({}, architectures) == kind


def test_runner_pooling_on_a_generating_architecture_embeds():
    assert kind_of({"--runner": "pooling"}, ["LlamaForCausalLM"]) == "embedding"
    assert kind_of({"--runner": "pooling"}, ["ChatGLMModel"]) == "embedding"  # its name: *Model -> embed
    assert kind_of({"--runner": "pooling"}, ["LlamaForSequenceClassification"]) == "score"


def test_the_model_directorys_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 64}))
    assert warmup_kind([], str(tmp_path)) == "embedding"
    assert warmup_kind(["--runner", "generate"], str(tmp_path)) == "completion"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    assert warmup_kind([], str(tmp_path)) == "score"
    (tmp_path / "config.json").write_text("{not json")
    assert warmup_kind([], str(tmp_path)) == "completion"
    assert warmup_kind([], str(tmp_path / "absent")) == "completion"
    assert warmup_kind([], "BAAI/bge-small-en") == "completion"  # a hub name: nothing to read


def test_hf_overrides_replace_the_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    overrides = json.dumps({"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1})
    assert warmup_kind(["--hf-overrides", overrides], str(tmp_path)) == "score"
    assert warmup_kind(["--hf-overrides", "{broken"], str(tmp_path)) == "completion"


# ---- the bodies ----------------------------------------------------------------------------------

def test_the_completion_body_is_unchanged():
    body = warmup_body(config(prompt="Hi there", max_tokens=2))
    assert json.dumps(body) == '{"model": "chat", "prompt": "Hi there", "max_tokens": 2, "temperature": 0}'
    assert warmup_body(config(prompt="Hi there", max_tokens=2), "completion") == body
    assert ROUTES["completion"] == "/v1/completions"


@pytest.mark.parametrize("kind", ["embedding", "score"])
def test_a_pooling_body_is_the_model_and_the_prompt(kind):
    assert warmup_body(config(prompt="Hi there"), kind) == {"model": "chat", "input": "Hi there"}


# ---- against the fake vLLM -----------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "route", "detail"), [
    ("completion", "/v1/completions", "HTTP 200, 4 token(s) asked"),
    ("embedding", "/v1/embeddings", "HTTP 200, 8 value(s)"),
    ("score", "/pooling", "HTTP 200, 8 value(s)"),
])
async def test_each_kind_against_the_fake_vllm(fake_vllm, kind, route, detail):
    srv = fake_vllm(served_model_names=["embed"]).wait_ready()
    body = {**warmup_body(config(), kind), "model": "embed"}
    async with aiohttp.ClientSession() as session:
        result = await warm_up(session, srv.url, body, 10, kind)
    assert result.ok and result.detail == f"POST {route}: {detail}", result
    assert [e["path"] for e in srv.events("finished")] == [route]


async def test_an_unknown_model_fails_the_warm_up(fake_vllm):
    srv = fake_vllm(served_model_names=["embed"]).wait_ready()
    async with aiohttp.ClientSession() as session:
        result = await warm_up(session, srv.url, {"model": "other", "input": "x"}, 10, "embedding")
    assert not result.ok and result.detail.startswith("POST /v1/embeddings: HTTP 404: "), result
    assert "does not exist" in result.detail


@pytest.mark.parametrize(("kind", "answer", "detail"), [
    ("embedding", {"data": []}, "POST /v1/embeddings: HTTP 200 without data[0].embedding: "),
    ("embedding", {"data": [{"embedding": "not a list"}]}, "POST /v1/embeddings: HTTP 200 without data[0].embedding: "),
    ("score", {"object": "list"}, "POST /pooling: HTTP 200 without data[0].data: "),
    ("completion", {"choices": []}, "POST /v1/completions: HTTP 200 without a completion: "),
])
async def test_a_200_without_a_result_fails(kind, answer, detail):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post(ROUTES[kind], handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        result = await warm_up(session, str(server.make_url("")).rstrip("/"), warmup_body(config(), kind), 5, kind)
    assert not result.ok and result.detail.startswith(detail), result
