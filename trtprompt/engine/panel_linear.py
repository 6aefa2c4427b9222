"""float32 and int8 weight-only linears on the vector FMA units, over weights packed into panels
(csrc/panel_linear.cpp).

oneDNN's float32 GEMM is tuned for many rows: on a 2-core AVX2 EPYC it ran SmolLM2's layer linears at ~105
GFLOP/s with 32 rows against ~165 with 2,048, and its per-call work is a share of a one-row call. The kernel
reads the weight packed once into panels of 2 x the variant's vector width of output columns ([N / P, K, P],
streamed in memory order) and multiplies each panel by blocks of up to 6 (AVX2) or 12 (AVX-512) rows held in
registers.
Measured there (docs/design.md, "Panel linear"): the 120 layer linears at 1 / 8 / 32 / 64 rows in 13-15 /
20-23 / 50 / 85-96 ms against oneDNN's 19-20 / 30-31 / 63-65 / 107-113, at 512 and 2,048 rows at or ahead of
oneDNN and MKL, and int8 weights at 8 / 32 rows in 12-17 / 44-49 ms against the few-rows kernel's 15-19 /
74-81. There a float32 layer linear keeps only the packed panels (no oneDNN copy). On a 2-core Zen 4 the
AVX-512 build leads oneDNN by less and only to 64 rows, so there a layer linear keeps oneDNN's weight too, for
larger calls; lm_head keeps oneDNN's on both. PANEL_ROWS has each variant's bounds.

bfloat16 weights run every call on panels of input-column pairs ([N / P, K / 2, P, 2], the operand of avx512_bf16's
dot product, csrc/bf16_panels.cpp) where the AVX-512 build holds that kernel and the CPU has the instruction, and
AMX does not run (amx_linear.py comes first): on a 2-core Zen 4 SmolLM2's layer linears took 0.7x oneDNN's bf16
time at 32 rows and no more at any row count from 1 to 2,048 (docs/design.md, "bf16 panels"); they keep no other
copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from trtprompt.engine import isa
from trtprompt.engine.amx_linear import float_bias
from trtprompt.engine.kernel_call import PANEL, KernelCall, Routed


@dataclass(frozen=True)
class PanelRows:
    """Rows a kernel variant's float32 calls run on the panels; larger calls run oneDNN's prepacked GEMM."""
    layer_max: int | None  # a layer linear's calls; None: every call (the linear keeps no oneDNN copy)
    head_max: int  # lm_head's calls
    screen_max: int  # a greedy step's rows that lm_head's int8 screen runs for (engine/greedy_head.py)

    def __post_init__(self) -> None:
        if self.layer_max is not None and self.layer_max < 1:
            raise ValueError(f"PanelRows.layer_max must be None or >= 1, got {self.layer_max}")
        for name in ("head_max", "screen_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"PanelRows.{name} must be >= 1, got {getattr(self, name)}")


# Kernel variants (engine/isa.py) where the kernel was measured ahead of oneDNN, and up to how many rows.
# avx2 (2-core Zen 3): layer linears at or ahead of oneDNN from 1 to 2,048 rows; lm_head (49,152 x 576) 3.9 /
# 5.8 / 13.2 / 20.4 ms at 1 / 8 / 32 / 48 rows against oneDNN's 4.8 / 6.6 / 14.6 / 21.1, behind from 64.
# avx512 (2-core Zen 4): SmolLM2's 120 layer linears 0.52-0.62x oneDNN's time at 1-8 rows, 0.9-0.97x at 16-64,
# 1.1x at 128; lm_head 0.5-0.7x at 1-8 rows, 1.0-1.17x from 16 (docs/design.md, "Panel linear").
# The greedy screen's steps against the float head's: on Zen 3 0.91 / 0.94 / 0.97x at 1 / 4 / 8 rows, as dear at 16;
# on Zen 4 0.90 / 0.92 / 1.12x at 1 / 4 / 8 (BENCHMARKS.md, "Greedy head", "Zen 4").
PANEL_ROWS: dict[str, PanelRows] = {"avx2": PanelRows(None, 32, 8), "avx512": PanelRows(64, 8, 4)}
# Rows an int8 weight-only call runs on the kernel: one row streams faster on the few-rows kernel (4.7-5.2
# against 5.5-5.8 ms); at 128 / 256 rows it took 212 / 375 ms against dequantizing for a dense GEMM's 257 / 414.
PANEL_INT8_ROWS = range(2, 257)


def panel_rows() -> PanelRows | None:
    """The row bounds of the kernel variant this process runs, or None where the kernel is not used (no compiled
    kernels, or a variant outside PANEL_ROWS)."""
    from trtprompt.engine import kernels  # builds or loads the compiled library once

    if not kernels.compiled_kernel_status()[0]:
        return None
    return PANEL_ROWS.get(kernels.variant().name)


def panel_width() -> int | None:
    """Output columns per panel in the kernel variant this process runs, or None where the kernel is not used."""
    return None if panel_rows() is None else int(torch.ops.trtprompt.panel_width())


def bf16_panels_fit(weight: torch.Tensor) -> bool:
    """True where this weight runs on bf16 panels: bfloat16 [N, K] on the CPU, K even, N whole panels, on the AVX-512
    build that holds the kernel, on a CPU with avx512_bf16."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        return False
    width = panel_width()  # builds or loads the compiled library once
    if width is None or not bool(torch.ops.trtprompt.bf16_panels_compiled()):
        return False
    return panels_fit(weight, width) and "avx512_bf16" in isa.cpu_flags()


