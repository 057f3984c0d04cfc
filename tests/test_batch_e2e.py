"""The Batch API end to end: the real `openai` client against a real ProxyServer with its batch
store, over a real fake vLLM process: upload, create, wait for completed, read the output (one
line per custom_id); a stop mid-batch and a new proxy over the same folder finish the same batch
id; another key's batch is a 404 and a metrics key is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, client, close_clients, model_pool, running_proxy
from vsup.config.schema import ApiKeyConfig, BatchConfig, ProxyConfig
from vsup.proxy import ProxyServer
from vsup.proxy.backends import Backend, BackendPool

ENDPOINT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fake():
    started = start_fake(name="c0", served_model_names=["chat"], env=LEAN)
    try:
        started.wait_ready()
        yield started
    finally:
        started.cleanup()


@contextlib.asynccontextmanager
async def batch_proxy(fake, folder, slots: int = 4, **front):
    async with running_proxy(model_pool(fake), models={"chat": ProxyConfig()},
                             server={"batch": BatchConfig(slots_per_instance=slots), "batch_dir": folder}, **front) as proxy:
        yield proxy


def jsonl(ids: list[str], delay: float | None = None) -> bytes:
    lines = []
    for cid in ids:
        body: dict = {"model": "chat", "messages": [{"role": "user", "content": f"question {cid}"}], "max_tokens": 3}
        if delay is not None:
            body["fake"] = {"token_delay": delay}
        lines.append(json.dumps({"custom_id": cid, "method": "POST", "url": ENDPOINT, "body": body}))
    return ("\n".join(lines) + "\n").encode()


async def wait_done(c: openai.AsyncOpenAI, batch_id: str, timeout: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        batch = await c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert asyncio.get_running_loop().time() < deadline, f"still {batch.status}: {batch.request_counts}"
        await asyncio.sleep(0.05)


async def test_the_openai_client_runs_a_batch_to_completion(fake, tmp_path):
    ids = [f"r{i}" for i in range(25)]
    async with batch_proxy(fake, tmp_path / "batches") as proxy:
        c = client(proxy)
        uploaded = await c.files.create(file=("in.jsonl", jsonl(ids)), purpose="batch")
        batch = await c.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h",
                                       metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        done = await wait_done(c, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (25, 25, 0)
        assert done.output_file_id and done.error_file_id is None
        text = (await c.files.content(done.output_file_id)).text
        lines = [json.loads(line) for line in text.splitlines()]
        assert [line["custom_id"] for line in lines] == ids  # one line per custom_id, in input order
        for line in lines:
            assert line["error"] is None and line["id"].startswith("batch_req_")
            assert line["response"]["status_code"] == 200
            assert line["response"]["body"]["object"] == "chat.completion"
            assert line["response"]["request_id"]


async def test_a_stop_mid_batch_resumes_the_same_batch(fake, tmp_path):
    ids = [f"r{i}" for i in range(16)]
    folder = tmp_path / "batches"
    async with batch_proxy(fake, folder, slots=3) as proxy:
        c = client(proxy)
        uploaded = await c.files.create(file=("in.jsonl", jsonl(ids, delay=0.05)), purpose="batch")
        batch = await c.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
        while (await c.batches.retrieve(batch.id)).request_counts.completed < 2:
            await asyncio.sleep(0.05)
    async with batch_proxy(fake, folder, slots=3) as proxy:  # the same folder: recover() and go on
        c = client(proxy)
        done = await wait_done(c, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 16
        lines = [json.loads(line) for line in (await c.files.content(done.output_file_id)).text.splitlines()]
        assert sorted(line["custom_id"] for line in lines) == sorted(ids)  # each exactly once


async def test_keys_own_their_batches(fake, tmp_path):
    keys = [ApiKeyConfig(name="alice", key="k-alice"), ApiKeyConfig(name="bob", key="k-bob"),
            ApiKeyConfig(name="scraper", key="k-scrape", metrics=True)]
    async with batch_proxy(fake, tmp_path / "batches", api_keys=keys) as proxy:
        alice, bob, scraper = client(proxy, "k-alice"), client(proxy, "k-bob"), client(proxy, "k-scrape")
        uploaded = await alice.files.create(file=("in.jsonl", jsonl(["a"])), purpose="batch")
        batch = await alice.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            await bob.batches.retrieve(batch.id)
        with pytest.raises(openai.PermissionDeniedError):
            await scraper.batches.list()
        with pytest.raises(openai.AuthenticationError):
            await client(proxy, "wrong").batches.list()
        assert (await wait_done(alice, batch.id)).status == "completed"


def test_vsup_proxy_batch_dir_survives_kill_9(tmp_path):
    """`vsup proxy --batch-dir` as a real process, killed with -9 halfway through a batch and
    started again over the same folder: the same batch id completes, one result per custom_id."""
    import os
    import signal
    import stat
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.fakevllm.fixtures import free_port
    from tests.proxy_support import start_fakes

    repo = Path(__file__).resolve().parents[1]
    (upstream,) = start_fakes(["u"])
    folder = tmp_path / "batches"
    config = tmp_path / "proxy.yaml"
    config.write_text("batch:\n  slots_per_instance: 3\nhealth:\n  interval: 0.2\n")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(repo), VSUP_API_KEY="")

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", "from vsup.cli.main import main; main()", "proxy", "--upstream", upstream.url,
             "--port", str(port), "--config", str(config), "--batch-dir", str(folder)],
            cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def ready(c: openai.OpenAI) -> None:
        deadline = time.monotonic() + 20
        while True:
            try:
                c.batches.list()
                return
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the proxy did not come up"
                time.sleep(0.1)

    ids = [f"k{i}" for i in range(30)]
    lines = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": ENDPOINT, "body": {
        "model": "fake-model", "messages": [{"role": "user", "content": cid}], "max_tokens": 3,
        "fake": {"token_delay": 0.05}}}) + "\n" for cid in ids).encode()
    proc = start()
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        ready(c)
        uploaded = c.files.create(file=("in.jsonl", lines), purpose="batch")
        batch = c.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
        deadline = time.monotonic() + 30
        while (before := c.batches.retrieve(batch.id)).request_counts.completed < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # lines in flight: their attempts are forgotten
        proc.wait(10)
        assert before.status == "in_progress" and before.request_counts.completed < 30  # halfway
        info = os.stat(folder)
        assert stat.S_IMODE(info.st_mode) == 0o700
        assert stat.S_IMODE(os.stat(folder / "batches.sqlite3").st_mode) == 0o600

        proc = start()
        ready(c)
        deadline = time.monotonic() + 60
        while (done := c.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, done.request_counts
            time.sleep(0.1)
        assert done.status == "completed" and done.request_counts.completed == 30
        results = [json.loads(line) for line in c.files.content(done.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in results) == sorted(ids)  # each exactly once
    finally:
        c.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        upstream.cleanup()


async def test_a_front_that_passes_keys_on_sends_each_line_as_its_owner(fake, tmp_path):
    keys = [ApiKeyConfig(name="alice", key="k-alice")]
    pool = BackendPool()
    pool.add(Backend(fake.name, fake.url, "chat"))
    pool.set_state(fake.name, "ready", True)
    node = ProxyServer(ProxyConfig(port=0, api_keys=keys), pool, models={"chat": ProxyConfig()})  # checks the keys
    await node.start()
    try:
        front_pool = BackendPool()
        front_pool.add(Backend("node", f"http://127.0.0.1:{node.port}", "chat"))
        front_pool.set_state("node", "ready", True)
        front = ProxyServer(ProxyConfig(port=0, api_keys=keys), front_pool, models={"chat": ProxyConfig()},
                            forward_key=True, batch=BatchConfig(slots_per_instance=4), batch_dir=tmp_path / "batches")
        await front.start()
        try:
            alice = client(front, "k-alice")
            uploaded = await alice.files.create(file=("in.jsonl", jsonl(["a", "b", "c"])), purpose="batch")
            batch = await alice.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
            done = await wait_done(alice, batch.id)
            assert (done.status, done.request_counts.completed) == ("completed", 3)  # the node took alice's key
        finally:
            await close_clients(front)
            await front.drain_and_stop(0)
    finally:
        await node.drain_and_stop(0)


async def test_a_reload_that_removes_a_model_fails_its_lines(fake, tmp_path):
    pool = BackendPool()
    pool.add(Backend(fake.name, fake.url, "chat"))
    pool.set_state(fake.name, "ready", True)
    config = ProxyConfig(port=0)
    proxy = ProxyServer(config, pool, models={"chat": ProxyConfig(), "later": ProxyConfig()},
                        batch=BatchConfig(slots_per_instance=4), batch_dir=tmp_path / "batches")
    await proxy.start()
    try:
        c = client(proxy)
        lines = [{"custom_id": f"{model}-{i}", "method": "POST", "url": ENDPOINT,
                  "body": {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}}
                 for i in range(3) for model in ("chat", "later")]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = await c.files.create(file=("in.jsonl", data), purpose="batch")
        batch = await c.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
        # "later" has no instance yet: its lines wait while chat's run
        while (await c.batches.retrieve(batch.id)).request_counts.completed < 3:
            await asyncio.sleep(0.05)
        assert (await c.batches.retrieve(batch.id)).status == "in_progress"
        proxy.reconfigure(config, None, models={"chat": ProxyConfig()})  # the reload drops "later"
        done = await wait_done(c, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 3)
        errors = [json.loads(line) for line in (await c.files.content(done.error_file_id)).text.splitlines()]
        assert sorted(e["custom_id"] for e in errors) == ["later-0", "later-1", "later-2"]
        assert {e["error"]["code"] for e in errors} == {"model_not_found"}
    finally:
        await close_clients(proxy)
        await proxy.drain_and_stop(0)
