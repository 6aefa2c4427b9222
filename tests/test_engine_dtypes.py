"""Built engines in bf16 and with int8 weight-only quantization run through from_engine_dir."""

from __future__ import annotations

import json

import pytest
import torch

from trtprompt.build import BuildRequest, run_build
from trtprompt.engine.attention import SeqSlice, build_attention_metadata
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams

PROMPT = list(range(5, 45))


def build(ckpt, out, **overrides):
    path = run_build(BuildRequest(ckpt, out, "cpu-dev", overrides=overrides, progress=False))
    assert path is not None
    return path


def greedy(engine: LLMEngine, n: int = 12) -> list[int]:
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=n, end_id=0))
    toks: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            toks += out.new_token_ids
    return toks


def prefill_logits(engine: LLMEngine) -> torch.Tensor:
    tpb = engine.kv.tokens_per_block
    meta = build_attention_metadata([SeqSlice(0, len(PROMPT), list(range(-(-len(PROMPT) // tpb))))],
                                    tpb, engine.device)
    with torch.inference_mode():
        return engine.runner.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta,
                                   engine.runner.kv_caches, torch.tensor([len(PROMPT) - 1]))[0]


@pytest.fixture(scope="module")
def fp32_logits(tiny_engine_dir):
    return prefill_logits(LLMEngine.from_engine_dir(tiny_engine_dir))


# compute_dtype bfloat16: bf16 arithmetic on any CPU (unset, one without bf16 instructions widens to float32,
# tests/test_bf16_cpu.py).
@pytest.mark.parametrize("overrides,load,cache_dtype", [
    ({"dtype": "bfloat16"}, {"compute_dtype": "bfloat16"}, torch.bfloat16),
    ({"quantization": "int8_wo"}, {}, torch.float32),
])
def test_reduced_precision_engines_run_and_stay_close(tiny_checkpoint_factory, tmp_path, fp32_logits,
                                                      overrides, load, cache_dtype):
    path = build(tiny_checkpoint_factory("llama"), tmp_path / "eng", **overrides)
    engine = LLMEngine.from_engine_dir(path, **load)
    assert engine.runner.kv_caches[0][0].dtype == cache_dtype
    logits = prefill_logits(engine)
    # The tiny random model's top logits sit within ~0.02 of each other, so
    # argmax may flip under rounding; the logits themselves must stay close.
    assert (logits - fp32_logits).abs().max().item() < 0.5
    assert int(fp32_logits.argmax()) in torch.topk(logits, 5).indices.tolist()
    assert len(greedy(engine)) == 12


def test_engine_without_paged_context_fmha_refuses_chunking_and_reuse(tiny_engine_dir, tmp_path):
    import shutil
    copy = tmp_path / "no-paged-ctx"
    shutil.copytree(tiny_engine_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["build_config"]["plugin_config"]["use_paged_context_fmha"] = False
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="enable_chunked_context needs an engine built with use_paged_context_fmha"):
        LLMEngine.from_engine_dir(copy, enable_chunked_context=True)
    with pytest.raises(ValueError, match="enable_kv_cache_reuse needs"):
        LLMEngine.from_engine_dir(copy, enable_kv_cache_reuse=True)
    # With the flags left to the engine's stored policy, both are simply off.
    engine = LLMEngine.from_engine_dir(copy)
    assert not engine.scheduler_config.enable_chunked_context and not engine.kv.enable_block_reuse


def test_unfinished_or_foreign_engine_dirs_are_refused(tiny_engine_dir, tmp_path):
    import shutil
    from trtprompt.engine.engine_dir import PARTIAL_MARKER
    from trtprompt.errors import EngineDirError
    partial = tmp_path / "partial"
    shutil.copytree(tiny_engine_dir, partial)
    (partial / PARTIAL_MARKER).write_text("")
    with pytest.raises(EngineDirError, match="unfinished build"):
        LLMEngine.from_engine_dir(partial)
    with pytest.raises(EngineDirError, match="does not exist"):
        LLMEngine.from_engine_dir(tmp_path / "missing")
