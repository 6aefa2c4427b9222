"""The tier knobs on the serve path: flags -> the tensorrt_llm model's parameters -> the engine process."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from trtprompt.cli import main
from trtprompt.serve.engine_process.server import engine_overrides
from trtprompt.serve.launch.launcher import tier_lines
from trtprompt.serve.launch.options import EngineInfo, ServeOptions, resolve_options
from trtprompt.serve.wire.model_config import read_parameters


def _repo(engine: Path, out: Path, *flags: str) -> Result:
    """`serve --repo-only` in this process: it writes the repository and returns."""
    return CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(out), *flags])


def test_serve_flags_reach_the_engine_process(tiny_engine_dir: Path, tmp_path: Path) -> None:
    out = _repo(tiny_engine_dir, tmp_path / "repo", "--disk-cache-path", str(tmp_path / "kv"),
                "--disk-cache-size", "67108864", "--kv-tier-write-policy", "selective")
    assert out.exit_code == 0, out.output
    params = read_parameters(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    got = {k: v for k, v in engine_overrides(params).items() if k.startswith(("disk_", "kv_tier", "kv_remote"))}
    assert got == {"disk_cache_path": str(tmp_path / "kv"), "disk_cache_size": 67108864,
                   "kv_tier_write_policy": "selective"}
    secret = tmp_path / "redis-password"
    secret.write_text("pw\n")
    remote = _repo(tiny_engine_dir, tmp_path / "remote", "--kv-remote-url", "redis://cache:6379/0",
                   "--kv-remote-password-file", str(secret))
    assert remote.exit_code == 0, remote.output
    params = engine_overrides(read_parameters(tmp_path / "remote" / "tensorrt_llm" / "config.pbtxt"))
    assert (params["kv_remote_url"], params["kv_remote_password_file"]) == ("redis://cache:6379/0", str(secret))
    plain = _repo(tiny_engine_dir, tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    assert not [k for k in read_parameters(tmp_path / "plain" / "tensorrt_llm" / "config.pbtxt")
                if k.startswith(("disk_", "kv_tier", "kv_remote"))]  # no tier: nothing written


def test_bad_tier_values_are_refused_naming_the_knob(tiny_engine_dir: Path) -> None:
    engine = EngineInfo.read(tiny_engine_dir)
    with pytest.raises(ValueError, match=r"disk_cache_size must be an integer in \[1048576"):
        resolve_options(engine, {"disk_cache_size": 1000})
    with pytest.raises(ValueError, match="kv_tier_write_policy must be one of write_through, selective, write_back"):
        resolve_options(engine, {"kv_tier_write_policy": "write_around"})
    # A password in the URL is refused before anything prints or passes it on (the message never repeats it).
    with pytest.raises(ValueError, match="the Redis URL carries a password") as refused:
        resolve_options(engine, {"kv_remote_url": "redis://:hunter2@cache:6379/0"})
    assert "hunter2" not in str(refused.value)
    with pytest.raises(ValueError, match="cannot read the Redis password file /no/such/file"):
        resolve_options(engine, {"kv_remote_url": "redis://cache", "kv_remote_password_file": "/no/such/file"})


def test_the_banner_names_each_tier() -> None:
    assert tier_lines(ServeOptions()) == []
    lines = tier_lines(ServeOptions(disk_cache_path="/var/cache/kv", kv_remote_url="redis://cache"))
    assert lines == ["  KV disk /var/cache/kv (up to 4.0 GiB, write_through; kept across restarts)",
                     "  KV remote redis://cache:6379/0 (write_through; shared by servers)"]
