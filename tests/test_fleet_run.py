"""A fleet of several models under one `Supervisor` (issue 21), in-process: the real proxy, control
socket and rollout over fake processes on a virtual clock (tests/lifecycle_fakes.py), planned on a
2-node machine of 4 cores each (tests/sysfs_builder.py). Each instance runs under its model's view
of the file; a reload adds, removes or resizes one model while the others' processes stay as they
are; the fleet's indexes may have holes. tests/test_fleet_e2e.py runs the same with `vsup run`."""

from __future__ import annotations

import asyncio
import sys

import pytest
import yaml

from tests.lifecycle_fakes import FakeOps
from tests.test_supervisor_inprocess import Fleet, fleet_fixture
from vsup.config.names import ALIAS, Name
from vsup.errors import VsupError
from vsup.proxy import ProxyServer
from vsup.supervisor import status as status_json
from vsup.supervisor.control import describe_indexes
from vsup.supervisor.states import State
from vsup.supervisor.warmup import warmup_kind

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "org/chat", "served_model_name": "chat", "instances": 1,
        "placement": {"cores_per_instance": 1}, "proxy": {"policy": "prefix_affinity"}}
EMBED = {"model": "org/embed", "served_model_name": "embed", "instances": 1,
         "placement": {"cores_per_instance": 1}, "vllm": {"args": ["--runner", "pooling", "--convert", "embed"]}}
RERANK = {"model": "org/rerank", "served_model_name": "rerank", "instances": 1,
          "placement": {"cores_per_instance": 1}, "vllm": {"args": ["--runner", "pooling"]}}


def fleet_config(tmp_path, models: list[dict], **sections) -> dict:
    config = {
        "models": models,
        "placement": {"launcher": "none", "reserve_cores": 0, "model_size_gib": 0.01, "kvcache_gib": 0.01,
                      "overhead_gib": 0.01, "memory_reserve_gib": 0.1},
        "vllm": {"command": [sys.executable, "serve"], "base_port": 41000},
        "proxy": {"port": 0, "drain_timeout": 5},
        "health": {"interval": 1.0, "timeout": 1.0, "startup_timeout": 30},
        "restart": {"max_delay": 0.5, "max_failures": 3},
        "start": {"mode": "parallel"},
        "stop": {"timeout": 5},
        "log": {"dir": str(tmp_path / "logs"), "echo": False},
        "control": {"socket": str(tmp_path / "control.sock")},
    }
    for section, values in sections.items():
        config[section] = {**config[section], **values}
    return config


class ModelFleet(Fleet):
    """Fleet over a `models:` file: write(models=[...], **sections)."""

    def write(self, models: list[dict] | None = None, **sections) -> None:
        self.path.write_text(yaml.safe_dump(fleet_config(self.tmp_path, models or [CHAT, EMBED], **sections)))

    def by_model(self) -> dict[str, list[tuple[int, int]]]:
        """model -> [(index, pid)] of the fleet."""
        out: dict[str, list[tuple[int, int]]] = {}
        for inst in self.sup.fleet.instances:
            out.setdefault(inst.model, []).append((inst.index, inst.pid))
        return out


class FailingModelOps(FakeOps):
    """Every process of a model named in `failing` fails its warm-up (a broken model: crash loop)."""

    failing: set[str] = set()

    async def spawn(self, argv, env, log):
        process = await super().spawn(argv, env, log)
        if argv[argv.index("--served-model-name") + 1] in self.failing:
            process.warmup = 500
        return process


fleet = fleet_fixture(ModelFleet)


class RecordingProxy(ProxyServer):
    """The real proxy, remembering the per-model proxy sections the supervisor handed it (what it
    routes with is the proxy's business, tests/test_proxy_*)."""

    def __init__(self, *args, models=None, names=None, **kwargs) -> None:
        super().__init__(*args, models=models, names=names, **kwargs)
        self.given, self.names = dict(models or {}), dict(names or {})

    def reconfigure(self, config, api_key, models=None, names=None, **batch) -> None:
        super().reconfigure(config, api_key, models=models, names=names, **batch)
        self.given, self.names = dict(models or {}), dict(names or {})


@pytest.fixture(autouse=True)
def recording_proxy(monkeypatch):
    monkeypatch.setattr("vsup.supervisor.supervisor.ProxyServer", RecordingProxy)


