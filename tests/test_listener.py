"""Who listens at an instance's address (vsup/supervisor/listener.py): /proc/net/tcp parsing on
captured text, and the owner check against real sockets of this process and of another uid."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vsup.errors import VsupError
from vsup.supervisor import listener

# Captured from a Linux 6.x box (trimmed): 8100 listening (0A) as uid 0, 8101 listening as uid
# 65534, one established connection to 8100 (01), one socket in TIME_WAIT (06).
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1FA4 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 123456 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1FA5 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 223344 1 0000000000000000 100 0 0 10 0
   2: 0100007F:C350 0100007F:1FA4 01 00000000:00000000 00:00000000 00000000     0        0 345678 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:C351 0100007F:1FA4 06 00000000:00000000 03:00000a2a 00000000     0        0 0 3 0000000000000000
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1FA4 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 998877 1 0000000000000000 100 0 0 10 0
   1: garbage line
"""


def test_only_listening_sockets_are_read_with_port_uid_and_inode():
    assert listener.parse_proc_net_tcp(TCP) == [listener.Listening(8100, 0, 123456), listener.Listening(8101, 65534, 223344)]
    assert listener.parse_proc_net_tcp(TCP6) == [listener.Listening(8100, 1000, 998877)]
    assert listener.parse_proc_net_tcp("") == []


def test_both_tables_are_read_from_a_proc_root(tmp_path):
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP)
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    assert {entry.uid for entry in listener.listeners_on(8100, tmp_path)} == {0, 1000}
    assert listener.listeners_on(9999, tmp_path) == []


def _listen() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_port_our_own_process_listens_on_is_ours_and_another_process_is_named():
    sock = _listen()
    port = sock.getsockname()[1]
    try:
        assert listener.check_port(port, [os.getpid()], "instance 0") is None
        why = listener.check_port(port, [1], "instance 0")  # init's tree does not hold it
        assert why is not None
        assert why.startswith(f"port {port} is held by pid {os.getpid()} (uid {os.getuid()}, ")
        assert why.endswith("not by instance 0's process tree; not routing to it")
    finally:
        sock.close()
    assert "nothing listens on port" in (listener.check_port(port, [os.getpid()], "instance 0") or "")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as uid 65534")
def test_a_squatter_of_another_uid_is_named_with_its_uid_and_command():
    code = ("import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(30)")
    squatter = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", code],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = int(squatter.stdout.readline())  # type: ignore[union-attr]
        why = listener.check_port(port, [os.getpid()], "instance 3")
        assert why is not None and f"held by pid {squatter.pid} (uid 65534, /usr/bin/python3 -c" in why, why
        assert "not by instance 3's process tree" in why
    finally:
        squatter.kill()
        squatter.wait()
        squatter.stdout.close()  # type: ignore[union-attr]


def test_a_stale_socket_of_ours_is_removed_and_anything_else_refused(tmp_path):
    path = str(tmp_path / "0.sock")
    listener.clear_socket(path)  # nothing there: nothing to do
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # what a killed instance leaves
    assert listener.check_socket(path) is None
    listener.clear_socket(path)
    assert not os.path.lexists(path)
    assert "is not there" in (listener.check_socket(path) or "")
    (tmp_path / "0.sock").write_text("not a socket")
    with pytest.raises(VsupError, match=r"0.sock exists and is not a socket of ours \(mode -rw"):
        listener.clear_socket(path)
    assert "is not a socket of uid" in (listener.check_socket(path) or "")
    os.unlink(path)
    os.symlink("/etc/passwd", path)  # a link is never followed, never removed
    with pytest.raises(VsupError, match="not a socket of ours"):
        listener.clear_socket(path)
    assert stat.S_ISLNK(os.lstat(path).st_mode)


def test_the_tree_may_hold_the_port_in_a_child():
    # vLLM's API server may hand its listening socket to a child: any pid of the tree counts
    code = "import time; time.sleep(30)"
    sock = _listen()
    child = subprocess.Popen([sys.executable, "-c", code], pass_fds=[sock.fileno()])
    sock.close()  # now only the child holds it
    try:
        for _ in range(50):
            held = listener.socket_inodes([child.pid])
            if held:
                break
            time.sleep(0.05)
        table = Path("/proc/net/tcp").read_text()
        listening = [e for e in listener.parse_proc_net_tcp(table) if e.inode in held]
        assert listening
        port = listening[0].port
        assert listener.check_port(port, [os.getpid(), child.pid], "instance 0") is None
    finally:
        child.kill()
        child.wait()
