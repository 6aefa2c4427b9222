"""The router process: sglang-router 0.3.2's own launcher, with its keys set in this process.

sglang-router takes its client API key (`--api-key`) and its control-plane keys
(`--control-plane-api-keys id:name:role:key`) only as command-line values, which every local
user can read in /proc/PID/cmdline. Its Python API takes the same values as RouterArgs fields,
so this entry point parses the rest of the command line with sglang-router's own parser and
sets the two fields from a file (`--secrets-file`, JSON, 0600 in the 0700 run dir) that it
removes as soon as it has read it. Nothing else differs from `python -m sglang_router.launch_router`.

    python -m trtprompt.serve.launch.router_main [--secrets-file PATH] SGLANG_ROUTER_ARGS...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SECRETS_FILE = "router.secrets"
ADMIN_KEY_ID = "trtprompt-admin"  # the control-plane key's id and name in the router's audit log


def write_secrets(run_dir: Path, api_key: str | None, admin_key: str | None) -> Path:
    """The keys for one router start, 0600 (the run dir is 0700); the router unlinks it."""
    path = run_dir / SECRETS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"api_key": api_key, "admin_key": admin_key}, f)
    return path


def read_secrets(path: Path) -> tuple[str | None, str | None]:
    """(api_key, admin_key) from path, which is then removed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    finally:
        path.unlink(missing_ok=True)
    return data.get("api_key") or None, data.get("admin_key") or None


def split_secrets_arg(argv: list[str]) -> tuple[Path | None, list[str]]:
    """(--secrets-file value, the other arguments) from argv."""
    if "--secrets-file" not in argv:
        return None, argv
    i = argv.index("--secrets-file")
    if i + 1 >= len(argv):
        raise SystemExit("--secrets-file needs a path")
    return Path(argv[i + 1]), argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args  # type: ignore[import-untyped]

    secrets, rest = split_secrets_arg(argv)
    args = parse_router_args(rest)
    if secrets is not None:
        api_key, admin_key = read_secrets(secrets)
        args.api_key = api_key
        if admin_key is not None:  # RouterArgs' parsed tuple order: (id, name, key, role)
            args.control_plane_api_keys = [(ADMIN_KEY_ID, ADMIN_KEY_ID, admin_key, "admin")]
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