async def test_a_two_model_fleet_runs_each_instance_under_its_models_view(fleet):
    f = await fleet()
    chat, embed = f.sup.fleet.instances[0], f.sup.fleet.instances[1]
    assert (chat.model, embed.model) == ("chat", "embed")
    assert chat.config.model == "org/chat" and embed.config.model == "org/embed" and chat.config.models is None
    assert chat.argv[chat.argv.index("serve") + 1] == "org/chat" and "--runner" not in chat.argv
    assert embed.argv[embed.argv.index("serve") + 1] == "org/embed"
    assert embed.argv[-4:] == ["--runner", "pooling", "--convert", "embed"]
    assert ["--served-model-name", "embed"] == embed.argv[embed.argv.index("--served-model-name"):][:2]
    backends = {b.name: b.model for b in f.sup.pool.all()}
    assert backends == {"0": "chat", "1": "embed"}
    assert set(f.sup.proxy.given) == {"chat", "embed"}
    assert f.sup.proxy.given["chat"].policy == "prefix_affinity"
    assert f.sup.proxy.given["embed"].policy == f.sup.config.proxy.policy
    # warm-up by kind: the pooling model gets one embedding, the chat model one completion
    routes = dict(f.ops.warmup_routes)
    bodies = dict(f.ops.warmups)
    assert routes[chat.pid] == "/v1/completions" and bodies[chat.pid]["model"] == "chat" and "prompt" in bodies[chat.pid]
    assert routes[embed.pid] == "/v1/embeddings"
    assert bodies[embed.pid] == {"model": "embed", "input": f.sup.config.health.warmup.prompt}
    assert f.sup.status()["vsup"]["ready"] == 2 and status_json.ready_enough(f.sup.config, f.sup.instances)
    assert not any(word in status_json.status_line(f.sup) for word in ("starting", "failed"))


async def test_adding_a_model_adds_its_instance_and_leaves_the_first_models_process_alone(fleet):
    f = await fleet()
    chat_before = f.by_model()["chat"]
    f.write(models=[CHAT, EMBED, RERANK])
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    embed_before = f.by_model()["embed"]
    # the models it does not change keep their CPUs (topology.fleet's keep): only the add
    assert [(s["index"], s["action"]) for s in record["steps"]] == [(2, "add")] and "of model rerank" in record["steps"][-1]["why"]
    assert sorted(record["unchanged"]) == [0, 1]
    assert f.by_model()["chat"] == chat_before and f.by_model()["embed"] == embed_before
    rerank = f.sup.fleet.instances[2]
    assert rerank.model == "rerank" and rerank.state is State.READY and rerank.config.model == "org/rerank"
    assert set(f.sup.proxy.given) == {"chat", "embed", "rerank"}
    assert dict(f.ops.warmup_routes)[rerank.pid] == "/v1/embeddings"


async def test_removing_a_model_drains_its_instances_and_leaves_a_hole_the_others_keep_their_indexes(fleet):
    f = await fleet(models=[CHAT, EMBED, RERANK])
    before = f.by_model()
    f.write(models=[CHAT, RERANK])
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    assert [(s["index"], s["action"], s["state"]) for s in record["steps"]] == [(1, "remove", "done")]
    assert record["steps"][0]["why"] == "the configuration no longer serves model embed"
    assert sorted(record["unchanged"]) == [0, 2]
    assert f.by_model() == {"chat": before["chat"], "rerank": before["rerank"]}
    assert f.sup.fleet.instances.indexes() == [0, 2] and len(f.sup.fleet.instances) == 2
    assert [i.index for i in f.sup.fleet.instances] == [0, 2] and 2 in f.sup.fleet.instances and 1 not in f.sup.fleet.instances
    assert set(f.sup.pool.states()) == {"0", "2"} and set(f.sup.proxy.given) == {"chat", "rerank"}
    # `vsup restart N` of the hole names the indexes there are; the others still restart
    with pytest.raises(VsupError, match=r"^no instance 1: this vsup runs instances 0, 2$"):
        f.sup.instance(1)
    result = await f.run(f.sup.restart([2], rolling=False))
    assert [r["index"] for r in result] == [2] and result[0]["state"] == "ready"
    assert f.sup.status()["vsup"]["ready"] == 2 and status_json.ready_enough(f.sup.config, f.sup.instances)
    assert not any(word in status_json.status_line(f.sup) for word in ("starting", "failed"))
    assert [i["index"] for i in f.sup.status()["instances"]] == [0, 2]
    # a later reload keeps the indexes: rerank stays instance 2 (its socket, log, process), a new
    # model takes the free index 1
    rerank_now = f.by_model()["rerank"]
    f.write(models=[CHAT, RERANK, EMBED])
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    assert [(s["index"], s["action"]) for s in record["steps"]] == [(1, "add")], record
    assert [(i.index, i.model) for i in f.sup.fleet.instances] == [(0, "chat"), (1, "embed"), (2, "rerank")]
    assert f.by_model()["chat"] == before["chat"] and f.by_model()["rerank"] == rerank_now


async def test_changing_one_models_count_adds_and_removes_only_its_instances(fleet):
    f = await fleet()
    chat_before = f.by_model()["chat"]
    f.write(models=[CHAT, {**EMBED, "instances": 2}])
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    assert [(s["index"], s["action"]) for s in record["steps"]] == [(2, "add")]
    assert f.by_model()["chat"] == chat_before and [i for i, _ in f.by_model()["embed"]] == [1, 2]
    assert f.sup.fleet.plan_of(f.sup.fleet.instances[2]).replica == 1
    f.write(models=[CHAT, EMBED])
    record = await f.run(f.sup.reload("vsup reload"))
    assert [(s["index"], s["action"], s["why"]) for s in record["steps"]] == [(2, "remove", "model embed runs 1 instance(s)")]
    assert f.by_model()["chat"] == chat_before and f.sup.fleet.instances.indexes() == [0, 1]


