"""Start phases and the progress rule end to end: `vsup run` over fake vLLM servers that start in
vLLM's phases (FAKE_VLLM_PHASES: vLLM 0.32's lines, real CPU time, real reads of the weight files,
or nothing at all), watched from outside through `vsup status` (JSON and text) and /metrics as the
starts happen."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import time

import pytest

from tests.vsup_harness import VSUP

pytestmark = pytest.mark.timeout(180)


def transitions(inst: dict, event: str) -> list[dict]:
    return [t for t in inst["transitions"] if t["event"] == event]


def proxy_metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_each_starts_phases_show_in_vsup_status_as_they_happen(vsup, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(6 << 20))
    # a boot longer than a reading's interval (2 s): the load's bytes count from a reading after Python's imports
    phases = {"PHASES": "boot:2.5,load:3,compile:12,profile:0.3", "SHARDS": "3", "WAIT_LINE_EVERY": "1"}
    run = vsup(model=str(model), placement={"model_size_gib": None}, health={"startup_timeout": 120}, start={"mode": "auto"},
               faults={0: phases, 1: phases})
    seen: dict[int, list[str]] = {0: [], 1: []}
    loading: list[dict] = []
    text = json_out = None
    metrics = ""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert run.proc.poll() is None, run.log()[-3000:]
        try:
            status = run.status()
        except OSError:  # its control socket is not there yet
            time.sleep(0.1)
            continue
        for inst in status["instances"]:
            phase = inst["phase"]
            if phase is None:
                continue
            if not seen[inst["index"]] or seen[inst["index"]][-1] != phase["name"]:
                seen[inst["index"]].append(phase["name"])
            if phase["name"] == "loading":
                loading.append(phase)
                if "vsup_instance_start_phase{" not in metrics:
                    metrics = proxy_metrics(run.proxy_port)
            if phase["name"] == "compiling" and phase["waiting"] and text is None:
                # both at once: the CLI takes seconds to start on a box this busy, the compile lasts 12
                clis = [subprocess.Popen([*VSUP, "status", "--socket", run.socket, *extra], stdout=subprocess.PIPE, text=True)
                        for extra in ((), ("--format", "json"))]
                text, json_out = (cli.communicate(timeout=30)[0] for cli in clis)
        if all(inst["state"] == "ready" for inst in status["instances"]):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"not both ready; phases seen {seen}\n{run.log()[-3000:]}")
    for index, names in seen.items():  # each reading (every 2 s) sees the phase the output named last
        assert [n for n in names if n in ("booting", "loading", "compiling")] == ["booting", "loading", "compiling"], (index, names)
    assert any(p["shards"] and p["read_bytes"] and p["weights_bytes"] == 6 << 20 for p in loading), loading
    assert max(p["read_bytes"] or 0 for p in loading) <= 8 << 20  # the weights' reads, not Python's own
    assert 'vsup_instance_start_phase{' in metrics and 'phase="loading"' in metrics
    # while compiling: the PHASE column, and vLLM's alarming line explained next to it
    assert text is not None and json_out is not None, seen
    assert re.search(r"starting\s+compiling \d+s", text), text
    assert re.search(r"instance [01] compiling: vLLM.*\"No available shared memory broadcast block found in \d+ seconds.*"
                     r"— normal while compiling", text), text
    assert '"name": "compiling"' in json_out and '"waiting": {' in json_out
    # start.mode auto: these fit together, so both started at once, and the log says why
    assert "start: parallel (start.mode auto): all 2 instances load at once: their peak" in run.log()
    first = [next(t["at"] for t in inst["transitions"] if t["to"] == "starting") for inst in status["instances"]]
    assert abs(first[0] - first[1]) < 1.0
    for inst in status["instances"]:
        assert inst["phase"] is None  # serving: no phase
        (healthy,) = transitions(inst, "healthy")
        assert re.search(r"\(booting \d+s, loading \d+s, (?:profiling \d+s, )?compiling \d+s", healthy["reason"]), healthy["reason"]


def test_a_start_that_stops_progressing_is_stopped_as_stalled_naming_its_phase(vsup):
    # loads, then hangs: no line but vLLM's waiting line every 0.5 s, no CPU, no reads
    run = vsup(instances=1, health={"startup_stall": 3, "startup_timeout": 60},
               faults={0: {"PHASES": "load:1,stall:120", "SHARDS": "2", "WAIT_LINE_EVERY": "0.5"}})
    status = run.wait_for(lambda s: transitions(s["instances"][0], "stalled"), 60, "the stalled start stopped")
    inst = status["instances"][0]
    stalled = transitions(inst, "stalled")[0]
    assert re.match(r"stalled in profiling for [3-6] s: no new phase, output, CPU time or reads in its process tree "
                    r"\(health\.startup_stall 3s; last /health: ", stalled["reason"]), stalled["reason"]
    start = next(t for t in inst["transitions"] if t["to"] == "starting")
    assert 1 + 3 <= stalled["at"] - start["at"] <= 1 + 3 + 2 + 4  # the load, the stall time, a reading's interval, slack
    again = run.wait_for(lambda s: s["instances"][0]["restarts"] >= 1, 30, "the next start")
    assert again["instances"][0]["last_exit"].startswith("stalled in profiling")


def test_a_slow_start_that_keeps_using_cpu_without_a_line_is_not_stalled(vsup):
    run = vsup(instances=1, health={"startup_stall": 2.5, "startup_timeout": 60},
               faults={0: {"PHASES": "compile:8", "WAIT_LINE_EVERY": "1"}})
    status = run.wait_ready(1, timeout=60)
    inst = status["instances"][0]
    assert not transitions(inst, "stalled") and inst["restarts"] == 0
    assert re.search(r"compiling [5-9]s", transitions(inst, "healthy")[0]["reason"])  # seen at a reading: up to 2 s late
