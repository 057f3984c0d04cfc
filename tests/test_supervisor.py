"""`vsup run` end to end: a real vsup process over real fake-vLLM processes, observed from outside
(control socket, proxy port, /proc). Timeouts are small in the configs and generous in the waits."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from itertools import pairwise
from pathlib import Path

import psutil
import pytest
import yaml

from tests.fakevllm.fixtures import start_records
from tests.vsup_harness import VSUP, VsupRun, make_config, port_is_free

pytestmark = pytest.mark.timeout(180)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*VSUP, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def transitions(inst: dict, old: str | None = None, new: str | None = None) -> list[dict]:
    return [t for t in inst["transitions"] if (old is None or t["from"] == old) and (new is None or t["to"] == new)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def exists(pid: int) -> bool:
    try:
        psutil.Process(pid)
        return True
    except psutil.NoSuchProcess:
        return False


def start_record(run: VsupRun, index: int, pid: int) -> dict:
    """The fake server's FAKE_VLLM_START record (engine_pid, shm files) of the run with `pid`."""
    log = (run.tmp / "logs" / f"i{index}.log").read_text(errors="replace")
    records = [r for r in start_records(log) if r["pid"] == pid]
    assert records, f"no start record of pid {pid} in i{index}.log"
    return records[-1]


def proxy_get(port: int, path: str, timeout: float = 5.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def completion_through_proxy(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 3})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = json.loads(response.read())
        assert response.status == 200, data
        return data
    finally:
        conn.close()


# ---- refusing to start -----------------------------------------------------------------------------

