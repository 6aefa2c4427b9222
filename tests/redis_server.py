"""A real redis-server for tests: on a free loopback port, in a temp dir, no persistence; stop, kill, restart.

Needs Debian's `redis-server` (`make install` installs it where apt exists); tests skip with SKIP_REASON
without it. The settings go into a redis.conf in the server's directory, so a password never shows on its
command line.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from trtprompt.serve.ports import free_ports

REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "redis-server is not installed (Debian: apt-get install redis-server, done by `make install`)"
START_DEADLINE_S = 30.0


def make_tls_cert(root: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, made with openssl: (cert, key)."""
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


class RedisServer:
    """One redis-server process. url has no password; pass `password` to the store separately."""

    def __init__(self, root: Path, password: str | None = None, tls: bool = False,
                 maxmemory: str = "64mb", policy: str = "allkeys-lru") -> None:
        assert REDIS_SERVER is not None, SKIP_REASON
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.tls = tls
        (self.port,) = free_ports(1)
        self.cert: Path | None = None
        lines = ["bind 127.0.0.1", 'save ""', "appendonly no", f"dir {root}", f"maxmemory {maxmemory}",
                 f"maxmemory-policy {policy}", f"logfile {root / 'redis.log'}"]
        if tls:
            self.cert, key = make_tls_cert(root)
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.cert}", f"tls-key-file {key}",
                      f"tls-ca-cert-file {self.cert}", "tls-auth-clients no"]
        else:
            lines.append(f"port {self.port}")
        if password is not None:
            lines.append(f"requirepass {password}")
        self.conf = root / "redis.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def admin(self) -> redis.Redis:
        """A plain client of this server (with its password), for the test's own commands."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10,
                           ssl=self.tls, ssl_ca_certs=str(self.cert) if self.cert else None)

    def start(self) -> RedisServer:
        assert REDIS_SERVER is not None, SKIP_REASON
        self.proc = subprocess.Popen([REDIS_SERVER, str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_DEADLINE_S
        client = self.admin()
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            assert self.proc.poll() is None, f"redis-server exited: {self._log_tail()}"
            assert time.monotonic() < deadline, f"redis-server did not answer PING: {self._log_tail()}"
            time.sleep(0.05)
        client.close()
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as a crash or an OOM kill does."""
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        """Stop and start on the same port (empty: no persistence), as a redeployed server comes back."""
        self.stop()
        self.start()

    def _log_tail(self) -> str:
        log = self.root / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
