"""The engine's speculative decoding settings: one frozen record, checked against the knob registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from trtprompt.knobs import KNOBS, NO_DRAFT_MODEL

# The knobs this record takes, each under its registry name (trtprompt/knobs.py declares bounds and defaults),
# and the field that holds it.
FIELD_OF_KNOB: dict[str, str] = {
    "speculative_decoding": "mode", "max_draft_len": "max_draft_len",
    "max_matching_ngram_size": "max_matching_ngram_size", "is_keep_all": "is_keep_all",
    "is_use_oldest": "is_use_oldest", "is_public_pool": "is_public_pool",
    "speculation_max_concurrency": "max_concurrency", "speculative_model": "draft_engine_dir"}
SPECULATION_KNOBS: tuple[str, ...] = tuple(FIELD_OF_KNOB)
# Tokens the shared n-gram pool keeps over recent requests (is_public_pool): about 150 bytes each over
# max_matching_ngram_size runs, so ~30 MB at the default; the oldest request's tokens leave first.
PUBLIC_POOL_TOKENS = 65_536


def _default(name: str) -> Any:
    return KNOBS[name].default


@dataclass(frozen=True)
class SpeculationConfig:
    """How the engine drafts and verifies (mode "ngram" or "draft_target"; "none" is no record at all)."""

    mode: str = _default("speculative_decoding")
    max_draft_len: int = _default("max_draft_len")
    max_matching_ngram_size: int = _default("max_matching_ngram_size")
    is_keep_all: bool = _default("is_keep_all")
    is_use_oldest: bool = _default("is_use_oldest")
    is_public_pool: bool = _default("is_public_pool")
    # None: speculation never pauses for the batch's size.
    max_concurrency: int | None = _default("speculation_max_concurrency")
    draft_engine_dir: str | None = None  # mode draft_target: the draft engine (speculative_model)
    public_pool_tokens: int = PUBLIC_POOL_TOKENS

    def __post_init__(self) -> None:
        for name, field_name in FIELD_OF_KNOB.items():
            KNOBS[name].check(getattr(self, field_name))
        if self.mode == "none":
            raise ValueError("speculative_decoding none: the engine takes no SpeculationConfig (None) instead")
        if self.mode == "draft_target" and self.draft_engine_dir is None:
            raise ValueError(NO_DRAFT_MODEL)
        if self.public_pool_tokens < 1:
            raise ValueError(f"public_pool_tokens must be >= 1, got {self.public_pool_tokens}")

    @classmethod
    def from_knobs(cls, values: Mapping[str, Any]) -> SpeculationConfig | None:
        """The record for these knob values (unset ones, None, take their defaults); None for mode none."""
        chosen = {field_name: values[name] if values.get(name) is not None else _default(name)
                  for name, field_name in FIELD_OF_KNOB.items()}
        return None if chosen["mode"] == "none" else cls(**chosen)
