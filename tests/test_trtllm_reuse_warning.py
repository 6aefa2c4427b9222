"""No silent loss of KV reuse on TensorRT-LLM 1.2 engines (issue 27): an engine directory written by plain
`trtllm-build` without use_paged_context_fmha (or without a paged KV cache) gets ONE warning line from
`serve` and `inspect` naming the build flag and what is off, and `serve --require-kv-reuse` refuses it
with that message. Engines that can reuse get no warning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
from click.testing import CliRunner
from trtllm_fixtures import make_engine_dir

from trtprompt import rules
from trtprompt.cli import main

LINE = ("engine built without use_paged_context_fmha: KV-cache reuse and chunked context are off "
        "(rebuild with trtllm-build --use_paged_context_fmha enable)")


@pytest.fixture()
def plain_engine(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> Path:
    return make_engine_dir("no_paged_context_fmha", tmp_path / "e", tiny_checkpoint_factory("llama"),
                           trtllm_build=True)


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_the_rule_names_flag_and_loss() -> None:
    assert rules.reuse_loss_warning({"plugin_config": {"use_paged_context_fmha": False}}) == LINE
    both = rules.reuse_loss_warning({"kv_cache_type": "CONTINUOUS", "plugin_config": {}})
    assert both is not None and "use_paged_context_fmha and paged_kv_cache" in both
    assert "--kv_cache_type paged" in both
    assert rules.reuse_loss_warning({"kv_cache_type": "PAGED", "plugin_config": {"use_paged_context_fmha": True}}) is None


def test_serve_warns_once(plain_engine: Path, tmp_path: Path) -> None:
    result = _cli("serve", str(plain_engine), "--repo-only", str(tmp_path / "repo"))
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {plain_engine.name}: {LINE}"]


def test_require_kv_reuse_refuses(plain_engine: Path, tmp_path: Path) -> None:
    result = _cli("serve", str(plain_engine), "--repo-only", str(tmp_path / "repo"), "--require-kv-reuse")
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: {plain_engine}: {LINE}; refused by --require-kv-reuse"
    assert not (tmp_path / "repo").exists()


def test_inspect_warns_once(plain_engine: Path) -> None:
    text = _cli("inspect", str(plain_engine))
    assert text.exit_code == 0, text.output
    assert [line for line in text.output.splitlines() if line.startswith("warning:")] == [f"warning: {LINE}"]
    data = json.loads(_cli("inspect", str(plain_engine), "--json").output)
    assert data["warnings"] == [LINE]


def test_a_good_engine_has_no_warning(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "e", tiny_checkpoint_factory("llama"), trtllm_build=True)
    served = _cli("serve", str(engine), "--repo-only", str(tmp_path / "repo"), "--require-kv-reuse")
    assert served.exit_code == 0, served.output
    assert "warning" not in served.output
    assert json.loads(_cli("inspect", str(engine), "--json").output)["warnings"] == []


def test_require_kv_reuse_refuses_reuse_switched_off(tiny_checkpoint_factory: Callable[..., Path],
                                                     tmp_path: Path) -> None:
    engine = make_engine_dir("good", tmp_path / "e", tiny_checkpoint_factory("llama"), trtllm_build=True)
    result = _cli("serve", str(engine), "--repo-only", str(tmp_path / "repo"), "--require-kv-reuse",
                  "--disable-kv-cache-reuse")
    assert result.exit_code == 1 and "KV-cache reuse is off" in result.output
