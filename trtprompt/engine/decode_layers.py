"""A pure decode step's decoder layers in one compiled call (csrc/decode_layers.cpp), or a step of whole chunks'.

DecoderModel runs its layers through this where the step is one new token per sequence, or every row in a chunk of
the prefill kernel's call (prefill chunks, speculative verification rows; no decode row, no shared-prefix group),
on the compiled ops (CompiledOps: the fused decode attention), without LoRA, with float (not int8) KV caches, and
where every layer linear routes a call of the step's rows to a compiled kernel (kernel_call.py); anywhere else the
layer loop runs, and it is the path tests compare this with, bit for bit. The C++ side calls the ops the loop would
call, in its order, so only the ~10 Python calls a layer between them go (docs/design.md, "Fused layer ops").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trtprompt.engine.attention import AttentionMetadata, KvCache
from trtprompt.engine.attention_int8 import Int8KvCache
from trtprompt.engine.kernel_call import KEPT_ROUTE_ROWS, KernelCall, Routed

# The row counts the engine's log line says fuse or not (a decode step's rows are its sequences).
SUMMARY_ROWS = (1, 8, 32, 64, 256)


@dataclass(frozen=True)
class LayerParts:
    """What the fused step reads of one layer (model.py's DecoderLayer, in its order)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    linears: tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, torch.nn.Module]  # qkv, o, gate_up, down

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("LayerParts: q_norm and k_norm go together")


@dataclass(frozen=True)
class StepLinears:
    """The layers' linears as the kernel calls of one row count, flattened as the op takes them."""

    kinds: list[int]
    groups: list[int]
    weights: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]

    @staticmethod
    def of(calls: Sequence[KernelCall]) -> StepLinears:
        return StepLinears([c.kind for c in calls], [c.group for c in calls], [c.weight for c in calls],
                           [c.scale for c in calls], [c.bias for c in calls])


class DecodeLayers:
    """The model's layers as one op call per decode step; `run` answers None where the layer loop must run."""

    def __init__(self, parts: Sequence[LayerParts], heads: int, scale: float, eps: float) -> None:
        if not parts:
            raise ValueError("DecodeLayers needs at least one layer")
        self.parts = tuple(parts)
        self.heads, self.scale, self.eps = heads, scale, eps
        self.norms = [t for p in self.parts for t in (p.input_norm, p.post_norm)]
        self.qk_norms = [t for p in self.parts for t in (p.q_norm, p.k_norm)]
        # Per row count up to KEPT_ROUTE_ROWS, as the linears keep their routes: a decode step asks once per step;
        # a larger step (a prefill chunk of any size) works them out again and leaves nothing behind.
        self._linears: dict[int, StepLinears | None] = {}

    def linears(self, rows: int) -> StepLinears | None:
        """The step's linears at `rows` rows, or None where one of them runs no compiled kernel there."""
        if rows in self._linears:
            return self._linears[rows]
        calls = [lin.kernel_call(rows) if isinstance(lin, Routed) else None for p in self.parts for lin in p.linears]
        got = None if any(c is None for c in calls) else StepLinears.of([c for c in calls if c is not None])
        if rows <= KEPT_ROUTE_ROWS:
            self._linears[rows] = got
        return got

    def summary(self, probes: Sequence[int] = SUMMARY_ROWS) -> str:
        """Which of these row counts run the layers in one call (the engine logs it once)."""
        fuses = {r: self.linears(r) is not None for r in probes}
        fused = [str(r) for r in probes if fuses[r]]
        loop = [str(r) for r in probes if not fuses[r]]
        said = f"{', '.join(fused)} rows: the layers in one compiled call" if fused else "the layer loop"
        return said + (f"; {', '.join(loop)} rows: the layer loop (a linear runs no compiled kernel there)"
                       if fused and loop else "")

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: Sequence[KvCache]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residual stream, last MLP output not yet added) as the layer loop leaves them, from the embeddings x
        [S, hidden] and CompiledOps.rotary_tables' cos/sin; None where the step or a part does not fit."""
        tables, chunks = meta.decode_tables, False
        if tables is None:
            tables, chunks = meta.chunk_tables, True
        if tables is None or isinstance(kv_caches[0], Int8KvCache):
            return None
        lin = self.linears(x.shape[0])
        if lin is None:
            return None
        x, delta = torch.ops.trtprompt.decode_layers(
            x, cos, sin, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], meta.slot_blocks,
            meta.slot_offsets, *tables, chunks, self.heads, self.scale, self.eps, self.norms, self.qk_norms, lin.kinds,
            lin.groups, lin.weights, lin.scales, lin.biases)
        return x, delta
