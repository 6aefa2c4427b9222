"""SmoothQuant for `--quantization int8_w8a8` (torch target): per-channel factors folded into the weights.

W8A8 quantizes each token on its own scale, so a few input channels with large values (the same
channels in every token) leave the many small ones a handful of levels. For a linear y = W x whose
input is made by something scalable per channel, x / s and W * s (columns) give the same y in float
and move part of each outlier into the weight, which is quantized per output row and takes it far
better. With calibration maxima max|X_j| and the weight's column maxima max|W_:,j|,

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)        (SmoothQuant, Xiao et al. 2023)

with one alpha (knob smoothquant_alpha) or, unset, the alpha of ALPHA_GRID that gives each linear of
each layer the smallest W8A8 output error on sampled calibration rows at the build's bit split.

Where 1/s goes, per decoder layer (all exact in float):
- qkv:     input_layernorm's weight (the norm's output is q/k/v's input);
- gate_up: post_attention_layernorm's weight;
- down:    up_proj's rows (down's input is silu(gate) * up, linear in up's output);
- o_proj:  v_proj's rows (attention output is a convex mix of v rows): one factor per v channel, shared
           by the query heads that read that kv head (GQA), from the maxima over those heads.
Every factor comes from the float model's activations and its original weights; norms stay float and
the run-time math is unchanged (TensorRT-LLM's SmoothQuant checkpoint layout). Calibration text: the
project's own corpora shipped in the package (trtprompt/data, the demo tokenizer's training text:
prose, field notes, code, several languages), one sequence per file; nothing is downloaded, and none
of it is the held-out text the quality benchmark scores (docs/quantization.md, "SmoothQuant").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm import tqdm

from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata
from trtprompt.engine.config import ModelConfig
from trtprompt.engine.model import DecoderLayer, DecoderModel
from trtprompt.engine.quant_w8a8 import LEGACY_BITS, W8A8Bits, quantize_int8, reference_w8a8

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CALIBRATION_FILES: tuple[str, ...] = ("corpus_en.txt", "corpus_notes.txt", "corpus_code.txt",
                                      "corpus_multilingual.txt")
SEQ_LEN = 512  # tokens per calibration sequence (fewer where the model's positions end sooner)
TOKENS_PER_BLOCK = 32
MIN_VALUE = 1e-5  # floor of maxima and factors: a dead channel must not divide by zero
KINDS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
# Leading tokens of each calibration sequence left out of the maxima. A model's first position can carry
# activations far above every other token's (attention sinks), and smoothing every token for them coarsens
# the weights; 0 (every token counts) is what was measured (docs/quantization.md, "Quality"), 1 was not.
SKIP_FIRST = 0
# alpha None: each linear of each layer takes the alpha of this grid whose W8A8 output is closest to the float
# output on calibration rows (every SAMPLE_STRIDE-th token), at the build's bit split.
ALPHA_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(2, 10))
SAMPLE_STRIDE = 8
WEIGHTS: Mapping[str, tuple[str, ...]] = MappingProxyType({  # each kind's weights, the input channels they share
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",),
})


@dataclass(frozen=True)
class SmoothQuantRecord:
    """How an engine's factors were made: config.json and trtprompt.json record it."""

    alpha: float | None  # None: searched per linear (per_layer)
    sequences: int
    tokens: int
    source: str
    skipped_first: int = 0  # leading tokens per sequence left out of the maxima
    per_layer: tuple[tuple[float, ...], ...] | None = None  # searched alphas, per layer in KINDS order

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if (self.alpha is None) == (self.per_layer is None):
            raise ValueError("a record holds either one alpha or the searched per-layer alphas")
        if self.sequences < 1 or self.tokens < self.sequences:
            raise ValueError(f"calibration needs at least one token per sequence, got {self.sequences} "
                             f"sequences of {self.tokens} tokens")

    def config_entries(self) -> dict[str, Any]:
        """pretrained_config.quantization keys (TensorRT-LLM's QuantConfig names alpha smoothquant_val)."""
        return {"smoothquant_val": self.alpha} if self.alpha is not None else {}

    def to_json(self) -> dict[str, Any]:
        searched = None if self.per_layer is None else {"grid": list(ALPHA_GRID), "per_layer": [
            dict(zip(KINDS, row)) for row in self.per_layer]}
        return {"alpha": self.alpha, "searched": searched, "smoothed": list(KINDS),
                "calibration": {"source": self.source, "sequences": self.sequences, "tokens": self.tokens,
                                "skipped_first_tokens": self.skipped_first}}


