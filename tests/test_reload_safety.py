"""A reload does what it is asked: a storm of SIGHUPs ends with the fleet on the file as it is last
(one follow-up reload, not dropped signals), and a reload onto a TCP port something else holds is
refused before anything is stopped. A real `vsup run` over fake vLLM processes (tests/fakevllm),
watched through the control socket, the proxy and /proc."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_reload import TOKENS, rewrite, stream_through_proxy
from tests.test_supervisor import cli
from tests.vsup_harness import free_ports
from vsup.config.schema import VsupConfig
from vsup.supervisor.reload_ports import busy_port

pytestmark = pytest.mark.timeout(240)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in raw if entry)


def test_a_storm_of_sighups_during_a_reload_ends_on_the_last_file_with_one_follow_up(vsup):
    # each instance takes a second to start: the first reload (two in-place steps) outlasts the storm
    run = vsup(faults={0: {"START_DELAY": "1"}, 1: {"START_DELAY": "1"}}, metrics={"interval": 30})
    run.wait_ready(2)
    for generation in range(1, 11):
        # a relaunch key (the instances' environment) and a live one (metrics.interval) per generation
        rewrite(run, vllm={"env": {**run.config["vllm"]["env"], "STORM_GENERATION": str(generation)}},
                metrics={"interval": 30 + generation})
        os.kill(run.proc.pid, signal.SIGHUP)
        time.sleep(0.05)
    during = run.status()["rollout"]
    status = run.wait_for(lambda s: s["rollout"]["state"] not in ("running", "pending"), 120, "the reloads to end")
    # the first time status says done, the fleet runs the last file
    for inst in status["instances"]:
        assert inst["state"] == "ready" and environ_of(inst["pid"])["STORM_GENERATION"] == "10", inst
    assert status["vsup"]["metrics_interval"] == 40
    assert status["rollout"]["state"] == "done" and status["rollout"]["pending"] is None, status["rollout"]
    assert during["state"] == "running" and during.get("pending") == "SIGHUP", during  # shown while it waited
    reloads = [line for line in run.log().splitlines() if "reload (SIGHUP): " in line and "settings applied" in line]
    assert len(reloads) == 2, reloads  # the first signal's, then one follow-up for the nine during it
    assert "reload (SIGHUP) refused" not in run.log()  # no signal was dropped as "a reload is running"
    assert stream_through_proxy(run.proxy_port) == (200, TOKENS)


def test_a_reload_onto_a_busy_port_is_refused_naming_the_holder_and_the_fleet_keeps_serving(vsup):
    run = vsup(vllm={"listen": "tcp"})  # instances on ports (under unix a base_port change moves nothing)
    before = run.wait_ready(2)["instances"]
    taken = {run.base_port, run.base_port + 1, run.spare_base_port, run.spare_base_port + 1, run.proxy_port}
    while True:  # the new base port: two free ports away from every port this vsup uses
        new_base = free_ports(2)
        if not taken & set(range(new_base - 1, new_base + 3)):
            break
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", new_base + 1))  # instance 1's new port
    holder.listen()
    try:
        rewrite(run, vllm={"base_port": new_base})
        result = cli("reload", "--socket", run.socket)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0].startswith(f"vsup: error: reload refused, nothing was changed: {run.config_path}:")
        assert (f"vllm.base_port: port {new_base + 1} for instance 1 is held by pid {os.getpid()} (" in lines[0]
                and lines[0].endswith("; stop what uses it or choose another vllm.base_port")), lines[0]
        status = run.status()
        assert [(i["pid"], i["port"], i["state"]) for i in status["instances"]] == [
            (i["pid"], i["port"], "ready") for i in before]
        assert status["rollout"]["state"] == "rejected" and f"held by pid {os.getpid()}" in status["rollout"]["error"]
        assert stream_through_proxy(run.proxy_port) == (200, TOKENS)
        shown = cli("status", "--socket", run.socket)
        assert "last reload (vsup reload): REJECTED" in shown.stdout and f"port {new_base + 1}" in shown.stdout
    finally:
        holder.close()
    # the port freed, the same file goes through
    result = cli("reload", "--socket", run.socket)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [i["port"] for i in run.status()["instances"]] == [new_base, new_base + 1]


# ---- which ports a reload needs (reload_ports.busy_port, pure) ------------------------------------------

def planned(base: int, count: int) -> SimpleNamespace:
    return SimpleNamespace(instances=[SimpleNamespace(index=i, port=base + i) for i in range(count)])


def config_with(base: int) -> VsupConfig:
    return VsupConfig.model_validate({"model": "m", "vllm": {"listen": "tcp", "base_port": base, "spare_base_port": 9000}})


def test_busy_port_follows_the_rollouts_slots():
    free = lambda port: port not in {7001, 9002, 7002}  # noqa: E731
    holder = lambda port: f"held by pid 42 (port {port})"  # noqa: E731
    # instances on 8000, 8001 moving to 7000, 7001: 7001 is taken
    assert busy_port(config_with(7000), planned(7000, 2), [8000, 8001], {8000: "0", 8001: "1"}, free, holder) == (
        "vllm.base_port: port 7001 for instance 1 is held by pid 42 (port 7001); stop what uses it or choose another vllm.base_port")
    # staying on their own ports (or on the spare one): nothing to check
    assert busy_port(config_with(7000), planned(7000, 2), [7000, 9001], {}, free, holder) is None
    # a new index needs one of its two slots: 7002 and 9002 are both taken
    assert busy_port(config_with(7000), planned(7000, 3), [7000, 7001], {}, free, holder) == (
        "vllm.base_port: port 7002 for the new instance 2 is held by pid 42 (port 7002), and its spare port 9002 is "
        "held by pid 42 (port 9002); stop what uses them or choose other ports")
    # moving onto a port another instance of this vsup still holds
    assert "is held by instance 1 of this vsup, which still runs when instance 0 moves there" in busy_port(
        config_with(8001), planned(8001, 2), [8000, 8001], {8000: "0", 8001: "1"}, lambda port: True, holder)
    # under vllm.listen: unix the instances hold no port: nothing is taken
    unix = VsupConfig.model_validate({"model": "m", "vllm": {"base_port": 7000, "spare_base_port": 9000}})
    assert busy_port(unix, planned(7000, 2), [8000, 8001], {}, lambda port: False, holder) is None
