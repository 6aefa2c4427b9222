"""The remote tier: one Redis server (or anything speaking its protocol) shared by every server of a deployment.

Bytes only, like every BlockStore (tiers/store.py): the codec above frames and checks each block. What this
file adds is the fault discipline of a network store. Every call is bounded by a socket timeout and tried
once; a fault (server down, slow, restarted, refusing our password) is a miss or a dropped write, counted,
with ONE warning per outage. While the server is down, calls do not touch the network: one call per backoff
interval (doubling up to BACKOFF_MAX_S) probes it, and the first that succeeds ends the outage.

Size is bounded by Redis itself (`maxmemory` with `allkeys-lru` or `allkeys-lfu`), optionally with a TTL per
entry; `probe()` says when the server is not configured that way. Why Redis and redis-py, the URL forms and
the password rules: docs/prefix-pool.md ("Remote tier"); the threat model: docs/security.md ("Remote KV store").

redis-py is imported when a store is made, so the engine imports without it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from trtprompt.engine.tiers.store import TierCounters
from trtprompt.secret_source import read_secret

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

PASSWORD_ENV = "TRTPROMPT_KV_REMOTE_PASSWORD"
DEFAULT_KEY_PREFIX = "trtprompt:kv:"
# A block read on a LAN takes milliseconds; half a second bounds what one slow server costs a load.
DEFAULT_TIMEOUT_S = 0.5
MAX_TIMEOUT_S = 60.0
MAX_TTL_S = 365 * 24 * 3600.0
MAX_KEY_PREFIX_CHARS = 256
MAX_PASSWORD_CHARS = 4096
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0
SCHEMES = {"redis": False, "rediss": True}  # scheme -> TLS


@dataclass(frozen=True)
class RedisTarget:
    """Where the server is, as a `redis://HOST:PORT/DB` or `rediss://` (TLS) URL says; never a password."""

    host: str
    port: int = 6379
    db: int = 0
    tls: bool = False
    username: str | None = None  # a Redis 6+ ACL user; its password comes from remote_password()

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("the Redis URL needs a host: redis://HOST:PORT/DB")
        if not 0 < self.port < 65536:
            raise ValueError(f"the Redis port must be 1 to 65535, got {self.port}")
        if not 0 <= self.db <= 65535:
            raise ValueError(f"the Redis database number must be 0 to 65535, got {self.db}")

    @classmethod
    def parse(cls, url: str) -> RedisTarget:
        """The target of url; ValueError naming what is wrong (the password itself is never repeated)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"the Redis URL must start with redis:// or rediss:// (TLS), got {parts.scheme!r}")
        if parts.password is not None:
            raise ValueError("the Redis URL carries a password, which every local user could read in "
                             f"/proc/PID/cmdline: remove it and set {PASSWORD_ENV} or use a password file")
        if parts.query or parts.fragment:
            raise ValueError("the Redis URL takes no ?options or #fragment: redis://HOST:PORT/DB")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"the Redis URL's port is not a number 1 to 65535: {url!r}") from None
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise ValueError(f"the Redis URL's path must be a database number (redis://HOST:PORT/0), got {path!r}")
        return cls(host=parts.hostname or "", port=6379 if port is None else port, db=int(path or 0),
                   tls=SCHEMES[parts.scheme], username=urllib.parse.unquote(parts.username) if parts.username
                   else None)

    @property
    def label(self) -> str:
        """The URL without secrets, for logs and the serve banner."""
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.tls else 'redis'}://{user}{host}:{self.port}/{self.db}"


