"""Reload, warm-up and the memory watchdog end to end: a real `vsup run` over fake vLLM processes
(tests/fakevllm), driven by the `vsup` CLI, SIGHUP and the fakes' own knobs, watched through the
control socket and the proxy. The same paths run in-process on a virtual clock in
tests/test_supervisor_inprocess.py, tests/test_memwatch.py and tests/test_driver.py."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest
import yaml

from tests.test_supervisor import alive, cli, proxy_get, transitions
from tests.vsup_harness import VsupRun, instance_connection

pytestmark = pytest.mark.timeout(240)

TOKENS = 12


def stream_through_proxy(port: int, key: str | None = None) -> tuple[int, int]:
    """One streaming completion through the proxy: (HTTP status, tokens received before [DONE];
    -1 when the stream ended without [DONE] or with an error event)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        body = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": TOKENS, "stream": True,
                           "fake": {"token_delay": 0.03}})
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            return response.status, 0
        tokens, done = 0, False
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return 200, -1
                tokens += 1
        return 200, tokens if done else -1
    finally:
        conn.close()


class Load:
    """`clients` threads streaming completions through the proxy back to back, and a watcher
    sampling the ready count and the proxy's /ready, until stop()."""

    def __init__(self, run: VsupRun, clients: int = 3) -> None:
        self.run = run
        self.results: list[tuple[int, int]] = []
        self.ready_counts: list[int] = []
        self.proxy_ready: list[int] = []
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(clients)]
        self._threads.append(threading.Thread(target=self._watch))
        for thread in self._threads:
            thread.start()

    def _client(self) -> None:
        while not self._done.is_set():
            try:
                self.results.append(stream_through_proxy(self.run.proxy_port))
            except OSError as exc:
                self.results.append((-1, -1))
                print("client:", exc)

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                self.ready_counts.append(self.run.status()["vsup"]["ready"])
                self.proxy_ready.append(proxy_get(self.run.proxy_port, "/ready"))
            except OSError as exc:
                print("watch:", exc)
            time.sleep(0.05)

    def stop(self) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(60)

    @property
    def failed(self) -> list[tuple[int, int]]:
        return [r for r in self.results if r != (200, TOKENS)]


def rewrite(run: VsupRun, **sections) -> None:
    """Change the running vsup's config file (sections merge into the current ones)."""
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(run.config.get(section), dict):
            run.config[section] = {**run.config[section], **values}
        else:
            run.config[section] = values
    run.config_path.write_text(yaml.safe_dump(run.config))


def test_reload_with_changed_args_replaces_every_instance_under_a_streaming_load_without_a_failed_request(vsup):
    run = vsup(proxy={"drain_timeout": 10})
    before = run.wait_ready(2)["instances"]
    load = Load(run)
    try:
        time.sleep(1.0)
        rewrite(run, vllm={"args": ["--dtype", "bfloat16"]})
        result = cli("reload", "--config", str(run.config_path))
        time.sleep(1.0)
    finally:
        load.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("last reload (vsup reload): done after "), result.stdout
    assert "2 replaced, 0 unchanged" in result.stdout and "instance 1: replace (command line +--dtype bfloat16)" in result.stdout
    assert load.failed == [] and len(load.results) > 10, load.results
    assert min(load.ready_counts) == 1 and set(load.proxy_ready) == {200}  # no free core: one fewer at most
    after = run.status()
    for old, new in zip(before, after["instances"], strict=True):
        assert new["state"] == "ready" and new["pid"] != old["pid"] and not alive(old["pid"])
        assert new["last_exit"].startswith("reload: command line +--dtype bfloat16")
        assert [t["to"] for t in new["transitions"]][-5:] == ["draining", "stopping", "starting", "warming", "ready"]
    assert after["rollout"]["state"] == "done" and after["rollout"]["trigger"] == "vsup reload"
    # one at a time: instance 1 was drained only once instance 0 was back in the rotation
    zero_back = transitions(after["instances"][0], "warming", "ready")[-1]["at"]
    assert transitions(after["instances"][1], "ready", "draining")[-1]["at"] >= zero_back
    argv = (run.tmp / "logs" / "i1.log").read_text()
    assert "--dtype bfloat16" in argv


def test_an_invalid_file_is_refused_with_the_error_and_the_fleet_is_untouched(vsup):
    run = vsup()
    before = [(i["pid"], i["state"]) for i in run.wait_ready(2)["instances"]]
    rewrite(run, instances=0)
    result = cli("reload", "--socket", run.socket)
    assert result.returncode == 2
    assert result.stderr.startswith(f"vsup: error: reload refused, nothing was changed: {run.config_path}:")
    assert "instances: 0 is not valid" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    status = run.status()
    assert [(i["pid"], i["state"]) for i in status["instances"]] == before
    assert status["rollout"]["state"] == "rejected"
    # by --config too (systemd's ExecReload): the broken file still says where its vsup listens,
    # and that vsup refuses it and records the refusal
    result = cli("reload", "--config", str(run.config_path))
    assert result.returncode == 2 and result.stderr.startswith("vsup: error: reload refused, nothing was changed: "), result.stderr
    assert run.status()["rollout"]["state"] == "rejected"
    shown = cli("status", "--socket", run.socket)
    assert "last reload (vsup reload): REJECTED" in shown.stdout and "instances: 0 is not valid" in shown.stdout


