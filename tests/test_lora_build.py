"""build --lora-dir: PEFT adapters checked against the base at build time and kept in the engine directory
(lora/NAME/), TensorRT-LLM's lora_config in config.json, `inspect` listing them, and the trtllm target's
trtllm-build flags."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from lora_adapters import make_peft_adapter, peft_greedy

from trtprompt.cli import main
from trtprompt.engine.request import SamplingParams
from trtprompt.lora_build import LoraRequest
from trtprompt.plan import make_plan
from trtprompt.profile import load_profile
from trtprompt.targets.trtllm_config import format_commands, trtllm_build_args, trtllm_build_command

PROMPT = [1, 40, 41, 42, 43, 44, 45]
NEW_TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_peft_adapter(base, root / "a", 4, ["q_proj", "v_proj"], seed=1, scale=0.3),
            "b": make_peft_adapter(base, root / "b", 8, ALL, seed=2, scale=0.3, rslora=True)}


def _build(base: Path, out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["build", str(base), "-o", str(out), "--no-progress", *extra])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def engine_dir(base: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora-engine") / "engine"
    code, output = _build(base, out, "--lora-dir", f"a={adapters['a']}", "--lora-dir", f"b={adapters['b']}",
                          "--max-lora-rank", "16")
    assert code == 0, output
    return out


def test_engine_dir_holds_the_adapters_and_lora_config(engine_dir: Path, adapters: dict[str, Path]) -> None:
    for name in ("a", "b"):
        copied = engine_dir / "lora" / name
        assert sorted(p.name for p in copied.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert (copied / "adapter_model.safetensors").read_bytes() == \
            (adapters[name] / "adapter_model.safetensors").read_bytes()
    build = json.loads((engine_dir / "config.json").read_text())["build_config"]
    assert build["lora_config"] == {
        "lora_dir": ["lora/a", "lora/b"], "lora_ckpt_source": "hf", "max_lora_rank": 16,
        "lora_target_modules": ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate",
                                "mlp_4h_to_h"],
        "trtllm_modules_to_hf_modules": {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                                         "attn_dense": "o_proj", "mlp_h_to_4h": "gate_proj", "mlp_gate": "up_proj",
                                         "mlp_4h_to_h": "down_proj"}}
    assert build["plugin_config"]["lora_plugin"] == "float32"
    meta = json.loads((engine_dir / "trtprompt.json").read_text())
    assert [(a["name"], a["rank"], a["target_modules"], a["source"]) for a in meta["lora"]["adapters"]] == [
        ("a", 4, ["q_proj", "v_proj"], str(adapters["a"])), ("b", 8, ALL, str(adapters["b"]))]


def test_engine_without_adapters_records_max_lora_rank_only(tiny_engine_dir: Path) -> None:
    build = json.loads((tiny_engine_dir / "config.json").read_text())["build_config"]
    assert build["lora_config"] == {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": 64,
                                    "lora_target_modules": [], "trtllm_modules_to_hf_modules": {}}
    assert "lora_plugin" not in build["plugin_config"]
    assert not (tiny_engine_dir / "lora").exists()


def test_engine_serves_each_adapter_as_peft_does(engine_dir: Path, base: Path, adapters: dict[str, Path]) -> None:
    from trtprompt.engine.engine import LLMEngine

    engine = LLMEngine.from_engine_dir(engine_dir, speculative_decoding="none")
    assert sorted(engine.lora.names()) == ["a", "b"]
    assert engine.lora.get("b").rank == 8
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for lora in (None, "a", "b"):
        engine.add_request(str(lora), PROMPT, params, lora=lora)
    got: dict[str, list[int]] = {}
    while engine.requests:
        for out in engine.step():
            assert out.error is None, out.error
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    expected = {str(n): peft_greedy(base, adapters[n] if n else None, PROMPT, NEW_TOKENS) for n in (None, "a", "b")}
    assert got == expected
    assert len({tuple(v) for v in expected.values()}) == 3  # the adapters change the tokens


def test_adapter_of_another_shape_fails_the_build_naming_it(base: Path, adapters: dict[str, Path],
                                                            tiny_checkpoint_factory: Callable[..., Path],
                                                            tmp_path: Path) -> None:
    other = make_peft_adapter(tiny_checkpoint_factory("qwen3"), tmp_path / "q", 4, ["q_proj"], seed=3)
    out = tmp_path / "engine"
    code, output = _build(base, out, "--lora-dir", f"a={adapters['a']}", "--lora-dir", f"qwen={other}")
    assert code != 0
    assert f"--lora-dir qwen={other}: adapter 'qwen': layer 0 q_proj has A (4, 64) and B (128, 4); the base " \
           "model needs A [rank, 64] and B [64, rank]" in output
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "q"]  # nothing written


def test_rank_above_max_lora_rank_fails_the_build_naming_it(base: Path, adapters: dict[str, Path],
                                                            tmp_path: Path) -> None:
    out = tmp_path / "engine"
    code, output = _build(base, out, "--lora-dir", f"a={adapters['a']}", "--lora-dir", f"b={adapters['b']}",
                          "--max-lora-rank", "4")
    assert code != 0
    assert f"--lora-dir b={adapters['b']}: adapter 'b': layer 0 down_proj has rank 8, above max_lora_rank 4" in output
    assert not out.exists()


def test_target_modules_leaving_an_adapters_module_out_fail(base: Path, adapters: dict[str, Path],
                                                            tmp_path: Path) -> None:
    code, output = _build(base, tmp_path / "e", "--lora-dir", f"a={adapters['a']}",
                          "--lora-target-modules", "attn_q", "--dry-run")
    assert code != 0
    assert "adapter 'a' targets attn_v (v_proj), which --lora-target-modules (attn_q) leaves out" in output
    code, output = _build(base, tmp_path / "e", "--lora-dir", f"a={adapters['a']}", "--lora-target-modules",
                          "attn_q", "--lora-target-modules", "attn_v", "--lora-target-modules", "mlp_4h_to_h",
                          "--dry-run")
    assert code == 0, output
    assert "lora_target_modules  attn_q attn_v mlp_4h_to_h" in output


@pytest.mark.parametrize("value, message", [
    ("a", "--lora-dir 'a': expected NAME=DIR"),
    ("../x=/tmp", "adapter name '../x' must be 1-128 of letters"),
])
def test_bad_lora_dir_values(base: Path, tmp_path: Path, value: str, message: str) -> None:
    code, output = _build(base, tmp_path / "e", "--lora-dir", value, "--dry-run")
    assert code != 0 and message in output
    with pytest.raises(ValueError, match="adapter name\\(s\\) a given more than once"):
        LoraRequest((("a", tmp_path), ("a", tmp_path)))


def test_inspect_lists_the_adapters(engine_dir: Path, adapters: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(engine_dir)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = lines.index("LoRA adapters (loaded at start; serve can add more)")
    assert lines[start + 1].split() == ["a", "rank", "4", "modules", "q_proj", "v_proj", "source",
                                        str(adapters["a"])]
    assert lines[start + 2].split() == ["b", "rank", "8", "modules", *ALL, "source", str(adapters["b"])]
    assert "  max_lora_rank        16" in lines
    data = json.loads(CliRunner().invoke(main, ["inspect", str(engine_dir), "--json"]).output)["lora"]
    assert data["lora_plugin"] == "float32" and data["max_lora_rank"] == 16
    assert [a["name"] for a in data["adapters"]] == ["a", "b"]


def test_inspect_without_adapters(tiny_engine_dir: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tiny_engine_dir)])
    assert "  none in the engine directory (build --lora-dir NAME=DIR adds them)" in result.output.splitlines()


LLAMA = dict(architecture="LlamaForCausalLM", vocab_size=768, hidden_size=64, intermediate_size=128,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_size=16,
             max_position_embeddings=32768, rotary_scaling=None, tie_word_embeddings=False,
             attn_bias=False, qk_layernorm=False, hidden_act="silu")


def test_trtllm_command_carries_the_lora_flags(adapters: dict[str, Path]) -> None:
    lora = LoraRequest((("a", adapters["a"]), ("b", adapters["b"])))
    plan = make_plan(LLAMA, load_profile("chat").with_overrides(max_lora_rank=32), "trtllm", "bfloat16", lora=lora)
    args = trtllm_build_args(plan, "LlamaForCausalLM")
    assert args.plugin_config["lora_plugin"] == "auto"
    assert args.lora_config == {"lora_dir": [str(adapters["a"]), str(adapters["b"])], "lora_ckpt_source": "hf",
                                "max_lora_rank": 32, "lora_target_modules": ["attn_q", "attn_k", "attn_v",
                                "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]}
    cmd = trtllm_build_command(args, Path("/c"), Path("/e"))
    assert cmd[cmd.index("--gemm_plugin") + 2:] == [
        "--lora_plugin", "auto", "--lora_dir", str(adapters["a"]), str(adapters["b"]), "--lora_ckpt_source", "hf",
        "--max_lora_rank", "32", "--lora_target_modules", "attn_q", "attn_k", "attn_v", "attn_dense",
        "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]
    text = format_commands(args, Path("/ck"), Path("/e")).replace("\\\n", "")
    (line,) = [line for line in text.splitlines() if line.startswith("trtllm-build")]
    assert shlex.split(line)[-17:] == cmd[cmd.index("--gemm_plugin") + 2:]


def test_trtllm_target_modules_without_adapters_and_none_at_all() -> None:
    lora = LoraRequest(target_modules=("attn_q", "attn_v"))
    args = trtllm_build_args(make_plan(LLAMA, load_profile("chat"), "trtllm", "bfloat16", lora=lora),
                             "LlamaForCausalLM")
    cmd = trtllm_build_command(args, Path("/c"), Path("/e"))
    assert cmd[cmd.index("--gemm_plugin") + 2:] == ["--lora_plugin", "auto", "--max_lora_rank", "64",
                                                    "--lora_target_modules", "attn_q", "attn_v"]
    plain = trtllm_build_args(make_plan(LLAMA, load_profile("chat"), "trtllm", "bfloat16"), "LlamaForCausalLM")
    assert plain.lora_config is None and "lora_plugin" not in plain.plugin_config
    assert not any(c.startswith("--lora") or c == "--max_lora_rank" for c in
                   trtllm_build_command(plain, Path("/c"), Path("/e")))
