"""Linear layers: a plain `F.linear` reference and a oneDNN prepacked path.

On our CPUs oneDNN with a weight reordered once into its blocked layout runs
2.4-4.4x faster than torch's default (MKL) path (docs/design.md, "Machines"). It applies only on
CPU for dtypes the CPU's oneDNN supports; everywhere else the reference path
runs. Weight-only int8 (W8A16) and int4 (W4A16) weights stay quantized where the compiled
few-rows kernel runs (csrc/few_rows_linear.cpp): a call of at most FEW_ROWS_MAX rows (a decode step
of a few sequences, where a linear is bound by reading its weight) reads the int8 / int4 bytes once;
a larger call dequantizes the weight into the compute dtype and runs a dense GEMM. Without the
kernel (no compiler) or on the reference backend they are dequantized once at load, as before:
torch's int8 weight-only matmul (`_weight_int8pack_mm`) ran at ~2 GFLOP/s with float32 activations.
W8A8 weights stay int8 and run an int8 GEMM (quant_w8a8.py, docs/quantization.md).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from trtprompt.engine import isa
from trtprompt.engine.amx_linear import (
    AMX_INT4_ROWS,
    AMX_INT8_ROWS,
    AMX_ROWS_MAX,
    AmxLinear,
    amx_available,
    float_bias,
    pack_int4_tiles,
    pack_tiles,
)
from trtprompt.engine.kernel_call import AMX, FEW_ROWS, ONEDNN, PANEL, KernelCall, Routed
from trtprompt.engine.panel_linear import (
    PANEL_INT8_ROWS,
    PanelLinear,
    bf16_panels_fit,
    on_rows,
    pack_panels,
    panel_rows,
    panel_width,
    panels_fit,
)
from trtprompt.engine.quant_int4 import dequantize_int4, group_of
from trtprompt.engine.quant_w8a8 import LEGACY_BITS, W8A8Bits, dequantize_int8, make_w8a8_linear

LINEAR_BACKENDS: tuple[str, ...] = ("onednn", "reference")
# Rows a weight-only call runs on the few-rows kernel (passes of 8); above, the weight is dequantized for a
# dense GEMM. The kernel was the faster of the two at every row count from 1 to 32 on SmolLM2's linears, int8
# and int4 (docs/quantization.md, "Weight-only at run time"); a speculative step's 1 + 16 rows stay on it.
FEW_ROWS_MAX = 32
# Rows a dense (float32 / bfloat16) layer linear runs on the few-rows kernel over a plain copy of its weight
# (DenseFewRowsLinear); above, oneDNN's prepacked GEMM. oneDNN's per-call work is a large share of a call that
# reads ~1 MB: for SmolLM2's 120 layer linears the kernel took 0.49-0.89x oneDNN's time at one to four bf16
# rows (1.0-1.1x at six) and 0.71-0.85x at one to eight float32 rows (0.9-1.06x at ten), on an AVX-512 + AMX
# Xeon (docs/design.md, "Few-rows linear"). The plain copy costs the layer weights' bytes a second time.
DENSE_FEW_ROWS_MAX: dict[torch.dtype, int] = {torch.bfloat16: 4, torch.float32: 8}
# Rows from which a weight-only (int8 / int4) call with bfloat16 activations runs oneDNN's bf16 GEMM over a bf16 copy
# of its dequantized weight, where the CPU has bf16 dot products (avx512_bf16) and the AMX kernel does not run. The
# few-rows and panel kernels multiply in float32 FMAs, half the rate of the bf16 dot product oneDNN uses: on a 2-core
# Zen 4, SmolLM2's 120 int8 (groups of 32) layer linears took 0.44x / 0.55x oneDNN bf16's time at 1 / 2 rows (they
# read half its bytes) but 1.3x at 4 rows and 1.7-2.1x at 8-64 (docs/quantization.md, "Weight-only at run time").
# The copy costs the bf16 weight's bytes beside the quantized ones.
BF16_COPY_ROWS_MIN = 4
# The M a prepacked weight is tuned for; measured insensitive between decode and prefill sizes.
ONEDNN_BATCH_HINT = 32
# Two caches keep an entry per distinct input shape, and the engine's token count changes
# every step: oneDNN's primitive cache (default 1,024 primitives) and, above it, ideep's LRU
# of per-shape computations that torch's _linear_pointwise goes through (LRU_CACHE_CAPACITY,
# default 1,024). Unbounded by use, they made the engine's RSS climb for many rounds of varied
# load (issue 11; docs/benchmarks-history.md "Soak (issue 11)" has the rounds with each cap).
# The caps keep a working set (the few token counts of neighbouring steps) and bound the rest.
# An operator's own values win.
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 256
IDEEP_CACHE_ENV = "LRU_CACHE_CAPACITY"
IDEEP_CACHE_CAPACITY = 64


def cap_primitive_cache() -> None:
    """Set both caches' capacities unless the operator did.

    They are read once, when the process first uses them, so this runs before the engine's
    first oneDNN call (onednn_available); in a process that used oneDNN before, the
    capacities it started with stay.
    """
    os.environ.setdefault(ONEDNN_CACHE_ENV, str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault(IDEEP_CACHE_ENV, str(IDEEP_CACHE_CAPACITY))


def _onednn_dtype_ok(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when prepacked oneDNN linears run, and agree with F.linear, for this dtype/device."""
    cap_primitive_cache()
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not _onednn_dtype_ok(dtype):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    ref = F.linear(x, w)
    return y.dtype == dtype and torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-1)


