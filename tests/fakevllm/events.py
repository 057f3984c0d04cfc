"""Append-only JSON-lines event log (FAKE_VLLM_EVENTS) that tests read to see what the server saw.

One os.write per record on an O_APPEND descriptor, so several fake instances may share one file
and a reader never sees half a line from a crash.
"""

from __future__ import annotations

import json
import os
import time


class EventLog:
    def __init__(self, path: str | None, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644) if path else None

    def emit(self, event: str, **fields) -> None:
        if self._fd is None:
            return
        record = {"event": event, "t": time.time(), "mono": time.monotonic(), "pid": self.pid, "instance": self.name}
        record.update(fields)
        os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())
