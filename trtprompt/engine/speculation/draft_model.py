"""The draft engine of speculative_decoding draft_target (being written)."""

from __future__ import annotations

from typing import Any

from trtprompt.engine.speculation.config import SpeculationConfig


def open_draft_model(config: SpeculationConfig, target_files: Any, target_config: Any) -> Any:
    raise ValueError("speculative_decoding draft_target is not available yet")
