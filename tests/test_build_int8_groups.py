"""`trtprompt build --quantization int8_wo --int8-group-size G`: int8 weights with a float32 scale per group of G
input columns (GGUF's Q8_0 layout with 32), lm_head too with --quantize-lm-head; what the build writes and records,
what the plan refuses, and that the kernels and the engine give what the dequantized weights give."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from engine_helpers import run_to_completion
from safetensors.torch import load_file

from trtprompt.checkpoint import is_layer_linear, read_checkpoint
from trtprompt.cli import main
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.linear import WeightOnlyLinear, dequantize
from trtprompt.engine.quant_int4 import INT4_GROUP_SIZES
from trtprompt.engine.quant_w8a8 import dequantize_int8, quantize_int8_groups
from trtprompt.engine.request import SamplingParams
from trtprompt.errors import PlanError
from trtprompt.plan import make_plan
from trtprompt.profile import Profile


def _build(ckpt: Path, out: Path, group: int, *args: str) -> Path:
    result = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "--no-progress", "--quantization",
                                       "int8_wo", "--int8-group-size", str(group), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
def test_each_group_is_rounded_on_its_own_scale(group: int) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(group)) * 0.3
    w[3, :group] *= 100  # one outlier group: its neighbours keep their own, finer scales
    q, scale = quantize_int8_groups(w, group)
    assert q.dtype == torch.int8 and scale.shape == (48, 256 // group)
    assert int(q.abs().max()) == 127
    bound = scale.repeat_interleave(group, dim=1) / 2
    assert bool(((dequantize_int8(q, scale, torch.float32) - w).abs() <= bound + 1e-6).all())
    assert float(scale[3, 0]) > 50 * float(scale[3, 1])
    with pytest.raises(ValueError, match="int8_group_size 96 does not divide the linear's 256 input columns"):
        quantize_int8_groups(w, 96)


@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_equal_the_dequantized_weight(group: int, dtype: torch.dtype) -> None:
    """One row on the few-rows kernel, 2-256 on the panel kernel (where it runs), more dequantized."""
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize_int8_groups(torch.randn(96, 384, generator=gen), group)
    lin = WeightOnlyLinear(q, scale, None, dtype)
    assert lin.group == group and lin.tiles is None  # AMX scales whole rows: never for grouped int8
    want_w = dequantize(q, scale, torch.float32)
    for rows in (1, 2, 5, 8, 33, 300):
        x = torch.randn(rows, 384, generator=gen).to(dtype)
        want = F.linear(x.float(), want_w)
        torch.testing.assert_close(lin(x).float(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=0.2 if dtype == torch.bfloat16 else 1e-4)


def test_the_few_rows_kernel_refuses_a_group_it_has_no_loop_for() -> None:
    from trtprompt.engine import kernels

    if not kernels.compiled_kernel_status()[0]:
        pytest.skip("no compiled kernels here")
    q, scale = torch.zeros(16, 96, dtype=torch.int8), torch.ones(16, 2)
    with pytest.raises(RuntimeError, match=r"int8 group \(48\) must be 32, 64 or 128"):
        torch.ops.trtprompt.few_rows_linear(torch.zeros(1, 96), q, scale, 48)


def test_the_build_writes_grouped_scales_and_the_engine_runs_them(wide_checkpoint: Path, tmp_path: Path) -> None:
    engine_dir = _build(wide_checkpoint, tmp_path / "e", 32, "--quantize-lm-head")
    src, out = load_file(str(wide_checkpoint / "model.safetensors")), load_file(str(engine_dir / "rank0.safetensors"))
    for name in [n for n in src if is_layer_linear(n)] + ["lm_head.weight"]:
        q, scale, w = out[name], out[f"{name}_scale"], src[name]
        assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0], w.shape[1] // 32), name
        assert torch.equal(dequantize_int8(q, scale, torch.float32), dequantize_int8(*quantize_int8_groups(w, 32),
                                                                                     torch.float32)), name
    meta = json.loads((engine_dir / "trtprompt.json").read_text())
    assert meta["profile"]["int8_group_size"] == 32
    assert sum(t.numel() * t.element_size() for t in out.values()) == meta["memory_plan"]["weight_bytes"]
    quant = json.loads((engine_dir / "config.json").read_text())["pretrained_config"]["quantization"]
    assert quant["quant_algo"] == "W8A16" and quant["group_size"] == 32 and quant["quantize_lm_head"] is True

    tokens = []
    for backend in ("onednn", "reference"):  # kept int8 on the kernels; dequantized at load
        engine = LLMEngine.from_engine_dir(engine_dir, linear_backend=backend, speculative_decoding="none")
        fast = [m for m in engine.runner.model.modules() if isinstance(m, WeightOnlyLinear)]
        assert len(fast) == (4 * 3 + 1 if backend == "onednn" else 0)  # qkv, o, gate_up, down per layer; lm_head
        assert all(m.group == 32 for m in fast)
        prompts = {"r0": [5, 9, 2, 7, 11], "r1": [3, 4, 5, 6, 7, 8, 9, 10, 12]}
        tokens.append(run_to_completion(engine, prompts, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert tokens[0] == tokens[1] and all(len(t) == 8 for t in tokens[0].values())


@pytest.mark.parametrize(("quantization", "target"), [("none", "torch"), ("int8_w8a8", "torch"),
                                                      ("int4_wo", "torch"), ("int8_wo", "trtllm")])
def test_int8_group_size_needs_int8_wo_on_the_torch_target(quantization: str, target: str,
                                                           tiny_checkpoint_factory: Callable[..., Path]) -> None:
    pc = read_checkpoint(tiny_checkpoint_factory("llama")).pretrained_config
    profile = Profile(quantization=quantization, int8_group_size=32, max_tokens_in_paged_kv_cache=4096)
    with pytest.raises(PlanError, match=f"int8_group_size 32 groups int8_wo's scales: it needs quantization int8_wo "
                                        f"on the torch target \\(got quantization {quantization} on the {target}"):
        make_plan(pc, profile, target, "float32")


def test_the_plan_counts_a_scale_per_group(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    pc = read_checkpoint(tiny_checkpoint_factory("llama")).pretrained_config
    rows = make_plan(pc, Profile(quantization="int8_wo", max_tokens_in_paged_kv_cache=4096), "torch", "float32")
    groups = make_plan(pc, Profile(quantization="int8_wo", int8_group_size=32, max_tokens_in_paged_kv_cache=4096),
                       "torch", "float32")
    assert groups.int8_group_size == 32 and rows.int8_group_size is None
    h, i, layers = pc["hidden_size"], pc["intermediate_size"], pc["num_hidden_layers"]
    head_dim = pc.get("head_dim") or h // pc["num_attention_heads"]
    q, kv = pc["num_attention_heads"] * head_dim, 2 * pc["num_key_value_heads"] * head_dim
    # a scale per (row, group) instead of one per row, for every layer linear: [out, in] -> out * (in / 32 - 1)
    extra = sum(out * (inp // 32 - 1) for out, inp in ((q, h), (kv, h), (h, q), (2 * i, h), (h, i))) * layers
    assert groups.memory.weight_bytes - rows.memory.weight_bytes == 4 * extra


def test_a_group_that_does_not_divide_a_linear_is_refused(tiny_checkpoint_factory: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    """The tiny checkpoint's linears have 64 input columns: groups of 128 are refused before any weight is read."""
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(tmp_path / "e"),
                                       "--no-progress", "--quantization", "int8_wo", "--int8-group-size", "128"])
    assert result.exit_code != 0
    assert "which int8_group_size 128 does not divide" in result.output + str(result.exception)
    assert not (tmp_path / "e").exists()
