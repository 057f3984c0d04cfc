"""The fake vLLM server, as a real process on a real port, driven by the real `openai` SDK."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest
from openai import OpenAI

from tests.fakevllm import WRAPPER
from tests.fakevllm.cli import UsageError, parse_args
from tests.fakevllm.fixtures import (
    REPO_ROOT,
    fake_processes,
    free_port,
    group_pids,
    http_get,
    read_events,
    start_records,
)
from tests.fakevllm.settings import SettingsError, load_faults

pytestmark = pytest.mark.timeout(120)


def client(srv, **kw) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=kw.pop("timeout", 30), **kw)


def post(port: int, path: str, body: bytes, timeout: float = 10) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"null")
    finally:
        conn.close()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# -------------------------------------------------------------------- command line and settings


def test_cli_accepts_both_vllm_forms_and_ignores_unknown_flags():
    a = parse_args(["serve", "/m", "--host", "127.0.0.1", "--port", "8123", "--dtype", "float32",
                    "--enforce-eager", "--served-model-name", "x", "y", "--max-model-len=512"])
    assert (a.model, a.port, a.names, a.max_model_len) == ("/m", 8123, ("x", "y"), 512)
    assert a.ignored == ("--dtype",) and a.enforce_eager
    b = parse_args(["--model", "/m", "--port", "9000", "--kv-cache-memory-bytes", "-1"])
    assert (b.model, b.port, b.names) == ("/m", 9000, ("/m",))


@pytest.mark.parametrize("argv, words", [
    (["serve"], "no model"),
    (["serve", "m", "--port", "http"], "--port 'http'"),
    (["serve", "m", "--port", "70000"], "out of range"),
    (["serve", "m", "other"], "unexpected argument 'other'"),
])
def test_cli_errors_name_the_argument(argv, words):
    with pytest.raises(UsageError, match=words):
        parse_args(argv)


def test_settings_reject_bad_values_with_the_variable_named():
    with pytest.raises(SettingsError, match="FAKE_VLLM_START_DELAY='soon'"):
        load_faults({"FAKE_VLLM_START_DELAY": "soon"})
    with pytest.raises(SettingsError, match="FAKE_VLLM_IGNORE_SIGTERM"):
        load_faults({"FAKE_VLLM_IGNORE_SIGTERM": "maybe"})
    assert load_faults({"FAKE_VLLM_CRASH_AT_START": "0"}).crash_at_start == 0
    assert load_faults({}).crash_at_start is None
    with pytest.raises(SettingsError, match="FAKE_VLLM_GROW_MIB_PER_S='-1' must be >= 0"):
        load_faults({"FAKE_VLLM_GROW_MIB_PER_S": "-1"})


def test_bad_command_line_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "tests.fakevllm", "serve", "m", "--port", "x"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["fakevllm: error: --port 'x' is not an integer (1..65535)"]


# -------------------------------------------------------------------- startup


def test_port_opens_and_health_answers_only_after_the_start_delay(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_START_DELAY": "3"})
    record = srv.start_record()
    assert record["pid"] == srv.pid and record["port"] == srv.port
    assert srv.health() is None and not port_open(srv.port)  # "loading the model"
    srv.wait_ready(timeout=30)
    started, ready = srv.wait_event("started"), srv.wait_event("ready")
    assert ready["mono"] - started["mono"] >= 2.9
    status, body = http_get(srv.port, "/health")
    assert (status, body) == (200, b"")


def test_start_record_reports_the_environment_and_placement_seen(fake_vllm):
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "CPU_VISIBLE_MEMORY_NODES": "0", "NOTIFY_SOCKET": "/run/x"}
    srv = fake_vllm(env=env, args=["--dtype", "float32"])
    record = srv.start_record()
    for key in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "CPU_VISIBLE_MEMORY_NODES"):
        assert record[key] == env[key]
    assert record["env"]["NOTIFY_SOCKET"] == "/run/x"
    assert record["affinity"] == sorted(os.sched_getaffinity(0))
    assert record["argv"][-2:] == ["--dtype", "float32"]
    assert srv.wait_event("started")["engine_pid"] == record["engine_pid"]


def test_phases_print_vllms_lines_in_order_read_the_weights_and_bind_after(fake_vllm, tmp_path):
    from vsup.supervisor.phases import OutputReader, Phase, match

    (tmp_path / "model.safetensors").write_bytes(os.urandom(3 << 20))
    srv = fake_vllm(model=str(tmp_path), env={"FAKE_VLLM_PHASES": "load:0.6,compile:1.2,profile:0.2",
                                              "FAKE_VLLM_SHARDS": "3", "FAKE_VLLM_WAIT_LINE_EVERY": "0.5"})
    srv.wait_ready(timeout=30)
    lines = srv.output().splitlines()
    named = [m[0].phase for line in lines if (m := match(line)) and m[0].phase is not None]
    order = [p for i, p in enumerate(named) if i == 0 or named[i - 1] is not p]
    assert order == [Phase.LOADING, Phase.PROFILING, Phase.COMPILING, Phase.PROFILING, Phase.OPENING], order
    reader = OutputReader()
    reader.feed(lines)
    assert reader.shards == (3, 3) and reader.percent == 100 and reader.waiting is not None and reader.waiting.count >= 1
    assert reader.took["weights_loaded"] >= 0.5 and reader.took["engine_ready"] >= 1.9
    ready = srv.wait_event("ready")["mono"] - srv.wait_event("started")["mono"]
    assert ready >= 2.0  # the port opened after the phases


def test_enforce_eager_is_a_switch_the_last_one_wins_and_takes_no_value():
    # vLLM's BooleanOptionalAction: the word after it is the model, not its value
    assert parse_args(["--enforce-eager", "serve-me", "--port", "1"]).model == "serve-me"
    assert not parse_args(["serve", "m"]).enforce_eager
    assert not parse_args(["serve", "m", "--enforce-eager", "--no-enforce-eager"]).enforce_eager
    assert parse_args(["serve", "m", "--no-enforce-eager", "--enforce_eager"]).enforce_eager
    with pytest.raises(UsageError, match="--enforce-eager: ignored explicit argument 'true'"):
        parse_args(["serve", "m", "--enforce-eager=true"])


def test_compiled_steps_are_faster_by_the_compiled_speedup():
    from tests.fakevllm.engine import step_time

    f = load_faults({"FAKE_VLLM_STEP_TIME": "0.04", "FAKE_VLLM_COMPILED_SPEEDUP": "2"})
    assert step_time(f, 1, 1, 2, False, compiled=True) == pytest.approx(step_time(f, 1, 1, 2, False) / 2)
    with pytest.raises(SettingsError, match="FAKE_VLLM_COMPILED_SPEEDUP='0.5' must be >= 1"):
        load_faults({"FAKE_VLLM_COMPILED_SPEEDUP": "0.5"})


def test_without_enforce_eager_the_start_compiles_and_with_it_does_not(fake_vllm):
    from vsup.supervisor.phases import Phase, match

    env = {"FAKE_VLLM_COMPILE": "1.5", "FAKE_VLLM_PHASES": "profile:0.1"}
    compiled, eager = fake_vllm(env=env), fake_vllm(env=env, args=["--enforce-eager"])
    for srv in (compiled, eager):
        srv.wait_ready(timeout=30)

    def phases(srv) -> list[Phase]:
        return [m[0].phase for line in srv.output().splitlines() if (m := match(line)) and m[0].phase is not None]

    assert Phase.COMPILING in phases(compiled) and Phase.COMPILING not in phases(eager)
    took = compiled.wait_event("ready")["mono"] - compiled.wait_event("started")["mono"]
    assert took >= 1.5  # the port opened after the compile


def test_bad_phases_are_refused_naming_the_variable():
    assert load_faults({"FAKE_VLLM_PHASES": "load:2, stall:0"}).phases == (("load", 2.0), ("stall", 0.0))
    for bad in ("load", "nap:3", "load:-1", "load:inf"):
        with pytest.raises(SettingsError, match="FAKE_VLLM_PHASES="):
            load_faults({"FAKE_VLLM_PHASES": bad})


def test_sigterm_while_loading_exits_0_without_binding(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_START_DELAY": "60"})
    shm = srv.start_record()["shm"]
    wait_until(lambda: len(srv.pids()) == 3, what="EngineCore and Worker")
    srv.send_signal(signal.SIGTERM)
    assert srv.wait(timeout=10) == 0
    assert srv.pids() == [] and not any(os.path.exists(p) for p in shm)
    assert srv.wait_event("stopped")["during"] == "startup" and srv.events("ready") == []


@pytest.mark.parametrize("code", ["3", "0"])
def test_crash_at_start_exits_with_the_code_and_never_binds(fake_vllm, code):
    srv = fake_vllm(env={"FAKE_VLLM_CRASH_AT_START": code, "FAKE_VLLM_START_DELAY": "0.3"})
    assert srv.wait(timeout=30) == int(code)
    assert not port_open(srv.port)
    assert srv.pids() == [] and srv.shm_files() == []  # a failed load takes its EngineCore with it


def test_busy_port_exits_1_like_vllm(fake_vllm):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        srv = fake_vllm(port=blocker.getsockname()[1])
        assert srv.wait(timeout=30) == 1
    assert "Address already in use" in srv.output() or "error while attempting to bind" in srv.output()


def test_wait_ready_is_not_fooled_by_another_server_on_the_port(fake_vllm):
    first = fake_vllm().wait_ready()
    second = fake_vllm(port=first.port)  # loses the race for the port: exits 1
    with pytest.raises(RuntimeError, match="exited with 1"):
        second.wait_ready(timeout=30)
    assert first.health() == 200


def test_wrapper_script_runs_from_any_cwd(tmp_path):
    port = free_port()
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(WRAPPER), "serve", "m", "--host", "127.0.0.1", "--port", str(port),
                                 "--served-model-name", "w"], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: port_open(port) or proc.poll() is not None, 30, "the wrapper's server")
        assert proc.poll() is None
        status, body = http_get(port, "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "w"
        record = start_records(log.read_text())[0]
        assert record["pid"] == proc.pid  # exec: the wrapper's pid is the server's
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not any(os.path.exists(p) for p in record["shm"])
    finally:
        if group_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for record in start_records(log.read_text()):
            for path in record["shm"]:
                if os.path.exists(path):
                    os.unlink(path)


# -------------------------------------------------------------------- the OpenAI API


def test_chat_and_completion_json_through_the_openai_sdk(fake_vllm):
    srv = fake_vllm(name="inst-a", served_model_names=["tiny"]).wait_ready()
    c = client(srv)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one two three"}],
                                     max_tokens=4)
    assert chat.choices[0].message.content == "tok0 tok1 tok2 tok3"
    assert chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (3, 4, 7)
    assert "inst-a" in chat.id and chat.system_fingerprint == "fakevllm-inst-a"
    comp = c.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert comp.choices[0].text == "tok0 tok1" and comp.usage.completion_tokens == 2
    default = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert default.usage.completion_tokens == 16
    raw = c.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                      max_completion_tokens=1)
    assert raw.headers["x-fake-instance"] == "inst-a"
    assert [m.id for m in c.models.list()] == ["tiny"]
    finished = srv.events("finished")
    assert [e["tokens"] for e in finished] == [4, 2, 16, 1]


def test_streaming_chat_and_completion_with_usage(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0.01"}).wait_ready()
    c = client(srv)
    chunks = list(c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    comp = list(c.completions.create(model="fake-model", prompt="hi", max_tokens=3, stream=True))
    assert [ch.choices[0].text for ch in comp] == ["tok0", " tok1", " tok2"]
    assert all(ch.usage is None for ch in comp)


def test_per_request_delays_from_the_body_override_the_environment(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0"}).wait_ready()
    c = client(srv, timeout=0.5)
    c.completions.create(model="fake-model", prompt="x", max_tokens=3)  # fast by default
    with pytest.raises(openai.APITimeoutError):
        c.completions.create(model="fake-model", prompt="x", max_tokens=3, extra_body={"fake": {"token_delay": 5}})
    assert srv.wait_event("cancelled")["tokens"] == 1  # the first token has no token_delay
    with pytest.raises(openai.BadRequestError, match="fake.first_token_delay"):
        c.completions.create(model="fake-model", prompt="x", extra_body={"fake": {"first_token_delay": -1}})


def test_raw_sse_framing_ends_with_done(fake_vllm):
    srv = fake_vllm().wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "a", "max_tokens": 2, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = resp.read().decode().split("\n\n")
    conn.close()
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2]) and len(events) == 4


def test_errors_are_openai_shaped(fake_vllm):
    srv = fake_vllm(served_model_names=["tiny"]).wait_ready()
    status, _, body = post(srv.port, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = post(srv.port, "/v1/chat/completions", json.dumps({"model": "tiny"}).encode())
    assert status == 400 and "messages" in body["error"]["message"]
    c = client(srv)
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist."):
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        c.completions.create(model="tiny", prompt="x", max_tokens=5000)
    status, _, body = post(srv.port, "/v1/nothing", b"{}")
    assert (status, body) == (404, {"detail": "Not Found"})


def test_embeddings_tokenize_and_admin_endpoints(fake_vllm):
    srv = fake_vllm().wait_ready()
    c = client(srv)
    first = c.embeddings.create(model="fake-model", input=["hello", "world"])  # SDK asks for base64
    again = c.embeddings.create(model="fake-model", input="hello", encoding_format="float")
    assert len(first.data) == 2 and len(first.data[0].embedding) == 8
    assert first.data[0].embedding == pytest.approx(again.data[0].embedding, abs=1e-6)
    assert first.data[0].embedding != pytest.approx(first.data[1].embedding)
    status, _, tok = post(srv.port, "/tokenize", json.dumps({"prompt": "a b c"}).encode())
    assert status == 200 and tok["count"] == 3 and tok["max_model_len"] == 2048
    assert json.loads(http_get(srv.port, "/version")[1])["version"]
    assert json.loads(http_get(srv.port, "/load")[1]) == {"server_load": 0}
    c.completions.create(model="fake-model", prompt="x", max_tokens=3)
    metrics = vllm_samples(srv)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:generation_tokens_total"] == 3


def vllm_samples(srv) -> dict[str, float]:
    """The fake's /metrics, parsed: vllm:* sample name -> value (one engine, one model)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(srv.port, "/metrics")[:2]
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name.startswith("vllm:") and "le" not in sample.labels and "finished_reason" not in sample.labels:
                assert sample.labels == {"model_name": "fake-model", "engine": "0"}, sample
                samples[sample.name] = sample.value
    return samples


