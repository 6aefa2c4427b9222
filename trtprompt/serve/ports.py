"""Free loopback ports, for servers started by tests, benchmarks and the chaos script."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (all held open together, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
