"""A linear's call of m rows on a compiled kernel: what its forward runs, and what a fused decode step
(decode_layers.py) hands to C++ for it.

Each linear that runs a compiled kernel declares once, in `route`, which kernel a call of m rows takes and with
which of its tensors; both paths read that answer, so the fused step runs each linear exactly as its forward does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The kernels a call may take; csrc/decode_layers.cpp switches on these numbers.
PANEL, AMX, FEW_ROWS, ONEDNN = 0, 1, 2, 3
KINDS = (PANEL, AMX, FEW_ROWS, ONEDNN)
# Row counts whose route a linear keeps (a decode step's rows are its sequences). A larger call, a prefill chunk of
# any size, works it out again (~2 us beside the call's milliseconds) and leaves nothing behind.
KEPT_ROUTE_ROWS = 256


@dataclass(frozen=True)
class KernelCall:
    """kind PANEL / AMX: panel_linear / amx_linear(x, weight, scale, bias), bias float32 added in the kernel;
    FEW_ROWS: few_rows_linear(x, weight, scale, group), then `+ bias` in the compute dtype; ONEDNN: oneDNN's
    prepacked GEMM (mkldnn._linear_pointwise) over the packed weight, bias in the compute dtype, no scale."""

    kind: int
    weight: torch.Tensor  # panels, AMX tiles, the plain [out, in] weight, or oneDNN's packed one
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    group: int = 0  # few rows: input columns per scale, 0 for a scale per row (or none)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KernelCall.kind must be one of {KINDS}, got {self.kind}")
        if self.group < 0:
            raise ValueError(f"KernelCall.group must be >= 0, got {self.group}")
        if self.kind == ONEDNN and self.scale is not None:
            raise ValueError("KernelCall.scale must be None for kind ONEDNN (a float weight)")

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """This call on x [m, in] from Python."""
        out: torch.Tensor
        if self.kind == ONEDNN:  # x of any leading dims
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return out
        if self.kind == FEW_ROWS:
            out = torch.ops.trtprompt.few_rows_linear(x.contiguous(), self.weight, self.scale, self.group)
            return out if self.bias is None else out + self.bias
        kernel = torch.ops.trtprompt.panel_linear if self.kind == PANEL else torch.ops.trtprompt.amx_linear
        out = kernel(x.contiguous(), self.weight, self.scale, self.bias)
        return out


class Routed(torch.nn.Module):
    """A linear whose calls of some row counts run a compiled kernel: subclasses say which in `route`; the answer
    for each m up to KEPT_ROUTE_ROWS is kept (a decode step asks it per linear per step)."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[int, KernelCall | None] = {}

    def route(self, m: int) -> KernelCall | None:
        """The kernel call of m rows, or None where the linear runs another path (oneDNN, a dense GEMM)."""
        raise NotImplementedError

    def kernel_call(self, m: int) -> KernelCall | None:
        try:
            return self._calls[m]
        except KeyError:
            call = self.route(m)
            if m <= KEPT_ROUTE_ROWS:
                self._calls[m] = call
            return call
