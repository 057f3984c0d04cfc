"""Real vLLM CPU (0.32, scripts/vllm-env) serving two models side by side: the tiny random Llama as
a chat model and the same weights as an embedding model (`--runner pooling --convert embed`), the
fleet of issue 21 (docs/fleet-vllm-notes.md has what vLLM answers and why).

The first part needs no fleet support in vsup: each instance is started exactly as vsup would start
it (vsup's own plan and `build_command` for configs/demo.yaml: its launcher, CPU list, environment
and `--uds` socket), the chat one on instance 0's CPUs and the embedding one on instance 1's, and
both are used directly on their sockets through the real `openai` client; vsup's kind-aware warm-up
(vsup/supervisor/warmup.py) is sent to the pooling one.

The last test runs one `vsup run` with a `models:` config and kills the embedding instance with
SIGKILL under a chat load.

Marked `vllm` (the venv and model are built once per machine and cached, as for
tests/test_vllm_e2e.py, whose helpers these tests share); `VSUP_SKIP_VLLM=1` skips them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml

from tests.test_vllm_e2e import (
    DEMO_CONFIG,
    STARTUP_TIMEOUT,
    alive,
    close_and_sweep,
    comm,
    cpus_allowed,
    processes_in_sessions,
    processes_with_env,
    shm_files_of,
    tree,
    wait_until,
)
from tests.vsup_harness import VsupRun, instance_get, ports_for
from vsup.config.fleet import models_of
from vsup.config.schema import VsupConfig, parse_config
from vsup.proxy.address import Sessions, unix_url
from vsup.supervisor.launch import build_command
from vsup.supervisor.preflight import checked_plan
from vsup.supervisor.rundir import prepare_instance_dir
from vsup.supervisor.warmup import warm_up, warmup_body, warmup_kind

POOLING_ARGS = ["--runner", "pooling", "--convert", "embed"]
CHAT, EMBED = "chat", "embed"

pytestmark = pytest.mark.timeout(1800)


# ---- configs ------------------------------------------------------------------------------------

def demo_vllm_section(venv: Path, tmp: Path) -> dict:
    """configs/demo.yaml's vllm section, pointed at the vLLM venv (vsup runs from .venv) with a
    VLLM_CACHE_ROOT of this run's own (the marker of its processes, as in test_vllm_e2e)."""
    vllm = copy.deepcopy(yaml.safe_load(DEMO_CONFIG.read_text())["vllm"])
    vllm["venv"] = str(venv)
    vllm["env"] = {**vllm.get("env", {}), "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    return vllm


def model_config(venv: Path, model: Path, tmp: Path, name: str, extra_args: list[str]) -> dict:
    """configs/demo.yaml (two instances, one per core) serving `model` as `name`, with `extra_args`."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config.update(model=str(model), served_model_name=name)
    config["vllm"] = demo_vllm_section(venv, tmp)
    config["vllm"]["args"] = [*config["vllm"]["args"], *extra_args]
    config["vllm"]["base_port"], config["vllm"]["spare_base_port"], config["proxy"]["port"] = ports_for(2)
    return config


def fleet_config(venv: Path, model: Path, tmp: Path) -> dict:
    """FLEET.md's shape: one chat instance and one embedding instance of the same weights, each on
    a core of its own, behind one port; quick health checks and restarts for the kill -9."""
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    vllm = demo_vllm_section(venv, tmp)
    vllm["base_port"], vllm["spare_base_port"], proxy_port = ports_for(2)
    return {
        "placement": demo["placement"],
        "vllm": vllm,
        "models": [
            {"model": str(model), "served_model_name": CHAT, "instances": 1, "placement": {"cores_per_instance": 1}},
            {"model": str(model), "served_model_name": EMBED, "instances": 1, "placement": {"cores_per_instance": 1},
             # an entry's list replaces the top level's whole: the demo's arguments, then the runner's
             "vllm": {"args": [*vllm["args"], *POOLING_ARGS]}},
        ],
        "proxy": {"host": "127.0.0.1", "port": proxy_port, "drain_timeout": 5},
        "health": {"interval": 1.0, "timeout": 10.0, "failures": 3, "startup_timeout": STARTUP_TIMEOUT},
        "restart": {"max_delay": 5.0, "max_failures": 20},
        "start": {"mode": "parallel"},
        "stop": {"timeout": 30},
        "log": {"dir": str(tmp / "logs"), "echo": True},
        "control": {"socket": str(tmp / "control.sock")},
    }


def test_the_fleet_config_is_one_the_schema_takes(tmp_path):
    """The shape the skipped fleet test writes parses today (phase 0) into a chat view and an
    embedding view, and the warm-up kind of each follows from its arguments. No vLLM needed."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    cfg = parse_config(yaml.safe_dump(fleet_config(tmp_path / "venv", model, tmp_path)), "fleet.yaml")
    views = models_of(cfg)
    assert [view.name for view in views] == [CHAT, EMBED]
    assert [warmup_kind(view.config.vllm.args, view.config.model) for view in views] == ["completion", "embedding"]
    assert views[1].config.vllm.args[-4:] == POOLING_ARGS and "--runner" not in views[0].config.vllm.args


# ---- one vLLM instance, started as vsup starts it -----------------------------------------------

@dataclass
class Instance:
    name: str             # its served model name
    proc: subprocess.Popen
    socket: str           # its --uds path
    cpus: frozenset[int]  # planned
    omp_cpus: frozenset[int]
    log: Path
    marker: str           # VLLM_CACHE_ROOT=...: in the environment of its processes

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, timeout: float = 300.0) -> openai.OpenAI:
        return openai_over_uds(self.socket, timeout)

    def processes(self) -> set[int]:
        return processes_in_sessions({self.proc.pid}) | processes_with_env(self.marker)


