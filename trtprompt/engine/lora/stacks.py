"""The resident adapters laid out for one step's batched products, and a plain reference.

Each fused linear of each layer gets every resident adapter's pairs side by side, module by module:
A_all [in, C] (the A matrices, transposed, module-major: all of q_proj's columns, then k_proj's, ...) and,
per module, B_m [C_m, out_m] (its scaled B matrices stacked: no zero rows or columns). C is the sum of the
resident adapters' ranks over the linear's modules; no adapter is padded to another's rank. A decode step
adds, to the linear's output y for its input x,

    xa = (x @ A_all) * mask;   y[:, out_m] += xa[:, C_m] @ B_m   for each module m

where mask [T, C] is 1 where row t's adapter owns column c: a fixed number of torch calls per linear, however
many adapters the batch mixes, and none in a step where no row has an adapter. A step of long prompt chunks
computes each run of rows with its own adapter's columns only (LoraStep). Rows without an adapter get exact
zeros. The stacks are rebuilt only when the resident set changes (manager.py). `reference_delta` computes the
same per row, adapter by adapter, the way PEFT does: tests compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trtprompt.engine.config import ModelConfig
from trtprompt.engine.lora.adapter import LoraAdapter
from trtprompt.engine.lora.modules import GROUPS, ModuleShape, module_shapes


@dataclass(frozen=True, eq=False)
class ModuleBlock:
    """One module's B matrices stacked (module-major rows start..end of the permuted products) and where its
    output sits in the fused linear's."""

    start: int
    end: int
    b: torch.Tensor  # [end - start, out_features]: no zero rows, no zero columns
    out_offset: int
    out_features: int


@dataclass(frozen=True, eq=False)
class SlotView:
    """One resident adapter's share of a GroupStack, made once: its A columns (a view) and its B matrices as one
    [its columns, out] matrix, each module's block at its output columns (zero elsewhere: one product per run
    instead of one per module; an adapter's own zeros are few)."""

    a: torch.Tensor  # [in, its columns]
    b: torch.Tensor  # [its columns, out of the fused linear]


@dataclass(frozen=True, eq=False)
class GroupStack:
    """One fused linear's resident pairs: a_t [in, C] slot-major (each adapter's columns together, for runs),
    `perm` reordering x @ a_t's columns module-major (for the masked path's one B product per module), each
    module's stacked B, the slot owning each slot-major column, and each slot's views."""

    a_t: torch.Tensor
    perm: torch.Tensor  # [C] long: module-major position -> slot-major column
    blocks: tuple[ModuleBlock, ...]
    col_slot: torch.Tensor  # [C] long, slot-major
    layout: tuple[tuple[int, int], ...]  # (slot, columns) in slot-major order: steps share masks by it
    views: dict[int, SlotView]


def _group_stack(cfg: ModelConfig, layer: int, group: str, slots: Sequence[LoraAdapter | None],
                 dtype: torch.dtype, device: torch.device) -> GroupStack | None:
    shapes, modules = module_shapes(cfg), GROUPS[group]
    a_parts: list[torch.Tensor] = []
    layout: list[tuple[int, int]] = []
    cols: dict[tuple[str, int], tuple[int, int]] = {}  # (module, slot) -> slot-major columns
    total = 0  # columns so far
    for slot, adapter in enumerate(slots):
        first = total
        for m in modules:
            pair = None if adapter is None else adapter.pairs.get((layer, m))
            if pair is not None:
                cols[(m, slot)] = (total, total + pair.rank)
                a_parts.append(pair.a)
                total += pair.rank
        if total > first:
            layout.append((slot, total - first))
    if not a_parts:
        return None
    a_t = torch.cat(a_parts).t().contiguous().to(device=device, dtype=dtype)
    blocks, perm, b_rows = _module_blocks(shapes, modules, slots, layer, cols, dtype, device)
    out = sum(shapes[m].out_features for m in modules)
    views = _slot_views(a_t, layout, modules, b_rows, out)
    col_slot = torch.cat([torch.full((w,), s, dtype=torch.long) for s, w in layout]).to(device)
    return GroupStack(a_t, torch.tensor(perm, dtype=torch.long, device=device), tuple(blocks), col_slot,
                      tuple(layout), views)


def _module_blocks(shapes: dict[str, ModuleShape], modules: tuple[str, ...], slots: Sequence[LoraAdapter | None],
                   layer: int, cols: dict[tuple[str, int], tuple[int, int]], dtype: torch.dtype,
                   device: torch.device) -> tuple[list[ModuleBlock], list[int], dict[tuple[str, int], ModuleBlock]]:
    """Each module's stacked B (module-major), the permutation into that order, and each (module, slot)'s B rows
    as a ModuleBlock of its own (a view)."""
    blocks: list[ModuleBlock] = []
    perm: list[int] = []
    b_rows: dict[tuple[str, int], ModuleBlock] = {}
    for m in modules:
        owners = [(slot, a) for slot, a in enumerate(slots) if (m, slot) in cols and a is not None]
        if not owners:
            continue
        b = torch.cat([a.pairs[(layer, m)].b.t() for _, a in owners]).contiguous().to(device=device, dtype=dtype)
        start, row = len(perm), 0
        for slot, _ in owners:
            c0, c1 = cols[(m, slot)]
            perm.extend(range(c0, c1))
            b_rows[(m, slot)] = ModuleBlock(c0, c1, b[row:row + c1 - c0], shapes[m].out_offset, shapes[m].out_features)
            row += c1 - c0
        blocks.append(ModuleBlock(start, len(perm), b, shapes[m].out_offset, shapes[m].out_features))
    return blocks, perm, b_rows


