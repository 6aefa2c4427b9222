"""The int8 weight schemes the quality comparison rounds with (bench/scenarios/int8_schemes.py): sym is the
engine's own int8_wo build, asym OpenVINO's per-channel int8 with a zero point; both within half a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_hf_model

from trtprompt.bench.scenarios import int8_schemes
from trtprompt.engine.quant_w8a8 import quantize_int8


def _weight() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(16, 40, generator=gen) * 0.05 + torch.linspace(-0.02, 0.03, 16)[:, None]


def test_sym_is_the_int8_wo_build_dequantized() -> None:
    w = _weight()
    q, scale = quantize_int8(w)
    assert torch.equal(int8_schemes.symmetric(w), q.float() * scale[:, None])
    assert bool(((int8_schemes.symmetric(w) - w).abs() <= scale[:, None] / 2 + 1e-7).all())


def test_asym_is_within_half_a_step_and_exact_on_its_own_grid() -> None:
    w = _weight()
    step = (w.amax(1) - w.amin(1)) / 255
    assert bool(((int8_schemes.asymmetric(w) - w).abs() <= step[:, None] / 2 + 1e-7).all())
    # a row already on 256 levels from its minimum comes back exactly (up to float rounding)
    grid = -0.5 + torch.arange(256, dtype=torch.float32)[None, :] * (1 / 256)
    assert torch.allclose(int8_schemes.asymmetric(grid), grid, atol=1e-6)
    # a skewed row: asym's step is the range / 255, sym's the largest magnitude / 127
    skewed = torch.linspace(0.1, 0.2, 64)[None, :]
    sym_err = (int8_schemes.symmetric(skewed) - skewed).abs().max()
    asym_err = (int8_schemes.asymmetric(skewed) - skewed).abs().max()
    assert asym_err < sym_err / 4


def test_rounded_model_rounds_the_layers_and_an_untied_head_only(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(make_hf_model(tmp_path, "llama", tie_word_embeddings=True)),
                                                dtype=torch.float32).eval()
    for scheme, head in (("sym", False), ("asym+head", True)):
        model = int8_schemes.rounded_model(base, scheme)
        plan = int8_schemes.parse_scheme(scheme)
        rounding = plan.rounding
        assert plan.head == head and plan.act_group is None
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        assert torch.equal(q_proj, rounding(base.model.layers[0].self_attn.q_proj.weight))
        assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
        want = rounding(base.lm_head.weight) if head else base.lm_head.weight
        assert torch.equal(model.lm_head.weight, want)
        assert (model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()) == head
    with pytest.raises(ValueError, match=r"'int4\+head' is not sym or asym"):
        int8_schemes.parse_scheme("int4+head")
    for bad in ("sym+a0", "sym+a32+a64", "sym+head+head", "sym+b32"):
        with pytest.raises(ValueError, match="is not sym or asym"):
            int8_schemes.parse_scheme(bad)


def test_activations_in_groups_round_each_run_of_columns_to_int8_on_its_own_scale(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hook = int8_schemes.activations_in_groups(4)
    x = torch.tensor([[1.0, -0.5, 0.25, 0.126, 100.0, 1.0, -1.0, 0.3]])
    (got,) = hook(torch.nn.Identity(), (x,))
    first, second = 1.0 / 127, 100.0 / 127  # each run of 4 on its own scale: the large value does not swamp the first
    want = torch.tensor([[round(v / first) * first for v in (1.0, -0.5, 0.25, 0.126)]
                         + [round(v / second) * second for v in (100.0, 1.0, -1.0, 0.3)]])
    assert torch.allclose(got, want, atol=1e-6)
    base = AutoModelForCausalLM.from_pretrained(str(make_hf_model(tmp_path, "llama", tie_word_embeddings=True)),
                                                dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        weights_only = int8_schemes.rounded_model(base, "sym-g32+head")(ids).logits
        with_acts = int8_schemes.rounded_model(base, "sym-g32+head+a32")(ids).logits
    assert int8_schemes.parse_scheme("sym-g32+head+a32").act_group == 32
    assert not torch.equal(weights_only, with_acts)  # the hooks ran
    assert torch.allclose(weights_only, with_acts, atol=0.1 * float(weights_only.abs().max()))


def test_the_int8_scenario_names_grouped_int8_variants() -> None:
    from trtprompt.bench.scenarios.int8 import parse_variant

    grouped = parse_variant("wog32head")
    assert (grouped.quantization, grouped.group, grouped.quantize_lm_head) == ("int8_wo", 32, True)
    assert (parse_variant("wog64").group, parse_variant("wog64").quantize_lm_head) == (64, False)
    assert (parse_variant("wohead").group, parse_variant("wohead").quantize_lm_head) == (None, True)
    assert (parse_variant("int4g64").quantization, parse_variant("int4g64").group) == ("int4_wo", 64)
    with pytest.raises(SystemExit, match="wo\\[gGROUP\\]\\[head\\]"):
        parse_variant("wog")