def supported_tasks(instance: Instance) -> set[str]:
    """What vLLM logged at start as the model's tasks (`Supported tasks: [...]`, in no fixed order)."""
    found = re.search(r"Supported tasks: \[([^\]]*)\]", instance.log_text())
    assert found, f"{instance.name}: no 'Supported tasks' line in its log"
    return {task.strip(" '") for task in found.group(1).split(",")}


def uds_http_client(path: str, timeout: float = 300.0):
    """An HTTP client of the openai SDK's own kind on a Unix socket: its HTTP library's transport
    with `uds=` (httpx, or httpx2 for the SDK releases built on it)."""
    http = sys.modules[openai.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0]]
    return openai.DefaultHttpxClient(transport=http.HTTPTransport(uds=path), timeout=timeout)


def openai_over_uds(path: str, timeout: float = 300.0) -> openai.OpenAI:
    """The openai SDK speaking to the instance on its socket."""
    return openai.OpenAI(base_url="http://localhost/v1", api_key="none", max_retries=0,
                         http_client=uds_http_client(path, timeout))


def planned_launch(config: dict, index: int, environ: dict[str, str]) -> tuple[list[str], dict[str, str], dict]:
    """vsup's plan for `config` and what it would run for instance `index`: argv, environment and
    the instance's plan entry (cpus, omp_cpus)."""
    cfg: VsupConfig = parse_config(yaml.safe_dump(config), "vsup.yaml")
    _machine, plan = checked_plan(cfg, "/", environ, runs_here=True)
    instance = plan.instances[index]
    argv, env = build_command(instance, cfg, environ)
    return argv, env, {"cpus": frozenset(instance.cpus), "omp_cpus": frozenset(instance.omp_cpus)}


def start_instance(config: dict, index: int, tmp: Path, environ: dict[str, str]) -> Instance:
    argv, env, planned = planned_launch(config, index, environ)
    prepare_instance_dir(config["proxy"]["port"], environ)
    socket = argv[argv.index("--uds") + 1]
    name = config["served_model_name"]
    log = tmp / f"{name}.log"
    with open(log, "ab") as out:  # a session of its own, as vsup starts each instance
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Instance(name, proc, socket, planned["cpus"], planned["omp_cpus"], log,
                    f"VLLM_CACHE_ROOT={env['VLLM_CACHE_ROOT']}")


