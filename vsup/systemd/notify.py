"""sd_notify: tell systemd (Type=notify) how vsup is doing.

The protocol (man sd_notify): one AF_UNIX/SOCK_DGRAM datagram to $NOTIFY_SOCKET holding
newline-separated KEY=VALUE lines. A leading "@" names a socket in the abstract namespace.
Without NOTIFY_SOCKET every method is a no-op, so the supervisor calls them unconditionally.
A failed send is logged once and never raised: losing a status line must not stop the service.
Children must not inherit NOTIFY_SOCKET/WATCHDOG_*/LISTEN_*: vsup.supervisor.launch.child_environment
strips them.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("vsup.notify")

# systemd keeps times as unsigned 64-bit microseconds, the largest value meaning "infinity"; a
# longer wish (stop.timeout: .inf) is sent as the largest finite one, never as an overflow.
MAX_USEC = 2**64 - 2


def _socket_address(value: str) -> str | None:
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # e.g. "vsock:..." (VMs): not something vsup needs to support


def _watchdog_usec(environ: Mapping[str, str]) -> int | None:
    raw = environ.get("WATCHDOG_USEC")
    if raw is None:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid is not None and pid.strip() != str(os.getpid()):
        return None  # the watchdog belongs to another process (e.g. a wrapper that exec'd us elsewhere)
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        return None
    return usec if usec > 0 else None


class Notifier:
    """Sends sd_notify messages; `enabled` is False (and every call a no-op) outside systemd."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None):
        self.address = address
        self.enabled = address is not None
        self.watchdog_usec = watchdog_usec if self.enabled else None
        # systemd asks for a ping every WATCHDOG_USEC; sending at half leaves room for one late tick.
        self.watchdog_interval: float | None = self.watchdog_usec / 2e6 if self.watchdog_usec else None
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        raw = environ.get("NOTIFY_SOCKET")
        if not raw:
            return cls(None)
        address = _socket_address(raw)
        if address is None:
            log.warning("ignoring NOTIFY_SOCKET=%r: only absolute paths and @abstract names are supported", raw)
            return cls(None)
        return cls(address, _watchdog_usec(environ))

    def send(self, *lines: str) -> bool:
        """Send KEY=VALUE lines as one datagram; True when it left, False when disabled or failed."""
        address = self.address
        if address is None:  # not enabled
            return False
        message = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # close-on-exec by default
                # systemd drains its socket at once; the bound only matters if the receiver is stuck,
                # and then the event loop must not wait on it for long.
                self._sock.settimeout(1.0)
            self._sock.sendto(message, address)
            return True
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("sd_notify to %s failed (%s); later failures are not logged", self._printable_address(), exc)
            return False

    def ready(self, status: str | None = None) -> None:
        lines = ["READY=1"]
        if status is not None:
            lines.append(_status_line(status))
        self.send(*lines)

    def status(self, text: str) -> None:
        self.send(_status_line(text))

    def watchdog(self) -> None:
        if self.watchdog_usec:
            self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        """Ask systemd for `seconds` more before TimeoutStartSec/TimeoutStopSec fires (repeat before
        it runs out). Beyond what systemd can hold (infinity included), the largest value it can."""
        if not seconds > 0:  # NaN too
            raise ValueError(f"extend_timeout needs a positive number of seconds, got {seconds!r}")
        usec = seconds * 1_000_000
        self.send(f"EXTEND_TIMEOUT_USEC={MAX_USEC if usec >= MAX_USEC else int(usec)}")

    def reloading(self, status: str | None = None) -> None:
        """RELOADING=1: systemd shows the unit as reloading until the next READY=1."""
        lines = ["RELOADING=1"]
        if status is not None:
            lines.append(_status_line(status))
        self.send(*lines)

    def stopping(self, status: str | None = None) -> None:
        lines = ["STOPPING=1"]
        if status is not None:
            lines.append(_status_line(status))
        self.send(*lines)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _printable_address(self) -> str:
        return "@" + self.address[1:] if self.address and self.address.startswith("\0") else str(self.address)


def _status_line(text: str) -> str:
    # a newline would start a new KEY=VALUE line: keep STATUS to one line
    return "STATUS=" + " ".join(text.splitlines())
