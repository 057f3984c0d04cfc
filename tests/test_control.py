"""The control endpoint in-process, over a real unix socket, against a stand-in for the running
vsup: control.py needs only the narrow `Controlled` protocol, not the Supervisor."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from vsup.supervisor import control
from vsup.supervisor.control import ControlServer, request
from vsup.supervisor.errors import VsupError

pytestmark = pytest.mark.timeout(30)


class Target:  # a control.Controlled
    """Two instances; restart() takes `delay` seconds, or refuses when `refuse` is set."""

    def __init__(self) -> None:
        self.instance_count = 2
        self.restarted: list[tuple[list[int], bool]] = []
        self.refuse: str | None = None
        self.delay = 0.0

    def status(self) -> dict:
        return {"vsup": {"pid": 1}, "instances": self.instance_statuses([0, 1])}

    def instance_statuses(self, indices: list[int]) -> list[dict]:
        return [{"index": i, "state": "ready"} for i in indices]

    async def restart(self, indices: list[int], rolling: bool) -> list[dict]:
        if self.refuse:
            raise VsupError(self.refuse)
        await asyncio.sleep(self.delay)
        self.restarted.append((indices, rolling))
        return self.instance_statuses(indices)


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
