"""`trtprompt build --quantization int8_wo --quantize-lm-head`: lm_head in int8 too, a scale per vocabulary row,
from the embedding where the checkpoint ties them (the embedding itself stays float); what it records, what it
refuses, and that the engine runs its head on the weight-only kernels with the dequantized head's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from trtprompt.checkpoint import read_checkpoint
from trtprompt.cli import main
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.linear import WeightOnlyLinear, dequantize
from trtprompt.engine.request import SamplingParams
from trtprompt.errors import PlanError
from trtprompt.plan import make_plan
from trtprompt.profile import Profile


def _build(ckpt: Path, out: Path, *args: str) -> Path:
    result = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "--no-progress", "--quantization",
                                       "int8_wo", "--quantize-lm-head", *args])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"], ids=["untied", "tied"])
def test_the_head_is_int8_and_the_engine_runs_it(arch: str, tiny_checkpoint_factory: Callable[..., Path],
                                                 tmp_path: Path) -> None:
    ckpt = tiny_checkpoint_factory(arch)
    src = load_file(str(ckpt / "model.safetensors"))
    tied = json.loads((ckpt / "config.json").read_text()).get("tie_word_embeddings", False)
    assert tied == (arch == "qwen3")
    engine_dir = _build(ckpt, tmp_path / "e")
    out = load_file(str(engine_dir / "rank0.safetensors"))
    q, scale = out["lm_head.weight"], out["lm_head.weight_scale"]
    head = src["model.embed_tokens.weight"] if tied else src["lm_head.weight"]
    assert q.dtype == torch.int8 and q.shape == head.shape and scale.shape == (head.shape[0],)
    assert bool(((head - q.float() * scale[:, None]).abs() <= scale[:, None] / 2 + 1e-6).all())
    assert torch.equal(out["model.embed_tokens.weight"], src["model.embed_tokens.weight"])  # stays float
    meta = json.loads((engine_dir / "trtprompt.json").read_text())
    assert sum(t.numel() * t.element_size() for t in out.values()) == meta["memory_plan"]["weight_bytes"]
    quant = json.loads((engine_dir / "config.json").read_text())["pretrained_config"]["quantization"]
    assert quant["quant_algo"] == "W8A16" and quant["quantize_lm_head"] is True

    x = torch.randn(5, head.shape[1], generator=torch.Generator().manual_seed(0))
    want = F.linear(x, dequantize(q, scale, torch.float32))
    tokens = []
    for backend in ("onednn", "reference"):  # the head kept int8 on the kernels; dequantized at load
        engine = LLMEngine.from_engine_dir(engine_dir, linear_backend=backend, speculative_decoding="none")
        lm_head = engine.runner.model.lm_head
        assert isinstance(lm_head, WeightOnlyLinear) == (backend == "onednn")
        for rows in (1, 2, 5):  # the few-rows kernel at one row; from two rows the panel kernel where it runs
            torch.testing.assert_close(lm_head(x[:rows]), want[:rows], rtol=1e-4, atol=1e-4)
        engine.add_request("r", [5, 9, 2, 7, 11], SamplingParams(max_tokens=8, ignore_eos=True))
        done: list[int] = []
        while engine.requests:
            for step_out in engine.step():
                done += step_out.new_token_ids
        tokens.append(done)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


@pytest.mark.parametrize(("quantization", "target"), [("none", "torch"), ("int8_w8a8", "torch"),
                                                      ("int4_wo", "torch"), ("int8_wo", "trtllm")])
def test_quantize_lm_head_needs_int8_wo_on_the_torch_target(quantization: str, target: str,
                                                            tiny_checkpoint_factory: Callable[..., Path]) -> None:
    pc = read_checkpoint(tiny_checkpoint_factory("llama")).pretrained_config
    profile = Profile(quantization=quantization, quantize_lm_head=True, max_tokens_in_paged_kv_cache=4096)
    with pytest.raises(PlanError, match="quantize_lm_head"):
        make_plan(pc, profile, target, "float32")


def test_the_plan_counts_the_int8_head(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    pc = read_checkpoint(tiny_checkpoint_factory("qwen3")).pretrained_config
    base = Profile(quantization="int8_wo", max_tokens_in_paged_kv_cache=4096)
    plain = make_plan(pc, base, "torch", "float32")
    with_head = make_plan(pc, Profile(quantization="int8_wo", quantize_lm_head=True,
                                      max_tokens_in_paged_kv_cache=4096), "torch", "float32")
    vocab, hidden = pc["vocab_size"], pc["hidden_size"]
    # tied: the float embedding stays, and the int8 copy and its scales come beside it
    assert with_head.memory.weight_bytes - plain.memory.weight_bytes == vocab * hidden + 4 * vocab
    assert with_head.quantize_lm_head and not plain.quantize_lm_head
