"""Run `vsup run` as a real subprocess over fake vLLM instances, and look at it from outside.

`VsupRun` writes a YAML config (small timeouts, taskset or no launcher, fake servers as
`vllm.command` through tests/fake_per_port.py so each instance can get its own faults), starts
`vsup run` in its own session with its log going to a file (never a pipe a test could forget to
read), and reads its state through the control socket (`status()`), the log, and /proc.
`close()` leaves nothing behind: vsup and every process it started are SIGKILLed if still there.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from vsup.supervisor.shm import files_in_use, remove_unused

ROOT = Path(__file__).resolve().parents[1]
# the `vsup` console script of the environment running the tests (.venv, or scripts/test's aiohttp-floor venv)
_SCRIPT = Path(sys.executable).with_name("vsup")
VSUP = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "vsup"]
FAKE = [sys.executable, str(ROOT / "tests" / "fake_per_port.py"), "serve"]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (the instances' base_port)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65536 and all(port_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def free_port() -> int:
    return free_ports(1)


def ports_for(instances: int) -> tuple[int, int, int]:
    """(base_port, spare_base_port, proxy port): free, and no two ranges meeting (two draws of
    free ports can meet, and vsup refuses a proxy.port on an instance's or a spare port)."""
    ranges: list[range] = []
    for count in (instances, instances, 1):
        while True:
            first = free_ports(count)
            candidate = range(first, first + count)
            if not any(set(candidate) & set(other) for other in ranges):
                ranges.append(candidate)
                break
    return ranges[0].start, ranges[1].start, ranges[2].start


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0) -> None:
        super().__init__("vsup", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def instance_connection(address: str, timeout: float = 30.0) -> http.client.HTTPConnection:
    """An HTTP connection to an instance at the address `vsup status` shows: its socket's path
    (the default, vllm.listen: unix) or host:port (tcp)."""
    if address.startswith("/"):
        return UnixHTTPConnection(address, timeout)
    host, port = address.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def instance_get(address: str, route: str, timeout: float = 30.0) -> tuple[int, bytes]:
    """GET `route` of an instance at `address` (instance_connection)."""
    conn = instance_connection(address, timeout)
    try:
        conn.request("GET", route)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def make_config(tmp: Path, *, instances: int = 2, **sections) -> dict:
    """A config for fast tests: each section's keys override these defaults."""
    base_port, spare_port, proxy_port = ports_for(instances)
    config = {
        "model": "fake-model",
        "instances": instances,
        "placement": {"launcher": "taskset", "reserve_cores": 0, "model_size_gib": 0.01, "kvcache_gib": 0.01,
                      "overhead_gib": 0.01, "memory_reserve_gib": 0.1},
        "vllm": {"command": FAKE, "base_port": base_port, "spare_base_port": spare_port, "env": {}},
        "proxy": {"port": proxy_port, "drain_timeout": 2},
        "health": {"interval": 0.2, "timeout": 1.0, "failures": 3, "startup_timeout": 20},
        "restart": {"max_delay": 0.2, "stable_after": 300, "max_failures": 100},
        "start": {"mode": "parallel"},
        "stop": {"timeout": 2},
        "log": {"dir": str(tmp / "logs"), "echo": True, "level": "info"},
        "control": {"socket": str(tmp / "control.sock")},
        "batch": {"dir": str(tmp / "batches")},  # each run its own store (one vsup per folder)
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    return config


class VsupRun:
    def __init__(self, tmp: Path, config: dict, env: dict[str, str] | None = None, vsup: list[str] = VSUP,
                 args: list[str] | None = None) -> None:
        self.tmp = tmp
        self.config = config
        self.config_path = tmp / "vsup.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "vsup.log"
        self.socket = config["control"]["socket"]
        self.base_port = config["vllm"]["base_port"]
        self.spare_base_port = config["vllm"].get("spare_base_port")
        self.proxy_port = config["proxy"]["port"]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_VLLM_", "PORT"))}
        # its own runtime directory (state file): a vsup only ever sweeps what vsups of this test left
        full_env["TMPDIR"] = str(tmp)
        full_env.update(env or {})
        self.seen_pids: set[int] = set()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*vsup, "run", "--config", str(self.config_path), *(args or [])], cwd=tmp, env=full_env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    # ---- looking ----------------------------------------------------------------------------------

    def port(self, index: int) -> int:
        return self.base_port + index

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, route: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
        conn = UnixHTTPConnection(self.socket, timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            conn.request(method, route, body=payload, headers={"Content-Type": "application/json"} if payload else {})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def status(self) -> dict:
        status, data = self.request("GET", "/status")
        assert status == 200, data
        for inst in data["instances"]:
            if inst["pid"]:
                self.seen_pids.add(inst["pid"])
        return data

    def instance(self, index: int) -> dict:
        return self.status()["instances"][index]

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> dict:
        """Poll status() until predicate(status) is true; fails with the log tail if vsup died."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vsup exited ({self.proc.returncode}) while waiting for {what}:\n{self.log()[-4000:]}")
            try:
                last = self.status()
            except OSError:
                time.sleep(0.1)
                continue
            if predicate(last):
                return last
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last status:\n"
                             f"{json.dumps(last, indent=1)[-3000:]}\nlog:\n{self.log()[-3000:]}")

    def wait_ready(self, count: int | None = None, timeout: float = 40.0) -> dict:
        count = len(self.config_instances()) if count is None else count
        return self.wait_for(lambda s: sum(i["state"] == "ready" for i in s["instances"]) >= count, timeout,
                             f"{count} instances ready")

    def config_instances(self) -> range:
        return range(self.config["instances"])

    def tree(self, pid: int) -> list[int]:
        """The instance process and its live descendants (EngineCore, Worker stand-ins)."""
        try:
            process = psutil.Process(pid)
            return [pid, *(c.pid for c in process.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def all_descendants(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    # ---- stopping ---------------------------------------------------------------------------------

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Leave nothing running: vsup and its whole family, including the ones that escaped, and
        the /dev/shm files they used (a SIGKILLed (fake) vLLM leaves them behind, as the real one
        does; vsup removes them when it stops an instance, but here vsup is killed too)."""
        family = set(self.all_descendants()) | self.seen_pids
        for pid in list(family):
            family.update(self.tree(pid))
        shm = files_in_use(family)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # killed processes unmap their files when they are gone; only then are the files unused
        psutil.wait_procs([p for p in map(_process, family) if p is not None], timeout=10)
        remove_unused(shm)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