def test_metrics_look_like_vllms(fake_vllm):
    """The families vsup re-exports, in vLLM's shape: prometheus_client's 0.0.4 text (counters typed
    with their _total name), model_name + engine labels, TTFT/ITL/e2e histograms fed by real timings,
    and the process_* families of vLLM's default registry."""
    from prometheus_client.parser import text_string_to_metric_families

    srv = fake_vllm().wait_ready()
    text = http_get(srv.port, "/metrics")[1].decode()
    assert "# TYPE vllm:generation_tokens_total counter" in text
    before = vllm_samples(srv)
    assert before["vllm:time_to_first_token_seconds_count"] == 0
    stream = client(srv).completions.create(model="fake-model", prompt="a b c d", max_tokens=5, stream=True,
                                             extra_body={"fake": {"first_token_delay": 0.05, "token_delay": 0.02}})
    assert len(list(stream)) == 5
    after = vllm_samples(srv)
    assert after["vllm:prompt_tokens_total"] == 4
    assert after["vllm:generation_tokens_total"] == 5
    assert after["vllm:time_to_first_token_seconds_count"] == 1
    assert after["vllm:time_to_first_token_seconds_sum"] >= 0.05
    assert after["vllm:inter_token_latency_seconds_count"] == 4
    assert after["vllm:inter_token_latency_seconds_sum"] >= 4 * 0.02
    assert after["vllm:e2e_request_latency_seconds_count"] == 1
    assert after["vllm:request_queue_time_seconds_count"] == 1
    families = {f.name: f for f in text_string_to_metric_families(http_get(srv.port, "/metrics")[1].decode())}
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert success["length"] == 1
    assert families["process_resident_memory_bytes"].samples[0].value > 0


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_resident_memory_grows_on_demand_and_bad_amounts_are_400(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_CHILD": "0"}).wait_ready()
    before = rss_mib(srv.pid)
    status, _, body = post(srv.port, "/fake/grow", json.dumps({"mib": 64}).encode())
    assert status == 200 and body == {"grown_mib": 64}
    assert rss_mib(srv.pid) - before >= 60  # resident at once, not merely reserved
    status, _, body = post(srv.port, "/fake/grow", json.dumps({"mib": 0}).encode())
    assert status == 400 and "0 < N" in body["error"]["message"]
    assert [e["mib"] for e in read_events(srv.events_path, "grown")] == [64]


def test_resident_memory_leaks_at_the_configured_rate(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_CHILD": "0", "FAKE_VLLM_GROW_MIB_PER_S": "40"}).wait_ready()
    start = rss_mib(srv.pid)
    wait_until(lambda: rss_mib(srv.pid) - start >= 40, timeout=10, what="40 MiB more resident memory")


def test_status_503_answers_completions_but_not_health(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_STATUS_503": "1"}).wait_ready()
    with pytest.raises(openai.InternalServerError) as err:
        client(srv).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503
    assert srv.health() == 200


# -------------------------------------------------------------------- faults


def test_crash_after_n_requests_leaves_children_and_shm_behind(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_CRASH_AFTER": "2", "FAKE_VLLM_CRASH_CODE": "7"}).wait_ready()
    c = client(srv)
    c.completions.create(model="fake-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.APIConnectionError):
        c.completions.create(model="fake-model", prompt="x", max_tokens=1)
    assert srv.wait(timeout=30) == 7
    assert srv.wait_event("crash")["code"] == 7
    assert len(srv.pids()) == 2  # EngineCore and Worker, orphaned
    assert len(srv.shm_files()) == 2


def test_crash_mid_stream_after_some_tokens(fake_vllm):
    env = {"FAKE_VLLM_CRASH_AFTER": "1", "FAKE_VLLM_CRASH_MID_STREAM": "1", "FAKE_VLLM_CRASH_AFTER_TOKENS": "3"}
    srv = fake_vllm(env=env).wait_ready()
    got = []
    error = None
    try:
        for chunk in client(srv).completions.create(model="fake-model", prompt="x", max_tokens=50, stream=True):
            got.append(chunk.choices[0].text)
    except Exception as e:  # the SDK surfaces the transport's error as is
        error = e
    assert error is not None, f"the stream ended without an error after {got}; events: {srv.events()}"
    assert got == ["tok0", " tok1", " tok2"]
    assert srv.wait(timeout=30) == 1


def test_crash_mid_stream_before_the_first_byte(fake_vllm):
    env = {"FAKE_VLLM_CRASH_AFTER": "1", "FAKE_VLLM_CRASH_MID_STREAM": "1", "FAKE_VLLM_CRASH_AFTER_TOKENS": "0"}
    srv = fake_vllm(env=env).wait_ready()
    with pytest.raises(openai.APIConnectionError):  # no status line at all: safe for a proxy to retry
        client(srv).completions.create(model="fake-model", prompt="x", max_tokens=5, stream=True)
    assert srv.wait(timeout=30) == 1


def test_sigint_stops_like_sigterm(fake_vllm):
    srv = fake_vllm().wait_ready()
    wait_until(lambda: len(srv.pids()) == 3, what="EngineCore and Worker")
    shm = srv.shm_files()
    srv.send_signal(signal.SIGINT)
    assert srv.wait(timeout=10) == 0
    assert srv.wait_event("sigterm")["signal"] == "SIGINT"
    assert srv.pids() == [] and not any(os.path.exists(p) for p in shm)


def test_ignore_sigterm_needs_sigkill(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_IGNORE_SIGTERM": "1"}).wait_ready()
    srv.send_signal(signal.SIGTERM)
    os.killpg(srv.pid, signal.SIGTERM)  # the whole group, as a supervisor's stop would
    with pytest.raises(subprocess.TimeoutExpired):
        srv.wait(timeout=1.5)
    assert srv.health() == 200 and len(srv.pids()) == 3
    srv.kill_group()
    assert srv.proc.returncode == -signal.SIGKILL and srv.pids() == []


def test_sigkill_of_the_api_server_orphans_enginecore_and_worker(fake_vllm):
    srv = fake_vllm().wait_ready()
    engine = srv.start_record()["engine_pid"]
    wait_until(lambda: len(srv.pids()) == 3, what="EngineCore and Worker")
    srv.kill()
    time.sleep(0.3)
    survivors = srv.pids()
    assert engine in survivors and len(survivors) == 2 and srv.pid not in survivors
    with open(f"/proc/{engine}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) != srv.pid  # reparented
    with open(f"/proc/{engine}/cmdline", "rb") as f:
        assert b"fakevllm-enginecore" in f.read()
    assert len(srv.shm_files()) == 2
    assert set(survivors) <= set(fake_processes(srv.port))  # found by command line, too
    srv.kill_group()
    assert srv.pids() == []


def test_sigterm_ends_streams_with_an_error_event_and_cleans_up(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0.05"}).wait_ready()
    wait_until(lambda: len(srv.pids()) == 3, what="EngineCore and Worker")
    shm = srv.shm_files()
    assert len(shm) == 2
    stream = client(srv).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=1000, stream=True)
    got = 0
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in stream:
            got += 1
            if got == 3:
                srv.send_signal(signal.SIGTERM)
    assert srv.wait(timeout=10) == 0
    assert srv.pids() == [] and not any(os.path.exists(p) for p in shm)
    assert [e["event"] for e in srv.events()][-3:] == ["sigterm", "aborted", "stopped"]


def test_client_disconnect_mid_stream_is_recorded_as_cancelled(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0.1"}).wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"X-Request-Id": "req-42"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: {")
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    cancelled = srv.wait_event("cancelled")
    request = srv.wait_event("request", id=cancelled["id"])
    assert request["request_id"] == "req-42"
    assert cancelled["phase"] == "streaming" and 1 <= cancelled["tokens"] < 100
    assert srv.events("finished") == []


def test_client_disconnect_before_first_token_is_recorded(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_FIRST_TOKEN_DELAY": "30"}).wait_ready()
    with pytest.raises(openai.APITimeoutError):
        client(srv, timeout=0.5).completions.create(model="fake-model", prompt="x", max_tokens=3)
    cancelled = srv.wait_event("cancelled")
    assert cancelled["phase"] == "waiting_first_token" and cancelled["tokens"] == 0


@pytest.mark.parametrize("mode", ["stall", "block"])
def test_hang_stops_answering_but_sigterm_still_works(fake_vllm, mode):
    srv = fake_vllm(env={"FAKE_VLLM_HANG_AFTER": "0.5", "FAKE_VLLM_HANG_MODE": mode}).wait_ready()
    srv.wait_event("hang")
    assert srv.health(timeout=1.0) is None
    assert srv.proc.poll() is None
    shm = srv.shm_files()
    srv.send_signal(signal.SIGTERM)
    assert srv.wait(timeout=10) == 0
    assert srv.pids() == [] and not any(os.path.exists(p) for p in shm)


def test_health_fails_after_n_seconds_while_the_process_lives(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_HEALTH_FAIL_AFTER": "0.5"}).wait_ready()
    srv.wait_event("health_failing")
    assert srv.health() == 500 and srv.proc.poll() is None
    with pytest.raises(openai.InternalServerError):
        client(srv).completions.create(model="fake-model", prompt="x", max_tokens=1)


def test_enginecore_death_makes_the_server_exit_0(fake_vllm):
    srv = fake_vllm().wait_ready()
    os.kill(srv.start_record()["engine_pid"], signal.SIGKILL)
    assert srv.wait(timeout=10) == 0
    assert srv.wait_event("engine_died")
    srv.kill_group()  # the Worker was orphaned by its EngineCore's death


def test_no_children_and_no_shm_when_disabled(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_CHILD": "0", "FAKE_VLLM_SHM": "0"}).wait_ready()
    record = srv.start_record()
    assert record["engine_pid"] is None and record["shm"] == []
    assert srv.pids() == [srv.pid]
    srv.send_signal(signal.SIGTERM)
    assert srv.wait(timeout=10) == 0


def test_noise_and_a_long_line_reach_the_output(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_NOISE": "200", "FAKE_VLLM_LONG_LINE": str(200 * 1024)}).wait_ready()
    wait_until(lambda: srv.output().count("noise line") >= 20, what="noise lines")
    assert any(len(line) >= 200 * 1024 for line in srv.output().splitlines())
    srv.send_signal(signal.SIGTERM)
    assert srv.wait(timeout=10) == 0


def test_max_num_seqs_queues_the_rest(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_MAX_NUM_SEQS": "1", "FAKE_VLLM_TOKEN_DELAY": "0.2"}).wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 100, "stream": True}))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: {")  # holds the only slot
    outcome: list[BaseException] = []

    def second_request() -> None:
        try:
            client(srv, timeout=1.5).completions.create(model="fake-model", prompt="y")
        except openai.APITimeoutError as e:  # it must wait for the slot, past the client's timeout
            outcome.append(e)

    queued = threading.Thread(target=second_request)
    queued.start()
    wait_until(lambda: json.loads(http_get(srv.port, "/load")[1])["server_load"] == 2, what="a queued request")
    metrics = vllm_samples(srv)
    assert metrics["vllm:num_requests_running"] == 1
    assert metrics["vllm:num_requests_waiting"] == 1
    queued.join(30)
    assert len(outcome) == 1
    assert srv.wait_event("cancelled")["phase"] == "queued"
    conn.close()


def test_a_full_stdout_pipe_blocks_the_server_like_vllm(tmp_path):
    """A supervisor that stops draining the pipe gets an unresponsive server; the fake must show it."""
    port = free_port()
    env = dict(os.environ, FAKE_VLLM_NOISE="2000", FAKE_VLLM_CHILD="0", FAKE_VLLM_SHM="0", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakevllm", "serve", "m", "--port", str(port)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    def answers() -> bool:
        try:
            return http_get(port, "/health", timeout=1.0)[0] == 200
        except OSError:
            return False

    try:
        for line in proc.stdout:  # drain until ready, then stop reading
            if b"Application startup complete." in line:
                break
        assert answers()
        wait_until(lambda: not answers(), 30, "the pipe to fill and block the server")
        assert proc.poll() is None and port_open(port)  # alive and listening, yet no answer
        drained = threading.Thread(target=proc.stdout.read, daemon=True)
        drained.start()
        wait_until(answers, 30, "recovery once drained")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # the reader thread, if any, has its EOF now


def test_sigterm_still_stops_everything_after_the_reader_of_its_output_is_gone(tmp_path):
    """Its supervisor was killed (the pipe has no reader any more), then SIGTERM came, as from
    PR_SET_PDEATHSIG: like vLLM, whose logging swallows a broken stream, it still shuts down."""
    port = free_port()
    env = dict(os.environ, FAKE_VLLM_EVENTS=str(tmp_path / "events.jsonl"), PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakevllm", "serve", "m", "--port", str(port)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    children: list[psutil.Process] = []
    try:
        record = None
        for line in proc.stdout:
            if line.startswith(b"FAKE_VLLM_START "):
                record = json.loads(line.split(b" ", 1)[1])
            if b"Application startup complete." in line:
                break
        proc.stdout.close()  # the reader goes away
        engine = psutil.Process(record["engine_pid"])
        children += [engine, *engine.children()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0  # before: stuck in its SIGTERM handler's print
        _, alive = psutil.wait_procs([engine], timeout=15)
        assert not alive and not any(os.path.exists(p) for p in record["shm"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()  # a Worker whose EngineCore was SIGKILLed too early on a loaded box


def test_concurrent_streams_share_one_instance(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0.02"}).wait_ready()
    c = client(srv)
    results: list[str] = []

    def one() -> None:
        stream = c.completions.create(model="fake-model", prompt="x", max_tokens=10, stream=True)
        results.append("".join(ch.choices[0].text for ch in stream))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == ["tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7 tok8 tok9"] * 8


# -------------------------------------------------------------------- the speed model (vsup tune)


def test_speed_model_step_time_follows_threads_cpus_and_preload():
    from tests.fakevllm.engine import step_time

    f = load_faults({"FAKE_VLLM_STEP_TIME": "0.1", "FAKE_VLLM_SEQ_COST": "0.5", "FAKE_VLLM_SATURATE_THREADS": "2",
                     "FAKE_VLLM_BUSY_PENALTY": "1.5", "FAKE_VLLM_PRELOAD_SPEEDUP": "2"})
    assert step_time(f, 1, threads=1, cpus=2, preload=False) == pytest.approx(0.1)  # a core left idle
    assert step_time(f, 3, threads=1, cpus=2, preload=False) == pytest.approx(0.2)  # batch of 3: +2 × 50 %
    assert step_time(f, 1, threads=2, cpus=2, preload=False) == pytest.approx(0.075)  # 2 threads, no idle core
    assert step_time(f, 1, threads=4, cpus=4, preload=False) == pytest.approx(0.075)  # saturated at 2 threads
    assert step_time(f, 1, threads=4, cpus=2, preload=False) == pytest.approx(0.05 * 1.5 * 4)  # oversubscribed
    assert step_time(f, 1, threads=1, cpus=2, preload=True) == pytest.approx(0.05)


def test_speed_model_batches_concurrent_streams_into_shared_steps(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_STEP_TIME": "0.05", "OMP_NUM_THREADS": "1"}).wait_ready()
    c = client(srv)
    results: list[str] = []

    def one() -> None:
        stream = c.completions.create(model="fake-model", prompt="x", max_tokens=10, stream=True)
        results.append("".join(ch.choices[0].text for ch in stream))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == ["tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7 tok8 tok9"] * 4
    steps = next(float(line.rsplit(" ", 1)[1]) for line in http_get(srv.port, "/metrics")[1].decode().splitlines()
                 if line.startswith("fakevllm:engine_steps_total"))
    # 4 × 10 tokens in shared steps (a stream that joins late adds a few), not 40 separate ones
    assert 10 <= steps <= 20