def _slot_views(a_t: torch.Tensor, layout: list[tuple[int, int]], modules: tuple[str, ...],
                b_rows: dict[tuple[str, int], ModuleBlock], out: int) -> dict[int, SlotView]:
    """Each slot's A columns and its B blocks in one matrix."""
    views: dict[int, SlotView] = {}
    first = 0
    for slot, width in layout:
        b_full = a_t.new_zeros(width, out)
        for m in modules:
            b = b_rows.get((m, slot))
            if b is not None:
                b_full[b.start - first:b.end - first, b.out_offset:b.out_offset + b.out_features] = b.b
        views[slot] = SlotView(a_t[:, first:first + width], b_full)
        first += width
    return views


class LoraStacks:
    """Every (layer, fused linear)'s GroupStack for one resident set (None where no adapter targets it)."""

    def __init__(self, cfg: ModelConfig, slots: Sequence[LoraAdapter | None], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.groups = {(layer, g): _group_stack(cfg, layer, g, slots, dtype, device)
                       for layer in range(cfg.num_hidden_layers) for g in GROUPS}


def _add(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor) -> None:
    """y += xa @ b, y in the model's dtype, xa and b in the stacks' (float32 stacks of a bf16 model: the product
    is rounded once, where it is added, as PEFT adds its float32 product)."""
    if y.dtype == b.dtype:
        y.addmm_(xa, b)
    else:
        y.add_(torch.mm(xa, b))


def slot_runs(row_slot: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, last row + 1, slot) of each run of rows with one adapter (rows without one left out)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(row_slot) + 1):
        if i == len(row_slot) or row_slot[i] != row_slot[start]:
            if row_slot[start] >= 0:
                runs.append((start, i, row_slot[start]))
            start = i
    return runs


class LoraStep:
    """One step's products for its packed rows' slots (-1: no adapter), computed one of two ways:

    - by runs (a prompt chunk's rows share one adapter): each run's own pairs, two calls per module and run,
      no work for rows or columns of other adapters;
    - masked (decode: one row per request): every resident column for every row in three calls per linear
      plus one per module (its B product), the products of other adapters zeroed by the mask.
    Runs are chosen when a run averages at least RUN_ROWS rows: then their calls cost less than the masked
    path's wasted products."""

    RUN_ROWS = 16

    def __init__(self, stacks: LoraStacks, row_slot: Sequence[int], device: torch.device,
                 by_runs: bool | None = None) -> None:
        self.stacks = stacks
        self.runs = slot_runs(row_slot)
        lora_rows = sum(e - s for s, e, _ in self.runs)
        self.by_runs = lora_rows >= self.RUN_ROWS * len(self.runs) if by_runs is None else by_runs
        self.row_slot = torch.tensor(list(row_slot), dtype=torch.long, device=device)
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}

    def _mask(self, g: GroupStack) -> torch.Tensor:
        mask = self._masks.get(g.layout)
        if mask is None:  # most layers share a layout: one mask per layout and step
            mask = (self.row_slot[:, None] == g.col_slot[None, :]).to(g.a_t.dtype)
            self._masks[g.layout] = mask
        return mask

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """y (the fused linear's output for x, [T, out]) with every row's adapter product added."""
        g = self.stacks.groups[(layer, group)]
        if g is None:
            return y
        x = x.to(g.a_t.dtype)  # float32 stacks of a bf16 model (LoraManager.step): x in float32
        if self.by_runs:
            return self._by_runs(y, x, g)
        xa = torch.mm(x, g.a_t)
        xa.mul_(self._mask(g))
        xa = xa.index_select(1, g.perm)  # module-major: each module's products side by side
        for b in g.blocks:
            _add(y[:, b.out_offset:b.out_offset + b.out_features], xa[:, b.start:b.end], b.b)
        return y

    def _by_runs(self, y: torch.Tensor, x: torch.Tensor, g: GroupStack) -> torch.Tensor:
        whole = len(self.runs) == 1 and self.runs[0][1] - self.runs[0][0] == x.shape[0]
        for first, last, slot in self.runs:
            view = g.views.get(slot)
            if view is None:
                continue  # this adapter targets none of the linear's modules in this layer
            rows_x, rows_y = (x, y) if whole else (x[first:last], y[first:last])
            _add(rows_y, torch.mm(rows_x, view.a), view.b)
        return y


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
