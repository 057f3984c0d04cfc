"""Is a loopback port free to listen on? (A bind probe with SO_REUSEADDR, as a server would bind.)"""

from __future__ import annotations

import socket


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False
