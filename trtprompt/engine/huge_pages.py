"""The model's large tensors moved onto transparent huge pages (Linux), once, after the weights are loaded.

Why (docs/design.md, "Weights on huge pages"): a decode step of a few rows streams every weight once, and on
4 KiB pages each page is a TLB miss and a stop for the hardware prefetchers, which do not cross a page. Moved
into 2 MiB pages, SmolLM2's 120 layer linears and lm_head at one row ran in 0.91x the time on a 2-core Zen 3
(float32, 538 MB a step), and a one-request decode step in 0.92x.

glibc serves torch's large allocations from mmap and the host's THP setting here is `madvise`, so a tensor gets
huge pages only from memory advised with MADV_HUGEPAGE before it is touched: each tensor is copied into such a
mapping and the module's attribute pointed at the copy. Tensors share a few slabs (SLAB_BYTES), so the waste is at
most a partly filled huge page per slab, and the copies go one tensor at a time (each original is freed as its
attribute moves), so loading needs at most one tensor's bytes more.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import torch

HUGE_PAGE_BYTES = 2 << 20
# Smaller tensors (norms, biases, most scales) are read from cache within a step: not worth a copy.
MIN_TENSOR_BYTES = 1 << 20
# Bytes a slab maps at least; a larger tensor gets a slab of its own size.
SLAB_BYTES = 64 << 20
# Where a tensor starts inside its slab (whole cache lines, as torch's allocator aligns).
ALIGN_BYTES = 64
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The host's transparent huge page mode (`always`, `madvise`, `never`), or None where there is none."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


class Slabs:
    """Anonymous private mappings advised for huge pages, handed out front to back."""

    def __init__(self) -> None:
        self._slab: torch.Tensor | None = None  # the current slab's bytes, 2 MiB aligned
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """nbytes of huge-page memory (uint8), untouched."""
        start = -(-self._used // ALIGN_BYTES) * ALIGN_BYTES
        if self._slab is None or start + nbytes > self._slab.numel():
            self._slab, start = _new_slab(max(SLAB_BYTES, nbytes)), 0
        self._used = start + nbytes
        return self._slab[start:start + nbytes]


def _new_slab(nbytes: int) -> torch.Tensor:
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # One huge page more, to start on a 2 MiB boundary wherever the kernel placed the mapping; the tensor views
    # keep the mapping alive (torch.frombuffer holds the buffer).
    m = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[offset:offset + size]


def _movable(t: object) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and t.is_contiguous() and t.numel() * t.element_size() >= MIN_TENSOR_BYTES)


def move_weights(model: torch.nn.Module) -> str:
    """Copy the model's large CPU tensors (parameters, buffers and plain tensor attributes such as packed panels)
    onto huge pages, each once however many attributes share it; returns the engine's log line."""
    mode = thp_mode()
    if mode not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"weights on the default pages (transparent huge pages: {mode or 'not on this system'})"
    slabs = Slabs()
    moved: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers, module.__dict__)
        for table in tables:
            for name, t in list(table.items()):
                if not _movable(t):
                    continue
                key = (t.data_ptr(), tuple(t.shape), t.dtype)
                if key not in moved:
                    copy = slabs.take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
                    moved[key] = copy.copy_(t.detach())
                table[name] = torch.nn.Parameter(moved[key], requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else moved[key]
    total = sum(t.numel() * t.element_size() for t in moved.values())
    return f"weights on huge pages: {total / (1 << 20):.0f} MiB in {len(moved)} tensors (THP {mode})"
