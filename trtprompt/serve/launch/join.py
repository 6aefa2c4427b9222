"""`trtprompt serve ENGINE --join-router URL`: one server that registers its OpenAI front end with a
router running elsewhere (`trtprompt router`, serve/launch/router_node.py) through the router's
own worker API (docs/multi-node.md).

A keeper thread registers the front end (POST /workers) once it answers /health, and again
whenever the router no longer lists it (the router restarted, or an operator removed it); a clean
stop removes it (DELETE /workers/{id}) before the server stops. A crashed server cannot say
goodbye: the router's health checks take it out, and the router's own list keeps it until it is
removed or comes back.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse

from trtprompt.serve.launch import router as R
from trtprompt.serve.launch.launcher import LaunchError, Server, ready_message, stop_on_signals
from trtprompt.serve.ports import http_ok

JOIN_INTERVAL_S = 2.0  # between the keeper's checks of its own health and the router's list
LEAVE_TIMEOUT_S = 10.0  # a clean stop waits this long for the router to drop the server
UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class JoinOptions:
    """Which router to join and the address it should call this server at.

    worker_key: this server's API key, handed to the router with the registration (in the POST
    body, never a command line); the router then sends it to this server on every call."""

    router: R.RouterAPI
    advertise_url: str
    worker_key: str | None = field(default=None, repr=False)
    interval_s: float = JOIN_INTERVAL_S

    def __post_init__(self) -> None:
        parsed = urlparse(self.advertise_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            raise ValueError(f"advertise_url must be http(s)://HOST:PORT, got {self.advertise_url!r}")
        if parsed.hostname in UNSPECIFIED_HOSTS:
            raise ValueError(f"advertise_url {self.advertise_url!r} names no host the router can call: give "
                             "this machine's name or address")
        if not 0 < self.interval_s <= 60:
            raise ValueError(f"interval_s must be in (0, 60], got {self.interval_s}")


def join_options(router_url: str, advertise_url: str | None, bind_host: str, openai_port: int,
                 admin_key: str | None, worker_key: str | None) -> JoinOptions:
    """The advertise URL defaults to the front end's own address, which only a router on this
    machine can use; binding every interface (0.0.0.0) therefore needs it given."""
    if advertise_url is None:
        if bind_host in UNSPECIFIED_HOSTS:
            raise ValueError(f"--join-router with --host {bind_host or '0.0.0.0'}: pass --advertise-url "
                             f"http://THIS_HOST:{openai_port}, the address the router calls this server at")
        advertise_url = f"http://{bind_host}:{openai_port}"
    return JoinOptions(R.RouterAPI(router_url, admin_key), advertise_url.rstrip("/"), worker_key)


class RouterJoin:
    """The keeper thread: registered while the front end is healthy and the router reachable."""

    def __init__(self, opts: JoinOptions, health_url: str, log: Callable[[str], None]) -> None:
        self.opts, self.health_url, self.log = opts, health_url, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="router-join", daemon=True)
        self.registrations = 0

    def start(self) -> None:
        """The first registration before the banner, so a wrong router or key is seen now."""
        if self.opts.worker_key is not None and router_is_open(self.opts.router) is True:
            raise LaunchError(f"the router {self.opts.router.base} takes requests without an API key, and it would "
                              "call this server with this server's key for anyone: start it with the same key "
                              "(trtprompt router --api-key-file), or serve without one (docs/multi-node.md)")
        self.check_once()
        self._thread.start()

    def check_once(self) -> bool:
        """Register if healthy and not listed; True when the router lists this server."""
        url = self.opts.advertise_url
        try:
            listed = any(w["url"] == url for w in R.workers(self.opts.router))
            if not listed and http_ok(self.health_url):
                R.register_worker(self.opts.router, url, self.opts.worker_key)
                self.registrations += 1
                self.log(f"trtprompt serve: registered {url} with the router {self.opts.router.base}"
                         f"{' again' if self.registrations > 1 else ''}")
                return True
            return listed
        except R.RouterError as exc:
            self.log(f"trtprompt serve: the router {self.opts.router.base} did not take {url}: {exc}; "
                     f"retrying every {self.opts.interval_s:.0f}s")
            return False

    def _keep(self) -> None:
        while not self._stop.wait(self.opts.interval_s):
            self.check_once()

    def leave(self) -> None:
        """Stop keeping, then take this server out of the router (a clean stop)."""
        self._stop.set()
        if self._thread.ident is None:  # never started: the server did not come up
            return
        if self._thread.is_alive():
            self._thread.join(self.opts.interval_s + 5.0)
        url = self.opts.advertise_url
        try:
            R.remove_worker(self.opts.router, url, LEAVE_TIMEOUT_S)
            self.log(f"trtprompt serve: removed {url} from the router {self.opts.router.base}")
        except R.RouterError as exc:  # the router's health checks take it out instead
            self.log(f"trtprompt serve: could not leave the router {self.opts.router.base}: {exc}")


def router_is_open(router: R.RouterAPI) -> bool | None:
    """Whether the router passes requests without a key (None: it cannot be reached now). Asked
    with an empty, unauthenticated completion: sglang-router 0.3.2 with an API key answers 401
    before it looks at the body or its workers; without one, anything else (measured)."""
    req = urllib.request.Request(f"{router.base}/v1/completions", b"{}", {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5.0):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code != 401
    except (urllib.error.URLError, OSError):
        return None


def serve_joined(server: Server, join: JoinOptions, health_url: str) -> int:
    """serve_forever (launcher.py), with the server registered in the router while it runs."""
    keeper = RouterJoin(join, health_url, server.log)
    with stop_on_signals(server.request_stop):
        try:
            server.start()
            keeper.start()
            server.log(ready_message(server) + f"\n  router  {join.router.base}  (joined as {join.advertise_url})")
            return server.watch()
        except LaunchError as exc:
            server.log(f"trtprompt serve: {exc}")
            return 1
        finally:
            with contextlib.suppress(Exception):  # leaving must not keep the server from stopping
                keeper.leave()
            server.stop()
