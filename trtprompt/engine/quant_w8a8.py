"""W8A8 linears: int8 weights per output channel, int8 activations per token, integer GEMM.

y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k] (+ bias[n]): the weight is quantized once
at build (symmetric per output channel), the activation at every call (symmetric per token). The
paths below compute the same integer sums; they differ only in fp32 rounding of the rescale.

- fbgemm: torch's fbgemm int8 GEMM (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`)
  on a weight prepacked once. fbgemm takes one activation scale per call, so each token is first
  divided by its own scale (the call then sees integers and scale 1) and its output multiplied
  back: per-token scales on a per-tensor kernel.
- onednn (where the CPU has AMX int8): oneDNN's int8 GEMM (`onednn::qlinear_pointwise`, AMX tiles) for
  calls of more than FBGEMM_MAX_ROWS rows, on uint8 activations quantized per token by one compiled pass
  (csrc/quantize_rows.cpp) and scaled back by another (scale_rows); fbgemm for fewer rows (decode steps of a
  few sequences, whose changing row counts would each cost oneDNN a new primitive). It holds both packed
  copies. Measured: docs/quantization.md, "W8A8 on AMX".
- reference: the same integers multiplied in floating point, exact while every partial sum stays
  below 2^24 (float64 beyond), then rescaled.

The bit split (W8A8Bits): without AVX-512 VNNI, fbgemm (and oneDNN) multiply unsigned 8-bit
activations (zero point added) by signed 8-bit weights with vpmaddubsw, which saturates each pair
of products at 2^15 - 1. One side gives up a bit so every pair stays below it and the sums are
exact: 8-bit weights with 7-bit activations ([-63, 63], zero point 64: pairs up to 2 x 127 x 127),
or 7-bit weights ([-63, 63]) with 8-bit activations (zero point 128: pairs up to 2 x 255 x 63).
The build chooses and config.json records it (`weight_bits`, `activation_bits`); docs/quantization.md
has the measurements behind these choices.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

W8A8_BACKENDS: tuple[str, ...] = ("onednn", "fbgemm", "reference")
# Rows a call of the onednn backend leaves to fbgemm. With the compiled quantize and rescale, oneDNN was the
# faster from 2 rows up on machine A (AMX; 1.2-1.6x at 4-16 rows, 0.95x at 1), but each new row count costs it a
# primitive (~0.5 ms a linear shape, once), and its cache is bounded (linear.py): decode steps of up to 16
# sequences, whose row count changes every few steps, stay on fbgemm (docs/quantization.md, "W8A8 on AMX").
FBGEMM_MAX_ROWS = 16
# The CPU flag the onednn backend needs: measured faster than fbgemm only with AMX's int8 tiles; without
# VNNI oneDNN's int8 GEMM was slower than fbgemm's (the AVX2 EPYC, docs/quantization.md).
ONEDNN_W8A8_FLAG = "amx_int8"
INT16_MAX = (1 << 15) - 1  # where vpmaddubsw saturates a pair of u8 x s8 products
MIN_SCALE = 1e-12  # an all-zero token quantizes to zeros instead of dividing by zero
FP32_EXACT = 1 << 24  # float32 holds every integer below this exactly
FBGEMM_ENGINES: tuple[str, ...] = ("x86", "fbgemm")


@dataclass(frozen=True)
class W8A8Bits:
    """Bits of the weights and of the activations; symmetric ranges [-(2^(b-1) - 1), 2^(b-1) - 1]."""

    weight_bits: int
    activation_bits: int

    def __post_init__(self) -> None:
        for name in ("weight_bits", "activation_bits"):
            if getattr(self, name) not in (7, 8):
                raise ValueError(f"{name} must be 7 or 8, got {getattr(self, name)!r}")
        if self.pair_max > INT16_MAX:
            raise ValueError(f"weight_bits {self.weight_bits} with activation_bits {self.activation_bits}: a pair of "
                             f"products reaches {self.pair_max} > {INT16_MAX}, where AVX2's vpmaddubsw saturates")

    @property
    def weight_qmax(self) -> int:
        return (1 << (self.weight_bits - 1)) - 1

    @property
    def act_qmax(self) -> int:
        return (1 << (self.activation_bits - 1)) - 1

    @property
    def act_zero_point(self) -> int:
        """Shifts [-act_qmax, act_qmax] into uint8 [1, 2 * act_qmax + 1], what fbgemm's activations are."""
        return self.act_qmax + 1

    @property
    def pair_max(self) -> int:
        """The largest |sum of two u8 x s8 products| fbgemm's inner step can see."""
        return 2 * (2 * self.act_qmax + 1) * self.weight_qmax

    def to_config(self) -> dict[str, int]:
        return {"weight_bits": self.weight_bits, "activation_bits": self.activation_bits}


