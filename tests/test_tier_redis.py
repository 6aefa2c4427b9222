"""The remote tier's store (trtprompt/engine/tiers/redis_store.py) against a real redis-server: round trips,
key prefixes, TTLs, passwords, TLS, and each fault (server stopped, restarted, slow, full) as a miss or a
dropped write with one warning per outage, then reconnection."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from redis_server import REDIS_SERVER, SKIP_REASON, RedisServer

from trtprompt.engine.tiers.redis_store import (
    BACKOFF_MAX_S,
    PASSWORD_ENV,
    RedisStore,
    RedisTarget,
    remote_password,
)

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
LOGGER = "trtprompt.engine.tiers.redis_store"
DEADLINE_S = 30.0


def poll(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and text in r.getMessage()]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    with RedisServer(tmp_path) as started:
        yield started


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisStore]:
    made = RedisStore.from_url(server.url, timeout_s=1.0)
    yield made
    made.close()


# --- the URL, the password: no server needed -------------------------------------------------------------

def test_urls_parse_to_targets_and_labels_keep_no_secret() -> None:
    assert RedisTarget.parse("redis://cache.internal:6380/3") == RedisTarget("cache.internal", 6380, 3, False)
    assert RedisTarget.parse("rediss://cache") == RedisTarget("cache", 6379, 0, True)
    acl = RedisTarget.parse("rediss://kv-user@10.0.0.5:6379/1")
    assert acl.username == "kv-user" and acl.label == "rediss://kv-user@10.0.0.5:6379/1"
    assert RedisTarget.parse("redis://[::1]:7000").label == "redis://[::1]:7000/0"


@pytest.mark.parametrize("url, words", [
    ("http://cache:6379/0", "redis:// or rediss://"),
    ("redis://:6379/0", "needs a host"),
    ("redis://cache:99999/0", "port"),
    ("redis://cache:6379/zero", "database number"),
    ("redis://cache:6379/0?ssl_cert_reqs=none", "no ?options"),
    ("redis://cache:6379/70000", "0 to 65535"),
])
def test_bad_urls_are_refused_naming_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ValueError, match="Redis") as info:
        RedisTarget.parse(url)
    assert words in str(info.value)


@pytest.mark.parametrize("url", ["redis://:s3cret-pw@cache:6379/0", "rediss://user:s3cret-pw@cache/0"])
def test_a_password_in_the_url_is_refused_without_repeating_it(url: str) -> None:
    with pytest.raises(ValueError) as info:
        RedisStore.from_url(url)
    message = str(info.value)
    assert "/proc/PID/cmdline" in message and PASSWORD_ENV in message and "password file" in message
    assert "s3cret-pw" not in message


def test_the_password_comes_from_the_file_else_the_environment(tmp_path: Path) -> None:
    env = {PASSWORD_ENV: " from-env \n"}
    assert remote_password(None, env) == "from-env"
    assert remote_password(None, {}) is None
    assert remote_password(None, {PASSWORD_ENV: "  "}) is None  # an empty variable counts as unset
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    assert remote_password(str(secret), env) == "from-file"  # the file wins over the variable
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        remote_password(str(tmp_path / "empty"), env)
    with pytest.raises(ValueError, match="cannot read the Redis password file"):
        remote_password(str(tmp_path / "missing"), env)


@pytest.mark.parametrize("kwargs, field", [({"timeout_s": 0}, "timeout_s"), ({"timeout_s": 61}, "timeout_s"),
                                           ({"ttl_s": 0}, "ttl_s"), ({"key_prefix": ""}, "key_prefix"),
                                           ({"tls_ca_file": "/ca.pem"}, "tls_ca_file")])
def test_bad_settings_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RedisStore.from_url("redis://127.0.0.1:6379/0", **kwargs)  # type: ignore[arg-type]


def test_the_module_imports_without_redis_py() -> None:
    # The engine imports the tiers package whether or not the remote tier is used: redis-py is loaded only
    # when a store is made. sys.modules["redis"] = None makes any `import redis` fail.
    code = ("import sys; sys.modules['redis'] = None\n"
            "import trtprompt.engine.tiers.redis_store as m\n"
            "try:\n    m.RedisStore.from_url('redis://127.0.0.1:1/0')\nexcept ImportError:\n    print('lazy')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "lazy", out.stderr


# --- a healthy server --------------------------------------------------------------------------------------

@needs_redis
def test_round_trip_replace_and_counters(store: RedisStore, server: RedisServer) -> None:
    block = bytes(range(256)) * 4096  # 1 MiB, every byte value
    assert store.get(b"\x00key-1") is None
    assert store.put(b"\x00key-1", block) is True
    assert store.get(b"\x00key-1") == block
    assert store.put(b"\x00key-1", b"replaced") is True
    assert store.get(b"\x00key-1") == b"replaced"
    store.delete(b"\x00key-1")
    assert store.get(b"\x00key-1") is None
    c = store.counters
    assert (c.hits, c.misses, c.writes, c.drops, c.errors) == (2, 2, 2, 0, 0)
    assert (c.bytes_read, c.bytes_written) == (len(block) + 8, len(block) + 8)
    assert store.probe() is None  # the fixture's server: maxmemory 64mb, allkeys-lru


@needs_redis
def test_every_key_carries_the_deployment_prefix_and_prefixes_isolate(server: RedisServer) -> None:
    blue = RedisStore.from_url(server.url, key_prefix="blue:")
    green = RedisStore.from_url(server.url, key_prefix="green:")
    assert blue.put(b"k", b"blue's block") and green.put(b"k", b"green's block")
    assert blue.get(b"k") == b"blue's block" and green.get(b"k") == b"green's block"
    blue.delete(b"k")
    assert blue.get(b"k") is None and green.get(b"k") == b"green's block"
    default = RedisStore.from_url(server.url)
    assert default.put(b"k", b"x") and default.get(b"k") == b"x"
    assert sorted(server.admin().keys("*")) == [b"green:k", b"trtprompt:kv:k"]


@needs_redis
def test_entries_get_the_ttl_asked_for(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url, ttl_s=90)
    assert store.put(b"k", b"v")
    assert 80_000 < server.admin().pttl(b"trtprompt:kv:k") <= 90_000
    short = RedisStore.from_url(server.url, key_prefix="short:", ttl_s=0.2)
    assert short.put(b"k", b"v")
    poll("the entry to expire", lambda: short.get(b"k") is None)
    assert server.admin().pttl(b"trtprompt:kv:k") > 0  # the other entry is untouched


@needs_redis
def test_probe_says_when_the_server_does_not_evict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(tmp_path / "a", maxmemory="0") as unbounded:
        assert "has no maxmemory" in (RedisStore.from_url(unbounded.url).probe() or "")
    with RedisServer(tmp_path / "b", policy="noeviction") as noevict:
        assert "noeviction: once full, every write is dropped" in (RedisStore.from_url(noevict.url).probe() or "")
    with RedisServer(tmp_path / "c", policy="volatile-lru") as volatile:
        assert "volatile-lru" in (RedisStore.from_url(volatile.url).probe() or "")
        assert RedisStore.from_url(volatile.url, ttl_s=3600).probe() is None  # every entry has a TTL
    assert len(warnings_about(caplog, "set maxmemory and maxmemory-policy allkeys-lru")) == 3


def test_probe_of_a_server_that_is_down_starts_the_outage_with_its_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    from trtprompt.serve.ports import free_ports

    (port,) = free_ports(1)
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)  # nothing listens there
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert "does not answer" in (store.probe() or "")
        assert len(warnings_about(caplog, "unreachable")) == 1  # said at start
        assert store.get(b"k") is None and store.put(b"k", b"v") is False  # the first use: no second warning
    assert len(warnings_about(caplog, "unreachable")) == 1
    assert (store.counters.misses, store.counters.drops) == (1, 1)


@needs_redis
def test_a_full_server_that_does_not_evict_drops_writes_and_still_serves_reads(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(tmp_path, maxmemory="4mb", policy="noeviction") as full:
        store = RedisStore.from_url(full.url)
        block = b"b" * 65536
        n = 0
        while store.put(b"%d" % n, block):
            n += 1
            assert n < 1000, "the 4 MiB server never filled"
        for i in range(3):
            assert store.put(b"more-%d" % i, block) is False
        assert store.get(b"0") == block  # full is not down: reads go on
        c = store.counters
        assert (c.writes, c.drops, c.errors) == (n, 4, 4)
        assert len(warnings_about(caplog, "is full and does not evict")) == 1
        assert warnings_about(caplog, "unreachable") == []


# --- passwords ---------------------------------------------------------------------------------------------

@needs_redis
def test_a_server_with_a_password_needs_it_read_from_env_or_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(tmp_path, password="pw-for-tests") as locked:
        anonymous = RedisStore.from_url(locked.url)
        assert anonymous.put(b"k", b"v") is False and anonymous.get(b"k") is None
        assert anonymous.counters.errors == 1  # the second call came inside the backoff: not sent
        assert "AuthenticationError" in warnings_about(caplog, "unreachable")[0]
        assert "does not answer" in (anonymous.probe() or "")
        wrong = RedisStore.from_url(locked.url, password="wrong-pw-7f3a")
        assert wrong.get(b"k") is None and wrong.counters.errors == 1
        assert "wrong-pw-7f3a" not in caplog.text + repr(wrong) + (wrong.probe() or "")

        monkeypatch.setenv(PASSWORD_ENV, "pw-for-tests")
        by_env = RedisStore.from_url(locked.url, password=remote_password(None))
        assert by_env.put(b"k", b"v") and by_env.get(b"k") == b"v"
        secret = tmp_path / "redis-password"
        secret.write_text("pw-for-tests\n")
        monkeypatch.setenv(PASSWORD_ENV, "wrong")  # the file wins
        by_file = RedisStore.from_url(locked.url, password=remote_password(str(secret)))
        assert by_file.get(b"k") == b"v" and by_file.probe() is None


@needs_redis
def test_the_password_file_knob_opens_a_store_that_authenticates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trtprompt.engine.tiers.config import TierConfig
    from trtprompt.engine.tiers.open import open_stores

    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    secret = tmp_path / "redis-password"
    secret.write_text("pw-for-tests\n")
    with RedisServer(tmp_path / "srv", password="pw-for-tests") as locked:
        (store,) = open_stores(TierConfig(kv_remote_url=locked.url, kv_remote_password_file=str(secret)))
        assert store.put(b"k", b"v") and store.get(b"k") == b"v" and store.counters.errors == 0
        (anonymous,) = open_stores(TierConfig(kv_remote_url=locked.url))
        assert anonymous.get(b"k") is None and anonymous.counters.errors == 1
    with pytest.raises(ValueError, match="the Redis password file .* is empty"):
        secret.write_text("")
        open_stores(TierConfig(kv_remote_url="redis://127.0.0.1:1/0", kv_remote_password_file=str(secret)))


# --- faults: stopped, restarted, slow ----------------------------------------------------------------------

@needs_redis
def test_a_stopped_server_is_misses_and_drops_with_one_warning_then_reconnection(
        server: RedisServer, store: RedisStore, caplog: pytest.LogCaptureFixture) -> None:
    assert store.put(b"k", b"before")
    server.kill()
    started = time.monotonic()
    results = [(store.get(b"k"), store.put(b"k", b"during")) for _ in range(200)]
    assert time.monotonic() - started < DEADLINE_S
    assert set(results) == {(None, False)}
    c = store.counters
    assert (c.hits, c.misses, c.drops, c.writes) == (0, 200, 200, 1)
    assert 1 <= c.errors <= 5  # one per probe, a probe per backoff interval: not one per call
    assert len(warnings_about(caplog, "unreachable")) == 1

    server.start()  # the same port, empty (no persistence)
    poll("the store to reconnect", lambda: store.put(b"k", b"after"))
    assert store.get(b"k") == b"after"
    assert len(warnings_about(caplog, "unreachable")) == 1  # still the one outage

    server.kill()  # a second outage is warned about again
    assert store.get(b"k") is None
    assert len(warnings_about(caplog, "unreachable")) == 2


@needs_redis
def test_a_restarted_server_is_reconnected_with_backoff_bounded(
        server: RedisServer, store: RedisStore, caplog: pytest.LogCaptureFixture) -> None:
    assert store.put(b"k", b"v") and store.get(b"k") == b"v"
    server.restart()
    # The pooled connection died with the old process: the first call fails, the store reconnects on a
    # later one within the backoff's cap.
    store.get(b"k")
    started = time.monotonic()
    poll("a write to the restarted server", lambda: store.put(b"k", b"again"))
    assert time.monotonic() - started <= BACKOFF_MAX_S + DEADLINE_S / 2
    assert store.get(b"k") == b"again"
    assert len(warnings_about(caplog, "unreachable")) <= 1


@needs_redis
def test_a_slow_server_costs_one_timeout_then_serving_goes_on(
        server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    store = RedisStore.from_url(server.url, timeout_s=0.2)
    assert store.put(b"k", b"v")
    pause_ms = 3000
    server.admin().client_pause(pause_ms)  # every client's commands wait, as behind a stalled server
    started = time.monotonic()
    assert store.get(b"k") is None
    assert time.monotonic() - started < pause_ms / 1000 / 2  # bounded by timeout_s, not by the stall
    assert [store.get(b"k") for _ in range(50)] == [None] * 50  # inside the backoff: no network
    assert store.counters.errors == 1
    assert "TimeoutError" in warnings_about(caplog, "unreachable")[0]
    poll("the paused server to serve again", lambda: store.get(b"k") == b"v")
    assert len(warnings_about(caplog, "unreachable")) <= 2  # probes during the pause may time out again


@needs_redis
def test_a_closed_store_refuses_calls_as_misses_and_drops(store: RedisStore) -> None:
    assert store.put(b"k", b"v")
    store.close()
    assert store.get(b"k") is None and store.put(b"k", b"v") is False
    assert (store.counters.misses, store.counters.drops) == (1, 1)


# --- TLS -----------------------------------------------------------------------------------------------------

@needs_redis
def test_rediss_talks_tls_and_checks_the_certificate(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(tmp_path, tls=True) as tls:
        assert tls.url.startswith("rediss://") and tls.cert is not None
        store = RedisStore.from_url(tls.url, tls_ca_file=str(tls.cert))
        assert store.put(b"k", b"over tls") and store.get(b"k") == b"over tls"
        untrusted = RedisStore.from_url(tls.url)  # the system's CAs do not know the self-signed certificate
        assert untrusted.get(b"k") is None
        assert "certificate verify failed" in warnings_about(caplog, "unreachable")[0]
        plain = RedisStore.from_url(tls.url.replace("rediss://", "redis://"))  # plain text to a TLS port
        assert plain.get(b"k") is None and plain.counters.errors == 1