def test_sighup_reloads_a_changed_count_and_api_key_applies_live(vsup):
    run = vsup(placement={"cores_per_instance": 1})  # instance 0 keeps CPU 0 when instance 1 goes
    zero, one = run.wait_ready(2)["instances"]
    rewrite(run, instances=1, proxy={"api_key": "sekret"}, placement={"cores_per_instance": 1})
    os.kill(run.proc.pid, signal.SIGHUP)
    status = run.wait_for(lambda s: s["rollout"] and s["rollout"]["state"] == "done", 60, "the reload")
    assert status["rollout"]["trigger"] == "SIGHUP" and status["rollout"]["applied"] == ["proxy.api_key"]
    assert [(s["index"], s["action"], s["state"]) for s in status["rollout"]["steps"]] == [(1, "remove", "done")]
    assert [i["pid"] for i in status["instances"]] == [zero["pid"]]  # unchanged: it kept running
    assert not alive(one["pid"]) and run.config["vllm"]["base_port"] + 1 not in {i["port"] for i in status["instances"]}
    assert stream_through_proxy(run.proxy_port) == (401, 0)
    assert stream_through_proxy(run.proxy_port, key="sekret") == (200, TOKENS)
    assert "reload (SIGHUP)" in run.log() and "settings applied at once: proxy.api_key" in run.log()


def test_a_replacement_starts_beside_the_old_one_when_its_cores_are_free(vsup):
    # one instance on CPU 0 of this 2-CPU machine, CPU 1 free; the reload moves it to CPU 1
    run = vsup(instances=1, placement={"cores_per_instance": 1})
    (old,) = run.wait_ready(1)["instances"]
    assert old["cpus"] == [0]
    load = Load(run, clients=2)
    try:
        time.sleep(0.5)
        rewrite(run, placement={"reserve_cores": 1})
        result = cli("reload", "--socket", run.socket, "--format", "json")
    finally:
        load.stop()
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    (step,) = record["steps"]
    assert step["how"] == "beside, on socket 0b.sock: its CPUs 1 are free"  # vllm.listen: unix
    assert min(load.ready_counts) == 1 and set(load.proxy_ready) == {200} and load.failed == []
    (new,) = run.status()["instances"]
    assert new["name"] == "0b" and new["port"] == run.spare_base_port and new["cpus"] == [1]
    assert os.sched_getaffinity(new["pid"]) == {1} and not alive(old["pid"])
    assert (run.tmp / "logs" / "i0b.log").exists()


def test_warm_up_runs_before_the_rotation_and_a_failing_one_keeps_the_instance_out(vsup):
    # instance 1 answers /health but every completion with 503: it never warms up
    run = vsup(faults={1: {"STATUS_503": 1}}, health={"warmup": {"prompt": "warm me", "max_tokens": 2}})
    status = run.wait_for(lambda s: s["instances"][0]["state"] == "ready"
                          and s["instances"][1]["backoff_failures"] >= 2, 60, "instance 1 failing its warm-up")
    zero, one = status["instances"]
    (warmed,) = transitions(zero, "warming", "ready")
    assert warmed["reason"].startswith("warm-up answered in")
    log = (run.tmp / "logs" / "i0.log").read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # the warm-up reached the instance itself
    failed = transitions(one, "warming", "stopping")
    assert failed and all(t["event"] == "warmup_failed" for t in failed)
    assert one["last_exit"].startswith("warm-up failed after") and "HTTP 503" in one["last_exit"]
    assert transitions(one, "warming", "ready") == []
    assert stream_through_proxy(run.proxy_port)[0] == 200  # instance 0 serves meanwhile


def test_memory_watchdog_drains_and_restarts_a_growing_instance_while_the_other_serves(vsup):
    run = vsup(restart={"max_rss": "300MiB", "max_rss_for": 1.0}, proxy={"drain_timeout": 10})
    zero, one = run.wait_ready(2)["instances"]
    reading = run.wait_for(lambda s: s["instances"][0]["memory_watchdog"]["rss"], 10, "a first reading")["instances"][0]
    assert reading["memory_watchdog"]["limit"] == 300 * 2**20 and reading["memory_watchdog"]["rss"] < 200 * 2**20
    load = Load(run, clients=2)
    try:
        time.sleep(0.5)
        conn = instance_connection(zero["address"])
        conn.request("POST", "/fake/grow", body=json.dumps({"mib": 350}), headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
        status = run.wait_for(lambda s: s["instances"][0]["pid"] != zero["pid"] and s["instances"][0]["state"] == "ready",
                              60, "instance 0 restarted")
    finally:
        load.stop()
    assert load.failed == [] and min(load.ready_counts) == 1 and set(load.proxy_ready) == {200}
    restarted, other = status["instances"]
    drain = transitions(restarted, "ready", "draining")[-1]
    assert drain["reason"].startswith("memory watchdog: RSS ") and "above restart.max_rss 300MiB" in drain["reason"]
    assert other["pid"] == one["pid"] and other["state"] == "ready" and transitions(other, "ready", "draining") == []
    assert not alive(zero["pid"]) and restarted["last_exit"].startswith("memory watchdog: RSS")
    assert "instance 0: memory" in run.log() and "draining and restarting it" in run.log()
