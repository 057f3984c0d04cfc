"""The two-level layout on loopback: clients -> `vsup proxy` (front) -> two `vsup run` "hosts" over
the fake vLLM (4 and 2 instances) -> instances. The front weights each host by the instances its
/ready reports, takes a host with 0 ready out at once, and puts it back when it recovers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections import Counter

from tests.proxy_support import LEAN
from tests.sysfs_builder import build_sysfs
from tests.test_proxy_cli import REPO, VSUP, request, served_by, wait_until
from tests.vsup_harness import VsupRun, free_port, make_config


def weights(log: str) -> dict[str, int]:
    """The last weight the front proxy logged for each upstream."""
    return {url: int(w) for url, w in re.findall(r"upstream (http://\S+): HTTP 200, \d+ instance\(s\) ready: weight (\d+)", log)}


def test_front_proxy_shares_by_ready_instances_ejects_at_zero_and_recovers(tmp_path):
    # vsup plans each host on a hand-made 4-core, 2-node machine; `launcher: none` because those
    # CPUs are not this machine's (the fake vLLM ignores the binding it is given).
    fsroot = build_sysfs(tmp_path / "machine", nodes=(2, 2))
    env = {**LEAN, "VSUP_FSROOT": str(fsroot)}
    hosts: dict[str, VsupRun] = {}
    front = None
    try:
        for name, count, restart in (("a", 4, {}), ("b", 2, {"max_failures": 1})):
            (tmp_path / name).mkdir()
            config = make_config(tmp_path / name, instances=count, placement={"launcher": "none"}, restart=restart)
            hosts[name] = VsupRun(tmp_path / name, config, env=env)
        a, b = hosts["a"], hosts["b"]
        url = {name: f"http://127.0.0.1:{run.proxy_port}" for name, run in hosts.items()}

        port = free_port()
        front_config = tmp_path / "front.yaml"
        front_config.write_text("proxy:\n  drain_timeout: 2\n  retries: 2\nhealth:\n  interval: 0.2\n  timeout: 2\n  failures: 3\n")
        front_log = tmp_path / "front.log"
        with open(front_log, "wb") as log:
            front = subprocess.Popen(
                [*VSUP, "proxy", "--upstream", url["a"], "--upstream", url["b"], "--port", str(port), "--config", str(front_config)],
                cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), VSUP_API_KEY=""), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        a.wait_ready()
        b.wait_ready()
        # the fake names itself by its socket's path (the instance's address in vsup status)
        host_of = {inst["address"]: name for name, run in hosts.items() for inst in run.status()["instances"]}
        wait_until(lambda: weights(front_log.read_text()) == {url["a"]: 4, url["b"]: 2}, 30,
                   "the front proxy to weight the hosts 4 and 2")

        # 4 ready instances get twice the share of 2; inside each host vsup spreads over its own
        served = Counter(served_by(port) for _ in range(60))
        per_host = Counter(host_of[instance] for instance in served.elements())
        assert abs(per_host["a"] - 2 * per_host["b"]) <= 3, per_host
        assert len(served) == 6, served  # every instance of both hosts took some

        # host b loses both instances (max_failures 1: they stay failed): its /health still says ok, its
        # /ready says 0 -> out of the front's rotation. Once b's vsup has seen the exits (before,
        # b's own proxy may answer 502 for a connection it had opened to the dead one), no client
        # sees an error: b answers 503 until the front drops it, and the front retries those on a.
        mark = len(front_log.read_text())
        for inst in b.status()["instances"]:
            os.kill(inst["pid"], signal.SIGKILL)
        b.wait_for(lambda s: not any(i["state"] == "ready" for i in s["instances"]), 20, "b to see its instances gone")
        assert {host_of[served_by(port)] for _ in range(20)} == {"a"}
        wait_until(lambda: f"upstream {url['b']}: /ready: HTTP 503, 0 instance(s) ready: out of rotation" in front_log.read_text()[mark:],
                   20, "the front proxy to take host b out")
        metrics = request(port, "GET", "/metrics")[2].decode()
        assert f'vsup_instance_ready{{instance="{url["b"]}"}} 0.0' in metrics
        assert request(port, "GET", "/ready")[0] == 200  # a still serves

        # b comes back (`vsup restart all`): in rotation again with its weight
        status, _ = b.request("POST", "/restart", {"target": "all", "wait": True}, timeout=40)
        assert status == 200
        b.wait_ready()
        wait_until(lambda: {host_of[served_by(port)] for _ in range(6)} == {"a", "b"}, 30, "host b back in rotation")

        # a host that goes away altogether (SIGTERM: drain, then its port closes) fails over too
        assert a.terminate() == 0
        assert {host_of[served_by(port)] for _ in range(10)} == {"b"}
    finally:
        if front is not None:
            if front.poll() is None:
                front.send_signal(signal.SIGTERM)
                try:
                    front.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(front.pid, signal.SIGKILL)
                    front.wait(10)
        for run in hosts.values():
            run.close()