def bf16_dot_copy(dtype: torch.dtype, device: torch.device) -> bool:
    """True where a weight-only linear computing in `dtype` keeps a bf16 copy for oneDNN (BF16_COPY_ROWS_MIN):
    bf16 activations on a CPU with avx512_bf16 (the AMX kernel, where it runs, comes first). Asked once per linear
    at load, so it does not rerun onednn_available's trial GEMM (~0.5 ms each, 211 times for SmolLM2): weight-only
    linears exist only on the onednn backend, which resolve_backend checked for this dtype once."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and "avx512_bf16" in isa.cpu_flags())


def resolve_backend(backend: str, dtype: torch.dtype, device: torch.device) -> str:
    """The backend that will really run: 'onednn' falls back to 'reference' where it cannot."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}")
    if backend == "onednn" and not onednn_available(dtype, device):
        return "reference"
    return backend


class DenseLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDnnLinear(Routed):
    """oneDNN's GEMM over the weight reordered once into its blocked layout, for calls of any rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT)
        self.bias = bias
        self.dense_call = KernelCall(ONEDNN, self.packed, None, bias)

    def route(self, m: int) -> KernelCall | None:
        return self.dense_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_call.run(x)


class DenseFewRowsLinear(OneDnnLinear):
    """oneDNN prepacked, and calls of at most `few_rows_max` rows on the few-rows kernel over the plain weight
    (a decode step of one to a few sequences, where a linear is bound by reading its weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, few_rows_max: int) -> None:
        super().__init__(weight, bias)
        self.weight = weight.contiguous()
        self.few_rows_max = few_rows_max

    def route(self, m: int) -> KernelCall | None:
        return KernelCall(FEW_ROWS, self.weight, None, self.bias) if m <= self.few_rows_max else self.dense_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = self.kernel_call(x.shape[0]) if x.dim() == 2 else self.dense_call
        assert call is not None  # for mypy: every row count has a route here
        return call.run(x)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight of int8 [out, in] + scale [out] or [out, groups], or of packed int4 (uint8) + [out, groups,
    2]."""
    if qweight.dtype == torch.uint8:
        return dequantize_int4(qweight, scale, dtype)
    return dequantize_int8(qweight, scale, dtype)


def few_rows_available(dtype: torch.dtype, device: torch.device, in_features: int) -> bool:
    """True when the compiled few-rows kernel runs here for activations of this dtype and width (a multiple
    of the kernel variant's vector)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    from trtprompt.engine import kernels  # builds or loads the compiled library once

    return kernels.compiled_kernel_status()[0] and in_features % kernels.variant().lanes == 0


class WeightOnlyLinear(Routed):
    """int8 [out, in] + scale [out] or [out, groups], or packed int4 [out, in / 2] + (scale, minimum) [out, groups,
    2], kept quantized. With bf16 activations where AMX runs (amx_linear.py) the weight is also kept in AMX's tile
    layout (its quantized bytes a second time): calls of `amx_rows` rows run there (not grouped int8: the AMX
    kernel scales whole rows). With bf16 activations on a CPU with avx512_bf16 and no AMX tiles, a bf16 copy of the
    dequantized weight runs calls from BF16_COPY_ROWS_MIN rows on oneDNN (bf16_dot_copy)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight, self.scale = qweight.contiguous(), scale.float().contiguous()
        self.int4 = qweight.dtype == torch.uint8
        int8_groups = not self.int4 and scale.dim() == 2
        self.group = 0  # input columns per scale: int4's group, grouped int8's, or 0 for a scale per row
        if self.int4:
            self.group = group_of(qweight, scale)
        elif int8_groups:
            self.group = qweight.shape[1] // scale.shape[1]
        self.bias, self.dtype = bias, dtype
        out_features, in_features = qweight.shape[0], qweight.shape[1] * (2 if self.int4 else 1)
        self.tiles: torch.Tensor | None = None
        self.tile_scale = self.scale  # int8: the row scale; int4: its (scale, minimum) per tile
        self.amx_rows = AMX_INT4_ROWS if self.int4 else AMX_INT8_ROWS
        if not int8_groups and amx_available(dtype, qweight.device, out_features, in_features):
            if self.int4:
                self.tiles, self.tile_scale = pack_int4_tiles(self.qweight, self.scale)
            else:
                self.tiles = pack_tiles(self.qweight)
        width = panel_width()
        self.panels: torch.Tensor | None = None  # int8 where the panel kernel runs and AMX does not
        self.panel_scale = self.scale  # the row scale, or grouped scales packed as the panels are
        if self.tiles is None and not self.int4 and width is not None and panels_fit(qweight, width):
            self.panels = pack_panels(self.qweight, width)
            if int8_groups:
                self.panel_scale = pack_panels(self.scale, width)
        self.bias_f32 = float_bias(bias)
        self.bf16_copy: OneDnnLinear | PanelLinear | None = None
        if self.tiles is None and bf16_dot_copy(dtype, qweight.device):
            self.bf16_copy = bf16_linear(dequantize(self.qweight, self.scale, dtype), bias)

    def route(self, m: int) -> KernelCall | None:
        """AMX tiles (bf16 only: amx_available), the bf16 copy, then the panels, then the few-rows kernel; None:
        dense."""
        if self.tiles is not None and m in self.amx_rows:
            return KernelCall(AMX, self.tiles, self.tile_scale, self.bias_f32)
        if self.bf16_copy is not None and m >= BF16_COPY_ROWS_MIN:
            return self.bf16_copy.kernel_call(m)
        if self.panels is not None and m in PANEL_INT8_ROWS:
            return KernelCall(PANEL, self.panels, self.panel_scale, self.bias_f32)
        if m <= FEW_ROWS_MAX:
            return KernelCall(FEW_ROWS, self.qweight, self.scale, self.bias, self.group)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return on_rows(self.forward, x)
        call = self.kernel_call(x.shape[0])
        if call is not None:
            return call.run(x)
        return F.linear(x, dequantize(self.qweight, self.scale, self.dtype), self.bias)


def bf16_panel_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PanelLinear | None:
    """A bfloat16 weight on bf16 panels, or None where they do not run (bf16_panels_fit)."""
    return PanelLinear(weight, bias, int(torch.ops.trtprompt.panel_width())) if bf16_panels_fit(weight) else None


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> OneDnnLinear | PanelLinear:
    """A bfloat16 weight on bf16 panels where they run, else on oneDNN's prepacked GEMM."""
    panels = bf16_panel_linear(weight, bias)
    return OneDnnLinear(weight, bias) if panels is None else panels


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, backend: str, dtype: torch.dtype,
                scale: torch.Tensor | None = None, w8a8_backend: str | None = None,
                w8a8_bits: W8A8Bits = LEGACY_BITS, few_rows: bool = True) -> torch.nn.Module:
    """A linear for `weight` [out, in] (int8 / packed int4 when `scale` is given) on an already resolved backend.

    int8 weights run the W8A8 kernel `w8a8_backend` when one is given; weight-only int8 / int4 stay
    quantized on the onednn backend where the few-rows kernel runs, else are dequantized at load. Dense bf16
    weights on the onednn backend run calls of a few dozen rows on AMX where the CPU has it (amx_linear.py),
    float32 ones on the panel kernel where it runs (panel_linear.py; lm_head, `few_rows` False, to a few dozen
    rows, oneDNN above);
    elsewhere dense weights run their fewest rows on the few-rows kernel unless `few_rows` is False (lm_head:
    oneDNN streams its one large weight as fast as that kernel).
    """
    if scale is not None and w8a8_backend is not None:
        return make_w8a8_linear(weight, scale, bias, w8a8_backend, w8a8_bits)
    in_features = weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)
    if scale is not None and backend == "onednn" and few_rows_available(dtype, weight.device, in_features):
        return WeightOnlyLinear(weight, scale, bias, dtype)
    if scale is not None:
        weight = dequantize(weight, scale, dtype)
    if backend != "onednn":
        return DenseLinear(weight, bias)
    if weight.dtype == dtype and amx_available(dtype, weight.device, *weight.shape):
        return AmxLinear(weight, bias, OneDnnLinear(weight, bias))
    panels = bf16_panel_linear(weight, bias) if weight.dtype == dtype else None
    if panels is not None:  # every call, lm_head's too
        return panels
    rows = panel_rows() if dtype == torch.float32 and weight.dtype == dtype else None
    width = panel_width()  # not None wherever rows is not
    if rows is not None and width is not None and panels_fit(weight, width):
        rows_max = rows.layer_max if few_rows else rows.head_max
        if rows_max is None:
            return PanelLinear(weight, bias, width)
        return PanelLinear(weight, bias, width, OneDnnLinear(weight, bias), rows_max)
    few_rows_max = DENSE_FEW_ROWS_MAX.get(dtype) if few_rows and weight.dtype == dtype else None
    if few_rows_max is not None and few_rows_available(dtype, weight.device, in_features):
        return DenseFewRowsLinear(weight, bias, few_rows_max)
    return OneDnnLinear(weight, bias)


