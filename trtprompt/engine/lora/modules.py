"""Which linears an adapter may target, and how they map onto the engine's fused linears.

PEFT names a module by its Hugging Face name (q_proj, ...); the engine fuses q/k/v into one linear
and gate/up into another (model.py), so an adapter's products for a fused linear are computed
together and added to that linear's output at each module's columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtprompt.engine.config import ModelConfig

# The engine's linears in forward order, each with the Hugging Face modules it fuses.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
MODULES: tuple[str, ...] = tuple(m for group in GROUPS.values() for m in group)
GROUP_OF: dict[str, str] = {m: g for g, group in GROUPS.items() for m in group}
# TensorRT-LLM's names of the same modules (its lora_target_modules; its hf_modules_to_trtllm_modules mapping).
TRTLLM_NAMES: dict[str, str] = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h",
}


@dataclass(frozen=True)
class ModuleShape:
    """in_features, out_features of one module, and where its output sits in its fused linear's."""

    in_features: int
    out_features: int
    out_offset: int


def module_shapes(cfg: ModelConfig) -> dict[str, ModuleShape]:
    h, d = cfg.hidden_size, cfg.head_size
    q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    return {
        "q_proj": ModuleShape(h, q, 0), "k_proj": ModuleShape(h, kv, q), "v_proj": ModuleShape(h, kv, q + kv),
        "o_proj": ModuleShape(q, h, 0),
        "gate_proj": ModuleShape(h, i, 0), "up_proj": ModuleShape(h, i, i),
        "down_proj": ModuleShape(i, h, 0),
    }