def wait_healthy(instance: Instance, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if instance.proc.poll() is not None:
            pytest.fail(f"{instance.name}: vLLM exited ({instance.proc.returncode}) before it was healthy:\n"
                        f"{instance.log_text()[-6000:]}")
        try:
            if instance_get(instance.socket, "/health", timeout=10)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{instance.name}: not healthy within {timeout:.0f}s:\n{instance.log_text()[-6000:]}")


def stop(instances: list[Instance]) -> None:
    """SIGTERM to each instance's session, SIGKILL to whatever of them is left (ours only, by pid),
    and their /dev/shm files removed."""
    family = {pid for inst in instances for pid in inst.processes()}
    mapped = shm_files_of(family)
    for inst in instances:
        if inst.proc.poll() is None:
            os.killpg(inst.proc.pid, signal.SIGTERM)
    for inst in instances:
        try:
            inst.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    for pid in alive(family):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: not alive(family), 30, "the instances' processes to be gone")
    for name in mapped:
        Path("/dev/shm", name).unlink(missing_ok=True)


@contextmanager
def two_instances(venv: Path, model: Path, tmp: Path):
    """The chat instance (demo plan's instance 0) and the embedding one (instance 1), started at
    once, both healthy."""
    environ = {**os.environ, "TMPDIR": str(tmp)}  # the sockets' folder is this test's
    chat = model_config(venv, model, tmp, CHAT, [])
    embed = model_config(venv, model, tmp, EMBED, POOLING_ARGS)
    embed["proxy"]["port"] = chat["proxy"]["port"]  # one socket folder: 0.sock and 1.sock
    started: list[Instance] = []
    try:
        started.append(start_instance(chat, 0, tmp, environ))
        started.append(start_instance(embed, 1, tmp, environ))
        for inst in started:
            wait_healthy(inst)
        yield started[0], started[1]
    finally:
        stop(started)


@pytest.fixture(scope="module")
def pair(vllm_install, tmp_path_factory):
    venv, model = vllm_install
    with two_instances(venv, model, tmp_path_factory.mktemp("vllm-fleet")) as (chat, embed):
        yield chat, embed


# ---- the pair, used directly --------------------------------------------------------------------

@pytest.mark.vllm
def test_each_instance_runs_on_its_planned_cpus_over_its_socket(pair):
    chat, embed = pair
    assert chat.cpus.isdisjoint(embed.cpus), (chat.cpus, embed.cpus)
    for inst in pair:
        assert inst.socket.endswith(".sock") and Path(inst.socket).exists()
        names = set()
        for pid in tree(inst.proc.pid):
            names.add(comm(pid))
            for tid, allowed in cpus_allowed(pid).items():
                assert allowed <= inst.cpus, f"{inst.name}: {comm(pid)} {pid} thread {tid} on {sorted(allowed)}"
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names
    assert supported_tasks(embed) == {"embed", "token_embed"}
    assert supported_tasks(chat) == {"generate"}


@pytest.mark.vllm
def test_chat_through_the_openai_client(pair):
    chat, _embed = pair
    with chat.client() as client:
        reply = client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, extra_body={"ignore_eos": True})
    assert reply.model == CHAT and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content


@pytest.mark.vllm
def test_streaming_chat_through_the_openai_client(pair):
    chat, _embed = pair
    pieces, finish, usage = [], None, None
    with chat.client() as client:
        stream = client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "Count to ten"}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                pieces += [choice.delta.content] if choice.delta.content else []
                finish = choice.finish_reason or finish
    assert len(pieces) >= 2 and finish == "length"
    assert usage is not None and usage.completion_tokens == 12


