"""The Batch API under `vsup run`, end to end with real processes: vsup over fake vLLM instances (a
chat model and an embedding model, `models:`), tenants' keys (proxy.api_keys), the real `openai`
SDK. A chat batch and an embeddings batch run to completion, each output line OpenAI's shape with
the instance's answer; another tenant's key gets 404 on the batch, its input and output files, as
for ones that do not exist; an admin key sees both tenants'. On by default: the config has no
`batch:` key but its folder."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.vsup_harness import VsupRun, make_config

pytestmark = pytest.mark.timeout(120)

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789", "ops": "sk-ops-0123456789"}


@pytest.fixture
def vsup(tmp_path):
    config = make_config(tmp_path, instances=2)
    for key in ("model", "instances"):
        config.pop(key)
    config["models"] = [
        {"model": "fake-chat", "served_model_name": "chat", "instances": 1, "vllm": {"args": ["--max-num-seqs", "4"]}},
        {"model": "fake-embed", "served_model_name": "embed", "instances": 1,
         "vllm": {"args": ["--max-num-seqs", "4", "--runner", "pooling", "--convert", "embed"]}},
    ]
    config["proxy"]["api_keys"] = [{"name": name, "key_env": f"KEY_{name.upper()}", "admin": name == "ops"} for name in KEYS]
    config["batch"] = {"dir": str(tmp_path / "batches")}  # only where the store lives: batch is on by default
    run = VsupRun(tmp_path, config, env={f"KEY_{name.upper()}": key for name, key in KEYS.items()})
    try:
        run.wait_ready(2)
        yield run
    finally:
        run.close()


def client(run: VsupRun, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{run.proxy_port}/v1", api_key=KEYS[who], max_retries=0, timeout=30)


def lines(endpoint: str, count: int) -> tuple[bytes, list[str]]:
    ids = [f"line-{n}" for n in range(count)]
    if endpoint == "/v1/embeddings":
        bodies = [{"model": "embed", "input": f"text number {n}"} for n in range(count)]
    else:
        bodies = [{"model": "chat", "messages": [{"role": "user", "content": f"question {n}"}], "max_tokens": 4} for n in range(count)]
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body}) + "\n"
                   for cid, body in zip(ids, bodies, strict=True))
    return data.encode(), ids


def finished(sdk: openai.OpenAI, batch_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s: {batch.request_counts}")


def test_a_chat_and_an_embeddings_batch_complete_and_belong_to_their_tenant(vsup):
    alice, bob, ops = client(vsup, "alice"), client(vsup, "bob"), client(vsup, "ops")
    chat_data, chat_ids = lines("/v1/chat/completions", 24)
    embed_data, embed_ids = lines("/v1/embeddings", 24)
    chat_file = alice.files.create(file=("chat.jsonl", chat_data), purpose="batch")
    embed_file = bob.files.create(file=("embed.jsonl", embed_data), purpose="batch")
    chat = alice.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                metadata={"job": "chat"})
    embed = bob.batches.create(input_file_id=embed_file.id, endpoint="/v1/embeddings", completion_window="24h")
    assert chat.status == "validating" and chat.metadata == {"job": "chat"} and chat.input_file_id == chat_file.id

    chat, embed = finished(alice, chat.id), finished(bob, embed.id)
    for batch, ids in ((chat, chat_ids), (embed, embed_ids)):
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (len(ids), len(ids), 0)
        assert batch.output_file_id and batch.error_file_id is None
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.created_at <= batch.completed_at
    chat_out = [json.loads(line) for line in alice.files.content(chat.output_file_id).read().splitlines()]
    embed_out = [json.loads(line) for line in bob.files.content(embed.output_file_id).read().splitlines()]
    # OpenAI's output line, in line order, each the instance's answer
    assert [line["custom_id"] for line in chat_out] == chat_ids and [line["custom_id"] for line in embed_out] == embed_ids
    for line in chat_out:
        assert line["id"].startswith("batch_req_") and line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["request_id"] and line["response"]["body"]["object"] == "chat.completion"
        assert line["response"]["body"]["choices"][0]["message"]["content"]
    for line in embed_out:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "list" and body["model"] == "embed"
        assert len(body["data"]) == 1 and all(isinstance(x, float) for x in body["data"][0]["embedding"])
    assert alice.files.retrieve(chat.output_file_id).purpose == "batch_output"

    # another tenant: 404 for all of alice's, as for what does not exist; nothing of hers listed
    for call in (lambda: bob.batches.retrieve(chat.id), lambda: bob.batches.cancel(chat.id),
                 lambda: bob.files.retrieve(chat_file.id), lambda: bob.files.content(chat_file.id),
                 lambda: bob.files.retrieve(chat.output_file_id), lambda: bob.files.content(chat.output_file_id),
                 lambda: bob.files.delete(chat.output_file_id),
                 lambda: bob.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as missing:
        bob.batches.retrieve("batch_" + "0" * 32)
    with pytest.raises(openai.NotFoundError) as theirs:
        bob.batches.retrieve(chat.id)
    assert json.dumps(theirs.value.body).replace(chat.id, "batch_" + "0" * 32) == json.dumps(missing.value.body)
    assert [b.id for b in bob.batches.list()] == [embed.id] and [b.id for b in alice.batches.list()] == [chat.id]
    assert chat_file.id not in {f.id for f in bob.files.list()}
    # alice's things are still hers, whole; the admin key sees every tenant's
    assert [json.loads(line) for line in alice.files.content(chat.output_file_id).read().splitlines()] == chat_out
    assert {b.id for b in ops.batches.list()} == {chat.id, embed.id}
    assert ops.batches.retrieve(chat.id).status == "completed" and ops.files.content(embed.output_file_id).read()
    # no key: 401, not a listing
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{vsup.proxy_port}/v1", api_key="sk-nobody", max_retries=0).batches.list()
