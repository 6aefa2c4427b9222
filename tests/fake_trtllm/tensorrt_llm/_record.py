"""Append one JSON line per call to $FAKE_TRTLLM_LOG (tests read it back)."""

from __future__ import annotations

import json
import os
from typing import Any


def record(call: str, **values: Any) -> None:
    path = os.environ.get("FAKE_TRTLLM_LOG")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"call": call, **values}, sort_keys=True, default=str) + "\n")