def pack_bf16_pairs(weight: torch.Tensor, width: int) -> torch.Tensor:
    """weight [N, K] bfloat16 as [N / width, K / 2, width, 2]: pairs[p, j, c, e] = weight[p * width + c, 2 * j + e]."""
    n, k = weight.shape
    return weight.reshape(n // width, width, k // 2, 2).transpose(1, 2).contiguous()


def panels_fit(weight: torch.Tensor, width: int) -> bool:
    """True when this [N, K] weight on the CPU packs into whole panels of `width` columns."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[0] % width == 0


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """weight [N, K] (float32 or int8) as [N / width, K, width]: panels[p, k, c] = weight[p * width + c, k]."""
    n, k = weight.shape
    return weight.reshape(n // width, width, k).transpose(1, 2).contiguous()


def on_rows(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """forward of x [..., in] folded to rows [-1, in], its output unfolded to x's leading dims. The model passes
    [T, in] itself, and a linear calls this only for other shapes: a reshape and a view cost ~3 us a call at
    batch 1."""
    out = forward(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


class PanelLinear(Routed):
    """A float32 linear on the kernel over the packed weight, or a bfloat16 one over its pairs (bf16_panels_fit); with
    a `dense` linear, calls of more than `rows_max` rows run there instead (lm_head)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, width: int,
                 dense: torch.nn.Module | None = None, rows_max: int | None = None) -> None:
        super().__init__()
        if (dense is None) != (rows_max is None):
            raise ValueError("PanelLinear: dense and rows_max go together (calls above rows_max run on dense)")
        self.panels = pack_bf16_pairs(weight, width) if weight.dtype == torch.bfloat16 else \
            pack_panels(weight.float(), width)
        self.bias_f32 = float_bias(bias)
        self.dense, self.rows_max = dense, rows_max

    def route(self, m: int) -> KernelCall | None:
        if self.rows_max is not None and m > self.rows_max:
            return None
        return KernelCall(PANEL, self.panels, None, self.bias_f32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return on_rows(self.forward, x)
        call = self.kernel_call(x.shape[0])
        if call is not None:
            return call.run(x)
        assert self.dense is not None  # for mypy: route answers None only where rows_max (and dense) are set
        dense: torch.Tensor = self.dense.forward(x)
        return dense
