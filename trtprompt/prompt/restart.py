"""Which of a prompt set's cached prefixes would survive a server restart (`trtprompt lint`).

The pool lives in the engine process's memory: a restart empties it. What survives is what the
tiers below it hold (docs/prefix-pool.md), and which blocks go down is the write policy's choice:

- write_through: every full block when it is computed: every prompt block of the set;
- selective: a block at its first reuse in the pool: only blocks a later prompt reused;
- write_back: blocks the pool evicts, and at a clean stop those it still holds: every prompt
  block after a clean stop (the lint model evicts nothing), none of the pool's after a crash.

The estimate runs the set in file order on the engine's rule (prompt/reuse.py) to learn what the
tiers would hold, then runs it again on a restarted server whose tiers hold just that: the
second run's reuse is what a restart keeps. It assumes the tiers have room for every block (the
disk tier evicts least recently used entries past --disk-cache-size; Redis evicts by its own
maxmemory policy) and that no write is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from trtprompt.engine.block_pool import BlockHash
from trtprompt.knobs import KNOBS
from trtprompt.prompt.prefix_tree import Branch
from trtprompt.prompt.reuse import ReuseEstimate, block_hashes, estimate_reuse, walk_reuse

TIER_FLAGS = "--disk-cache-path DIR (local disk) or --kv-remote-url redis://HOST:PORT/DB (shared by servers)"


@dataclass(frozen=True)
class TierSetup:
    """The serve tier knobs the linter models (trtprompt/knobs.py)."""

    disk_cache_path: str | None = None
    kv_remote_url: str | None = None
    kv_tier_write_policy: str = KNOBS["kv_tier_write_policy"].default

    def __post_init__(self) -> None:
        choices = KNOBS["kv_tier_write_policy"].choices or ()
        if self.kv_tier_write_policy not in choices:
            raise ValueError(f"kv_tier_write_policy must be one of {', '.join(choices)}, "
                             f"got {self.kv_tier_write_policy!r}")

    @property
    def tiers(self) -> tuple[str, ...]:
        return (("disk",) if self.disk_cache_path else ()) + (("redis",) if self.kv_remote_url else ())


@dataclass(frozen=True)
class SharedPrefix:
    """A prefix-tree branch shared by two or more prompts, and how many of its blocks a tier keeps."""

    branch: Branch
    kept_blocks: int

    @property
    def survives(self) -> bool:
        return self.kept_blocks == self.branch.num_blocks


@dataclass(frozen=True)
class RestartReport:
    setup: TierSetup
    kept_blocks: int  # distinct prompt blocks the tiers hold after the run (0 without tiers)
    shared: tuple[SharedPrefix, ...]
    after_restart: ReuseEstimate  # the set run again on a restarted server

    def as_dict(self, tokens_per_block: int) -> dict[str, Any]:
        est = self.after_restart
        return {"tiers": list(self.setup.tiers), "write_policy": self.setup.kv_tier_write_policy,
                "kept_blocks": self.kept_blocks,
                "shared_prefixes": [{"blocks": [s.branch.first_block, s.branch.last_block],
                                     "tokens": s.branch.num_blocks * tokens_per_block, "prompts": s.branch.prompts,
                                     "kept_blocks": s.kept_blocks, "survives": s.survives} for s in self.shared],
                "after_restart": {"reused_blocks": est.reused_blocks, "reusable_tokens": est.reused_tokens,
                                  "reusable_fraction": round(est.reusable_fraction, 6)}}


def kept_hashes(ids: Sequence[Sequence[int]], tokens_per_block: int, salts: Sequence[str | None] | None,
                setup: TierSetup) -> set[BlockHash]:
    """The blocks the tiers hold after the set ran once in file order (module docstring)."""
    if not setup.tiers:
        return set()
    kept: set[BlockHash] = set()
    for hashes, hits in walk_reuse(ids, tokens_per_block, salts):
        if setup.kv_tier_write_policy == "selective":
            kept.update(hashes[:hits])  # reused once in the pool: written then
        else:
            kept.update(hashes)
    return kept


def _shared(tree: Sequence[Branch], ids: Sequence[Sequence[int]], tokens_per_block: int,
            salts: Sequence[str | None] | None, kept: set[BlockHash]) -> list[SharedPrefix]:
    out: list[SharedPrefix] = []
    for branch in tree:
        if branch.prompts < 2:
            continue
        i = branch.example_prompt
        hashes = block_hashes(ids[i], tokens_per_block, salts[i] if salts else None)
        run = hashes[branch.first_block:branch.last_block + 1]
        n = 0
        while n < len(run) and run[n] in kept:  # a prefix is usable up to its first missing block
            n += 1
        out.append(SharedPrefix(branch, n))
        out += _shared(branch.children, ids, tokens_per_block, salts, kept)
    return out


def restart_report(ids: Sequence[Sequence[int]], tokens_per_block: int, salts: Sequence[str | None] | None,
                   tree: Sequence[Branch], setup: TierSetup) -> RestartReport:
    kept = kept_hashes(ids, tokens_per_block, salts, setup)
    after = estimate_reuse(ids, tokens_per_block, salts, cached=set(kept))
    return RestartReport(setup, len(kept), tuple(_shared(tree, ids, tokens_per_block, salts, kept)), after)


def restart_lines(report: RestartReport, tokens_per_block: int) -> list[str]:
    """The text report's section."""
    setup, est = report.setup, report.after_restart
    if not setup.tiers:
        return ["after a restart: nothing survives: the KV pool lives in the engine process's memory and no "
                f"tier is configured below it; serve with {TIER_FLAGS} to keep blocks across restarts"]
    policy = setup.kv_tier_write_policy
    lines = [f"after a restart ({' and '.join(setup.tiers)} tier, {policy}): the tiers keep {report.kept_blocks} "
             f"prompt block(s); the set run again reuses {est.reused_tokens} of {est.total_tokens} prompt tokens "
             f"({est.reusable_fraction:.1%})"]
    if policy == "write_back":
        lines.append("  write_back writes the pool's blocks at a clean stop: after a crash only blocks it had "
                     "evicted survive")
    for s in report.shared[:10]:
        b = s.branch
        fate = ("survives" if s.survives else
                f"{s.kept_blocks} of {b.num_blocks} blocks survive" if s.kept_blocks else "does not survive")
        why = "" if s.survives or policy != "selective" else " (selective writes a block at its first reuse)"
        lines.append(f"  blocks {b.first_block}-{b.last_block} ({b.num_blocks * tokens_per_block} tokens, "
                     f"shared by {b.prompts} prompts): {fate}{why}")
    if len(report.shared) > 10:
        lines.append(f"  ... and {len(report.shared) - 10} more shared prefixes (see --json)")
    return lines
