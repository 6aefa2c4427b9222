"""Fast paged attention: decode in place, prefill by parts, shared prefixes once (cascade).

Every query row's attention is assembled from parts over disjoint key sets,
each with its log-sum-exp, merged exactly:

- decode rows: their own blocks (after any shared prefix), read in place by the
  compiled kernel (kernels.py), or gathered and attended with a length mask in
  pure torch where the kernel is unavailable;
- prefill chunks: their new tokens (causal, straight from this step's K/V, no
  copy) and their cached context after any shared prefix (no mask);
- a group of sequences sharing cached prefix blocks (cascade.py): every member's
  query rows attend to those blocks together, in one call.

With the compiled kernels, every prefill chunk instead attends to its context and its
own tokens (already written to the cache) in one pass over its blocks in place, all
chunks of the step in one call (kernels.paged_prefill: blocked GEMMs, online softmax,
causal blocks skipped), and a cascade group's rows attend to the shared blocks the
same way; docs/attention.md has the design and the figures. Over an int8 cache
(kv_cache_dtype int8) the compiled path runs the kernels' int8 twins, which read
the int8 rows in place: every part of every step, no float copy of the cache.

Design and measurements: docs/design.md, "Attention".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from trtprompt.engine import kernels
from trtprompt.engine.attention_common import (
    KvCache,
    SeqSlice,
    StepReads,
    additive_mask,
    contiguous_start,
    gather_blocks,
    gather_tables,
    put_rows,
    slot_tensors,
    take_rows,
)
from trtprompt.engine.attention_reference import MAX_DECODE_GROUP_BLOCKS, decode_groups
from trtprompt.engine.cascade import find_shared_prefixes

Parts = tuple[torch.Tensor, torch.Tensor]  # (out [n, heads, d], lse [n, heads] float32)

# Chunks of at most this many new tokens attend to their own tokens in one padded
# batch per layer (SmallChunks): padding costs (width / n)^2 of tiny work, and one
# call replaces a parallel region per chunk. On a quiet machine that saves little
# (a [1, 8, 32, 64] flash call takes ~60 us); when the cores are shared (a served
# engine beside Triton and its clients) each region waits for a descheduled thread,
# and 63 suffix chunks took 12.9 s per step instead of 3.7 s (docs/benchmarks-history.md,
# "Engine attention: in-place paged decode, cascade over shared prefixes").
SMALL_CHUNK_TOKENS = 128


@dataclass(frozen=True)
class DecodeBatch:
    rows: torch.Tensor  # [S] packed rows
    rows_start: int | None  # set when rows == arange(start, start + S)
    tables: torch.Tensor  # [S, max_blocks] own blocks (int32 for the kernel), padded with block 0
    lens: torch.Tensor  # [S] int32 tokens to attend in those blocks
    mask: torch.Tensor | None  # pure torch only: [S, 1, 1, max_blocks * tpb] additive, model dtype


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # rows [start, start + num_new_tokens)
    num_new_tokens: int
    context_blocks: torch.Tensor | None  # blocks of the cached context after any shared prefix
    context_len: int  # tokens of that context


@dataclass(frozen=True)
class SmallChunks:
    """Prefill chunks short enough to attend to their own tokens in one padded batch.

    One call instead of one per chunk (the suffixes after a shared prefix): see
    SMALL_CHUNK_TOKENS for what that saves and when.
    """

    rows: torch.Tensor  # [C, width] packed rows of each chunk, padded with its last row
    rows_start: int | None  # rows[0, 0] when every row is real and they are consecutive: slices do
    # Both None when every chunk has `width` tokens: no padding, a plain causal call.
    valid: torch.Tensor | None  # [C * width] bool: the padded positions that are real rows
    mask: torch.Tensor | None  # [C, 1, width, width] additive causal mask (padding keys masked), model dtype


@dataclass(frozen=True)
class PrefixGroup:
    rows: torch.Tensor  # [R] packed query rows of every member
    block_ids: torch.Tensor  # [P] the shared blocks
    table: torch.Tensor | None  # compiled only: [1, P] int32, the blocks as the prefill kernel's table
    segments: torch.Tensor | None  # compiled only: [1, 4] int64, all R rows against all P blocks' tokens


@dataclass(frozen=True)
class KernelChunks:
    """Every prefill chunk of the step for the compiled prefill kernel: one segment each."""

    tables: torch.Tensor  # [C, max_blocks] int32: the chunk's blocks after any shared prefix, padded with 0
    segments: torch.Tensor  # [C, 4] int64: row_start, num_rows, num_keys, first_limit (kernels.paged_prefill)


def flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
                   mask: torch.Tensor | None = None) -> Parts:
    """q [B, H, Lq, d], k/v [B, kv_heads, Lk, d] -> (out [B, H, Lq, d], lse [B, H, Lq] float32).

    The CPU flash kernel takes GQA K/V as they are (each kv head serves its group of
    query heads, bit-identical to repeating them); elsewhere they are repeated."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse
    k, v = repeat_kv(k, v, q.shape[1], dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype), lse


def fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[n, heads, d] -> [kv_heads, n * group, d]: a GQA group's heads become query rows of its kv head."""
    n, heads, d = q.shape
    return q.view(n, kv_heads, heads // kv_heads, d).transpose(0, 1).reshape(kv_heads, -1, d)


def unfold_heads(out: torch.Tensor, lse: torch.Tensor, n: int) -> Parts:
    """Inverse of fold_heads for (out [kv_heads, n * group, d], lse [kv_heads, n * group])."""
    kv_heads, _, d = out.shape
    out = out.view(kv_heads, n, -1, d).transpose(0, 1).reshape(n, -1, d)
    return out, lse.view(kv_heads, n, -1).transpose(0, 1).reshape(n, -1)


def merge(a: Parts, b: Parts) -> Parts:
    """Attention over the union of two disjoint key sets, from each one's (out, lse)."""
    (oa, la), (ob, lb) = a, b
    m = torch.maximum(la, lb)
    wa, wb = (la - m).exp(), (lb - m).exp()
    total = wa + wb
    out = oa.float() * (wa / total).unsqueeze(-1) + ob.float() * (wb / total).unsqueeze(-1)
    return out.to(oa.dtype), m + total.log()


def attend_unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Parts:
    """q [n, heads, d] rows against every key of k/v [kv_heads, L, d]."""
    out, lse = flash_with_lse(fold_heads(q, k.shape[0]).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale)
    return unfold_heads(out[0], lse[0], q.shape[0])


def repeat_kv(k: torch.Tensor, v: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V with each kv head repeated for its GQA group (along dim)."""
    group = heads // k.shape[dim]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=dim), v.repeat_interleave(group, dim=dim)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Parts:
    """A chunk's rows q [n, heads, d] against its own new tokens k/v [n, kv_heads, d], causally."""
    out, lse = flash_with_lse(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                              v.transpose(0, 1).unsqueeze(0), scale, causal=True)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


@dataclass(frozen=True)
class PagedMetadata:
    num_tokens: int
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    reads: StepReads  # kv_blocks, listed when an int8 cache asks
    decodes: tuple[DecodeBatch, ...]
    prefills: tuple[PrefillChunk, ...]
    small: SmallChunks | None  # the own-token part of short chunks, batched
    groups: tuple[PrefixGroup, ...]
    compiled: bool
    chunks: KernelChunks | None = None  # compiled: all prefill chunks in one kernel call (prefills, small empty)

    @property
    def kv_blocks(self) -> torch.Tensor:
        """Every block the step reads, once (attention_common.StepReads)."""
        return self.reads.blocks

    @property
    def pure_decode(self) -> bool:
        """Every row is a decode, in one batch in packed order, with no shared prefix."""
        return not self.prefills and not self.groups and self.small is None and self.chunks is None \
            and len(self.decodes) == 1 and self.decodes[0].rows_start == 0

    @functools.cached_property
    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block tables, lens) of a pure decode step on the compiled kernel, where attention.decode_attention
        runs each layer's rotary, KV write and attention in one call; None otherwise. Asked once a layer,
        worked out once a step."""
        return (self.decodes[0].tables, self.decodes[0].lens) if self.compiled and self.pure_decode else None

    @functools.cached_property
    def chunk_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block tables, segments) of a compiled step whose every row is in a chunk of its prefill kernel call
        (no decode row, no shared-prefix group): the one-call layers run it with csrc's chunk_attention."""
        if not self.compiled or self.chunks is None or self.decodes or self.groups or self.prefills \
                or self.small is not None:
            return None
        return self.chunks.tables, self.chunks.segments

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache,
               scale: float) -> torch.Tensor:
        """Compiled: the step's new K/V are read from the cache (written first), not from k and v."""
        if self.pure_decode:
            return self._decode(q, kv_cache, self.decodes[0], scale)[0]  # a pure decode step
        if self.chunks is not None:  # rows of the chunks written, the others set below
            out, lse = _prefill_kernel(kv_cache)(q.contiguous(), kv_cache[0], kv_cache[1], self.chunks.tables,
                                                 self.chunks.segments, scale)
        else:
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for dec in self.decodes:
            o, o_lse = self._decode(q, kv_cache, dec, scale)
            put_rows(out, dec.rows, dec.rows_start, o)
            put_rows(lse, dec.rows, dec.rows_start, o_lse)
        if self.small is not None:
            rows, (o, o_lse) = _small_chunks(q, k, v, self.small, scale)
            put_rows(out, rows, self.small.rows_start, o)
            put_rows(lse, rows, self.small.rows_start, o_lse)
        for chunk in self.prefills:
            self._prefill(q, k, v, kv_cache, chunk, scale, out, lse)
        for group in self.groups:
            qg = q.index_select(0, group.rows)
            if group.table is not None and group.segments is not None:
                shared = _prefill_kernel(kv_cache)(qg, kv_cache[0], kv_cache[1], group.table, group.segments, scale)
            else:
                shared = attend_unmasked(qg, gather_blocks(kv_cache[0], group.block_ids),
                                         gather_blocks(kv_cache[1], group.block_ids), scale)
            o, o_lse = merge((out.index_select(0, group.rows), lse.index_select(0, group.rows)), shared)
            out.index_copy_(0, group.rows, o)
            lse.index_copy_(0, group.rows, o_lse)
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KvCache, chunk: PrefillChunk,
                 scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
        """A chunk's own tokens (unless already done in the small-chunk batch) and its cached context."""
        rows = slice(chunk.start, chunk.start + chunk.num_new_tokens)
        batched = self.small is not None and chunk.num_new_tokens <= SMALL_CHUNK_TOKENS
        parts = (out[rows], lse[rows]) if batched else attend_causal(q[rows], k[rows], v[rows], scale)
        if chunk.context_blocks is not None:
            n = chunk.context_len
            parts = merge(parts, attend_unmasked(q[rows], gather_blocks(kv_cache[0], chunk.context_blocks)[:, :n],
                                                 gather_blocks(kv_cache[1], chunk.context_blocks)[:, :n], scale))
        elif batched:
            return  # nothing to add to what the batch wrote
        out[rows], lse[rows] = parts

    def _decode(self, q: torch.Tensor, kv_cache: KvCache, dec: DecodeBatch, scale: float) -> Parts:
        num = dec.rows.shape[0]
        qd = take_rows(q, dec.rows, dec.rows_start)
        if self.compiled:
            return _decode_kernel(kv_cache)(qd.contiguous(), kv_cache[0], kv_cache[1], dec.tables, dec.lens, scale)
        assert dec.mask is not None  # built for every pure-torch batch (_decode_batch)
        kv_heads, d = kv_cache[0].shape[1], kv_cache[0].shape[3]
        out, lse = flash_with_lse(qd.view(num, kv_heads, -1, d), gather_tables(kv_cache[0], dec.tables),
                                  gather_tables(kv_cache[1], dec.tables), scale, mask=dec.mask.to(q.dtype))
        return out.reshape(num, -1, d), lse.reshape(num, -1)


