"""Where an engine's adapters come from: its own `lora/NAME/` directories (trtprompt build --lora-dir) and
those named when it starts (serve --lora-modules NAME=DIR), the latter winning a shared name."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from trtprompt.engine.lora.adapter import CONFIG_FILE

LORA_SUBDIR = "lora"  # in an engine directory: one PEFT adapter directory per name


def lora_dirs(engine_path: str | Path, given: Mapping[str, str] | None) -> dict[str, str]:
    """{name: adapter directory}: the engine's own, sorted by name, then `given`."""
    root = Path(engine_path) / LORA_SUBDIR
    found = {d.name: str(d) for d in sorted(root.iterdir()) if (d / CONFIG_FILE).is_file()} if root.is_dir() else {}
    found.update(given or {})
    return found
