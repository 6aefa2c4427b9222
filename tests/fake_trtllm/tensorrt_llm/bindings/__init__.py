"""Fake of tensorrt_llm.bindings: only KVCacheType."""

from enum import Enum


class KVCacheType(Enum):
    CONTINUOUS = 0
    PAGED = 1
    DISABLED = 2
