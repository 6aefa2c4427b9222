"""Which sequences of a step share cached prefix blocks, decided from block tables alone.

Prefix reuse makes sequences with a common prompt start point at the same
physical blocks. Their queries can attend to those blocks together, once
(cascade attention), instead of each reading them again; attention_paged.py
merges that partial result with each sequence's own part by log-sum-exp.
No hint from the client is needed: equal block ids are equal KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Below this many prefix-token reads saved per layer, the extra gather, attention
# call and merge of a cascade cost more than reading the prefix per sequence.
MIN_SAVED_TOKENS = 512


@dataclass(frozen=True)
class SharedPrefix:
    members: tuple[int, ...]  # indices of the step's sequences that share the blocks
    num_blocks: int  # leading blocks every member has cached and shares


def _common_blocks(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _best_group(members: list[int], tables: Sequence[Sequence[int]], cached: Sequence[int],
                tpb: int) -> SharedPrefix | None:
    """The deepest-paying group among sequences whose first block is the same.

    Depth is measured against the first member; the group keeps the members
    sharing at least depth d, with d chosen to maximise the tokens saved.
    """
    lead = tables[members[0]]
    depth = {i: _common_blocks(lead, tables[i], min(cached[i], cached[members[0]])) for i in members[1:]}
    depth[members[0]] = cached[members[0]]
    best: SharedPrefix | None = None
    best_saved = 0
    ranked = sorted(members, key=lambda i: -depth[i])
    for k in range(2, len(ranked) + 1):
        d = depth[ranked[k - 1]]
        saved = (k - 1) * d * tpb
        if d > 0 and saved > best_saved:
            best, best_saved = SharedPrefix(tuple(sorted(ranked[:k])), d), saved
    return best if best_saved >= MIN_SAVED_TOKENS else None


def find_shared_prefixes(tables: Sequence[Sequence[int]], cached_blocks: Sequence[int],
                         tokens_per_block: int) -> list[SharedPrefix]:
    """Groups of sequences sharing leading cached blocks.

    tables[i] is sequence i's block table, cached_blocks[i] how many of its
    leading blocks hold only tokens computed before this step (context_len //
    tokens_per_block): only those may be shared, as a block is written by one
    sequence alone.
    """
    by_first: dict[int, list[int]] = {}
    for i, n in enumerate(cached_blocks):
        if n > 0:
            by_first.setdefault(tables[i][0], []).append(i)
    groups = []
    for members in by_first.values():
        group = _best_group(members, tables, cached_blocks, tokens_per_block) if len(members) > 1 else None
        if group is not None:
            groups.append(group)
    return groups
