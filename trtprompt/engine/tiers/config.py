"""What tiers an engine runs with: the disk and remote tier knobs (trtprompt/knobs.py) as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass

from trtprompt.knobs import KNOBS

TIER_KNOBS: tuple[str, ...] = ("disk_cache_path", "disk_cache_size", "kv_remote_url", "kv_remote_password_file",
                                "kv_tier_write_policy")
WRITE_POLICIES: tuple[str, ...] = tuple(KNOBS["kv_tier_write_policy"].choices or ())


@dataclass(frozen=True)
class TierConfig:
    disk_cache_path: str | None = KNOBS["disk_cache_path"].default
    disk_cache_size: int = KNOBS["disk_cache_size"].default
    kv_remote_url: str | None = KNOBS["kv_remote_url"].default
    kv_remote_password_file: str | None = KNOBS["kv_remote_password_file"].default
    kv_tier_write_policy: str = KNOBS["kv_tier_write_policy"].default
    queue_blocks: int = 256  # per tier writer (writer.py); not a knob: drops are counted and visible

    def __post_init__(self) -> None:
        for name in TIER_KNOBS:
            KNOBS[name].check(getattr(self, name))
        if self.queue_blocks < 1:
            raise ValueError(f"queue_blocks must be >= 1, got {self.queue_blocks}")
        if self.disk_cache_path is not None and not self.disk_cache_path.strip():
            raise ValueError("disk_cache_path must not be empty (leave it unset for no disk tier)")

    @property
    def enabled(self) -> bool:
        return self.disk_cache_path is not None or self.kv_remote_url is not None
