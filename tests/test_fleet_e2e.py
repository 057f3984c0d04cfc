"""A fleet of models end to end: a real `vsup run` over fake vLLM processes (tests/fakevllm, each
started with its model's `--served-model-name`), planned on a 2-node machine of 4 cores each
(`--fsroot`, tests/sysfs_builder.py; launcher none, so nothing is pinned to CPUs this box lacks).
While a steady load of the chat model goes through the proxy (which routes it by its "model"),
reloads add a model, change one model's count and remove one (drained): no chat request fails
and its process is never restarted. The in-process versions are tests/test_fleet_run.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml

from tests.sysfs_builder import build_sysfs
from tests.test_supervisor import cli, transitions
from tests.vsup_harness import VsupRun, instance_connection, make_config

pytestmark = pytest.mark.timeout(240)

CHAT = {"model": "fake-chat", "served_model_name": "chat", "instances": 1, "placement": {"cores_per_instance": 1}}
EMBED = {"model": "fake-embed", "served_model_name": "embed", "instances": 1, "placement": {"cores_per_instance": 1},
         "vllm": {"args": ["--runner", "pooling", "--convert", "embed"]}}
RERANK = {"model": "fake-rerank", "served_model_name": "rerank", "instances": 1, "placement": {"cores_per_instance": 1},
          "vllm": {"args": ["--runner", "pooling"]}}


def start(tmp_path, models: list[dict]) -> VsupRun:
    config = make_config(tmp_path, instances=6, placement={"launcher": "none"})
    del config["model"], config["instances"]
    config["models"] = models
    fsroot = build_sysfs(tmp_path / "machine", nodes=(4, 4))
    return VsupRun(tmp_path, config, args=["--fsroot", str(fsroot)])


def rewrite(run: VsupRun, models: list[dict]) -> None:
    run.config["models"] = models
    run.config_path.write_text(yaml.safe_dump(run.config))


def reload(run: VsupRun) -> dict:
    result = cli("reload", "--config", str(run.config_path), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return run.status()["rollout"]


def of_model(status: dict, model: str) -> list[dict]:
    return [inst for inst in status["instances"] if model_of(inst) == model]


def model_of(inst: dict) -> str:
    """The served model of an instance, as its own /v1/models says (status's "model" must agree)."""
    conn = instance_connection(inst["address"], 5)
    try:
        conn.request("GET", "/v1/models")
        served = json.loads(conn.getresponse().read())["data"][0]["id"]
    finally:
        conn.close()
    assert inst["model"] == served, inst
    return served


class ChatLoad:
    """Two clients sending chat completions through the proxy at `address`, back to back."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.results: list[int] = []
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(2)]
        for thread in self._threads:
            thread.start()

    def _client(self) -> None:
        while not self._done.is_set():
            try:
                conn = instance_connection(self.address, 30)
                body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                self.results.append(response.status)
                conn.close()
            except OSError:
                self.results.append(-1)
                time.sleep(0.05)  # a refused connection must not spin

    def stop(self) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(60)

    @property
    def failed(self) -> list[int]:
        return [r for r in self.results if r != 200]


def test_a_two_model_fleet_reloads_add_resize_and_remove_models_while_the_chat_model_serves(tmp_path):
    run = start(tmp_path, [CHAT, EMBED])
    try:
        status = run.wait_ready(2)
        assert [i["index"] for i in status["instances"]] == [0, 1]
        chat = of_model(status, "chat")[0]
        embed = of_model(status, "embed")[0]
        # warm-up by kind: the pooling model's was one embedding
        warmed = [t["reason"] for t in transitions(embed, "warming", "ready")]
        assert warmed and "POST /v1/embeddings: HTTP 200" in warmed[0], embed["transitions"]
        assert "POST /v1/completions: HTTP 200" in transitions(chat, "warming", "ready")[0]["reason"]
        load = ChatLoad(f"127.0.0.1:{run.proxy_port}")
        try:
            time.sleep(0.5)
            rewrite(run, [CHAT, EMBED, RERANK])  # a model added
            record = reload(run)
            # the models it does not change keep their CPUs (topology.fleet's keep): nothing is replaced
            assert record["state"] == "done" and [(s["index"], s["action"]) for s in record["steps"]] == [(2, "add")], record
            rewrite(run, [CHAT, {**EMBED, "instances": 2}, RERANK])  # one model's count changed
            record = reload(run)
            assert record["state"] == "done", record
            assert [(s["index"], s["action"]) for s in record["steps"]] == [(3, "add")], record
            rewrite(run, [CHAT, RERANK])  # a model removed: its instances drained
            record = reload(run)
            assert record["state"] == "done", record
            removed = [(s["index"], s["action"], s["detail"]) for s in record["steps"]]
            assert removed == [(3, "remove", "drained and stopped"), (1, "remove", "drained and stopped")], record
            time.sleep(0.5)
        finally:
            load.stop()
        assert load.failed == [] and len(load.results) > 20, (load.failed, len(load.results))
        status = run.status()
        now = of_model(status, "chat")[0]
        assert (now["index"], now["pid"], now["address"], now["restarts"]) == (0, chat["pid"], chat["address"], 0)
        assert [(i["index"], model_of(i)) for i in status["instances"]] == [(0, "chat"), (2, "rerank")]
        assert all(i["state"] == "ready" for i in status["instances"]) and status["vsup"]["ready"] == 2
        # `vsup restart N` of the hole names the indexes there are
        result = cli("restart", "1", "--config", str(run.config_path))
        assert result.returncode != 0 and "no instance 1: this vsup runs instances 0, 2" in result.stderr, result.stderr
        assert "ready -> draining" in run.log()
    finally:
        run.close()


def test_a_crash_looping_model_leaves_the_other_model_serving(tmp_path):
    broken = {**EMBED, "vllm": {**EMBED["vllm"], "env": {"FAKE_VLLM_CRASH_AT_START": "3"}}}
    run = start(tmp_path, [CHAT, broken])
    try:
        status = run.wait_for(lambda s: s["instances"][0]["state"] == "ready" and s["instances"][1]["state"] == "backoff",
                              40, "chat ready, embed crashing")
        chat = status["instances"][0]
        load = ChatLoad(f"127.0.0.1:{run.proxy_port}")
        try:
            time.sleep(3.0)  # embed keeps crashing meanwhile
        finally:
            load.stop()
        status = run.status()
        assert status["instances"][1]["restarts"] >= 1 and status["instances"][1]["state"] != "ready"
        assert load.failed == [] and len(load.results) > 10, (load.failed, len(load.results))
        assert (status["instances"][0]["pid"], status["instances"][0]["restarts"]) == (chat["pid"], 0)
        assert status["instances"][0]["state"] == "ready"
    finally:
        run.close()