# Engines built before the split was recorded hold 8-bit weights and ran 7-bit activations.
LEGACY_BITS = W8A8Bits(weight_bits=8, activation_bits=7)
# What `trtprompt build --quantization int8_w8a8` writes: with SmoothQuant, 8-bit activations cost less than
# 8-bit weights (docs/quantization.md, "Quality").
BUILD_BITS = W8A8Bits(weight_bits=7, activation_bits=8)
WEIGHT_QMAX = LEGACY_BITS.weight_qmax  # int8_wo's weights: always 8 bits


def quantize_int8(weight: torch.Tensor, qmax: int = WEIGHT_QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as symmetric per-row int8 in [-qmax, qmax] (the build's, and SmoothQuant's
    alpha search's): w ~= q * scale[:, None], |error| <= scale / 2 per row."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / float(qmax)
    q = torch.round(w / scale[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int8_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_wo with int8_group_size: each run of `group` input columns of a row rounded as quantize_int8 rounds a
    row (GGUF's Q8_0 with 32): (int8 [out, in], float32 scale [out, in / group])."""
    out_f, in_f = weight.shape
    if in_f % group:
        raise ValueError(f"int8_group_size {group} does not divide the linear's {in_f} input columns")
    q, scale = quantize_int8(weight.reshape(-1, group))
    return q.reshape(out_f, in_f), scale.reshape(out_f, in_f // group)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight of int8 [out, in] with its scale per row [out] or per group [out, in / group]."""
    s = scale.float()
    if s.dim() == 1:
        return (q.float() * s[:, None]).to(dtype)
    out_f, groups = s.shape
    return (q.float().reshape(out_f, groups, -1) * s[..., None]).reshape(q.shape).to(dtype)


def bits_of(quantization: Mapping[str, Any] | None) -> W8A8Bits:
    """The split config.json's pretrained_config.quantization records (absent: LEGACY_BITS)."""
    q = quantization or {}
    if "weight_bits" not in q and "activation_bits" not in q:
        return LEGACY_BITS
    try:
        return W8A8Bits(int(q["weight_bits"]), int(q["activation_bits"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json quantization records weight_bits {q.get('weight_bits')!r} and "
                         f"activation_bits {q.get('activation_bits')!r}: {exc}") from exc


def quantize_per_token(x: torch.Tensor, act_qmax: int = LEGACY_BITS.act_qmax) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q float32 holding integers in [-act_qmax, act_qmax], x ~= q * scale, scale [..., 1]."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=MIN_SCALE).div_(act_qmax)
    return torch.round(x / scale).clamp_(-act_qmax, act_qmax), scale


def reference_w8a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, bits: W8A8Bits = LEGACY_BITS) -> torch.Tensor:
    """The W8A8 linear in plain torch: x [..., in] float, qweight int8 [out, in], scale float32 [out]."""
    q, s = quantize_per_token(x, bits.act_qmax)
    exact = qweight.shape[1] * bits.weight_qmax * bits.act_qmax < FP32_EXACT
    acc_dtype = torch.float32 if exact else torch.float64
    acc = torch.matmul(q.to(acc_dtype), qweight.to(acc_dtype).t())
    y = (acc * scale.to(acc_dtype)).float() * s
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check_weight_range(qweight: torch.Tensor, bits: W8A8Bits) -> None:
    """Refuse weights outside the recorded split: on fbgemm they could saturate, silently."""
    top = int(qweight.abs().max()) if qweight.numel() else 0
    if top > bits.weight_qmax:
        raise ValueError(f"int8 weights reach |{top}| but the engine records weight_bits {bits.weight_bits} "
                         f"(|q| <= {bits.weight_qmax}); config.json and the weights disagree: rebuild the engine")


class ReferenceW8A8Linear(torch.nn.Module):
    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 bits: W8A8Bits = LEGACY_BITS) -> None:
        super().__init__()
        self.qweight, self.scale, self.bias, self.bits = qweight, scale.float(), bias, bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_w8a8(x, self.qweight, self.scale, self.bias, self.bits)


def _prepack(qweight: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # torch deprecates quantized tensors (pytorch issue 184982); fbgemm's prepack still takes one.
        warnings.simplefilter("ignore", UserWarning)
        qt = torch._make_per_channel_quantized_tensor(qweight.contiguous(), scale.double(), zero_points, 0)
        packed: torch.ScriptObject = torch.ops.quantized.linear_prepack(qt, None)
    return packed


class FbgemmW8A8Linear(torch.nn.Module):
    """Holds only the prepacked int8 weight (fbgemm's copy), not the checkpoint's."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 bits: W8A8Bits = LEGACY_BITS) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.packed = _prepack(qweight, scale)
        self.bias, self.bits = bias, bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        s = x2.abs().amax(dim=-1, keepdim=True).clamp_(min=MIN_SCALE).div_(self.bits.act_qmax)
        # Rounded here: fbgemm's own input conversion does not round the same way on every shape (M=32,
        # K=1536 differed); no clamp, |x / s| <= act_qmax already. Three passes over the activations, not six.
        y: torch.Tensor = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            torch.div(x2, s).round_(), 1.0, self.bits.act_zero_point, self.packed)
        y = y.mul_(s) if self.bias is None else torch.addcmul(self.bias, y, s)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _compiled() -> bool:
    from trtprompt.engine import kernels

    return kernels.compiled_kernel_status()[0]


def quantize_rows_u8(x: torch.Tensor, bits: W8A8Bits) -> tuple[torch.Tensor, torch.Tensor]:
    """(q uint8 [M, K], scale [M, 1]): quantize_per_token's integers plus the zero point, in one compiled pass
    where the kernels run (bit-identical), else in torch."""
    if _compiled():
        q, s = torch.ops.trtprompt.quantize_rows(x.contiguous(), bits.act_qmax, bits.act_zero_point, MIN_SCALE)
        return q, s
    qf, s = quantize_per_token(x, bits.act_qmax)
    return qf.add_(bits.act_zero_point).to(torch.uint8), s


def rescale_rows(y: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(y [M, N] float32 * s [M, 1] (+ bias)) as dtype: one compiled pass where the kernels run (bit-identical
    without a bias; with one, within an ulp of float32), else torch's mul_ (or addcmul) and cast."""
    if _compiled():
        out: torch.Tensor = torch.ops.trtprompt.scale_rows(y, s, bias, dtype)
        return out
    return (y.mul_(s) if bias is None else torch.addcmul(bias, y, s)).to(dtype)


class OneDnnW8A8Linear(torch.nn.Module):
    """oneDNN's int8 GEMM (AMX) above FBGEMM_MAX_ROWS rows, fbgemm at or below: both packed copies."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 bits: W8A8Bits = LEGACY_BITS) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.few_rows = FbgemmW8A8Linear(qweight, scale, bias, bits)
        # The input shape oneDNN packs the weight for: a hint (any row count runs on it); past FBGEMM_MAX_ROWS.
        self.packed = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), [FBGEMM_MAX_ROWS * 2, self.in_features])
        self.scale = scale.float().contiguous()
        self.zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.bias = None if bias is None else bias.float().contiguous()
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= FBGEMM_MAX_ROWS:
            few: torch.Tensor = self.few_rows(x)
            return few
        q, s = quantize_rows_u8(x2, self.bits)
        y: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, self.bits.act_zero_point, self.packed, self.scale, self.zero_points, None, 1.0, 0,
            torch.float32, "none", [], "")
        return rescale_rows(y, s, self.bias, x.dtype).reshape(*x.shape[:-1], self.out_features)


def _probe_inputs(bits: W8A8Bits, rows: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(qweight, scale, x of `rows` rows): random values, and the worst case for saturation (every product at
    its largest)."""
    gen = torch.Generator().manual_seed(0)
    q = bits.weight_qmax
    qweight = torch.randint(-q, q + 1, (24, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(24, generator=gen) + 0.5
    worst = torch.full((24, 64), q, dtype=torch.int8)
    worst[1::2] = -q
    return [(qweight, scale, torch.randn(rows, 64, generator=gen)), (worst, scale, torch.ones(rows, 64))]


def _probe(name: str, make: Callable[..., torch.nn.Module], bits: W8A8Bits, rows: int) -> str | None:
    """Why the int8 linear `make` builds cannot serve here (None: it runs and matches the reference on probes)."""
    for qweight, scale, x in _probe_inputs(bits, rows):
        try:
            y = make(qweight, scale, None, bits)(x)
        except RuntimeError as exc:
            return f"{name}'s int8 linear failed: {str(exc).strip().splitlines()[0][:200]}"
        if not torch.allclose(y, reference_w8a8(x, qweight, scale, None, bits), rtol=1e-5, atol=1e-4):
            return f"{name}'s int8 linear disagrees with the reference on a probe"
    return None


@functools.lru_cache(maxsize=None)
def onednn_unavailable_reason(bits: W8A8Bits = LEGACY_BITS) -> str | None:
    """Why the onednn backend is not chosen here (None: the CPU has AMX int8 and it matches the reference on
    probes of more than FBGEMM_MAX_ROWS rows)."""
    from trtprompt.engine import isa

    if ONEDNN_W8A8_FLAG not in isa.cpu_flags():
        return f"the CPU lacks {ONEDNN_W8A8_FLAG}"
    return _probe("oneDNN", OneDnnW8A8Linear, bits, FBGEMM_MAX_ROWS + 3)


@functools.lru_cache(maxsize=None)
def fbgemm_unavailable_reason(bits: W8A8Bits = LEGACY_BITS) -> str | None:
    """Why the fbgemm path cannot run here at this split (None: it runs and matches the reference on probes)."""
    engine = torch.backends.quantized.engine
    if engine not in FBGEMM_ENGINES:
        return (f"torch's quantized engine is {engine!r} (supported here: "
                f"{', '.join(torch.backends.quantized.supported_engines)}), not fbgemm or x86")
    return _probe("fbgemm", FbgemmW8A8Linear, bits, 5)


def resolve_w8a8_backend(linear_backend: str, bits: W8A8Bits = LEGACY_BITS) -> str:
    """The W8A8 kernel for an already resolved linear backend: on the onednn linear backend (the fast CPU
    path), oneDNN's int8 GEMM where the CPU has AMX int8 and it passes its probes, else fbgemm."""
    if linear_backend == "reference":
        return "reference"
    why = fbgemm_unavailable_reason(bits)
    if why is not None:
        raise ValueError(f"W8A8 linears (quantization int8_w8a8) need torch's fbgemm int8 GEMM, which cannot "
                         f"run here: {why}. Load the engine with linear_backend='reference' to run the "
                         "pure-torch int8 path instead (slower), or build with --quantization int8_wo")
    return "onednn" if onednn_unavailable_reason(bits) is None else "fbgemm"


def make_w8a8_linear(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     backend: str, bits: W8A8Bits = LEGACY_BITS) -> torch.nn.Module:
    if backend not in W8A8_BACKENDS:
        raise ValueError(f"W8A8 backend must be one of {', '.join(W8A8_BACKENDS)}, got {backend!r}")
    check_weight_range(qweight, bits)
    if backend == "onednn":
        return OneDnnW8A8Linear(qweight.cpu(), scale.cpu(), bias, bits)
    if backend == "fbgemm":
        return FbgemmW8A8Linear(qweight.cpu(), scale.cpu(), bias, bits)
    return ReferenceW8A8Linear(qweight, scale, bias, bits)
