"""float32 and int8 weight-only linears of a few dozen rows on the vector FMA units (csrc/panel_linear.cpp).

oneDNN's float32 GEMM is tuned for many rows: on a 2-core AVX2 EPYC it ran SmolLM2's layer linears at ~105
GFLOP/s with 32 rows against ~165 with 2,048, and its per-call work is a share of a one-row call. The kernel
reads a copy of the weight packed once into panels of 2 x the variant's vector width of output columns
([N / P, K, P], streamed in memory order) and multiplies each panel by blocks of up to 6 rows (AVX2) held in
registers. Measured there (docs/design.md, "Panel linear"): the 120 layer linears at 1 / 8 / 32 / 64 rows
in 13-15 / 20-23 / 50 / 85-96 ms against oneDNN's 19-20 / 30-31 / 63-65 / 107-113, and int8 weights at 8 /
32 rows in 12-17 / 42-43 ms against the few-rows kernel's 15-19 / 74-81. Calls of other sizes stay on the
paths they ran before. Only the avx2 variant uses it: the AVX-512 build of the kernel is tested, not yet
measured against oneDNN.
"""

from __future__ import annotations

import torch

from trtprompt.engine.amx_linear import float_bias

# Kernel variants (engine/isa.py) where the kernel was measured faster than oneDNN and the few-rows kernel.
PANEL_VARIANTS = frozenset({"avx2"})
# Rows a float32 layer linear runs on the kernel; above, oneDNN (at 64 rows: 85-96 against 107-113 ms).
PANEL_ROWS_MAX = 64
# The same for lm_head (49,152 x 576 on SmolLM2): 4.7 / 8.1 / 13.3 ms at 1 / 8 / 32 rows against oneDNN's 5.7 /
# 15.3 / 15.8; at 64 rows 31.3 against 28.8.
PANEL_HEAD_ROWS_MAX = 32
# Rows an int8 weight-only call runs on the kernel: one row streams faster on the few-rows kernel (4.7-5.2
# against 5.5-5.8 ms); at 128 / 256 rows it took 212 / 375 ms against dequantizing for a dense GEMM's 257 / 414.
PANEL_INT8_ROWS = range(2, 257)


def panel_width() -> int | None:
    """Output columns per panel in the kernel variant this process runs, or None where the kernel is not used
    (no compiled kernels, or a variant outside PANEL_VARIANTS)."""
    from trtprompt.engine import kernels  # builds or loads the compiled library once

    if not kernels.compiled_kernel_status()[0] or kernels.variant().name not in PANEL_VARIANTS:
        return None
    return int(torch.ops.trtprompt.panel_width())


def panels_fit(weight: torch.Tensor, width: int) -> bool:
    """True when this [N, K] weight on the CPU packs into whole panels of `width` columns."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[0] % width == 0


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """weight [N, K] (float32 or int8) as [N / width, K, width]: panels[p, k, c] = weight[p * width + c, k]."""
    n, k = weight.shape
    return weight.reshape(n // width, width, k).transpose(1, 2).contiguous()


class PanelLinear(torch.nn.Module):
    """A float32 linear: calls of at most `rows_max` rows on the kernel over the packed weight, the rest on
    `dense`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, width: int, rows_max: int,
                 dense: torch.nn.Module) -> None:
        super().__init__()
        self.panels = pack_panels(weight.float(), width)
        self.bias_f32 = float_bias(bias)
        self.rows_max, self.dense = rows_max, dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > self.rows_max or x.dtype != torch.float32:
            out: torch.Tensor = self.dense(x)
            return out
        out = torch.ops.trtprompt.panel_linear(x.contiguous(), self.panels, None, self.bias_f32)
        return out