async def test_a_models_live_keys_apply_at_once_to_that_model_only(fleet):
    f = await fleet()
    pids = f.by_model()
    f.write(models=[{**CHAT, "proxy": {"policy": "least_outstanding"}},
                    {**EMBED, "warmup": {"enabled": False}}])
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done" and record["steps"] == [] and sorted(record["unchanged"]) == [0, 1]
    assert record["applied"] == ["models[0].proxy.policy", "models[1].warmup.enabled"]
    assert f.by_model() == pids
    assert f.sup.proxy.given["chat"].policy == "least_outstanding"
    chat, embed = f.sup.fleet.instances[0], f.sup.fleet.instances[1]
    assert embed.config.health.warmup.enabled is False and chat.config.health.warmup.enabled is True
    # the next start of the pooling model's instance skips its warm-up; the chat's does not
    warmups = len(f.ops.warmups)
    await f.run(f.sup.restart([0, 1], rolling=False))
    assert [pid for pid, _ in f.ops.warmups[warmups:]] == [f.sup.fleet.instances[0].pid]


async def test_a_crash_looping_model_does_not_touch_the_other_models_instances(tmp_path):
    FailingModelOps.failing = {"embed"}

    class Broken(ModelFleet):
        def __init__(self, tmp_path, **sections) -> None:
            super().__init__(tmp_path, **sections)
            self.sup._ops = self.ops = FailingModelOps(load_time=2.0, stop_time=0.5)

        async def start(self) -> None:
            self.task = asyncio.create_task(self.sup.run())
            await self.until(lambda: self.sup.fleet.instances.get(1) is not None
                             and self.sup.fleet.instances[1].state is State.FAILED, "embed gives up")

    f = Broken(tmp_path)
    try:
        await f.start()
        chat, embed = f.sup.fleet.instances[0], f.sup.fleet.instances[1]
        assert chat.state is State.READY and chat.restarts == 0 and chat.failures == 0
        assert embed.failures == 3 and "crash loop" in embed.history[-1].reason
        assert [b.name for b in f.sup.pool.ready()] == ["0"]  # the chat model stays in the rotation
        assert "failed: 1" in status_json.status_line(f.sup)
    finally:
        await f.stop()


def test_describe_indexes_names_holes():
    assert describe_indexes([0, 1, 2]) == "0..2" and describe_indexes([0, 2, 3]) == "0, 2, 3"
    assert describe_indexes([]) == "none" and describe_indexes([4]) == "4..4"


@pytest.mark.parametrize(("args", "kind"), [
    ([], "completion"), (["--dtype", "bfloat16"], "completion"), (["--runner", "pooling"], "embedding"),
    (["--runner=pooling"], "embedding"), (["--convert", "embed"], "embedding"), (["--runner", "generate"], "completion"),
])
def test_the_kind_of_a_models_warm_up_comes_from_its_args(args, kind):
    assert warmup_kind(args, None) == kind


async def test_a_models_changed_args_replace_only_its_instances(fleet):
    f = await fleet()
    chat_before = f.by_model()["chat"]
    f.write(models=[CHAT, {**EMBED, "vllm": {"args": ["--runner", "pooling", "--convert", "embed", "--dtype", "float32"]}}])
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    assert [(s["index"], s["action"], s["why"]) for s in record["steps"]] == [(1, "replace", "command line +--dtype float32")]
    assert record["unchanged"] == [0] and f.by_model()["chat"] == chat_before
    assert f.sup.fleet.instances[1].argv[-2:] == ["--dtype", "float32"] and f.sup.fleet.instances[1].model == "embed"


async def test_a_models_new_alias_replaces_only_its_instances_and_reaches_the_proxy(fleet):
    f = await fleet()
    chat_before = f.by_model()["chat"]
    f.write(models=[CHAT, {**EMBED, "aliases": ["text-embedding-3-small"]}])
    record = await f.run(f.sup.reload("vsup reload"))
    assert record["state"] == "done", record
    assert [(s["index"], s["action"]) for s in record["steps"]] == [(1, "replace")]
    assert "+text-embedding-3-small" in record["steps"][0]["why"]
    assert record["unchanged"] == [0] and f.by_model()["chat"] == chat_before
    embed = f.sup.fleet.instances[1]
    assert embed.argv[embed.argv.index("--served-model-name"):][:3] == ["--served-model-name", "embed", "text-embedding-3-small"]
    assert f.sup.proxy.names == {"text-embedding-3-small": Name("embed", ALIAS)}