def calibration_sequences(tokenizer_json: Path, seq_len: int) -> list[list[int]]:
    """The first seq_len tokens of each shipped corpus file, as the checkpoint's tokenizer encodes it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    seqs = [tok.encode((DATA_DIR / name).read_text(encoding="utf-8")).ids[:seq_len] for name in CALIBRATION_FILES]
    return [s for s in seqs if s]


def smoothing_factors(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha), both maxima and s floored at MIN_VALUE."""
    a = act_max.float().clamp(min=MIN_VALUE)
    w = weight_max.float().clamp(min=MIN_VALUE)
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=MIN_VALUE)


def per_kv_channel(values: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[heads * head_size] -> [kv_heads * head_size]: the max over the query heads that read each kv head."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    return values.view(cfg.num_key_value_heads, group, cfg.head_size).amax(dim=1).reshape(-1)


def to_query_heads(values: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[kv_heads * head_size] -> [heads * head_size]: each query head takes its kv head's values."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kv = values.view(cfg.num_key_value_heads, 1, cfg.head_size)
    return kv.expand(cfg.num_key_value_heads, group, cfg.head_size).reshape(-1)


# An observer of a linear's input: one whole sequence's prefill, [tokens, channels].
Observer = Callable[[torch.Tensor], None]


def _recorder(store: dict[str, torch.Tensor], kind: str, skip: int) -> Observer:
    def observe(x: torch.Tensor) -> None:
        top = x.detach().reshape(-1, x.shape[-1])[skip:].abs().amax(dim=0).float()
        store[kind] = top if kind not in store else torch.maximum(store[kind], top)
    return observe


def _sampler(store: dict[str, list[torch.Tensor]], kind: str, skip: int) -> Observer:
    def observe(x: torch.Tensor) -> None:
        store.setdefault(kind, []).append(x.detach().reshape(-1, x.shape[-1])[skip::SAMPLE_STRIDE].float().clone())
    return observe


def _prefill(model: DecoderModel, ids: Sequence[int]) -> None:
    blocks = -(-len(ids) // TOKENS_PER_BLOCK)
    caches = allocate_kv_cache(model.cfg, blocks, TOKENS_PER_BLOCK, torch.float32, model.device)
    meta = build_attention_metadata([SeqSlice(0, len(ids), list(range(blocks)))], TOKENS_PER_BLOCK, model.device,
                                    backend="torch")
    model(torch.tensor(ids), torch.arange(len(ids)), meta, caches, torch.tensor([len(ids) - 1]))


def collect_input_maxima(model: DecoderModel, sequences: Sequence[Sequence[int]], progress: bool = True,
                         skip_first: int = 0, samples: list[dict[str, list[torch.Tensor]]] | None = None,
                         ) -> list[dict[str, torch.Tensor]]:
    """Per layer, per kind (KINDS): max |input| of that linear per input channel over the calibration tokens
    (all but each sequence's first skip_first); samples (one dict per layer): every SAMPLE_STRIDE-th input row."""
    if any(len(ids) <= skip_first for ids in sequences):
        raise ValueError(f"every calibration sequence needs more than skip_first={skip_first} tokens")
    maxima: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]
    observed: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (owner, attribute, the linear itself)
    for i, (store, layer) in enumerate(zip(maxima, model.layers)):
        if not isinstance(layer, DecoderLayer):
            raise TypeError(f"calibration observes the engine's DecoderLayer, got {type(layer).__name__}")
        owners = {"qkv": (layer.attn, "qkv"), "o": (layer.attn, "o_proj"), "gate_up": (layer.mlp, "gate_up"),
                  "down": (layer.mlp, "down")}
        for k in KINDS:
            owner, name = owners[k]
            observers = [_recorder(store, k, skip_first)]
            if samples is not None:
                observers.append(_sampler(samples[i], k, skip_first))
            observed.append((owner, name, getattr(owner, name)))
            setattr(owner, name, _Observed(getattr(owner, name), observers))
    try:
        for ids in tqdm(sequences, desc="calibrating (smoothquant)", unit="seq", disable=not progress):
            _prefill(model, ids)
    finally:
        for owner, name, linear in observed:
            setattr(owner, name, linear)
    return maxima


class _Observed(torch.nn.Module):
    """A linear whose inputs the calibration sees: the model calls its linears' forward directly (model.py), so
    forward hooks on them would not run."""

    def __init__(self, linear: torch.nn.Module, observers: list[Observer]) -> None:
        super().__init__()
        self.linear, self.observers = linear, observers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for observe in self.observers:
            observe(x)
        out: torch.Tensor = self.linear.forward(x)
        return out


def _column_max(t: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    return torch.stack([t[n].abs().amax(dim=0) for n in names]).amax(dim=0)


def kind_weight(t: Mapping[str, torch.Tensor], prefix: str, kind: str) -> torch.Tensor:
    """The kind's weights as one [sum(out), in] matrix (as the engine fuses them)."""
    return torch.cat([t[f"{prefix}{name}.weight"] for name in WEIGHTS[kind]])


def kind_factors(t: Mapping[str, torch.Tensor], prefix: str, cfg: ModelConfig, maxima: Mapping[str, torch.Tensor],
                 kind: str, alpha: float) -> torch.Tensor:
    """One kind's factors (o: one per v channel) from the layer's original float weights."""
    weight_max = _column_max(t, [f"{prefix}{name}.weight" for name in WEIGHTS[kind]])
    if kind == "o":
        return smoothing_factors(per_kv_channel(maxima["o"], cfg), per_kv_channel(weight_max, cfg), alpha)
    return smoothing_factors(maxima[kind], weight_max, alpha)


def column_factors(s: torch.Tensor, kind: str, cfg: ModelConfig) -> torch.Tensor:
    """What the kind's weight columns are multiplied by (o: each query head takes its kv head's factors)."""
    return to_query_heads(s, cfg) if kind == "o" else s


def layer_factors(t: Mapping[str, torch.Tensor], prefix: str, cfg: ModelConfig,
                  maxima: Mapping[str, torch.Tensor], alphas: Mapping[str, float]) -> dict[str, torch.Tensor]:
    return {kind: kind_factors(t, prefix, cfg, maxima, kind, alphas[kind]) for kind in KINDS}


def w8a8_error(x: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor, bits: W8A8Bits) -> float:
    """Squared error of the W8A8 linear smoothed by cols against the float one, on rows x."""
    q, scale = quantize_int8(weight * cols, bits.weight_qmax)
    return float((reference_w8a8(x / cols, q, scale, None, bits) - x @ weight.t()).pow(2).sum())


def search_alphas(t: Mapping[str, torch.Tensor], prefix: str, cfg: ModelConfig, maxima: Mapping[str, torch.Tensor],
                  samples: Mapping[str, list[torch.Tensor]], bits: W8A8Bits) -> dict[str, float]:
    """Per kind, the ALPHA_GRID value with the smallest W8A8 output error on the sampled calibration rows."""
    best: dict[str, float] = {}
    for kind in KINDS:
        x, weight = torch.cat(samples[kind]), kind_weight(t, prefix, kind)
        errors = {a: w8a8_error(x, weight, column_factors(kind_factors(t, prefix, cfg, maxima, kind, a), kind, cfg),
                                bits) for a in ALPHA_GRID}
        best[kind] = min(errors, key=lambda a: errors[a])
    return best


def _scale_rows(t: dict[str, torch.Tensor], linear: str, inverse: torch.Tensor) -> None:
    """A producing linear's output channel j (and its bias) times inverse[j]."""
    t[linear + ".weight"] = t[linear + ".weight"] * inverse[:, None]
    if linear + ".bias" in t:
        t[linear + ".bias"] = t[linear + ".bias"] * inverse


def fold_layer(t: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, s: Mapping[str, torch.Tensor]) -> None:
    """Replace the layer's tensors in t (new tensors: the originals may be the checkpoint's memory map)."""
    a, m = prefix + "self_attn.", prefix + "mlp."
    for name in (f"{a}q_proj", f"{a}k_proj", f"{a}v_proj"):
        t[name + ".weight"] = t[name + ".weight"] * s["qkv"]
    t[prefix + "input_layernorm.weight"] = t[prefix + "input_layernorm.weight"] / s["qkv"]
    for name in (m + "gate_proj", m + "up_proj"):
        t[name + ".weight"] = t[name + ".weight"] * s["gate_up"]
    t[prefix + "post_attention_layernorm.weight"] = t[prefix + "post_attention_layernorm.weight"] / s["gate_up"]
    t[m + "down_proj.weight"] = t[m + "down_proj.weight"] * s["down"]
    _scale_rows(t, m + "up_proj", 1.0 / s["down"])
    t[a + "o_proj.weight"] = t[a + "o_proj.weight"] * to_query_heads(s["o"], cfg)
    _scale_rows(t, a + "v_proj", 1.0 / s["o"])


def calibration_model(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> DecoderModel:
    """The float model on the plain torch paths (F.linear, pure-torch attention): nothing compiled at build."""
    model = DecoderModel(cfg, torch.float32, torch.device("cpu"), "reference")
    model.load_weights(tensors)
    return model


def smooth(tensors: Mapping[str, torch.Tensor], pc: Mapping[str, Any], alpha: float | None, tokenizer_json: Path,
           progress: bool = True, bits: W8A8Bits = LEGACY_BITS) -> tuple[dict[str, torch.Tensor], SmoothQuantRecord]:
    """The checkpoint's tensors in float32 with every layer smoothed, and the record of how.
    alpha None: searched per layer and kind over ALPHA_GRID at this bit split."""
    cfg = ModelConfig.from_pretrained_config(pc)
    floats = {name: t.float() for name, t in tensors.items()}
    sequences = calibration_sequences(tokenizer_json, min(SEQ_LEN, cfg.max_position_embeddings))
    if not sequences:
        raise ValueError(f"{tokenizer_json} encodes the calibration text to no tokens")
    skip = SKIP_FIRST
    samples: list[dict[str, list[torch.Tensor]]] | None = None if alpha is not None else [
        {} for _ in range(cfg.num_hidden_layers)]
    maxima = collect_input_maxima(calibration_model(floats, cfg), sequences, progress, skip, samples)
    out, chosen = _smooth_layers(floats, cfg, maxima, alpha, samples, bits, progress)
    source = "trtprompt/data/" + ", ".join(CALIBRATION_FILES) + f" (first {SEQ_LEN} tokens each)"
    return out, SmoothQuantRecord(alpha, len(sequences), sum(map(len, sequences)), source, skip,
                                  None if alpha is not None else chosen)


def _smooth_layers(floats: Mapping[str, torch.Tensor], cfg: ModelConfig, maxima: list[dict[str, torch.Tensor]],
                   alpha: float | None, samples: list[dict[str, list[torch.Tensor]]] | None, bits: W8A8Bits,
                   progress: bool) -> tuple[dict[str, torch.Tensor], tuple[tuple[float, ...], ...]]:
    out, chosen = dict(floats), []
    bar = tqdm(maxima, desc="searching alpha", unit="layer", disable=not progress or alpha is not None)
    for i, layer_max in enumerate(bar):
        prefix = f"model.layers.{i}."
        alphas = dict.fromkeys(KINDS, alpha) if alpha is not None else search_alphas(
            floats, prefix, cfg, layer_max, samples[i] if samples else {}, bits)
        chosen.append(tuple(alphas[k] for k in KINDS))
        fold_layer(out, prefix, cfg, layer_factors(floats, prefix, cfg, layer_max, alphas))
    return out, tuple(chosen)