# What each linear class computes with, for the one log line that says what runs (linear_summary).
_LINEAR_KINDS: dict[str, str] = {
    "DenseLinear": "F.linear (reference)",
    "OneDnnLinear": "oneDNN prepacked",
    "DenseFewRowsLinear": "oneDNN prepacked (few-rows kernel <= {few} rows)",
    "PanelLinear": "panel kernel",
    "Bf16PanelLinear": "panel kernel on bf16 dot products",
    "PanelDenseLinear": "oneDNN prepacked (panel kernel <= {few} rows)",
    "AmxLinear": f"oneDNN prepacked (AMX bf16 kernel <= {AMX_ROWS_MAX} rows)",
    "WeightOnlyLinear": f"weight-only kept quantized (few-rows kernel <= {FEW_ROWS_MAX} rows, dense above)",
    "PanelWeightOnly": (f"weight-only kept quantized (panel kernel for {PANEL_INT8_ROWS.start}-"
                        f"{PANEL_INT8_ROWS.stop - 1} rows, the few-rows kernel for fewer, dense above)"),
    "AmxWeightOnly": "weight-only kept quantized (AMX for {amx} rows, the few-rows kernel for fewer, dense above)",
    "Bf16CopyWeightOnly": (f"weight-only kept quantized below {BF16_COPY_ROWS_MIN} rows (the few-rows and panel "
                           f"kernels), a bf16 copy from {BF16_COPY_ROWS_MIN} (" + "{copy})"),
    "FbgemmW8A8Linear": "W8A8 int8 GEMM (fbgemm)",
    "OneDnnW8A8Linear": "W8A8 int8 GEMM (oneDNN with AMX; fbgemm for few rows)",
    "ReferenceW8A8Linear": "W8A8 in plain torch (reference)",
}