def test_bad_config_exits_2_naming_the_key(tmp_path):
    config = make_config(tmp_path, health={"interval": -1})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    result = cli("run", "--config", str(path))
    assert result.returncode == 2
    assert "health.interval" in result.stderr and "-1" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_busy_proxy_port_exits_2_and_starts_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = make_config(tmp_path, proxy={"port": port})
        path = tmp_path / "vsup.yaml"
        path.write_text(yaml.safe_dump(config))
        result = cli("run", "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert f"{port}" in result.stderr and "proxy" in result.stderr
    assert "Traceback" not in result.stderr
    assert "started pid" not in result.stderr  # no instance was launched before the port check failed


def test_missing_server_program_exits_2_naming_vllm_command(tmp_path):
    config = make_config(tmp_path, vllm={"command": [str(tmp_path / "no-such-vllm"), "serve"]})
    path = tmp_path / "vsup.yaml"
    path.write_text(yaml.safe_dump(config))
    result = cli("run", "--config", str(path))
    assert result.returncode == 2
    assert "vllm.command" in result.stderr and "no-such-vllm" in result.stderr


def test_status_without_a_running_vsup_says_so(tmp_path):
    result = cli("status", "--socket", str(tmp_path / "nothing.sock"))
    assert result.returncode == 2
    assert "not running" in result.stderr and "nothing.sock" in result.stderr


# ---- starting and serving ----------------------------------------------------------------------------

def test_staggered_slow_start_is_ready_only_after_health_then_serves_through_the_proxy(vsup):
    # instance 0 "loads its model" for 2 s with its port closed, like vLLM's 40-120 s
    run = vsup(faults={0: {"START_DELAY": 2}}, start={"mode": "staggered"})
    loading = run.wait_for(lambda s: s["instances"][0]["pid"] is not None, 20, "instance 0 spawned")
    first = loading["instances"][0]
    assert first["state"] == "starting" and alive(first["pid"])
    assert loading["instances"][1]["state"] == "stopped"  # staggered: waits for instance 0
    assert proxy_get(run.proxy_port, "/ready") == 503  # nothing ready, nothing routed

    status = run.wait_ready(2)
    zero, one = status["instances"]
    (healthy,) = transitions(zero, "starting", "warming")
    (became_ready,) = transitions(zero, "warming", "ready")
    (started,) = transitions(zero, "stopped", "starting")
    assert healthy["at"] - started["at"] >= 2.0  # not before /health answered
    assert "/health 200" in healthy["reason"]
    assert became_ready["reason"].startswith("warm-up answered")  # and the warm-up before the rotation
    assert transitions(one, "stopped", "starting")[0]["at"] >= became_ready["at"]  # the next after the previous

    for index, inst in enumerate((zero, one)):
        assert inst["port"] == run.port(index)
        assert alive(inst["pid"]) and inst["restarts"] == 0 and inst["last_exit"] is None
        assert inst["cpus"] == [index]  # taskset, reserve_cores 0: one CPU each on this 2-CPU box
        assert inst["placement_ok"] is True, inst["placement_drift"]
        assert os.sched_getaffinity(inst["pid"]) == {index}

    result = cli("status", "--config", str(run.config_path), "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [(i["index"], i["state"], i["pid"], i["port"]) for i in data["instances"]] == [
        (0, "ready", zero["pid"], run.port(0)), (1, "ready", one["pid"], run.port(1))]
    text = cli("status", "--socket", run.socket)
    assert text.returncode == 0 and "2/2 instances ready" in text.stdout
    assert str(zero["pid"]) in text.stdout and f"/instances-{run.proxy_port}/1.sock" in text.stdout  # the socket

    answer = completion_through_proxy(run.proxy_port)
    assert answer["choices"][0]["text"]
    assert proxy_get(run.proxy_port, "/ready") == 200


def test_heavy_output_and_long_lines_do_not_block_the_instance(vsup):
    run = vsup(instances=1, faults={0: {"NOISE": 2000, "LONG_LINE": 300000}})
    run.wait_ready(1)
    pid = run.instance(0)["pid"]
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # probes and requests keep working while it floods its pipes
        began = time.monotonic()
        inst = run.instance(0)
        assert inst["state"] == "ready" and inst["pid"] == pid
        assert time.monotonic() - began < 5
        time.sleep(0.3)
    completion_through_proxy(run.proxy_port)
    log = (run.tmp / "logs" / "i0.log").read_text(errors="replace")
    assert "[truncated" in log  # the 300 kB line was cut, not fatal
    assert log.count("noise line") > 1000
    assert not transitions(run.instance(0), "ready")  # never left ready


# ---- failures ----------------------------------------------------------------------------------------

def test_kill9_of_the_api_server_restarts_it_and_removes_its_orphans_while_the_other_serves(vsup):
    # a long poll interval: leaving the rotation must come from the exit itself, not from a poll
    run = vsup(health={"interval": 30})
    zero, one = run.wait_ready(2)["instances"]
    record = start_record(run, 0, zero["pid"])
    engine = record["engine_pid"]
    orphans = [engine, *(c.pid for c in psutil.Process(engine).children(recursive=True))]
    assert len(orphans) == 2 and all(alive(p) for p in orphans)  # EngineCore and its Worker
    assert record["shm"] and all(os.path.exists(p) for p in record["shm"])

    os.kill(zero["pid"], signal.SIGKILL)
    run.wait_for(lambda s: s["instances"][0]["state"] != "ready", 5, "instance 0 out of rotation at once")
    status = run.wait_for(lambda s: s["instances"][0]["state"] == "ready" and s["instances"][0]["pid"] not in (None, zero["pid"]),
                          40, "instance 0 restarted")
    again, other = status["instances"]
    assert again["restarts"] == 1
    assert again["last_exit"].startswith("killed by SIGKILL from outside vsup (not the OOM killer: oom_kill unchanged at ")
    (exit_transition,) = transitions(again, "ready", "stopping")
    assert exit_transition["event"] == "exited"
    assert not any(alive(p) for p in orphans), "the killed server's EngineCore/Worker survived"
    assert not any(os.path.exists(p) for p in record["shm"]), "its /dev/shm files were left behind"
    # the other instance never noticed
    assert other["pid"] == one["pid"] and other["restarts"] == 0 and not transitions(other, "ready")


def test_when_an_api_server_dies_the_rest_of_its_tree_is_gone_within_2_s_not_stop_timeout(vsup):
    # the slowest case: EngineCore and Worker ignore SIGTERM, and stop.timeout is 30 s (the issue
    # measured 10.8 s with real vLLM: its orphans held the memory the restart needed meanwhile)
    run = vsup(instances=1, faults={0: {"IGNORE_SIGTERM": 1}}, stop={"timeout": 30}, health={"interval": 30})
    zero = run.wait_ready(1)["instances"][0]
    engine = start_record(run, 0, zero["pid"])["engine_pid"]
    orphans = [engine, *(c.pid for c in psutil.Process(engine).children(recursive=True))]
    assert len(orphans) == 2 and all(alive(p) for p in orphans)
    os.kill(zero["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    while any(alive(p) for p in orphans) and time.monotonic() < killed_at + 30:
        time.sleep(0.02)
    gone_after = time.monotonic() - killed_at
    assert gone_after < 2.5, f"EngineCore and Worker went {gone_after:.1f}s after their API server"  # 2 s + polling slack
    stopped = run.wait_for(lambda s: transitions(s["instances"][0], "stopping", "backoff"), 10, "the stop")["instances"][0]
    assert transitions(stopped, "ready", "stopping")[0]["event"] == "exited"
    assert "after SIGKILL" in run.log()  # "process tree of pid N gone after SIGKILL in 1.xs"


def test_backoff_grows_and_is_capped_then_a_crash_loop_fails_only_that_instance(vsup):
    run = vsup(faults={1: {"CRASH_AT_START": 3}},
               restart={"max_delay": 2.0, "max_failures": 5})
    # (parallel start: on a loaded box instance 0 may still be loading when instance 1 gives up)
    status = run.wait_for(lambda s: s["instances"][1]["state"] == "failed" and s["instances"][0]["state"] == "ready",
                          60, "instance 1 failed while instance 0 is ready")
    zero, one = status["instances"]
    entered = transitions(one, None, "backoff")
    left = transitions(one, "backoff", "starting")
    assert len(entered) == len(left) == 4  # the 5th failure is the crash loop
    waited = [b["at"] - a["at"] for a, b in zip(entered, left, strict=True)]
    # 1 s plus up to 1 s of jitter, then doubling (2, 4, 8 s) capped at max_delay 2 s
    planned = [float(t["reason"].split()[3].removesuffix("s")) for t in entered]
    assert 1.0 <= planned[0] <= 2.0 and planned[1:] == [2.0, 2.0, 2.0], planned
    for got, want in zip(waited, planned, strict=True):
        assert want - 0.02 <= got <= want + 1.0, (waited, planned)  # + 1 s for a loaded box
    assert "code 3" in one["last_exit"]
    assert transitions(one, "stopping", "failed")[0]["event"] == "crash_loop"
    assert zero["state"] == "ready" and not transitions(zero, "ready")  # the other kept serving
    assert completion_through_proxy(run.proxy_port)

    # `vsup restart 1` gives it a new chance; it crash-loops again and the command says so
    result = cli("restart", "1", "--socket", run.socket)
    assert result.returncode == 1
    assert "instance 1" in result.stderr and "failed" in result.stderr
    assert run.instance(1)["restarts"] == 9  # five more starts
    assert run.instance(0)["state"] == "ready"

    # SIGHUP does the same for every failed instance
    run.proc.send_signal(signal.SIGHUP)
    run.wait_for(lambda s: s["instances"][1]["restarts"] > 9, 20, "instance 1 started again after SIGHUP")


def test_a_hung_instance_and_one_whose_health_fails_are_restarted(vsup):
    run = vsup(faults={0: {"HANG_AFTER": 1}, 1: {"HEALTH_FAIL_AFTER": 1}},
               health={"interval": 0.2, "timeout": 0.5, "failures": 3})

    def came_back(inst: dict) -> bool:
        unhealthy = transitions(inst, "ready", "unhealthy")
        return bool(unhealthy) and any(t["at"] > unhealthy[0]["at"] for t in transitions(inst, "warming", "ready"))

    status = run.wait_for(lambda s: all(came_back(i) for i in s["instances"]), 60, "both restarted")
    zero, one = status["instances"]
    assert "timeout" in transitions(zero, "ready", "unhealthy")[0]["reason"]
    assert "HTTP 500" in transitions(one, "ready", "unhealthy")[0]["reason"]
    for inst in (zero, one):
        assert inst["restarts"] >= 1 and inst["last_exit"].startswith("unhealthy")


def test_an_instance_whose_engine_hangs_behind_a_healthy_api_server_is_taken_out_and_restarted(vsup):
    # /health keeps answering (the health checks see nothing); the proxy's stall watchdog does
    run = vsup(faults={0: {"HANG_AFTER": 1, "HANG_MODE": "engine"}}, proxy={"stall_timeout": 1})
    run.wait_ready(2)
    time.sleep(1.5)  # instance 0's engine is stuck now
    for _ in range(4):  # round robin: the ones sent to instance 0 are retried on 1 (completion_through_proxy asserts 200)
        completion_through_proxy(run.proxy_port)
    status = run.wait_for(lambda s: s["instances"][0]["restarts"] >= 1, 30, "instance 0 restarted")
    stopped = transitions(status["instances"][0], "ready", "stopping")[0]
    assert "stalled: 1 request(s) without a byte" in stopped["reason"], stopped
    assert status["instances"][1]["restarts"] == 0
    assert "stalled" in run.log()


def test_exit_code_0_after_engine_death_and_a_startup_timeout_are_failures(vsup):
    run = vsup(faults={0: {"START_DELAY": 60}}, health={"startup_timeout": 5})
    one = run.wait_for(lambda s: s["instances"][1]["state"] == "ready", 30, "instance 1 ready")["instances"][1]
    engine = start_record(run, 1, one["pid"])["engine_pid"]
    os.kill(engine, signal.SIGKILL)  # like vLLM, the fake's API server then exits with code 0
    status = run.wait_for(lambda s: s["instances"][1]["restarts"] >= 1 and s["instances"][1]["state"] == "ready"
                          and transitions(s["instances"][0], "starting", "stopping"), 40, "both failures handled")
    zero, one = status["instances"]
    exited = transitions(one, "ready", "stopping")[0]
    assert exited["event"] == "exited" and "code 0" in exited["reason"]
    assert transitions(one, "stopping", "backoff")  # a failure like any other: backoff, then a new start
    timed_out = transitions(zero, "starting", "stopping")[0]
    assert timed_out["event"] == "startup_timeout" and "5s" in timed_out["reason"]
    first_start = transitions(zero, "stopped", "starting")[0]
    assert 5 <= timed_out["at"] - first_start["at"] < 5 + 5


# ---- stopping ----------------------------------------------------------------------------------------

def test_sigterm_stops_every_process_even_one_ignoring_sigterm_and_frees_the_ports(vsup):
    run = vsup(faults={1: {"IGNORE_SIGTERM": 1}}, stop={"timeout": 2})
    zero, one = run.wait_ready(2)["instances"]
    family = run.all_descendants()
    assert len(family) >= 6  # two servers, each with EngineCore and Worker
    shm = start_record(run, 0, zero["pid"])["shm"] + start_record(run, 1, one["pid"])["shm"]

    began = time.monotonic()
    code = run.terminate(timeout=30)
    took = time.monotonic() - began
    assert code == 0, run.log()[-3000:]
    assert 2.0 <= took < 2.0 + 15  # instance 1 needed the SIGKILL after stop.timeout
    leftovers = [p for p in family if exists(p)]
    assert not leftovers, f"processes left (zombies included): {leftovers}"
    assert all(port_is_free(p) for p in (run.port(0), run.port(1), run.proxy_port))
    assert not Path(run.socket).exists()
    assert not any(os.path.exists(p) for p in shm)
    log = run.log()
    assert "instance 1: stopping -> stopped" in log and "SIGKILL" in log


def test_restart_one_and_rolling_restart_all_keep_the_endpoint_up(vsup):
    run = vsup(faults={0: {"START_DELAY": 1}, 1: {"START_DELAY": 1}})
    zero, one = run.wait_ready(2)["instances"]
    ready_counts: list[int] = []
    proxy_answers: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                ready_counts.append(run.status()["vsup"]["ready"])
                proxy_answers.append(proxy_get(run.proxy_port, "/ready", timeout=5))
            except OSError as exc:
                proxy_answers.append(-1)
                print("watch:", exc)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = cli("restart", "0", "--config", str(run.config_path))
        assert result.returncode == 0, result.stderr
        after_one = run.status()["instances"]
        assert after_one[0]["state"] == "ready" and after_one[0]["pid"] != zero["pid"]
        assert after_one[0]["last_exit"].startswith("stopped on request")
        assert after_one[1]["pid"] == one["pid"]

        result = cli("restart", "all", "--rolling", "--socket", run.socket, "--format", "json")
        assert result.returncode == 0, result.stderr
        final = json.loads(result.stdout)["instances"]
        assert [i["state"] for i in final] == ["ready", "ready"]
        assert final[0]["pid"] not in (zero["pid"], after_one[0]["pid"]) and final[1]["pid"] != one["pid"]
        # one at a time: instance 1 went down only after instance 0 was ready again
        status = run.status()["instances"]
        zero_ready_again = transitions(status[0], "warming", "ready")[-1]["at"]
        one_drained = transitions(status[1], "ready", "draining")[-1]["at"]
        assert one_drained >= zero_ready_again
        for inst in status:  # the rolling path: drained, restarted, warmed up
            assert [t["to"] for t in inst["transitions"]][-5:] == ["draining", "stopping", "starting", "warming", "ready"]
    finally:
        done.set()
        watcher.join()
    assert len(ready_counts) > 20 and min(ready_counts) >= 1, ready_counts
    assert set(proxy_answers) == {200}, proxy_answers


def test_systemd_notify_ready_status_watchdog_and_stopping(vsup, tmp_path):
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(sock_path))
        notify.settimeout(0.2)
        run = vsup(faults={0: {"START_DELAY": 2}, 1: {"START_DELAY": 2}},
                   env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "2000000"})
        messages: list[tuple[float, str]] = []

        def collect(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                try:
                    messages.append((time.monotonic(), notify.recv(4096).decode()))
                except TimeoutError:
                    pass

        run.wait_for(lambda s: s["instances"][0]["state"] == "starting", 20, "loading")
        collect(1.2)
        assert run.status()["vsup"]["ready"] == 0
        assert not any("READY=1" in m for _, m in messages)  # not while the models load
        assert any("EXTEND_TIMEOUT_USEC=" in m for _, m in messages), messages  # ... but systemd is told to wait
        run.wait_ready(2)
        collect(0.3)  # what queued up meanwhile
        listening = time.monotonic()
        collect(4.5)  # pings every second: 3 s gave only 2 on a loaded box
        ready = [m for _, m in messages if "READY=1" in m]
        assert len(ready) == 1 and "STATUS=2/2 instances ready, 0 in flight" in ready[0]
        pings = [t for t, m in messages if m == "WATCHDOG=1" and t > listening]
        assert len(pings) >= 3 and max(b - a for a, b in pairwise(pings)) < 2.0  # within WATCHDOG_USEC
        for inst in run.status()["instances"]:
            environ = Path(f"/proc/{inst['pid']}/environ").read_bytes().split(b"\0")
            assert not [v for v in environ if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))]
        assert run.terminate() == 0
        collect(0.5)
        assert any(m.startswith("STOPPING=1") for _, m in messages)


