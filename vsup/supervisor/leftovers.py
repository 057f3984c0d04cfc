"""What a vsup that is gone (kill -9, the OOM killer) left running, and the next `vsup run` that
removes it.

Instance leaders die with vsup (PR_SET_PDEATHSIG, vsup/supervisor/processes.py) and vLLM then stops
its EngineCore and Worker. What can still outlive vsup: a leader that ignores SIGTERM or hangs, an
EngineCore orphaned earlier (its API server was killed first), a child started in the instant
vsup died. Two marks find them:
- every running vsup keeps a state file in its runtime directory (vsup/supervisor/rundir.py),
  `vsup-<pid>.json`: its pid and start time (together they name one process; a reused pid never
  passes for it), config and ports; a clean stop removes it;
- every process of its instances carries `VSUP_TREE=<pid>-<start time>-<random>` (proctree.py).
A new `vsup run` reads the state files in its runtime directory; for each vsup that no longer
runs, it stops the processes carrying that vsup's mark (SIGTERM, `stop.timeout` of grace, SIGKILL),
removes the /dev/shm files they used, logs what it removed and deletes the state file. The
processes of a vsup that still runs are never touched.

`describe_port_holder` names the process that holds a port, for the "port not free" error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from vsup.errors import VsupError
from vsup.supervisor import proctree, shm
from vsup.supervisor.rundir import prepare_runtime_dir

logger = logging.getLogger("vsup.leftovers")

KILL_WAIT = 5.0  # seconds for SIGKILLed processes to disappear
_STATE_GLOB = "vsup-*.json"


@dataclass(frozen=True)
class StateFile:
    path: Path
    pid: int
    start: int  # clock ticks since boot: with pid, the process's identity
    config: str | None = None
    proxy: str | None = None
    ports: tuple[int, ...] = ()

    @property
    def mark(self) -> str:
        """The start of every VSUP_TREE token this vsup handed out."""
        return f"{self.pid}-{self.start}-"

    @property
    def running(self) -> bool:
        return proctree.is_running(self.pid, self.start)


def write_state(directory: Path, *, config: str | None, proxy: str, ports: list[int]) -> Path:
    """Write this vsup's state file (atomically) and return its path."""
    pid, start = proctree.token_owner(proctree.own_mark()) or (os.getpid(), 0)
    path = directory / f"vsup-{pid}.json"
    partial = path.with_suffix(".json.part")
    partial.write_text(json.dumps({"pid": pid, "start": start, "config": config, "proxy": proxy, "ports": ports}))
    os.replace(partial, path)
    return path


def read_states(directory: Path) -> list[StateFile]:
    """The state files in `directory`; unreadable ones are logged and skipped."""
    states = []
    for path in sorted(directory.glob(_STATE_GLOB)):
        try:
            data = json.loads(path.read_text())
            states.append(StateFile(path, int(data["pid"]), int(data["start"]), data.get("config"), data.get("proxy"),
                                    tuple(int(p) for p in data.get("ports") or ())))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the state file %s: %s", path, exc)
    return states


def _command(pid: int, limit: int = 80) -> str:
    try:
        process = psutil.Process(pid)
        text = " ".join(process.cmdline()) or process.name()
    except (psutil.Error, OSError):
        st = proctree.read_stat(pid)
        text = st.comm if st else "?"
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Removal:
    """What was removed of one vsup that is gone."""

    state: StateFile
    processes: dict[int, str] = field(default_factory=dict)  # pid -> command line
    killed: list[int] = field(default_factory=list)  # needed SIGKILL
    survivors: list[int] = field(default_factory=list)  # still there after SIGKILL (uninterruptible sleep)
    shm_removed: list[str] = field(default_factory=list)

    def describe(self) -> str:
        state = self.state
        parts = [f"vsup pid {state.pid} is no longer running" + (f" (config {state.config})" if state.config else "")]
        if self.processes:
            listed = ", ".join(f"pid {pid} ({command})" for pid, command in sorted(self.processes.items()))
            parts.append(f"stopped what it left running: {listed}")
        if self.killed:
            parts.append(f"SIGKILL needed for {self.killed}")
        if self.survivors:
            parts.append(f"still there after SIGKILL: {self.survivors}")
        if self.shm_removed:
            parts.append(f"removed {len(self.shm_removed)} /dev/shm files ({', '.join(self.shm_removed)})")
        return "; ".join(parts)


async def _stop(found: dict[int, proctree.ProcStat], grace: float) -> tuple[list[int], list[int]]:
    """SIGTERM, `grace` seconds, SIGKILL for the rest; returns (killed, survivors)."""
    for st in found.values():
        proctree.signal_exact(st, signal.SIGTERM)
    left = await proctree.wait_gone(found.values(), grace)
    if not left:
        return [], []
    for st in left:
        proctree.signal_exact(st, signal.SIGKILL)
    survivors = await proctree.wait_gone(left, KILL_WAIT)
    return sorted(st.pid for st in left), sorted(st.pid for st in survivors)


async def remove_leftovers(directory: Path, grace: float, shm_dir: str | Path = shm.SHM_DIR) -> list[Removal]:
    """Stop and sweep what every vsup recorded in `directory` that no longer runs left behind."""
    removals = []
    for state in read_states(directory):
        if state.running:
            continue  # never the processes of a vsup that runs
        removal = Removal(state)
        found = proctree.find_marked(state.mark)
        removal.processes = {pid: _command(pid) for pid in found}
        files = shm.files_in_use(found, shm_dir)  # before they go: the names carry no pid
        if found:
            removal.killed, removal.survivors = await _stop(found, grace)
        removal.shm_removed = shm.remove_unused(files, shm_dir) + shm.remove_openmp_files(found, shm_dir)
        if removal.processes or removal.shm_removed:
            logger.warning("leftovers: %s", removal.describe())
            removals.append(removal)
        if not removal.survivors:  # else: the next run tries again
            state.path.unlink(missing_ok=True)
    return removals


def sweep(environ: Mapping[str, str], grace: float) -> list[Removal]:
    """`vsup run`'s first step: remove what dead vsups of this runtime directory left behind."""
    try:
        directory = prepare_runtime_dir(environ)
    except (VsupError, OSError) as exc:
        logger.warning("not looking for processes left by a killed vsup: %s", exc)
        return []
    return asyncio.run(remove_leftovers(directory, grace))


def describe_port_holder(port: int) -> str | None:
    """"pid N (command)" of the process listening on TCP `port`, and whose vLLM it is when it
    carries a vsup mark; None when no listener can be seen (another user's, without root)."""
    try:
        connections = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return None
    pids = sorted({c.pid for c in connections
                   if c.pid and c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN})
    if not pids:
        return None
    pid = pids[0]
    text = f"held by pid {pid} ({_command(pid)})"
    owner = proctree.token_owner(proctree.read_token(pid) or "")
    if owner is not None and proctree.is_running(*owner):
        text += f", an instance of the vsup with pid {owner[0]}, which is running"
    elif owner is not None:
        text += f", a vLLM instance left behind by vsup pid {owner[0]}, which is no longer running (stop it: kill {pid})"
    return text