def _int8_rows(kv_cache: KvCache) -> bool:
    return kv_cache[0].dtype == torch.int8


def _prefill_kernel(kv_cache: KvCache) -> Callable[..., Parts]:
    """kernels.paged_prefill, or its twin reading int8 rows (kv_cache_dtype int8) in place."""
    return kernels.paged_prefill_int8 if _int8_rows(kv_cache) else kernels.paged_prefill


def _decode_kernel(kv_cache: KvCache) -> Callable[..., Parts]:
    """kernels.paged_decode, or its twin reading int8 rows in place."""
    return kernels.paged_decode_int8 if _int8_rows(kv_cache) else kernels.paged_decode


def _small_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, small: SmallChunks,
                  scale: float) -> tuple[torch.Tensor, Parts]:
    """(packed rows, parts) of every short chunk against its own tokens, in one call."""
    num, width = small.rows.shape
    flat = small.rows.reshape(-1)

    def batch(x: torch.Tensor) -> torch.Tensor:  # [T, h, d] -> [C, h, width, d]
        return take_rows(x, flat, small.rows_start).view(num, width, x.shape[1], x.shape[2]).transpose(1, 2)

    mask = None if small.mask is None else small.mask.to(q.dtype)
    out, lse = flash_with_lse(batch(q), batch(k), batch(v), scale, causal=mask is None, mask=mask)
    out = out.transpose(1, 2).reshape(num * width, q.shape[1], q.shape[2])
    lse = lse.transpose(1, 2).reshape(num * width, q.shape[1])
    if small.valid is None:
        return flat, (out, lse)
    return flat[small.valid], (out[small.valid], lse[small.valid])


