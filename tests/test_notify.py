"""sd_notify against real AF_UNIX datagram sockets, path and abstract, as systemd would listen."""

from __future__ import annotations

import logging
import math
import os
import socket
import uuid

import pytest

from vsup.systemd.notify import Notifier


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    """A bound SOCK_DGRAM socket and the NOTIFY_SOCKET value that names it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(5)
    if request.param == "path":
        path = str(tmp_path / "notify.sock")
        sock.bind(path)
        value = path
    else:
        name = f"vsup-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        value = "@" + name
    yield sock, value
    sock.close()


def receive(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_ready_status_stopping_extend_arrive_exactly(listener):
    sock, value = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    assert notifier.enabled
    notifier.ready("2/2 instances ready")
    assert receive(sock) == "READY=1\nSTATUS=2/2 instances ready"
    notifier.status("1/2 instances ready, 14 in flight")
    assert receive(sock) == "STATUS=1/2 instances ready, 14 in flight"
    notifier.extend_timeout(90)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=90000000"
    notifier.extend_timeout(0.25)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=250000"
    notifier.stopping()
    assert receive(sock) == "STOPPING=1"
    notifier.ready()
    assert receive(sock) == "READY=1"
    notifier.close()


def test_status_stays_one_line(listener):
    sock, value = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    notifier.status("loading\nREADY=1")
    assert receive(sock) == "STATUS=loading READY=1"
    notifier.close()


def test_watchdog_interval_is_half_of_watchdog_usec(listener):
    sock, value = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "30000000"})
    assert notifier.watchdog_interval == pytest.approx(15.0)
    notifier.watchdog()
    assert receive(sock) == "WATCHDOG=1"
    notifier.close()


def test_watchdog_for_our_pid_is_honoured(listener):
    sock, value = listener
    env = {"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    notifier = Notifier.from_env(env)
    assert notifier.watchdog_interval == pytest.approx(2.0)
    notifier.watchdog()
    assert receive(sock) == "WATCHDOG=1"
    notifier.close()


def test_watchdog_of_another_pid_is_not_ours(listener):
    sock, value = listener
    env = {"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    notifier = Notifier.from_env(env)
    assert notifier.enabled
    assert notifier.watchdog_interval is None
    notifier.watchdog()  # sends nothing
    notifier.status("after")
    assert receive(sock) == "STATUS=after"  # the first datagram to arrive is the status, not a WATCHDOG
    notifier.close()


@pytest.mark.parametrize("bad", ["0", "-5", "soon"])
def test_unusable_watchdog_usec_means_no_watchdog(listener, bad):
    _, value = listener
    assert Notifier.from_env({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": bad}).watchdog_interval is None


def test_no_notify_socket_is_a_no_op(tmp_path):
    notifier = Notifier.from_env({"WATCHDOG_USEC": "30000000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval is None
    notifier.ready("x")
    notifier.status("x")
    notifier.watchdog()
    notifier.extend_timeout(5)
    notifier.stopping()
    assert notifier.send("READY=1") is False
    assert list(tmp_path.iterdir()) == []


def test_unsupported_socket_kind_is_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="vsup.notify"):
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert "vsock:2:1234" in caplog.text


def test_send_errors_are_logged_once_and_never_raised(tmp_path, caplog):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert notifier.enabled
    with caplog.at_level(logging.WARNING, logger="vsup.notify"):
        notifier.ready("x")
        notifier.status("y")
        assert notifier.send("WATCHDOG=1") is False
    warnings = [r for r in caplog.records if r.name == "vsup.notify"]
    assert len(warnings) == 1
    assert "nobody-listens.sock" in warnings[0].getMessage()
    notifier.close()


def test_extend_timeout_rejects_non_positive(listener):
    _, value = listener
    with pytest.raises(ValueError, match="positive"):
        Notifier.from_env({"NOTIFY_SOCKET": value}).extend_timeout(0)


@pytest.mark.parametrize("seconds", [math.inf, 1e300, 2**64])
def test_extend_timeout_beyond_what_systemd_holds_sends_the_largest_value(listener, seconds):
    # `stop.timeout: .inf` once made the stop path die here (OverflowError) with every instance running
    sock, value = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": value})
    notifier.extend_timeout(seconds)
    assert receive(sock) == f"EXTEND_TIMEOUT_USEC={2**64 - 2}"
    notifier.close()


def test_extend_timeout_rejects_nan(listener):
    _, value = listener
    with pytest.raises(ValueError, match="positive"):
        Notifier.from_env({"NOTIFY_SOCKET": value}).extend_timeout(math.nan)
