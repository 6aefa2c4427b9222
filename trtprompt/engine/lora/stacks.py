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
zeros. Where the compiled kernels run (kernels.lora_kernel_lanes), every run goes to csrc/lora_runs.cpp instead:
each run's rows read their adapter's pairs once, in one call per linear, with no products for other adapters.
The stacks are rebuilt only when the resident set changes (manager.py). `reference_delta` computes the same
per row, adapter by adapter, the way PEFT does: tests compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

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
class KernelPairs:
    """One fused linear's pairs as csrc/lora_runs.cpp reads them: every A row slot-major, every B flattened,
    and per pair (slot, first A row, rank, offset in b, out_offset, out_features)."""

    a: torch.Tensor  # [C, in]
    b: torch.Tensor  # 1-D
    pairs: torch.Tensor  # [P, 6] long


@dataclass(frozen=True, eq=False)
class GroupStack:
    """One fused linear's resident pairs: a_t [in, C] slot-major (each adapter's columns together, for runs),
    `perm` reordering x @ a_t's columns module-major (for the masked path's one B product per module), each
    module's stacked B, the slot owning each slot-major column, each slot's views and the kernel's pairs."""

    a_t: torch.Tensor
    perm: torch.Tensor  # [C] long: module-major position -> slot-major column
    blocks: tuple[ModuleBlock, ...]
    col_slot: torch.Tensor  # [C] long, slot-major
    layout: tuple[tuple[int, int], ...]  # (slot, columns) in slot-major order: steps share masks by it
    views: dict[int, SlotView]
    kernel: KernelPairs


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
    a_rows = torch.cat(a_parts).to(device=device, dtype=dtype)
    blocks, perm, b_rows = _module_blocks(shapes, modules, slots, layer, cols, dtype, device)
    out = sum(shapes[m].out_features for m in modules)
    a_t = a_rows.t().contiguous()
    views = _slot_views(a_t, layout, modules, b_rows, out)
    col_slot = torch.cat([torch.full((w,), s, dtype=torch.long) for s, w in layout]).to(device)
    return GroupStack(a_t, torch.tensor(perm, dtype=torch.long, device=device), tuple(blocks), col_slot,
                      tuple(layout), views, _kernel_pairs(a_rows, cols, b_rows))


def _kernel_pairs(a_rows: torch.Tensor, cols: dict[tuple[str, int], tuple[int, int]],
                  b_rows: dict[tuple[str, int], ModuleBlock]) -> KernelPairs:
    fields: list[list[int]] = []
    b_parts: list[torch.Tensor] = []
    offset = 0
    for (m, slot), (c0, c1) in sorted(cols.items(), key=lambda item: item[1]):
        block = b_rows[(m, slot)]
        fields.append([slot, c0, c1 - c0, offset, block.out_offset, block.out_features])
        b_parts.append(block.b.reshape(-1))
        offset += block.b.numel()
    return KernelPairs(a_rows, torch.cat(b_parts), torch.tensor(fields, dtype=torch.long))


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


LoraPath = Literal["masked", "runs", "kernel"]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activations csrc/lora_runs.cpp takes


class LoraStep:
    """One step's products for its packed rows' slots (-1: no adapter), computed along one of three paths:

    - kernel (where the compiled kernels run): csrc/lora_runs.cpp, one call per linear for every run, each run's
      rows reading their own adapter's pairs once and computing no product for another adapter; measured
      faster than torch's paths from 4-row decode runs up, and level with them on float32 512-row prompt
      chunks (docs/lora.md);
    - runs (a prompt chunk's rows share one adapter): each run's own pairs, two torch calls per run and linear;
    - masked (decode rows without the kernel): every resident column for every row in three calls per linear
      plus one per module (its B product), the products of other adapters zeroed by the mask.
    By default (path None) the kernel where it runs; else runs when a run averages at least RUN_ROWS rows (their
    calls then cost less than the masked path's wasted products), the mask otherwise. On the kernel path, a
    linear whose input width is not a multiple of the kernel's vector (or float16 activations) goes by runs."""

    RUN_ROWS = 16

    def __init__(self, stacks: LoraStacks, row_slot: Sequence[int], device: torch.device,
                 path: LoraPath | None = None, kernel_lanes: int | None = None) -> None:
        """kernel_lanes: the kernel's vector width (kernels.lora_kernel_lanes), None where it does not run."""
        if path == "kernel" and kernel_lanes is None:
            raise ValueError("path 'kernel' needs kernel_lanes (the compiled kernels' vector width)")
        self.stacks = stacks
        self.runs = slot_runs(row_slot)
        if path is None:
            path = "kernel" if kernel_lanes is not None else (
                "runs" if sum(e - s for s, e, _ in self.runs) >= self.RUN_ROWS * len(self.runs) else "masked")
        self.path: LoraPath = path
        self.kernel_runs = torch.tensor(self.runs, dtype=torch.long) if path == "kernel" and self.runs else None
        self.lanes = kernel_lanes or 1
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
        if self.kernel_runs is not None and x.shape[1] % self.lanes == 0 and x.dtype in KERNEL_DTYPES:
            k = g.kernel
            torch.ops.trtprompt.lora_runs(y, x, self.kernel_runs, k.a, k.b, k.pairs)
            return y
        x = x.to(g.a_t.dtype)  # float32 stacks of a bf16 model (LoraManager.step): x in float32
        return self._masked(y, x, g) if self.path == "masked" else self._by_runs(y, x, g)

    def _masked(self, y: torch.Tensor, x: torch.Tensor, g: GroupStack) -> torch.Tensor:
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
