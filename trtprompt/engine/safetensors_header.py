"""The JSON header of a .safetensors file, read without loading any tensor.

In the engine package because the engine's own files (an engine dir's
weights) are checked with it; the checkpoint reader of the build side uses
it too, so the engine never imports the build side for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trtprompt.errors import CheckpointError

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


def safetensors_header(path: Path) -> dict[str, Any]:
    """{tensor name: {dtype, shape, data_offsets}, "__metadata__": ...}; CheckpointError if unreadable."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size <= 0 or size > MAX_HEADER_BYTES:
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
            if not isinstance(header, dict):
                raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
            return header
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a valid safetensors file: {exc}") from exc
