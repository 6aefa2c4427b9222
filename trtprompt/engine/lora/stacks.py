"""The resident adapters laid out for one step's batched products, and a plain reference.

Each fused linear of each layer gets two matrices holding every resident adapter's pairs side by
side: A_all [in, C] (the adapters' A stacked, transposed) and B_all [C, out] (their scaled B, each
module's block at its columns of the fused output, zero elsewhere). C is the sum of the resident
adapters' ranks over the linear's modules; no adapter is padded to another's rank. A step then
adds, to the linear's output y for its input x,

    y += ((x @ A_all) * mask) @ B_all

where mask [T, C] is 1 where row t's adapter owns column c: three torch calls per linear, however
many adapters the batch mixes, and none in a step where no row has an adapter. Rows without an
adapter get exact zeros. The stacks are rebuilt only when the resident set changes (manager.py).
`reference_delta` computes the same per row, adapter by adapter, the way PEFT does: tests compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trtprompt.engine.config import ModelConfig
from trtprompt.engine.lora.adapter import LoraAdapter
from trtprompt.engine.lora.modules import GROUPS, module_shapes


@dataclass(frozen=True, eq=False)
class GroupStack:
    """One fused linear's resident pairs: a_t [in, C], b_t [C, out], and the slot owning each column."""

    a_t: torch.Tensor
    b_t: torch.Tensor
    col_slot: torch.Tensor  # [C] long
    layout: tuple[tuple[int, int], ...]  # (slot, columns) in column order: steps share masks by it


def _group_stack(cfg: ModelConfig, layer: int, group: str, slots: Sequence[LoraAdapter | None],
                 dtype: torch.dtype, device: torch.device) -> GroupStack | None:
    shapes = module_shapes(cfg)
    modules = GROUPS[group]
    out_total = sum(shapes[m].out_features for m in modules)
    a_parts: list[torch.Tensor] = []
    b_parts: list[torch.Tensor] = []
    layout: list[tuple[int, int]] = []
    for slot, adapter in enumerate(slots):
        if adapter is None:
            continue
        width = 0
        for m in modules:
            pair = adapter.pairs.get((layer, m))
            if pair is None:
                continue
            a_parts.append(pair.a)
            b = torch.zeros(pair.rank, out_total)
            s = shapes[m]
            b[:, s.out_offset:s.out_offset + s.out_features] = pair.b.t()
            b_parts.append(b)
            width += pair.rank
        if width:
            layout.append((slot, width))
    if not layout:
        return None
    col_slot = torch.cat([torch.full((w,), s, dtype=torch.long) for s, w in layout]).to(device)
    return GroupStack(torch.cat(a_parts).t().contiguous().to(device=device, dtype=dtype),
                      torch.cat(b_parts).contiguous().to(device=device, dtype=dtype), col_slot, tuple(layout))


class LoraStacks:
    """Every (layer, fused linear)'s GroupStack for one resident set (None where no adapter targets it)."""

    def __init__(self, cfg: ModelConfig, slots: Sequence[LoraAdapter | None], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.groups = {(layer, g): _group_stack(cfg, layer, g, slots, dtype, device)
                       for layer in range(cfg.num_hidden_layers) for g in GROUPS}


class LoraStep:
    """One step's batched products: the stacks and each packed row's slot (-1: no adapter)."""

    def __init__(self, stacks: LoraStacks, row_slot: torch.Tensor, dtype: torch.dtype) -> None:
        self.stacks = stacks
        self.row_slot = row_slot
        self.dtype = dtype
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}

    def _mask(self, g: GroupStack) -> torch.Tensor:
        mask = self._masks.get(g.layout)
        if mask is None:  # most layers share a layout: one mask per layout and step
            mask = (self.row_slot[:, None] == g.col_slot[None, :]).to(self.dtype)
            self._masks[g.layout] = mask
        return mask

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """y (the fused linear's output for x, [T, out]) with every row's adapter product added."""
        g = self.stacks.groups[(layer, group)]
        if g is None:
            return y
        xa = torch.mm(x, g.a_t)
        xa.mul_(self._mask(g))
        return y.addmm_(xa, g.b_t)


def reference_delta(x: torch.Tensor, rows: Sequence[tuple[int, int, LoraAdapter | None]], cfg: ModelConfig,
                    layer: int, group: str) -> torch.Tensor:
    """What the adapters add to one fused linear's output, segment by segment and module by module in
    float32 as PEFT computes it: lora_B(lora_A(x)) * scaling (rows: (start, end, adapter))."""
    shapes = module_shapes(cfg)
    modules = GROUPS[group]
    out = torch.zeros(x.shape[0], sum(shapes[m].out_features for m in modules))
    for start, end, adapter in rows:
        for m in modules:
            pair = None if adapter is None else adapter.pairs.get((layer, m))
            if pair is not None:
                s = shapes[m]
                product = (x[start:end].float() @ pair.a.t()) @ pair.b.t()
                out[start:end, s.out_offset:s.out_offset + s.out_features] = product
    return out
