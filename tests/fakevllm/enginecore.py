"""EngineCore / Worker stand-ins, run as a plain script (no package import, fast start):

    python enginecore.py fakevllm-enginecore PORT READY_FD WORKER(0|1) [SHM_PATH ...]
    python enginecore.py fakevllm-worker PORT READY_FD [SHM_PATH ...]

READY_FD: a pipe to the parent; one byte is written once the process (and for EngineCore, its
Worker) has its signal handling in place: the handshake the API server waits for before it binds,
like vLLM's engine startup handshake.

They idle, map the server's /dev/shm files (as vLLM's processes do), and do not watch their
parent: SIGKILL of the API server leaves them orphaned, exactly the leak a supervisor must clean.
SIGTERM/SIGINT: the EngineCore stops its Worker, then exits 0; with FAKE_VLLM_IGNORE_SIGTERM=1 both
ignore them. /proc/PID/comm is set to vLLM's process titles.
"""

import mmap
import os
import signal
import subprocess
import sys
import time


def set_title(title: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(title)
    except OSError:
        pass


def map_files(paths):
    maps = []
    for path in paths:
        try:
            with open(path, "r+b") as f:
                maps.append(mmap.mmap(f.fileno(), 0))
        except (OSError, ValueError):
            pass  # already removed: nothing to hold
    return maps


def main() -> None:
    role, port, ready_fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ignore = os.environ.get("FAKE_VLLM_IGNORE_SIGTERM") == "1"
    worker = None
    worker_ready = None
    if role == "fakevllm-enginecore":
        set_title("VLLM::EngineCor")  # comm is 15 chars at most
        want_worker, shm = sys.argv[4] == "1", sys.argv[5:]
        if want_worker:
            worker_ready, child_fd = os.pipe()
            worker = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "fakevllm-worker", port, str(child_fd), *shm],
                stdin=subprocess.DEVNULL,
                pass_fds=(child_fd,),
            )
            os.close(child_fd)
    else:
        set_title("VLLM::Worker")
        shm = sys.argv[4:]

    def stop(signum, frame):
        if worker is not None and worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(2)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN if ignore else stop)
    held = map_files(shm)  # noqa: F841 (kept mapped for the process's lifetime)
    if worker_ready is not None:
        os.read(worker_ready, 1)  # b"" if the Worker died: the parent then sees us as ready anyway
        os.close(worker_ready)
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    if worker is not None:
        print(f"INFO [core.py] fakevllm EngineCore_DP0 pid={os.getpid()} worker={worker.pid} port={port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