@pytest.mark.vllm
def test_embeddings_through_the_openai_client(pair):
    _chat, embed = pair
    with embed.client() as client:
        reply = client.embeddings.create(model=EMBED, input=["hello", "world wide"])
        again = client.embeddings.create(model=EMBED, input="hello")  # the SDK asks for base64 and decodes it
        models = [m.id for m in client.models.list().data]
    assert reply.model == EMBED and [item.index for item in reply.data] == [0, 1]
    assert all(len(item.embedding) == 64 for item in reply.data)  # the tiny Llama's hidden size
    assert reply.data[0].embedding != reply.data[1].embedding
    assert reply.usage.prompt_tokens > 2
    assert again.data[0].embedding == pytest.approx(reply.data[0].embedding, rel=1e-5)
    assert models == [EMBED]


@pytest.mark.vllm
def test_each_model_refuses_the_others_routes(pair):
    chat, embed = pair
    with embed.client() as client, pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with chat.client() as client, pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=CHAT, input="hi")


@pytest.mark.vllm
def test_the_pooling_routes_answer_as_the_notes_say(pair):
    _chat, embed = pair
    with uds_http_client(embed.socket) as http:  # the routes the SDK has no method for
        def post(route: str, body: dict) -> dict:
            response = http.post(f"http://localhost{route}", json={"model": EMBED, **body})
            assert response.status_code == 200, (route, response.text[:300])
            return response.json()

        pooled = post("/pooling", {"input": "hello world"})
        scores = post("/score", {"text_1": "hello", "text_2": ["hello world", "red river"]})
        reranked = post("/rerank", {"query": "hello", "documents": ["hello world", "red river"]})
        tokens = post("/tokenize", {"prompt": "hello world"})
        classify = http.post("http://localhost/classify", json={"model": EMBED, "input": "x"}).status_code
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 64
    assert [(d["index"], d["object"]) for d in scores["data"]] == [(0, "score"), (1, "score")]
    assert all(-1 <= d["score"] <= 1 for d in scores["data"])  # cosine similarity of embeddings
    assert sorted(r["index"] for r in reranked["results"]) == [0, 1]
    assert tokens["count"] == len(tokens["tokens"]) > 1
    assert classify == 404  # an embedding model has no classifier head


@pytest.mark.vllm
async def test_vsups_warm_up_of_each_kind(pair):
    chat, embed = pair
    cfg = VsupConfig.model_validate({"model": "m", "served_model_name": EMBED})
    sessions = Sessions(timeout=None)
    try:
        session, base = sessions.get(unix_url(Path(embed.socket)))
        for kind, route in (("embedding", "/v1/embeddings"), ("score", "/pooling")):
            result = await warm_up(session, base, warmup_body(cfg, kind), 120, kind)
            assert result.ok and result.detail == f"POST {route}: HTTP 200, 64 value(s)", result
        wrong = await warm_up(session, base, warmup_body(cfg), 120)  # a completion: what vsup sent before
        assert not wrong.ok and wrong.detail.startswith("POST /v1/completions: HTTP 404"), wrong
        session, base = sessions.get(unix_url(Path(chat.socket)))
        result = await warm_up(session, base, warmup_body(cfg.model_copy(update={"served_model_name": CHAT})), 120)
        assert result.ok, result
    finally:
        await sessions.close()
    assert '"POST /v1/embeddings HTTP/1.1" 200' in embed.log_text() and '"POST /pooling HTTP/1.1" 200' in embed.log_text()


# ---- the fleet: one vsup run --------------------------------------------------------------------

