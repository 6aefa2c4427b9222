"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over packed tokens.

No padding: a step's tokens of all sequences form one [T, hidden] batch;
attention is paged (attention.py). q/k/v and gate/up are fused into one GEMM
each. The row-wise ops (RMSNorm, rotary, SiLU * up) come from a LayerOps
(layer_ops.py): transformers' torch expressions, or one compiled op each.
Logits are computed only at the rows asked for, and returned in float32. A pure decode step, or a step of
whole chunks, whose linears all run compiled kernels at its rows runs every layer in one compiled call
(decode_layers.py), the layer loop's result bit for bit.

The layers and their parts call each other's forward, not the modules themselves: nn.Module.__call__ (hook
checks, an extra frame) cost ~5 us a call on a 2-core EPYC, and a decode step makes ~180 of them (a one-request
SmolLM2 decode step took 0.94x the time without: docs/design.md, "Fused layer ops"). No forward hooks run on these
modules; smoothquant.py observes the linears' inputs by wrapping them instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from trtprompt.engine import isa
from trtprompt.engine.attention import (  # noqa: F401  (re-exported: the model's interface)
    AttentionMetadata,
    KvCache,
    SeqSlice,
    allocate_kv_cache,
    build_attention_metadata,
    decode_attention,
    paged_attention,
)
from trtprompt.engine.config import ModelConfig
from trtprompt.engine.decode_layers import DecodeLayers, LayerParts
from trtprompt.engine.greedy_head import GreedyHead
from trtprompt.engine.huge_pages import move_weights
from trtprompt.engine.layer_ops import LayerOps, TorchOps
from trtprompt.engine.linear import linear_summary, make_linear, resolve_backend
from trtprompt.engine.lora.stacks import LoraStep
from trtprompt.engine.quant_w8a8 import LEGACY_BITS, W8A8Bits, bits_of, resolve_w8a8_backend
from trtprompt.engine.rope import RotaryEmbedding
from trtprompt.engine.weights import (
    W4A16,
    W8A8,
    W8A16,
    LinearWeights,
    check_quant_algo,
    fuse_linears,
    take_linear,
    take_tensor,
)

# The engine dtypes' torch types (config.json's dtype names): the target engine and a draft engine load by it.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(torch.nn.Module):
    """transformers' RMSNorm (LayerOps.rms_norm)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, qkv: torch.nn.Module, o_proj: torch.nn.Module,
                 q_norm: RMSNorm | None, k_norm: RMSNorm | None, index: int = 0) -> None:
        super().__init__()
        self.index = index  # its layer's: LoRA pairs are per layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_size = cfg.head_size
        self.scale = cfg.head_size ** -0.5
        self.qkv, self.o_proj = qkv, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        # (q weight, k weight, eps) as the fused decode attention takes them; None: no q/k norms
        self.qk_norms = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None and k_norm is not None \
            else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KvCache, ops: LayerOps,
                lora: LoraStep | None = None) -> torch.Tensor:
        qkv = self.qkv.forward(x)
        if lora is not None:
            qkv = lora.apply(qkv, x, self.index, "qkv")
        fused = decode_attention(qkv, cos, sin, kv_cache, meta, self.num_heads, self.scale,
                                 self.qk_norms) if ops.fuses_decode else None
        out = self._attend(qkv, cos, sin, meta, kv_cache, ops) if fused is None else fused
        projected: torch.Tensor = self.o_proj.forward(out)
        return projected if lora is None else lora.apply(projected, out, self.index, "o_proj")

    def _attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KvCache, ops: LayerOps) -> torch.Tensor:
        """Op by op: split, (q/k norms,) rotary, KV write and attention -> [T, heads * head_size]."""
        t, d = qkv.shape[0], self.head_size
        q, k, v = torch.split(qkv, [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.view(t, self.num_heads, d)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward(q, ops), self.k_norm.forward(k, ops)
        q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
        return paged_attention(q, k, v, kv_cache, meta, self.scale).reshape(t, self.num_heads * d)


class MLP(torch.nn.Module):
    def __init__(self, gate_up: torch.nn.Module, down: torch.nn.Module, index: int = 0) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.index = index

    def forward(self, x: torch.Tensor, ops: LayerOps, lora: LoraStep | None = None) -> torch.Tensor:
        gate_up: torch.Tensor = self.gate_up.forward(x)
        if lora is not None:
            gate_up = lora.apply(gate_up, x, self.index, "gate_up")
        act = ops.silu_and_mul(gate_up)
        down: torch.Tensor = self.down.forward(act)
        return down if lora is None else lora.apply(down, act, self.index, "down_proj")


class DecoderLayer(torch.nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm) -> None:
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KvCache, ops: LayerOps,
                lora: LoraStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output not yet added): each residual add happens in the op
        that norms its result, the last one in the next layer's (or the final norm's)."""
        x, h = ops.add_rms_norm(x, delta, self.input_norm.weight, self.input_norm.eps)
        attended: torch.Tensor = self.attn.forward(h, cos, sin, meta, kv_cache, ops, lora)
        x, h = ops.add_rms_norm(x, attended, self.post_norm.weight, self.post_norm.eps)
        mixed: torch.Tensor = self.mlp.forward(h, ops, lora)
        return x, mixed


class DecoderModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 linear_backend: str = "onednn") -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        # The backend that really runs: onednn falls back to reference off CPU or for unsupported dtypes.
        self.linear_backend = resolve_backend(linear_backend, dtype, self.device)
        self.rotary = RotaryEmbedding(cfg, self.device)
        self.layers = torch.nn.ModuleList()
        self.embed_tokens: torch.Tensor | None = None
        self.norm: RMSNorm | None = None
        self.lm_head: torch.nn.Module | None = None
        # A float head's int8 screen for rows read only for their argmax (greedy_head.py); None: the head runs
        self.greedy_head: GreedyHead | None = None
        self.w8a8_backend: str | None = None  # the int8 GEMM of W8A8 linears (quant_w8a8.py); None: not W8A8
        self.w8a8_bits = LEGACY_BITS  # their weight / activation bit split (config.json records it)
        self.group_size: int | None = None  # int4 weights' group (W4A16) or grouped int8's (W8A16); None: neither
        self.int4 = False  # the layer linears are packed int4 (W4A16)
        # A pure decode step's layers in one compiled call (decode_layers.py); None: always the layer loop
        self.decode_layers: DecodeLayers | None = None
        self.weight_pages: str | None = None  # where load_weights left the large tensors (huge_pages.py), for the log

    # -- weights -----------------------------------------------------------------

    def _linear(self, lw: LinearWeights) -> torch.nn.Module:
        return make_linear(lw.weight, lw.bias, self.linear_backend, self.dtype, lw.scale, self.w8a8_backend,
                           self.w8a8_bits)

    def _norm(self, tensors: Mapping[str, torch.Tensor], name: str, size: int) -> RMSNorm:
        weight = take_tensor(tensors, name, (size,), self.dtype, self.device)
        return RMSNorm(weight, self.cfg.norm_epsilon)

    def _layer(self, tensors: Mapping[str, torch.Tensor], i: int, quantized: bool) -> DecoderLayer:
        c, p = self.cfg, f"model.layers.{i}."
        d, h = c.head_size, c.hidden_size

        def lin(name: str, out_features: int, in_features: int) -> LinearWeights:
            return take_linear(tensors, p + name, (out_features, in_features), self.dtype, self.device, quantized,
                               self.group_size, self.int4)

        qkv = fuse_linears([lin("self_attn.q_proj", c.num_attention_heads * d, h),
                            lin("self_attn.k_proj", c.num_key_value_heads * d, h),
                            lin("self_attn.v_proj", c.num_key_value_heads * d, h)])
        o_proj = lin("self_attn.o_proj", h, c.num_attention_heads * d)
        q_norm = self._norm(tensors, p + "self_attn.q_norm.weight", d) if c.qk_layernorm else None
        k_norm = self._norm(tensors, p + "self_attn.k_norm.weight", d) if c.qk_layernorm else None
        attn = Attention(c, self._linear(qkv), self._linear(o_proj), q_norm, k_norm, i)
        gate_up = fuse_linears([lin("mlp.gate_proj", c.intermediate_size, h),
                                lin("mlp.up_proj", c.intermediate_size, h)])
        down = lin("mlp.down_proj", h, c.intermediate_size)
        mlp = MLP(self._linear(gate_up), self._linear(down), i)
        return DecoderLayer(attn, mlp, self._norm(tensors, p + "input_layernorm.weight", h),
                            self._norm(tensors, p + "post_attention_layernorm.weight", h))

    def load_weights(self, tensors: Mapping[str, torch.Tensor], quant_algo: str | None = None,
                     w8a8_bits: W8A8Bits = LEGACY_BITS, group_size: int | None = None) -> None:
        """Load HF-named tensors; with a quant_algo the layer linears are int8 + `<name>_scale` (a scale per group
        of group_size input columns where W8A16 has one; W4A16: packed int4 in groups of group_size, which it
        needs)."""
        check_quant_algo(quant_algo)
        if (quant_algo == W4A16 and group_size is None) or (quant_algo not in (W4A16, W8A16) and group_size):
            raise ValueError(f"quant_algo {quant_algo!r} with group_size {group_size!r}: W4A16 needs a group_size "
                             f"(config.json quantization.group_size), {W8A16} may have one, the other algos take "
                             "none")
        c = self.cfg
        quantized = quant_algo is not None
        self.w8a8_bits, self.group_size, self.int4 = w8a8_bits, group_size, quant_algo == W4A16
        self.w8a8_backend = resolve_w8a8_backend(self.linear_backend, w8a8_bits) if quant_algo == W8A8 else None
        embed_shape = (c.vocab_size, c.hidden_size)
        self.embed_tokens = take_tensor(tensors, "model.embed_tokens.weight", embed_shape, self.dtype, self.device)
        self.layers = torch.nn.ModuleList(self._layer(tensors, i, quantized)
                                          for i in range(c.num_hidden_layers))
        self.norm = self._norm(tensors, "model.norm.weight", c.hidden_size)
        self.lm_head, head_weight = self._head(tensors, quant_algo)
        self.greedy_head = None if head_weight is None else GreedyHead.of(head_weight)
        # Before the one-call step takes its references to the tensors.
        self.weight_pages = move_weights(self) if self.device.type == "cpu" else None
        self.decode_layers = self._decode_layers()

    def _decode_layers(self) -> DecodeLayers:
        """The layers as the one-call step reads them; heads, scale and eps are the layers' own (every layer's
        norms share the config's epsilon)."""
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)  # for mypy: ModuleList items are Modules
        return DecodeLayers([self._parts(layer) for layer in self.layers], first.attn.num_heads, first.attn.scale,
                            first.input_norm.eps)

    @staticmethod
    def _parts(layer: torch.nn.Module) -> LayerParts:
        assert isinstance(layer, DecoderLayer)  # for mypy: ModuleList items are Modules
        a, m = layer.attn, layer.mlp
        return LayerParts(layer.input_norm.weight, layer.post_norm.weight,
                          None if a.q_norm is None else a.q_norm.weight, None if a.k_norm is None else a.k_norm.weight,
                          (a.qkv, a.o_proj, m.gate_up, m.down))

    def _head(self, tensors: Mapping[str, torch.Tensor], quant_algo: str | None
              ) -> tuple[torch.nn.Module, torch.Tensor | None]:
        """lm_head: the embedding where tied, else its own weight; int8 + a scale per vocabulary row where the
        engine was built with quantize_lm_head (int8_wo only), whether or not the checkpoint ties them. With it,
        its float weight (None where it is int8)."""
        c, shape = self.cfg, (self.cfg.vocab_size, self.cfg.hidden_size)
        if "lm_head.weight_scale" in tensors:
            if quant_algo != W8A16:
                raise ValueError(f"an int8 lm_head (lm_head.weight_scale) goes with quant_algo {W8A16}, "
                                 f"not {quant_algo!r}")
            lw = take_linear(tensors, "lm_head", shape, self.dtype, self.device, True, self.group_size)
            return make_linear(lw.weight, None, self.linear_backend, self.dtype, lw.scale, few_rows=False), None
        assert self.embed_tokens is not None  # for mypy: load_weights sets it first
        head = self.embed_tokens if c.tie_word_embeddings else take_tensor(tensors, "lm_head.weight", shape,
                                                                           self.dtype, self.device)
        return make_linear(head, None, self.linear_backend, self.dtype, few_rows=False), head

    def compute_summary(self) -> str:
        """What the linears run (engine.py logs it once with the attention path): kinds, counts, dtype."""
        linears: list[torch.nn.Module] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)  # for mypy: ModuleList items are Modules
            linears += [layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down]
        if self.lm_head is not None:
            linears.append(self.lm_head)
        summary = linear_summary(linears, self.dtype)
        if self.greedy_head is not None:
            summary += f"; {self.greedy_head.summary()}"
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            have = [f for f in isa.BF16_FLAGS if f in isa.cpu_flags()]
            summary += f"; the CPU's bf16 instructions: {', '.join(have) if have else 'none (emulated)'}"
        return summary

    # -- forward -----------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KvCache], logits_indices: torch.Tensor,
                ops: LayerOps | None = None, lora: LoraStep | None = None,
                screen_bans: Sequence[list[int]] | None = None) -> torch.Tensor:
        """[len(logits_indices), vocab] float32 logits at the given packed rows (TorchOps by default; lora: the
        step's adapter products, engine/lora/). screen_bans: each row is read for its argmax alone once these
        tokens of it are -inf, so the greedy head may leave -inf for every token that cannot be it
        (greedy_head.py)."""
        ops = TorchOps() if ops is None else ops
        if self.embed_tokens is None or self.norm is None or self.lm_head is None:
            raise RuntimeError("DecoderModel.load_weights must run before forward")
        if input_ids.shape[0] != meta.num_tokens or positions.shape[0] != meta.num_tokens:
            raise ValueError(
                f"input_ids ({input_ids.shape[0]}) and positions ({positions.shape[0]}) must both "
                f"hold the metadata's {meta.num_tokens} tokens"
            )
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model {len(self.layers)}")
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = ops.rotary_tables(*self.rotary.cos_sin(positions, self.dtype))
        fused = self.decode_layers.run(x, cos, sin, meta, kv_caches) \
            if ops.fuses_decode and lora is None and self.decode_layers is not None else None
        delta: torch.Tensor | None = None
        if fused is not None:
            x, delta = fused
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, delta = layer.forward(x, delta, cos, sin, meta, kv_cache, ops, lora)
        if delta is not None:
            delta = delta.index_select(0, logits_indices)
        x = ops.add_rms_norm(x.index_select(0, logits_indices), delta, self.norm.weight, self.norm.eps)[1]
        screened = None if screen_bans is None or self.greedy_head is None else self.greedy_head.logits(x, screen_bans)
        logits: torch.Tensor = self.lm_head.forward(x) if screened is None else screened
        return logits.float()


def load_model_from_safetensors(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                                linear_backend: str, quant_algo: str | None = None,
                                w8a8_bits: W8A8Bits = LEGACY_BITS, group_size: int | None = None) -> DecoderModel:
    from safetensors.torch import load_file

    tensors = load_file(str(path), device="cpu")
    model = DecoderModel(cfg, dtype, device, linear_backend)
    model.load_weights(tensors, quant_algo, w8a8_bits, group_size)
    return model


def load_engine_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                      linear_backend: str, quantization: Mapping[str, Any] | None) -> DecoderModel:
    """The model of an engine whose config.json records `quantization` (its quant_algo, W8A8 bit split,
    int4 or int8 group_size)."""
    q = quantization or {}
    group = q.get("group_size") if q.get("quant_algo") in (W4A16, W8A16) else None
    return load_model_from_safetensors(path, cfg, dtype, device, linear_backend, q.get("quant_algo"), bits_of(q),
                                       None if group is None else int(group))
