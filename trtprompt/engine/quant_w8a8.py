"""W8A8 linears: int8 weights per output channel, int8 activations per token, integer GEMM.

y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k] (+ bias[n]): the weight is quantized once
at build (symmetric per output channel, int8 in [-127, 127]), the activation at every call
(symmetric per token). Both paths below compute the same integer sums; they differ only in fp32
rounding of the rescale.

- fbgemm: torch's fbgemm int8 GEMM (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`)
  on a weight prepacked once. fbgemm takes one activation scale per call, so each token is first
  divided by its own scale (the call then sees integers and scale 1) and its output multiplied
  back: per-token scales on a per-tensor kernel.
- reference: the same integers multiplied in floating point, exact while every partial sum stays
  below 2^24 (float64 beyond), then rescaled.

Activations use 7 bits ([-63, 63]), not 8: without AVX-512 VNNI, fbgemm (and oneDNN) multiply
unsigned 8-bit activations (zero point added) by signed 8-bit weights with vpmaddubsw, which
saturates each pair of products at 2^15 - 1; with the zero point at 64 every pair stays below it
and the sums are exact. docs/quantization.md has the measurements behind these choices.
"""

from __future__ import annotations

import functools
import warnings

import torch

W8A8_BACKENDS: tuple[str, ...] = ("fbgemm", "reference")
WEIGHT_QMAX = 127
ACT_QMAX = 63
ACT_ZERO_POINT = 64  # ACT_QMAX + 1: quantized activations land in [1, 127] as uint8
MIN_SCALE = 1e-12  # an all-zero token quantizes to zeros instead of dividing by zero
FP32_EXACT = 1 << 24  # float32 holds every integer below this exactly
FBGEMM_ENGINES: tuple[str, ...] = ("x86", "fbgemm")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q float32 holding integers in [-ACT_QMAX, ACT_QMAX], x ~= q * scale, scale [..., 1]."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=MIN_SCALE).div_(ACT_QMAX)
    return torch.round(x / scale).clamp_(-ACT_QMAX, ACT_QMAX), scale


def reference_w8a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 linear in plain torch: x [..., in] float, qweight int8 [out, in], scale float32 [out]."""
    q, s = quantize_per_token(x)
    exact = qweight.shape[1] * WEIGHT_QMAX * ACT_QMAX < FP32_EXACT
    acc_dtype = torch.float32 if exact else torch.float64
    acc = torch.matmul(q.to(acc_dtype), qweight.to(acc_dtype).t())
    y = (acc * scale.to(acc_dtype)).float() * s
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class ReferenceW8A8Linear(torch.nn.Module):
    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight, self.scale, self.bias = qweight, scale.float(), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_w8a8(x, self.qweight, self.scale, self.bias)


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

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.packed = _prepack(qweight, scale)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        s = x2.abs().amax(dim=-1, keepdim=True).clamp_(min=MIN_SCALE).div_(ACT_QMAX)
        # Rounded here: fbgemm's own input conversion does not round the same way on every shape (M=32,
        # K=1536 differed); no clamp, |x / s| <= ACT_QMAX already. Three passes over the activations, not six.
        y: torch.Tensor = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            torch.div(x2, s).round_(), 1.0, ACT_ZERO_POINT, self.packed)
        y = y.mul_(s) if self.bias is None else torch.addcmul(self.bias, y, s)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


@functools.lru_cache(maxsize=None)
def fbgemm_unavailable_reason() -> str | None:
    """Why the fbgemm path cannot run here (None: it runs and matches the reference on a probe)."""
    engine = torch.backends.quantized.engine
    if engine not in FBGEMM_ENGINES:
        return (f"torch's quantized engine is {engine!r} (supported here: "
                f"{', '.join(torch.backends.quantized.supported_engines)}), not fbgemm or x86")
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-WEIGHT_QMAX, WEIGHT_QMAX + 1, (24, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(24, generator=gen) + 0.5
    x = torch.randn(5, 64, generator=gen)
    try:
        y = FbgemmW8A8Linear(qweight, scale, None)(x)
    except RuntimeError as exc:
        return f"fbgemm's int8 linear failed: {str(exc).strip().splitlines()[0][:200]}"
    if not torch.allclose(y, reference_w8a8(x, qweight, scale, None), rtol=1e-5, atol=1e-4):
        return "fbgemm's int8 linear disagrees with the reference on a probe"
    return None


def resolve_w8a8_backend(linear_backend: str) -> str:
    """The W8A8 kernel for an already resolved linear backend: onednn (the fast CPU path) -> fbgemm."""
    if linear_backend == "reference":
        return "reference"
    why = fbgemm_unavailable_reason()
    if why is not None:
        raise ValueError(f"W8A8 linears (quantization int8_w8a8) need torch's fbgemm int8 GEMM, which cannot "
                         f"run here: {why}. Load the engine with linear_backend='reference' to run the "
                         "pure-torch int8 path instead (slower), or build with --quantization int8_wo")
    return "fbgemm"


def make_w8a8_linear(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     backend: str) -> torch.nn.Module:
    if backend not in W8A8_BACKENDS:
        raise ValueError(f"W8A8 backend must be one of {', '.join(W8A8_BACKENDS)}, got {backend!r}")
    if backend == "fbgemm":
        return FbgemmW8A8Linear(qweight.cpu(), scale.cpu(), bias)
    return ReferenceW8A8Linear(qweight, scale, bias)
