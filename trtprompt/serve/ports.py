"""Loopback ports: free ones for the servers tests and benchmarks start, and readiness probes."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (all held open together, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when url answers HTTP 200 now (a readiness or health probe)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
