"""The control endpoint in-process, over a real unix socket, against a stand-in for the running
vsup: control.py needs only the narrow `Controlled` protocol, not the Supervisor."""

from __future__ import annotations

import ast
import asyncio
import os
import socket
from pathlib import Path

import pytest

from vsup.config.schema import VsupConfig
from vsup.errors import VsupError
from vsup.supervisor import control
from vsup.supervisor.control import ControlServer, request

pytestmark = pytest.mark.timeout(30)


class Target:  # a control.Controlled
    """Two instances; restart() and reload() take `delay` seconds, or refuse when `refuse` is set."""

    def __init__(self, proxy_port: int = 8000) -> None:
        self.instance_count = 2
        self.instance_indexes = [0, 1]
        self.proxy_port = proxy_port
        self.restarted: list[tuple[list[int], bool]] = []
        self.reloaded: list[tuple[str, bool]] = []
        self.refuse: str | None = None
        self.delay = 0.0

    def status(self) -> dict:
        return {"vsup": {"pid": 1, "proxy": f"127.0.0.1:{self.proxy_port}"}, "instances": self.instance_statuses([0, 1])}

    def instance_statuses(self, indices: list[int]) -> list[dict]:
        return [{"index": i, "state": "ready"} for i in indices]

    async def restart(self, indices: list[int], rolling: bool) -> list[dict]:
        if self.refuse:
            raise VsupError(self.refuse)
        await asyncio.sleep(self.delay)
        self.restarted.append((indices, rolling))
        return self.instance_statuses(indices)

    async def reload(self, trigger: str, wait: bool) -> dict:
        if self.refuse:
            raise VsupError(self.refuse)
        if wait:
            await asyncio.sleep(self.delay)
        self.reloaded.append((trigger, wait))
        return {"kind": "reload", "state": "done" if wait else "running"}


@pytest.fixture
async def served(tmp_path):
    target = Target()
    server = ControlServer(tmp_path / "control.sock", target)
    await server.start()
    yield target, server.path
    await server.stop()
    assert not server.path.exists()


def test_control_imports_nothing_of_the_supervisor_not_even_for_typing():
    tree = ast.parse(Path(control.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "vsup.supervisor.supervisor" not in imported and "vsup.supervisor.lifecycle" not in imported


async def test_status_and_restart_over_the_socket(served):
    target, path = served
    assert (await request(path, "GET", "/status", timeout=5))["instances"][1] == {"index": 1, "state": "ready"}
    answer = await request(path, "POST", "/restart", {"target": "all", "rolling": True}, timeout=5)
    assert [i["index"] for i in answer["instances"]] == [0, 1] and target.restarted == [([0, 1], True)]


async def test_bad_targets_and_refusals_are_one_line_errors(served):
    target, path = served
    with pytest.raises(VsupError, match=r"no instance 5: this vsup runs instances 0\.\.1"):
        await request(path, "POST", "/restart", {"target": 5}, timeout=5)
    with pytest.raises(VsupError, match="not an instance index"):
        await request(path, "POST", "/restart", {"target": True}, timeout=5)
    target.refuse = "vsup is stopping; nothing is restarted"
    with pytest.raises(VsupError, match="vsup is stopping"):
        await request(path, "POST", "/restart", {"target": 0}, timeout=5)


async def test_no_wait_answers_before_the_restart_is_done(served):
    target, path = served
    target.delay = 0.5
    answer = await request(path, "POST", "/restart", {"target": 1, "wait": False}, timeout=5)
    assert answer == {"instances": [{"index": 1, "state": "ready"}]} and target.restarted == []
    await asyncio.sleep(1.0)
    assert target.restarted == [([1], False)]  # it went on without a client waiting


async def test_reload_over_the_socket_and_its_refusal(served):
    target, path = served
    assert await request(path, "POST", "/reload", {"wait": True}, timeout=5) == {"rollout": {"kind": "reload", "state": "done"}}
    assert (await request(path, "POST", "/reload", {"wait": False}, timeout=5))["rollout"]["state"] == "running"
    assert target.reloaded == [("vsup reload", True), ("vsup reload", False)]
    target.refuse = "reload refused, nothing was changed: vsup.yaml:3: instances: 0 is not valid"
    with pytest.raises(VsupError, match="reload refused, nothing was changed: vsup.yaml:3"):
        await request(path, "POST", "/reload", {}, timeout=5)


# ---- where the client looks (vsup status / restart / reload without --socket) -------------------------

def config_for(port: int, socket: str | None = None) -> VsupConfig:
    return VsupConfig.model_validate({"model": "m", "proxy": {"port": port}, "control": {"socket": socket}})


def test_candidates_are_the_units_runtime_dir_the_installed_unit_then_the_users_private_dir(tmp_path):
    environ = {"TMPDIR": str(tmp_path)}
    assert control.socket_candidates(config_for(8001), environ) == [
        (control.SYSTEMD_DEFAULT, False), (tmp_path / f"vsup-{os.getuid()}" / "control-8001.sock", True)]
    assert control.socket_candidates(config_for(8001), {**environ, "RUNTIME_DIRECTORY": "/run/vsup"}) == [
        (Path("/run/vsup/control.sock"), True), (tmp_path / f"vsup-{os.getuid()}" / "control-8001.sock", True)]
    assert control.socket_candidates(config_for(8001, "/srv/v.sock"), environ) == [(Path("/srv/v.sock"), True)]
    assert control.socket_candidates(None, environ)[0] == (control.SYSTEMD_DEFAULT, True)


@pytest.fixture
def unit_socket(tmp_path, monkeypatch):
    """The installed unit's socket (/run/vsup/control.sock), moved under tmp_path."""
    path = tmp_path / "run-vsup" / "control.sock"
    path.parent.mkdir()
    monkeypatch.setattr(control, "SYSTEMD_DEFAULT", path)
    return path


async def test_a_root_shell_finds_the_service_in_its_runtime_directory(tmp_path, unit_socket):
    server = ControlServer(unit_socket, Target(proxy_port=8000))
    await server.start()
    try:
        environ = {"TMPDIR": str(tmp_path)}  # nothing in this user's private directory
        found = await asyncio.to_thread(control.find_socket, None, config_for(8000), environ)
        assert found == unit_socket
        assert (await request(found, "GET", "/status", timeout=5))["vsup"]["proxy"] == "127.0.0.1:8000"
        # another vsup's config (proxy port 8001): the service's socket is not taken for it
        with pytest.raises(VsupError) as err:
            await asyncio.to_thread(control.find_socket, None, config_for(8001), environ)
        private = tmp_path / f"vsup-{os.getuid()}" / "control-8001.sock"
        assert str(err.value) == (f"vsup is not running: no control socket answers at {unit_socket} (a vsup with proxy "
                                  f"port 8000, not 8001), {private} (no such socket); if it runs with another "
                                  "proxy.port or control.socket, pass --config FILE or --socket PATH")
    finally:
        await server.stop()


async def test_a_stale_socket_is_passed_over_and_named(tmp_path, unit_socket):
    private = tmp_path / f"vsup-{os.getuid()}"
    private.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(private / "control-8000.sock"))  # bound, never listening: what a killed vsup leaves
    stale.close()
    server = ControlServer(unit_socket, Target())
    await server.start()
    try:
        assert await asyncio.to_thread(control.find_socket, None, None, {"TMPDIR": str(tmp_path)}) == unit_socket
    finally:
        await server.stop()
    with pytest.raises(VsupError, match=r"control\.sock \(no such socket\), .*control-8000\.sock \(does not answer: Connection refused\)"):
        control.find_socket(None, None, {"TMPDIR": str(tmp_path)})