def _decode_batch(rows: list[int], seqs: list[SeqSlice], skips: list[int], tpb: int, device: torch.device,
                  dtype: torch.dtype, compiled: bool) -> DecodeBatch:
    lens = [s.context_len + 1 - skip * tpb for s, skip in zip(seqs, skips)]
    width = max(-(-n // tpb) for n in lens)
    tables = [list(s.block_table[skip:skip + width]) for s, skip in zip(seqs, skips)]
    tables = [t + [0] * (width - len(t)) for t in tables]
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    mask = None
    if not compiled:
        keep = torch.arange(width * tpb, device=device)[None, :] < lens_t[:, None]
        mask = additive_mask(keep, dtype)[:, None, None]
    return DecodeBatch(torch.tensor(rows, dtype=torch.long, device=device), contiguous_start(rows),
                       torch.tensor(tables, dtype=torch.int32 if compiled else torch.long, device=device),
                       lens_t, mask)


def _prefill_chunk(start: int, seq: SeqSlice, skip: int, tpb: int, device: torch.device) -> PrefillChunk:
    context_len = seq.context_len - skip * tpb
    if context_len <= 0:
        return PrefillChunk(start, seq.num_new_tokens, None, 0)
    blocks = list(seq.block_table[skip:skip + -(-context_len // tpb)])
    return PrefillChunk(start, seq.num_new_tokens, torch.tensor(blocks, dtype=torch.long, device=device),
                        context_len)


def _small_chunks_batch(starts: list[int], sizes: list[int], device: torch.device,
                        dtype: torch.dtype) -> SmallChunks | None:
    if len(sizes) < 2:
        return None  # one chunk gains nothing from a batch
    width = max(sizes)
    pos = torch.arange(width, device=device)
    sizes_t = torch.tensor(sizes, device=device)
    rows = torch.tensor(starts, device=device)[:, None] + torch.minimum(pos[None, :], sizes_t[:, None] - 1)
    if min(sizes) == width:  # equal chunks (a batch of same-length prompts): no padding to mask
        back_to_back = all(b - a == width for a, b in zip(starts, starts[1:]))
        return SmallChunks(rows, starts[0] if back_to_back else None, None, None)
    valid = pos[None, :] < sizes_t[:, None]
    keep = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # [C, query, key]
    return SmallChunks(rows, None, valid.reshape(-1), additive_mask(keep, dtype)[:, None])


def _kernel_chunks(starts: list[int], seqs: Sequence[SeqSlice], skips: list[int], tpb: int,
                   device: torch.device) -> KernelChunks | None:
    """One kernel segment per prefill chunk: its blocks after any shared prefix, context and own tokens.

    The chunk's own K/V are in the cache when attention runs (write_kv comes first), so row i
    (position context_len + i) sees the first context_len - skip * tpb + i + 1 of those blocks' tokens.
    """
    chosen = [i for i, s in enumerate(seqs) if s.num_new_tokens > 1]
    if not chosen:
        return None
    tables, segments = [], []
    for i in chosen:
        seq, first = seqs[i], skips[i] * tpb
        keys = seq.context_len + seq.num_new_tokens - first
        tables.append(list(seq.block_table[skips[i]:skips[i] + -(-keys // tpb)]))
        segments.append([starts[i], seq.num_new_tokens, keys, seq.context_len - first + 1])
    width = max(len(t) for t in tables)
    return KernelChunks(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
                        torch.tensor(segments, dtype=torch.long, device=device))


def _prefix_group(rows: list[int], ids: list[int], tpb: int, device: torch.device, compiled: bool) -> PrefixGroup:
    if not compiled:
        return PrefixGroup(torch.tensor(rows, dtype=torch.long, device=device),
                           torch.tensor(ids, dtype=torch.long, device=device), None, None)
    keys = len(ids) * tpb
    return PrefixGroup(torch.tensor(rows, dtype=torch.long, device=device),
                       torch.tensor(ids, dtype=torch.long, device=device),
                       torch.tensor([ids], dtype=torch.int32, device=device),
                       torch.tensor([[0, len(rows), keys, keys]], dtype=torch.long, device=device))


def build(seqs: Sequence[SeqSlice], tpb: int, device: torch.device, dtype: torch.dtype,
          compiled: bool) -> PagedMetadata:
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.num_new_tokens)
    skips = [0] * len(seqs)
    groups = []
    for shared in find_shared_prefixes([s.block_table for s in seqs], [s.context_len // tpb for s in seqs], tpb):
        rows = [r for i in shared.members for r in range(starts[i], starts[i + 1])]
        ids = list(seqs[shared.members[0]].block_table[:shared.num_blocks])
        groups.append(_prefix_group(rows, ids, tpb, device, compiled))
        for i in shared.members:
            skips[i] = shared.num_blocks
    dec = [i for i, s in enumerate(seqs) if s.num_new_tokens == 1]
    # The kernel needs no temporaries; the gathering fallback bounds its copy per batch.
    parts = [dec] if compiled or not dec else [
        [dec[j] for j in g] for g in decode_groups([seqs[i].context_len + 1 - skips[i] * tpb for i in dec],
                                                   tpb, MAX_DECODE_GROUP_BLOCKS)]
    decodes = tuple(_decode_batch([starts[i] for i in p], [seqs[i] for i in p], [skips[i] for i in p],
                                  tpb, device, dtype, compiled) for p in parts if p)
    blocks, offsets = slot_tensors(seqs, tpb, device)
    read = StepReads(tuple(seqs), tpb, device)
    if compiled:
        return PagedMetadata(starts[-1], blocks, offsets, read, decodes, (), None, tuple(groups), compiled,
                             _kernel_chunks(starts, seqs, skips, tpb, device))
    prefills = tuple(_prefill_chunk(starts[i], s, skips[i], tpb, device)
                     for i, s in enumerate(seqs) if s.num_new_tokens > 1)
    short = [c for c in prefills if c.num_new_tokens <= SMALL_CHUNK_TOKENS]
    small = _small_chunks_batch([c.start for c in short], [c.num_new_tokens for c in short], device, dtype)
    return PagedMetadata(starts[-1], blocks, offsets, read, decodes, prefills, small, tuple(groups), compiled)