def remote_password(password_file: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The Redis password: the file's content (surrounding whitespace dropped), else $TRTPROMPT_KV_REMOTE_PASSWORD;
    None when neither is set (an empty variable counts as unset; an empty or unreadable file is refused)."""
    value = read_secret(password_file, os.environ if env is None else env, PASSWORD_ENV, "Redis password")
    if value is None:
        return None
    if len(value) > MAX_PASSWORD_CHARS:
        raise ValueError(f"the Redis password must be at most {MAX_PASSWORD_CHARS} characters, got {len(value)}")
    return value


@dataclass
class _Outage:
    """Whether the server is reachable, and when to try it again while it is not. Thread-safe."""

    label: str
    down_since: float | None = None
    retry_at: float = 0.0
    backoff_s: float = BACKOFF_FIRST_S
    lock: threading.Lock = field(default_factory=threading.Lock)

    def may_try(self) -> bool:
        """True while up; while down, True for one caller per backoff interval (the probe)."""
        with self.lock:
            if self.down_since is None:
                return True
            now = time.monotonic()
            if now < self.retry_at:
                return False
            self.retry_at = now + self.backoff_s  # the other callers wait for this probe's outcome
            return True

    def failed(self, exc: Exception) -> None:
        with self.lock:
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                self.backoff_s = BACKOFF_FIRST_S
                log.warning("remote KV tier %s unreachable (%s: %s): its blocks are misses and its writes are "
                            "dropped until it answers again (retrying with backoff up to %gs)",
                            self.label, type(exc).__name__, exc, BACKOFF_MAX_S)
            else:
                self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)
            self.retry_at = now + self.backoff_s

    def succeeded(self) -> None:
        if self.down_since is None:  # the common case: no lock on the hot path
            return
        with self.lock:
            if self.down_since is not None:
                log.info("remote KV tier %s answers again after %.1fs", self.label,
                            time.monotonic() - self.down_since)
                self.down_since = None


class RedisStore:
    """A BlockStore on one Redis database: key prefix + block key -> the codec's bytes."""

    name = "redis"

    def __init__(self, client: redis.Redis, target: RedisTarget, key_prefix: str = DEFAULT_KEY_PREFIX,
                 ttl_s: float | None = None) -> None:
        if not 0 < len(key_prefix) <= MAX_KEY_PREFIX_CHARS or not key_prefix.isprintable():
            raise ValueError(f"key_prefix must be 1 to {MAX_KEY_PREFIX_CHARS} printable characters, "
                             f"got {key_prefix!r}")
        if ttl_s is not None and not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g}] seconds or None, got {ttl_s}")
        self.counters = TierCounters()
        self.target = target
        self._client = client
        self._prefix = key_prefix.encode("utf-8")
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._outage = _Outage(target.label)
        self._full_warned = False
        self._closed = False
        self._lock = threading.Lock()  # _full_warned (the counters have their own lock)
        from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

        self._faults: tuple[type[Exception], ...] = (RedisError, OSError)
        self._full: type[Exception] = OutOfMemoryError
        self._refused: type[Exception] = ResponseError  # a command the server (or its ACL) does not allow

    @classmethod
    def from_url(cls, url: str, password: str | None = None, key_prefix: str = DEFAULT_KEY_PREFIX,
                 timeout_s: float = DEFAULT_TIMEOUT_S, ttl_s: float | None = None,
                 tls_ca_file: str | None = None) -> RedisStore:
        """A store on the server url names (nothing is sent yet: a server that is down is an outage, not an error).

        password: from remote_password(), never from the URL. timeout_s bounds each connect and each reply.
        tls_ca_file: the CA that signed a rediss:// server's certificate (default: the system's, or $SSL_CERT_FILE).
        """
        target = RedisTarget.parse(url)
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s}")
        if tls_ca_file is not None and not target.tls:
            raise ValueError("tls_ca_file is for rediss:// URLs; this one is redis:// (no TLS)")
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(
            host=target.host, port=target.port, db=target.db, username=target.username, password=password,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # each call tried once: the outage state decides when to try again
            ssl=target.tls, ssl_ca_certs=tls_ca_file, client_name="trtprompt-kv-tier")
        return cls(client, target, key_prefix=key_prefix, ttl_s=ttl_s)

    def __repr__(self) -> str:
        return f"RedisStore({self.target.label})"  # never the password

    def get(self, key: bytes) -> bytes | None:
        value = self._call(lambda: self._client.get(self._prefix + key)) if self._usable() else None
        if isinstance(value, bytes):
            self.counters.add(hits=1, bytes_read=len(value))
            return value
        self.counters.add(misses=1)
        return None

    def put(self, key: bytes, value: bytes) -> bool:
        done = self._usable() and self._call(
            lambda: self._client.set(self._prefix + key, value, px=self._ttl_ms)) is True
        if not done:
            self.counters.add(drops=1)
            return False
        self.counters.add(writes=1, bytes_written=len(value))
        with self._lock:
            self._full_warned = False
        return True

    def delete(self, key: bytes) -> None:
        if self._usable():
            self._call(lambda: self._client.delete(self._prefix + key))

    def close(self) -> None:
        self._closed = True
        try:
            self._client.close()
        except self._faults:
            pass  # closing sockets to a server that is gone

    def probe(self) -> str | None:
        """None when the server answers and bounds its memory with an evicting policy; else what to fix
        (the engine calls it once at start, tiers/open.py; also logged). Never raises.

        A server that does not answer starts an outage (its one warning is logged now, not at the first
        request's load), so calls stay off the network until a backoff probe finds it up."""
        try:
            self._client.ping()
        except self._faults as exc:
            return self._unreachable(exc)
        try:
            config = self._client.config_get("maxmemory*")
        except self._refused:
            return None  # managed services often disable CONFIG: the server answers, its policy is unknown
        except self._faults as exc:
            return self._unreachable(exc)
        return _eviction_problem(self.target.label, config, self._ttl_ms is not None)

    def _unreachable(self, exc: Exception) -> str:
        self._outage.failed(exc)  # logs the outage's one warning
        return f"{self.target.label} does not answer: {type(exc).__name__}: {exc}"

    def _usable(self) -> bool:
        return not self._closed and self._outage.may_try()

    def _call(self, command: Callable[[], object]) -> object:
        """command's reply, or None after a fault (counted, and an outage unless the server is merely full)."""
        try:
            reply = command()
        except self._full as exc:
            self.counters.add(errors=1)
            with self._lock:
                warn, self._full_warned = not self._full_warned, True
            if warn:
                log.warning("remote KV tier %s is full and does not evict (%s): writes are dropped; set "
                            "maxmemory-policy allkeys-lru (docs/prefix-pool.md)", self.target.label, exc)
            return None
        except self._faults as exc:
            self.counters.add(errors=1)
            self._outage.failed(exc)
            return None
        self._outage.succeeded()
        return reply


def _eviction_problem(label: str, config: object, has_ttl: bool) -> str | None:
    """What is wrong with a server's maxmemory settings for a cache tier, or None."""
    settings = {_text(k): _text(v) for k, v in config.items()} if isinstance(config, dict) else {}
    policy = settings.get("maxmemory-policy", "")
    if settings.get("maxmemory", "0") == "0":
        problem = f"{label} has no maxmemory: the tier grows until the server runs out of memory"
    elif policy == "noeviction" or (policy.startswith("volatile-") and not has_ttl):
        problem = f"{label} has maxmemory-policy {policy}: once full, every write is dropped"
    else:
        return None
    log.warning("%s; set maxmemory and maxmemory-policy allkeys-lru (docs/prefix-pool.md)", problem)
    return problem


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