def linear_summary(linears: list[torch.nn.Module], dtype: torch.dtype) -> str:
    """`<count> x <what runs>` per kind of linear, with the compute dtype and the weights' stored dtype."""
    counts: dict[str, int] = {}
    copies = 0  # the small-call kernels' weight copies, memory beside the prepacked weights: say how much
    for m in linears:
        held = m.qweight.dtype if isinstance(m, WeightOnlyLinear) else None
        name = _LINEAR_KINDS.get(type(m).__name__, type(m).__name__)
        if isinstance(m, DenseFewRowsLinear):
            name, copies = name.format(few=m.few_rows_max), copies + m.weight.nbytes
        elif isinstance(m, PanelLinear) and m.rows_max is not None:
            name, copies = _LINEAR_KINDS["PanelDenseLinear"].format(few=m.rows_max), copies + m.panels.nbytes
        elif isinstance(m, PanelLinear) and m.panels.dtype == torch.bfloat16:
            name = _LINEAR_KINDS["Bf16PanelLinear"]
        elif isinstance(m, AmxLinear):
            copies += m.packed.nbytes
        elif isinstance(m, WeightOnlyLinear) and m.tiles is not None:
            name = _LINEAR_KINDS["AmxWeightOnly"].format(amx=f"{m.amx_rows.start}-{m.amx_rows.stop - 1}")
            copies += m.tiles.nbytes
        elif isinstance(m, WeightOnlyLinear) and m.bf16_copy is not None:
            what, copy = ("bf16 panels", m.bf16_copy.panels) if isinstance(m.bf16_copy, PanelLinear) else \
                ("oneDNN bf16", m.bf16_copy.packed)
            name = _LINEAR_KINDS["Bf16CopyWeightOnly"].format(copy=what)
            copies += copy.nbytes + (m.panels.nbytes if m.panels is not None else 0)
        elif isinstance(m, WeightOnlyLinear) and m.panels is not None:
            name, copies = _LINEAR_KINDS["PanelWeightOnly"], copies + m.panels.nbytes
        key = f"{name}, {'int4' if held == torch.uint8 else 'int8' if held == torch.int8 else ''}".rstrip(", ")
        counts[key] = counts.get(key, 0) + 1
    parts = ", ".join(f"{n} x {k}" for k, n in counts.items())
    extra = f" (+{copies / 2**20:.0f} MiB of weight copies for the few-rows, AMX and panel kernels)" if copies else ""
    return f"linears in {str(dtype).removeprefix('torch.')}: {parts}{extra}"
