"""Which of a prompt set's cached prefixes would survive a server restart (`trtprompt lint`).

The pool lives in the engine process's memory: a restart empties it. What survives is what the
tiers below it hold (docs/prefix-pool.md), and which blocks go down is the write policy's choice:

- write_through: every full block when it is computed: every prompt block of the set;
- selective: a block at its first reuse in the pool: only blocks a later prompt reused;
- write_back: blocks the pool evicts, and at a clean stop those it still holds: every prompt
  block after a clean stop (the lint model evicts nothing), none of the pool's after a crash.

The estimate runs the set in file order on the engine's rule (prompt/reuse.py) to learn what the
tiers would hold, then runs it again on a restarted server whose tiers hold just that: the
second run's reuse is what a restart keeps. It assumes no write is dropped. A disk tier alone
keeps what fits its --disk-cache-size (when the engine's block size is known): it evicts its least
recently used entries, and a block already stored is not written again, so the blocks written
last are the ones kept, whatever their reuse. A Redis tier is taken to hold every block (its own
maxmemory policy decides otherwise: docs/prefix-pool.md, "Remote tier").
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
    disk_cache_size: int = KNOBS["disk_cache_size"].default
    entry_bytes: int | None = None  # one block as the disk tier stores it, from the engine (None: unknown)

    def __post_init__(self) -> None:
        choices = KNOBS["kv_tier_write_policy"].choices or ()
        if self.kv_tier_write_policy not in choices:
            raise ValueError(f"kv_tier_write_policy must be one of {', '.join(choices)}, "
                             f"got {self.kv_tier_write_policy!r}")
        problem = KNOBS["disk_cache_size"].problem(self.disk_cache_size)
        if problem:
            raise ValueError(f"disk_cache_size {problem}")
        if self.entry_bytes is not None and self.entry_bytes < 1:
            raise ValueError(f"entry_bytes must be >= 1, got {self.entry_bytes}")

    @property
    def disk_capacity_blocks(self) -> int | None:
        """Blocks the disk budget holds when the disk is the only tier and the block size is known."""
        if not self.disk_cache_path or self.kv_remote_url or self.entry_bytes is None:
            return None
        return self.disk_cache_size // self.entry_bytes

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
    evicted_blocks: int  # written, then evicted to fit the disk budget
    shared: tuple[SharedPrefix, ...]
    after_restart: ReuseEstimate  # the set run again on a restarted server

    def as_dict(self, tokens_per_block: int) -> dict[str, Any]:
        est = self.after_restart
        return {"tiers": list(self.setup.tiers), "write_policy": self.setup.kv_tier_write_policy,
                "kept_blocks": self.kept_blocks, "evicted_blocks": self.evicted_blocks,
                "shared_prefixes": [{"blocks": [s.branch.first_block, s.branch.last_block],
                                     "tokens": s.branch.num_blocks * tokens_per_block, "prompts": s.branch.prompts,
                                     "kept_blocks": s.kept_blocks, "survives": s.survives} for s in self.shared],
                "after_restart": {"reused_blocks": est.reused_blocks, "reusable_tokens": est.reused_tokens,
                                  "reusable_fraction": round(est.reusable_fraction, 6)}}


def written_hashes(ids: Sequence[Sequence[int]], tokens_per_block: int, salts: Sequence[str | None] | None,
                   setup: TierSetup) -> list[BlockHash]:
    """The blocks written to the tiers while the set runs once in file order, in the order of their
    first write (module docstring); none without tiers."""
    if not setup.tiers:
        return []
    written: dict[BlockHash, None] = {}  # insertion-ordered set: a stored block is not written again
    for hashes, hits in walk_reuse(ids, tokens_per_block, salts):
        new = hashes[:hits] if setup.kv_tier_write_policy == "selective" else hashes  # selective: at first reuse
        written.update(dict.fromkeys(new))
    return list(written)


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
    written = written_hashes(ids, tokens_per_block, salts, setup)
    capacity = setup.disk_capacity_blocks
    kept = set(written if capacity is None or len(written) <= capacity else written[len(written) - capacity:])
    after = estimate_reuse(ids, tokens_per_block, salts, cached=set(kept))
    return RestartReport(setup, len(kept), len(written) - len(kept),
                         tuple(_shared(tree, ids, tokens_per_block, salts, kept)), after)


def restart_lines(report: RestartReport, tokens_per_block: int, fresh: ReuseEstimate | None = None) -> list[str]:
    """The text report's section (fresh: the set's reuse on a fresh server, to compare with)."""
    setup, est = report.setup, report.after_restart
    if not setup.tiers:
        return ["after a restart: nothing survives: the KV pool lives in the engine process's memory and no "
                f"tier is configured below it; serve with {TIER_FLAGS} to keep blocks across restarts"]
    policy = setup.kv_tier_write_policy
    lines = [f"after a restart ({' and '.join(setup.tiers)} tier, {policy}): the tiers keep {report.kept_blocks} "
             f"prompt block(s); the set run again reuses {est.reused_tokens} of {est.total_tokens} prompt tokens "
             f"({est.reusable_fraction:.1%}"
             + (f"; {fresh.reusable_fraction:.1%} on a fresh server)" if fresh is not None else ")")]
    if report.evicted_blocks:
        entries = f"{report.kept_blocks} entr{'y' if report.kept_blocks == 1 else 'ies'}"
        lines.append(f"  the disk budget (--disk-cache-size {setup.disk_cache_size}) holds {entries} of "
                     f"{setup.entry_bytes} bytes: the {report.evicted_blocks} written first are evicted "
                     "(the figure above is then at most: the restarted server's own writes evict more)")
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