@pytest.mark.vllm
def test_one_vsup_run_serves_chat_and_embeddings_and_survives_a_kill9_of_the_embedding_instance(vllm_install, tmp_path):
    venv, model = vllm_install
    config = fleet_config(venv, model, tmp_path)
    marker = f"VLLM_CACHE_ROOT={config['vllm']['env']['VLLM_CACHE_ROOT']}"
    run = VsupRun(tmp_path, config)  # this checkout's vsup (.venv), vLLM from vllm.venv
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{run.proxy_port}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        status = run.wait_ready(count=2, timeout=STARTUP_TIMEOUT)
        by_model = {inst["model"]: inst for inst in status["instances"]}
        assert set(by_model) == {CHAT, EMBED}, status["instances"]
        assert set(by_model[CHAT]["cpus"]).isdisjoint(by_model[EMBED]["cpus"])
        for inst in status["instances"]:  # each model warmed up its own way, on its own socket
            assert inst["address"].startswith("/") and inst["address"].endswith(".sock"), inst
            warmed = [t for t in inst["transitions"] if t["from"] == "warming" and t["to"] == "ready"]
            assert warmed and warmed[-1]["reason"].startswith("warm-up answered"), inst["transitions"]
        logs = {name: (tmp_path / "logs" / f"i{inst['index']}.log").read_text(errors="replace")
                for name, inst in by_model.items()}
        assert '"POST /v1/completions HTTP/1.1" 200' in logs[CHAT]
        assert '"POST /v1/embeddings HTTP/1.1" 200' in logs[EMBED]

        assert sorted(m.id for m in client.models.list().data) == [CHAT, EMBED]
        assert len(client.embeddings.create(model=EMBED, input=["a", "b"]).data) == 2
        reply = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
        with pytest.raises(openai.NotFoundError) as unknown:
            client.embeddings.create(model="nope", input="x")
        assert unknown.value.code == "model_not_found" and CHAT in str(unknown.value) and EMBED in str(unknown.value)

        # kill -9 of the embedding instance's API server while chat streams run: no chat fails
        victim = by_model[EMBED]
        victim_tree = tree(victim["pid"])
        done = threading.Event()
        outcomes: list[str] = []

        def stream(index: int) -> None:
            n = 0
            while not done.is_set():
                n += 1
                try:
                    chunks = client.chat.completions.create(
                        model=CHAT, messages=[{"role": "user", "content": f"stream {index} {n}"}], max_tokens=32,
                        stream=True, extra_body={"ignore_eos": True})
                    finish = None
                    for chunk in chunks:
                        for choice in chunk.choices:
                            finish = choice.finish_reason or finish
                    outcomes.append(f"finished:{finish}")
                except Exception as exc:
                    outcomes.append(f"failed:{type(exc).__name__}: {exc}"[:300])

        with ThreadPoolExecutor(3) as pool:
            for i in range(3):
                pool.submit(stream, i)
            time.sleep(3)
            os.kill(victim["pid"], signal.SIGKILL)
            # while the embedding model has no ready instance: 503 + Retry-After, chat keeps serving
            down = run.wait_for(lambda s: next(i for i in s["instances"] if i["model"] == EMBED)["state"] != "ready",
                                60, "the embedding instance to leave the rotation")
            assert down
            with pytest.raises(openai.APIStatusError) as unavailable:
                client.embeddings.create(model=EMBED, input="while it is down")
            assert unavailable.value.status_code == 503 and unavailable.value.response.headers.get("retry-after")
            back = run.wait_for(lambda s: all(i["state"] == "ready" for i in s["instances"])
                                and next(i for i in s["instances"] if i["model"] == EMBED)["pid"] != victim["pid"],
                                STARTUP_TIMEOUT, "the embedding instance to come back ready")
            time.sleep(3)
            done.set()
        failed = [o for o in outcomes if o != "finished:length"]
        assert not failed and len(outcomes) >= 3, f"{len(outcomes)} chat streams, failed: {failed[:5]}"
        assert len(client.embeddings.create(model=EMBED, input="after the restart").data[0].embedding) == 64
        assert next(i for i in back["instances"] if i["model"] == CHAT)["pid"] == by_model[CHAT]["pid"]  # untouched
        wait_until(lambda: not alive(victim_tree), 120, f"the killed tree {victim_tree} to be gone")
    finally:
        client.close()
        close_and_sweep(run, marker)

