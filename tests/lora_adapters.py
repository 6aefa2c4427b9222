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
    return make_peft_adapter_with(checkpoint, out, seed, scale, r=rank, lora_alpha=alpha or 2 * rank,
                                  target_modules=list(modules), use_rslora=rslora,
                                  layers_to_transform=None if layers is None else list(layers))


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


def make_peft_adapter_with(checkpoint: Path, out: Path, seed: int, scale: float = 0.05, **lora_config: Any) -> Path:
    """A PEFT adapter of `checkpoint` in `out` with any LoraConfig settings (use_dora, modules_to_save, lm_head
    targets: what an engine must refuse), every LoRA parameter random N(0, scale^2) as make_peft_adapter's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    model.save_pretrained(out)
    return out


def peft_oracle_model(checkpoint: Path, adapters: dict[str, Path]) -> Any:
    """transformers' model of checkpoint with every adapter loaded into one PeftModel (unmerged), by name."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for i, (name, path) in enumerate(adapters.items()):
        if i == 0:
            model = PeftModel.from_pretrained(model, path, adapter_name=name).eval()
        else:
            model.load_adapter(path, adapter_name=name)
    return model


def peft_greedy_on(model: Any, jobs: Sequence[tuple[str | None, Sequence[int]]], max_new_tokens: int,
                   **generate: Any) -> list[list[list[int]]]:
    """Each (adapter name or None: the base model, prompt) job's generated sequences on a peft_oracle_model
    (greedy unless `generate` says otherwise: num_beams, ...). The end tokens do not stop generation unless
    `generate` names eos_token_id (the engine's ignore_eos), so greedy answers have max_new_tokens tokens.
    Jobs of one adapter and one prompt length run as one batch (no padding: nothing changes but speed)."""
    import contextlib

    import torch

    batches: dict[tuple[str | None, int], list[int]] = {}
    for i, (name, prompt) in enumerate(jobs):
        batches.setdefault((name, len(prompt)), []).append(i)
    per_prompt = int(generate.get("num_return_sequences", 1))
    results: list[list[list[int]]] = [[] for _ in jobs]
    with torch.no_grad():
        for (name, length), members in batches.items():
            ids = torch.tensor([list(jobs[i][1]) for i in members])
            kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": None, "pad_token_id": 0,
                      "attention_mask": torch.ones_like(ids), **generate}
            if name is not None:
                model.set_adapter(name)
            with model.disable_adapter() if name is None and hasattr(model, "disable_adapter") \
                    else contextlib.nullcontext():
                out = model.generate(ids, **kwargs)
            for k, i in enumerate(members):
                results[i] = [[int(t) for t in row[length:]] for row in out[k * per_prompt:(k + 1) * per_prompt]]
    return results


def peft_greedy_jobs(checkpoint: Path, adapters: dict[str, Path], jobs: Sequence[tuple[str | None, Sequence[int]]],
                     max_new_tokens: int) -> list[list[int]]:
    """peft_greedy for many (adapter name or None, prompt) jobs with one base model: every adapter loaded
    into one PeftModel (unmerged) and switched per job, the base through disable_adapter(). The end tokens
    do not stop generation (the engine's ignore_eos), so every answer has max_new_tokens tokens."""
    model = peft_oracle_model(checkpoint, adapters)
    return [seqs[0] for seqs in peft_greedy_on(model, jobs, max_new_tokens)]