def test_restart_of_an_unknown_instance_is_a_clear_error(vsup):
    run = vsup(instances=1)
    run.wait_ready(1)
    result = cli("restart", "5", "--socket", run.socket)
    assert result.returncode == 2 and "no instance 5" in result.stderr and "0..0" in result.stderr


# ---- when vsup itself is killed ----------------------------------------------------------------------

def test_a_sigkilled_vsup_takes_its_instances_along_and_the_next_run_sweeps_what_stayed(vsup, tmp_path):
    # instance 1 ignores SIGTERM (a hung vLLM): the one thing that can outlive its vsup; on TCP
    # ports, where another vsup can meet it
    run = vsup(faults={1: {"IGNORE_SIGTERM": 1}}, vllm={"listen": "tcp"})
    zero, one = run.wait_ready(2)["instances"]
    records = [start_record(run, 0, zero["pid"]), start_record(run, 1, one["pid"])]
    trees = [run.tree(zero["pid"]), run.tree(one["pid"])]
    assert all(len(tree) == 3 for tree in trees)  # API server, EngineCore, Worker
    (state_file,) = tmp_path.glob("vsup-*/vsup-*.json")

    os.kill(run.proc.pid, signal.SIGKILL)  # kill -9, or the OOM killer
    run.proc.wait(10)
    # instance 0 goes with its vsup: its leader gets SIGTERM and stops its EngineCore (the fake's
    # Worker follows unless its EngineCore was SIGKILLed first on a loaded box: swept below then)
    leader_and_engine = [zero["pid"], records[0]["engine_pid"]]
    deadline = time.monotonic() + 30
    while any(alive(p) for p in leader_and_engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in leader_and_engine), "instance 0 outlived its vsup"
    assert not any(os.path.exists(p) for p in records[0]["shm"])  # vLLM's own clean exit on SIGTERM
    assert all(alive(p) for p in trees[1]) and not port_is_free(run.port(1)) and state_file.exists()

    # a vsup with another runtime directory cannot know it: it refuses, naming the holder
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    refused = subprocess.run([*VSUP, "run", "--config", str(run.config_path)], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(elsewhere)})
    assert refused.returncode == 2, refused.stderr
    assert f"port {run.port(1)} on 127.0.0.1 is not free" in refused.stderr
    assert f"held by pid {one['pid']} (" in refused.stderr
    assert f"left behind by vsup pid {run.proc.pid}, which is no longer running" in refused.stderr
    assert all(alive(p) for p in trees[1])

    # the next vsup in the same runtime directory stops and sweeps it, then serves on the same ports
    again = VsupRun(tmp_path, run.config)
    try:
        again.wait_ready(2, timeout=60)
        log = again.log()
        assert f"leftovers: vsup pid {run.proc.pid} is no longer running" in log
        assert all(f"pid {p} (" in log for p in trees[1]) and "SIGKILL needed" in log
        assert not any(alive(p) for p in trees[0] + trees[1])  # nothing of the killed vsup is left
        assert not any(os.path.exists(p) for p in records[1]["shm"])
        assert not state_file.exists()
        assert completion_through_proxy(run.proxy_port)
    finally:
        again.close()
