"""`vsup batch list | show --follow | cancel` (real CLI processes) against a real ProxyServer with
the Batch API on (its store in tmp_path, its runner feeding a real fake vLLM process), batches made
by the real `openai` SDK; and what the same run shows in ProxyServer.batches() (the status JSON's
`batches`) and /metrics. Keys: two tenants and an admin; a tenant sees only its own batches, another's
is 404 exactly as a missing one; every error is one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import aiohttp
import openai
import pytest

from tests.fakevllm.fixtures import start_fake
from tests.proxy_support import LEAN, model_pool, running_proxy, url, wait_for
from tests.vsup_harness import VSUP
from vsup.config.schema import ApiKeyConfig, BatchConfig, ProxyConfig
from vsup.proxy import ProxyServer

KEYS = [ApiKeyConfig(name="alice", key="key-alice"), ApiKeyConfig(name="bob", key="key-bob"),
        ApiKeyConfig(name="root", key="key-root", admin=True)]
METADATA = {"job": "\x1b]0;pwned\x07", "name": "\u202egnp.exe", "x": "<script>alert(1)</script>"}
SHOWN = "job=\\x1b]0;pwned\\x07, name=\\u202egnp.exe, x=<script>alert(1)</script>"


@pytest.fixture(scope="module")
def fake():
    started = start_fake(name="c0", served_model_names=["chat"], env=LEAN)
    try:
        started.wait_ready()
        yield started
    finally:
        started.cleanup()


@contextlib.asynccontextmanager
async def batch_proxy(fake, tmp_path):
    server = {"batch": BatchConfig(), "batch_dir": tmp_path / "batches", "batch_slots": {"chat": 3}}
    async with running_proxy(model_pool(fake), models={"chat": ProxyConfig()}, server=server, api_keys=KEYS) as proxy:
        yield proxy


async def vsup(proxy: ProxyServer | None, *args: str, key: str | None = "key-alice", target: str | None = None) -> tuple[int, str, str]:
    """A real `vsup` process against the proxy: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VSUP_API_KEY", "VSUP_URL")}
    given = ["--url", target or url(proxy, "")] + (["--api-key", key] if key else [])
    process = await asyncio.create_subprocess_exec(*VSUP, "batch", args[0], *given, *args[1:], env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode or 0, out.decode(), err.decode()


async def make_batch(proxy: ProxyServer, lines: int, delay: float, key: str = "key-alice", metadata: dict | None = None) -> str:
    text = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                        "fake": {"token_delay": delay}}}) + "\n" for i in range(lines))
    async with openai.AsyncOpenAI(base_url=url(proxy, "/v1"), api_key=key, max_retries=0, timeout=30) as client:
        file = await client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata=metadata)
    return batch.id


async def metrics_text(proxy: ProxyServer) -> str:
    async with aiohttp.ClientSession() as session, session.get(url(proxy, "/metrics"),
                                                               headers={"Authorization": "Bearer key-root"}) as answer:
        assert answer.status == 200
        return await answer.text()


async def test_list_show_follow_and_what_status_and_metrics_see(fake, tmp_path):
    async with batch_proxy(fake, tmp_path) as proxy:
        batch_id = await make_batch(proxy, 16, 0.5, metadata=METADATA)  # 6 lines at a time (3 slots, twice that: quiet), 2 s each
        code, out, err = await vsup(proxy, "list")
        assert code == 0, err
        row = next(line for line in out.splitlines() if line.startswith(batch_id))
        assert row.endswith(SHOWN) and "\x1b" not in out and "\u202e" not in out
        assert (await vsup(proxy, "list", key="key-bob"))[1] == "no batches\n"  # another tenant's: not listed
        assert batch_id in (await vsup(proxy, "list", key="key-root"))[1]  # the admin sees every owner's

        found: dict = {}

        def seen_running() -> bool:
            found.update({b["id"]: b for b in proxy.batches() if b["status"] == "in_progress"})
            return batch_id in found

        await wait_for(seen_running, timeout=30, what="the batch in progress")
        running = found[batch_id]
        assert running["owner"] == "alice" and running["models"] == ["chat"] and running["metadata"] == METADATA
        assert "key-alice" not in json.dumps(proxy.batches())  # the owner's name, never its key

        code, out, err = await vsup(proxy, "show", batch_id, "--follow", "--interval", "0.3")
        assert code == 0, (out, err)
        assert out.splitlines()[0] == f"batch {batch_id}: completed"
        assert "  progress 16/16" in out.splitlines()
        assert "16/16" in err  # the bar's last draw (stderr)
        assert "  metadata job: \\x1b]0;pwned\\x07" in out
        assert "\x1b]0" not in out + err and "\u202e" not in out + err

        [ended] = [b for b in proxy.batches() if b["id"] == batch_id]
        assert (ended["status"], ended["completed"], ended["total"], ended["rate"]) == ("completed", 16, 16, None)
        text = await metrics_text(proxy)
        assert 'vsup_batch_lines_total{model="chat",outcome="completed"} 16.0' in text
        assert 'vsup_batch_batches{status="completed"} 1.0' in text
        assert batch_id not in text and "alice" not in text and 'custom_id' not in text


async def test_cancel_and_the_one_line_errors(fake, tmp_path):
    async with batch_proxy(fake, tmp_path) as proxy:
        slow = await make_batch(proxy, 40, 0.5)
        code, _, err = await vsup(proxy, "cancel", slow, key="key-bob")
        assert code == 2 and err == f"vsup: error: {url(proxy, '')}/v1/batches/{slow}/cancel: 404: No such Batch object: {slow}\n"
        code, out, err = await vsup(proxy, "cancel", slow)
        assert code == 0, err
        assert out in (f"batch {slow}: cancelling\n", f"batch {slow}: cancelled\n")
        code, out, err = await vsup(proxy, "show", slow, "--follow", "--interval", "0.3")
        assert code == 1, (out, err)  # it ended, but not completed
        assert out.splitlines()[0] == f"batch {slow}: cancelled"
        code, _, err = await vsup(proxy, "show", "batch_nope")
        assert code == 2 and err.endswith(": 404: No such Batch object: batch_nope\n") and err.count("\n") == 1
        code, _, err = await vsup(proxy, "list", key=None)
        assert code == 2 and "wants an API key (401): give one with --api-key or VSUP_API_KEY" in err and err.count("\n") == 1
        code, _, err = await vsup(proxy, "list", key="wrong")
        assert code == 2 and "(401)" in err
        done = await make_batch(proxy, 1, 0.0)
        await wait_for(lambda: any(b["id"] == done and b["status"] == "completed" for b in proxy.batches()), timeout=30)
        code, _, err = await vsup(proxy, "cancel", done)
        assert code == 2 and ": 409: " in err and "only a validating or in_progress batch can be cancelled" in err
        port = proxy.port
    code, _, err = await vsup(None, "list", target=f"http://127.0.0.1:{port}")
    assert code == 2 and err.startswith(f"vsup: error: no proxy answers at http://127.0.0.1:{port} (") and err.count("\n") == 1
