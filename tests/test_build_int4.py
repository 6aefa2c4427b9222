"""`trtprompt build --quantization int4_wo`: what the build writes (packed int4 + a scale per group), what it
records, and what it refuses; and that the engine it makes gives the greedy tokens of its dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from trtprompt import knobs
from trtprompt.build import BuildRequest, run_build
from trtprompt.checkpoint import is_layer_linear, read_checkpoint
from trtprompt.cli import main
from trtprompt.engine.quant_int4 import INT4_GROUP_SIZES, dequantize_int4, group_of
from trtprompt.errors import CheckpointError, PlanError, ProfileError
from trtprompt.plan import make_plan
from trtprompt.profile import Profile

LINEARS_PER_LAYER = 7


def _build(ckpt: Path, out: Path, *args: str) -> Path:
    result = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "--no-progress",
                                       "--quantization", "int4_wo", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _check_engine(ckpt: Path, engine: Path, group: int) -> None:
    src, out = load_file(str(ckpt / "model.safetensors")), load_file(str(engine / "rank0.safetensors"))
    quantized = sorted(n for n in src if is_layer_linear(n))
    assert len(quantized) == 3 * LINEARS_PER_LAYER
    assert set(out) == set(src) | {f"{n}_scale" for n in quantized}
    for name in quantized:
        packed, scale, w = out[name], out[f"{name}_scale"], src[name]
        rows, cols = w.shape
        assert packed.dtype == torch.uint8 and packed.shape == (rows, cols // 2), name
        assert scale.dtype == torch.float32 and scale.shape == (rows, cols // group, 2), name
        assert group_of(packed, scale) == group
        err = (dequantize_int4(packed, scale, torch.float32) - w).abs()
        bound = scale[..., 0].repeat_interleave(group, dim=1) / 2  # half a level of each group's own range
        assert bool((err <= bound + 1e-6).all()), name
        groups = w.reshape(rows, cols // group, group)
        assert torch.equal(scale[..., 1], groups.amin(-1))  # each group's minimum is a level: stored exactly
    for name in set(src) - set(quantized):  # embeddings, norms, lm_head: the engine dtype, untouched
        assert out[name].dtype == torch.float32 and torch.equal(out[name], src[name]), name
    meta = json.loads((engine / "trtprompt.json").read_text())
    assert meta["profile"]["quantization"] == "int4_wo" and meta["profile"]["int4_group_size"] == group
    assert sum(t.numel() * t.element_size() for t in out.values()) == meta["memory_plan"]["weight_bytes"]
    quant = json.loads((engine / "config.json").read_text())["pretrained_config"]["quantization"]
    assert quant == {"quant_algo": "W4A16", "group_size": group, "kv_cache_quant_algo": None}


@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
def test_each_group_size_writes_packed_weights_and_scales(wide_checkpoint: Path, tmp_path: Path, group: int) -> None:
    engine = _build(wide_checkpoint, tmp_path / f"w4g{group}", "--int4-group-size", str(group))
    _check_engine(wide_checkpoint, engine, group)


def test_default_group_on_the_tiny_checkpoint(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = tiny_checkpoint_factory("llama")
    _check_engine(ckpt, _build(ckpt, tmp_path / "w4"), knobs.default("int4_group_size"))


def test_the_knob_and_the_format_agree_on_the_group_sizes() -> None:
    # knobs.py is standard library only, so it declares the tuple the engine's quant_int4 holds.
    assert knobs.INT4_GROUP_SIZES is INT4_GROUP_SIZES and knobs.KNOBS["int4_group_size"].choices == (32, 64, 128)
    assert knobs.default("int4_group_size") == 32


def test_a_group_that_does_not_divide_a_linear_is_refused(tiny_checkpoint_factory: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    req = BuildRequest(tiny_checkpoint_factory("llama"), tmp_path / "bad",
                       overrides={"quantization": "int4_wo", "int4_group_size": 128}, progress=False)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' has "
                                              r"in_features 64, which int4_group_size 128 does not divide"):
        run_build(req)
    assert not (tmp_path / "bad").exists()


def test_a_bad_group_size_is_refused_naming_the_knob(tiny_checkpoint_factory: Callable[..., Path],
                                                     tmp_path: Path) -> None:
    ckpt = tiny_checkpoint_factory("llama")
    result = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(tmp_path / "e"), "--quantization", "int4_wo",
                                       "--int4-group-size", "48"])
    assert result.exit_code != 0 and "Invalid value for '--int4-group-size': '48' is not one of" in result.output
    with pytest.raises(ProfileError, match=r"int4_group_size must be one of 32, 64, 128, got 48"):
        run_build(BuildRequest(ckpt, tmp_path / "e", overrides={"quantization": "int4_wo", "int4_group_size": 48},
                               progress=False))
    with pytest.raises(ValueError, match=r"build\.int4_group_size must be one of 32, 64, 128, got 16"):
        Profile(int4_group_size=16)
    assert not (tmp_path / "e").exists()


def test_the_plan_records_the_group_for_int4_wo_only(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    pc = read_checkpoint(tiny_checkpoint_factory("llama")).pretrained_config
    plan = make_plan(pc, Profile(quantization="int4_wo", int4_group_size=64, max_tokens_in_paged_kv_cache=4096),
                     "torch", "float32")
    assert (plan.quant_algo, plan.int4_group_size) == ("W4A16", 64)
    int8 = make_plan(pc, Profile(quantization="int8_wo", max_tokens_in_paged_kv_cache=4096), "torch", "float32")
    assert int8.int4_group_size is None


def test_trtllm_refuses_int4_wo_and_names_int4_awq(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    pc = read_checkpoint(tiny_checkpoint_factory("llama")).pretrained_config
    with pytest.raises(PlanError, match=r"quantization int4_wo .* is available on the torch target only; on the "
                                        r"trtllm target use int4_awq, TensorRT-LLM's grouped int4 weights with AWQ "
                                        r"calibration"):
        make_plan(pc, Profile(quantization="int4_wo"), "trtllm", "float32")


def test_int4_engine_serves_greedy_tokens_of_its_dequantized_weights(wide_checkpoint: Path, tmp_path: Path) -> None:
    """The built engine on the fast path (int4 kept packed: prefill dense, decode on the few-rows kernel) and
    on the reference backend (dequantized at load) give the same greedy tokens."""
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.linear import WeightOnlyLinear
    from trtprompt.engine.request import SamplingParams

    engine_dir = _build(wide_checkpoint, tmp_path / "e4", "--int4-group-size", "64")
    outputs = []
    for backend in ("onednn", "reference"):
        engine = LLMEngine.from_engine_dir(engine_dir, linear_backend=backend, speculative_decoding="none")
        fast = [m for m in engine.runner.model.modules() if isinstance(m, WeightOnlyLinear)]
        assert len(fast) == (4 * 3 if backend == "onednn" else 0)  # qkv, o, gate_up, down per layer
        for i, prompt in enumerate(([5, 9, 2, 7, 11], [3, 4, 5, 6, 7, 8, 9, 10, 12])):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        done: dict[str, list[int]] = {"r0": [], "r1": []}
        while engine.requests:
            for out in engine.step():
                done[out.request_id] += out.new_token_ids
        outputs.append(done)
    assert outputs[0] == outputs[1] and all(len(t) == 8 for t in outputs[0].values())
