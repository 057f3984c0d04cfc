"""`vllm.command` for supervisor tests that need different faults per instance.

vsup gives every instance the same environment, so a test sets `PORT<port>__FAKE_VLLM_<KEY>=value`
(vllm.listen: tcp) or `SOCK<name>__FAKE_VLLM_<KEY>=value` (unix: the socket's file name without
.sock, `0` or `0b`) and this wrapper, seeing `--port <port>` or `--uds .../<name>.sock` on its
command line, turns it into `FAKE_VLLM_<KEY>=value` before it execs the fake vLLM server (same pid:
the supervisor's child is the server itself).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    args = sys.argv[1:]
    if "--uds" in args:
        prefix: str | None = f"SOCK{Path(args[args.index('--uds') + 1]).stem}__"
    else:
        prefix = f"PORT{args[args.index('--port') + 1]}__" if "--port" in args else None
    for name, value in list(os.environ.items()):
        if prefix is not None and name.startswith(prefix):
            os.environ[name[len(prefix):]] = value
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    os.execv(sys.executable, [sys.executable, "-P", "-m", "tests.fakevllm", *args])


if __name__ == "__main__":
    main()
