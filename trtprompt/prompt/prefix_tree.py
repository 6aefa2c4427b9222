"""The prefix tree of a prompt set in units of KV blocks.

Each node is one full block (identified by its chained hash, so equal
paths mean equal prefixes); runs of nodes that the same prompts share are
folded into one branch, which is what a reader wants to see: "these 28
blocks are shared by all 200 prompts, then 3 groups diverge".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from trtprompt.prompt.reuse import block_hashes


@dataclass
class _Node:
    depth: int  # block index of this node
    prompt: int  # first prompt that reached it (for a text preview)
    count: int = 0
    children: dict[bytes, "_Node"] = field(default_factory=dict)


@dataclass(frozen=True)
class Branch:
    """A run of blocks [first_block, last_block] shared by `prompts` prompts."""

    first_block: int
    last_block: int
    prompts: int
    example_prompt: int
    children: tuple["Branch", ...]

    @property
    def num_blocks(self) -> int:
        return self.last_block - self.first_block + 1

    def as_dict(self, tokens_per_block: int, preview: Callable[["Branch"], str]) -> dict[str, Any]:
        return {"blocks": [self.first_block, self.last_block],
                "tokens": self.num_blocks * tokens_per_block, "prompts": self.prompts,
                "example_prompt": self.example_prompt, "text": preview(self),
                "children": [c.as_dict(tokens_per_block, preview) for c in self.children]}


def build_tree(prompts: Sequence[Sequence[int]], tokens_per_block: int,
               salts: Sequence[str | None] | None = None) -> list[Branch]:
    """Top-level branches (one per distinct first block)."""
    root = _Node(-1, -1)
    for i, ids in enumerate(prompts):
        node = root
        for depth, h in enumerate(block_hashes(ids, tokens_per_block, salts[i] if salts else None)):
            node = node.children.setdefault(h, _Node(depth, i))
            node.count += 1
    return [_fold(child) for child in root.children.values()]


def _fold(node: _Node) -> Branch:
    first = node
    while len(node.children) == 1:
        only = next(iter(node.children.values()))
        if only.count != node.count:
            break
        node = only
    kids = sorted((_fold(c) for c in node.children.values()), key=lambda b: (-b.prompts, b.example_prompt))
    return Branch(first.depth, node.depth, first.count, first.prompt, tuple(kids))


def render_tree(branches: Sequence[Branch], tokens_per_block: int, preview: Callable[[Branch], str],
                min_prompts: int = 2, max_children: int = 8) -> list[str]:
    """Text lines; branches used by fewer than min_prompts prompts are summarised per level."""
    lines: list[str] = []

    def walk(level: Sequence[Branch], indent: str) -> None:
        shown = [b for b in level if b.prompts >= min_prompts][:max_children]
        rest = [b for b in level if b not in shown]
        for b in shown:
            lines.append(f"{indent}blocks {b.first_block}-{b.last_block} ({b.num_blocks * tokens_per_block} tokens), "
                         f"shared by {b.prompts} prompts: {preview(b)!r}")
            walk(b.children, indent + "  ")
        if rest:
            lines.append(f"{indent}+ {len(rest)} branch(es) used by {sum(b.prompts for b in rest)} prompt(s) "
                         "not shared further")

    walk(sorted(branches, key=lambda b: (-b.prompts, b.example_prompt)), "")
    return lines
