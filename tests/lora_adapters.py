"""PEFT adapters made in the tests: random low-rank weights on a base checkpoint, saved by PEFT itself
(adapter_config.json + adapter_model.safetensors), and transformers + PEFT (unmerged) as the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(checkpoint: Path, out: Path, rank: int, modules: Sequence[str], seed: int, scale: float = 0.05,
                      rslora: bool = False, alpha: int | None = None, layers: Sequence[int] | None = None) -> Path:
    """A PEFT LoRA adapter of `checkpoint` in `out`: every lora_A / lora_B random N(0, scale^2) (PEFT's own
    init leaves B zero, which would make every adapter the base model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(modules), use_rslora=rslora,
                        layers_to_transform=None if layers is None else list(layers), init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    model.save_pretrained(out)
    return out


def peft_greedy(checkpoint: Path, adapter: Path | None, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for prompt, with the adapter applied unmerged (PeftModel) or none."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    out = model.eval().generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]
