"""bf16 linears of a few dozen rows on AMX tiles (csrc/amx_linear.cpp), where the CPU has AMX-BF16.

oneDNN runs its bf16 GEMM on AMX too, but at 1-32 rows its per-call work costs about as much as reading the
weight: SmolLM2's 120 layer linears took 11.7-13.8 ms a step in oneDNN and 7.8-9.4 ms here, and its lm_head
1.4-3.4 against 1.4-1.8 ms (docs/design.md, "AMX linear"). The kernel reads a copy of the weight packed once
into AMX's tile layout; calls of more rows (prefill) stay on oneDNN's prepacked weight. Weight-only int8 and
int4 weights (int8_wo, int4_wo with bf16 activations) are packed the same way and widened to bf16 in cache as
they are read.
"""

from __future__ import annotations

import torch

from trtprompt.engine.kernel_call import AMX, KernelCall, Routed
from trtprompt.engine.quant_int4 import group_of

# Rows a bf16 call runs on AMX; above, oneDNN. SmolLM2's layer linears took 0.66-0.69x oneDNN's time at 1-32
# rows, 0.83-0.91x at 64, 0.93-0.98x at 128 and 1.0-1.12x at 256.
AMX_ROWS_MAX = 64
# Rows an int8 weight-only call runs on AMX: at one row the few-rows kernel streams the int8 weight a little
# faster (4.9 against 5.6 ms for SmolLM2's layer linears); at 8 rows it took 10.3 ms and AMX 5.7, at 32 rows
# 54 against 8.1; past 256 rows dequantizing the weight for a dense GEMM wins (2,048 rows: 255 against 326 ms).
AMX_INT8_ROWS = range(2, 257)
# The same for int4 weights (groups of 32-128 columns). Widening nibbles with their group's scale and minimum
# bounds the kernel at ~9 ms for SmolLM2's layer linears at 1-8 rows (int8: ~6.3); the few-rows kernel took
# 6.3 ms at one row, 7.2 at two, 11.3 at four, 18 at eight, 72 at 32; dense past 256 as for int8.
AMX_INT4_ROWS = range(4, 257)
# The tile shape the packed weight is cut into: 16 output rows x 32 input columns.
TILE_N = 16
TILE_K = 32


def amx_available(dtype: torch.dtype, device: torch.device, out_features: int, in_features: int) -> bool:
    """True when the AMX kernel runs here for a bf16 weight [out_features, in_features] (whole tiles only)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    if out_features % TILE_N or in_features % TILE_K:
        return False
    from trtprompt.engine import kernels  # builds or loads the compiled library once

    if not kernels.compiled_kernel_status()[0] or not hasattr(torch.ops.trtprompt, "amx_bf16_ready"):
        return False
    return bool(torch.ops.trtprompt.amx_bf16_ready())


def float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as the kernel adds it: float32, contiguous (None stays None)."""
    return None if bias is None else bias.float().contiguous()


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as [N / 16, K / 32, 16, 32]: packed[nb, kb, r, 2c + j] = weight[16 nb + c, 32 kb + 2r + j].

    One 1 KB block per (16 output rows, 32 input columns), each the B operand of AMX's bf16 dot product
    (pairs of input columns side by side per output row), in the order the kernel streams them.
    """
    n, k = weight.shape
    tiles = weight.reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K // 2, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(n // TILE_N, k // TILE_K, TILE_K // 2, 2 * TILE_N).contiguous()


def pack_int4_tiles(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 weight (quant_int4.py: uint8 [N, K / 2], (scale, minimum) [N, K / group, 2]) as the kernel reads it:
    (tiles uint8 [N / 16, K / 32, 16, 16], scales float32 [N / 16, K / 32, 2, 16]).

    Tile byte i holds element i of pack_tiles' 512-element tile in its low nibble and element i + 256 in its
    high one; a tile's 32 columns lie in one group (groups are multiples of 32), so each of its 16 output rows
    has one (scale, minimum).
    """
    n, half_k = packed.shape
    k, group = 2 * half_k, group_of(packed, scale)
    p = packed.reshape(n, k // group, group // 2)
    codes = torch.cat((p & 15, p >> 4), dim=-1).reshape(n, k)  # column order, one code per byte
    flat = pack_tiles(codes).reshape(n // TILE_N, k // TILE_K, 2, 256)
    tiles = (flat[:, :, 0] | (flat[:, :, 1] << 4)).reshape(n // TILE_N, k // TILE_K, TILE_N, TILE_N)
    per_tile = scale.float()[:, torch.arange(k // TILE_K) * TILE_K // group]  # [N, K / 32, 2]
    scales = per_tile.reshape(n // TILE_N, TILE_N, k // TILE_K, 2).permute(0, 2, 3, 1)
    return tiles.contiguous(), scales.contiguous()


class AmxLinear(Routed):
    """Calls of at most AMX_ROWS_MAX rows on the AMX kernel over the packed weight; the rest on `dense`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dense: torch.nn.Module) -> None:
        super().__init__()
        self.packed = pack_tiles(weight.contiguous())
        self.bias_f32 = float_bias(bias)
        self.dense = dense

    def route(self, m: int) -> KernelCall | None:
        """AMX tiles to AMX_ROWS_MAX rows, above them the dense linear's route where it has one (oneDNN)."""
        if m <= AMX_ROWS_MAX:
            return KernelCall(AMX, self.packed, None, self.bias_f32)
        return self.dense.kernel_call(m) if isinstance(self.dense, Routed) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = self.kernel_call(x.shape[0]) if x.dim() == 2 and x.dtype == torch.bfloat16 else None
        out: torch.Tensor = self.dense(x) if call is None else call.run(x)
        return out
