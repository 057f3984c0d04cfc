"""The processes and shared memory a vLLM API server leaves around, imitated.

vLLM's tree is API server -> EngineCore -> Worker, all in one process group. SIGKILL of the API
server alone orphans the other two (they keep running, holding memory); SIGKILL of the group leaves
its /dev/shm files behind. The fake reproduces both so the supervisor's cleanup can be tested:
the stand-ins are tiny idle scripts (enginecore.py) whose argv contains `fakevllm-enginecore` /
`fakevllm-worker`, they are NOT put in a new session (same group as the server), and they do not
watch their parent.
"""

from __future__ import annotations

import mmap
import os
import secrets
import signal
import subprocess
import sys

ENGINE_TAG = "fakevllm-enginecore"
WORKER_TAG = "fakevllm-worker"

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "enginecore.py")


class SharedMemoryFiles:
    """/dev/shm/psm_<hex> (a multiprocessing SharedMemory) and sem.mp-<hex> (a semaphore), as vLLM
    creates them; mapped by the server and its children, removed only on a clean shutdown."""

    def __init__(self, directory: str = "/dev/shm") -> None:
        token = secrets.token_hex(4)
        self.paths = [os.path.join(directory, f"psm_{token}"), os.path.join(directory, f"sem.mp-{token}")]
        self._maps: list[mmap.mmap] = []
        for path, size in zip(self.paths, (1 << 20, 32), strict=True):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)  # sparse on tmpfs: no real memory used
                self._maps.append(mmap.mmap(fd, size))
            finally:
                os.close(fd)

    def remove(self) -> None:
        for m in self._maps:
            m.close()
        self._maps.clear()
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class EngineCore:
    """The EngineCore stand-in child (which itself starts the Worker stand-in)."""

    def __init__(self, port: int, worker: bool, shm_paths: list[str], ignore_sigterm: bool) -> None:
        env = dict(os.environ, FAKE_VLLM_IGNORE_SIGTERM="1" if ignore_sigterm else "0")
        self.ready_fd, child_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, _SCRIPT, ENGINE_TAG, str(port), str(child_fd), "1" if worker else "0", *shm_paths],
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=(child_fd,),
            )
        finally:
            os.close(child_fd)

    def wait_ready(self) -> bool:
        """Block until the EngineCore (and its Worker) report ready; False if it died first."""
        try:
            return os.read(self.ready_fd, 1) == b"r"
        finally:
            os.close(self.ready_fd)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = 2.0) -> None:
        """SIGTERM (the child stops its Worker), then SIGKILL if it does not go in time."""
        if self.proc.poll() is not None:
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
