"""TensorRT-LLM's six retention inputs (trtprompt/interface.py RETENTION_INPUTS) and the engine's
RetentionConfig, both ways: what the Triton models read (serve/triton_models/inputs.py) and what a
client of Triton sends (the OpenAI front end's Triton path). Their rules, with TensorRT-LLM's
meaning (docs/prefix-pool.md, "Retention"): ranges [start, end) over the prompt, end -1 to its end,
priorities 0-100, durations in ms with -1 for none; every refusal names the input.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from trtprompt.engine.request import (
    RETENTION_PRIORITY_DEFAULT,
    RETENTION_PRIORITY_MAX,
    RETENTION_PRIORITY_MIN,
    RetentionConfig,
    TokenRangeRetention,
)
from trtprompt.error_codes import BadRequestError, FieldError
from trtprompt.interface import RETENTION_INPUTS

STARTS, ENDS, PRIORITIES, DURATIONS, DECODE_PRIORITY, DECODE_DURATION = (name for name, *_ in RETENTION_INPUTS)
RANGE_INPUTS = (STARTS, ENDS, PRIORITIES, DURATIONS)
DECODE_INPUTS = (DECODE_PRIORITY, DECODE_DURATION)
NO_END = -1  # an end of -1: to the end of the prompt
NO_EXPIRY = -1  # a duration of -1: the priority lasts until the block is evicted (TensorRT-LLM's)


def _priority(name: str, value: int) -> int:
    if not RETENTION_PRIORITY_MIN <= value <= RETENTION_PRIORITY_MAX:
        raise BadRequestError(f"input '{name}' must hold priorities in [{RETENTION_PRIORITY_MIN}, "
                              f"{RETENTION_PRIORITY_MAX}], got {value}", name)
    return value


def _duration(name: str, value: int) -> int | None:
    if value != NO_EXPIRY and value < 1:
        raise BadRequestError(f"input '{name}' must hold durations in ms >= 1, or {NO_EXPIRY} for none, "
                              f"got {value}", name)
    return None if value == NO_EXPIRY else value


def _check_lengths(vectors: Mapping[str, Sequence[int] | None]) -> int:
    """How many ranges: starts, ends and priorities given together, durations optional, one length."""
    starts = vectors.get(STARTS)
    if starts is None:
        named = [name for name in RANGE_INPUTS if vectors.get(name) is not None]
        if named:
            raise BadRequestError(f"input '{named[0]}' needs '{STARTS}' (the ranges' starts)", named[0])
        return 0
    for name in (ENDS, PRIORITIES, DURATIONS):
        values = vectors.get(name)
        if values is None and name != DURATIONS:
            raise BadRequestError(f"input '{name}' is required with '{STARTS}'", name)
        if values is not None and len(values) != len(starts):
            raise BadRequestError(f"input '{name}' must have as many values as '{STARTS}' ({len(starts)}), "
                                  f"got {len(values)}", name)
    return len(starts)


def _token_ranges(vectors: Mapping[str, Sequence[int] | None]) -> tuple[TokenRangeRetention, ...]:
    n = _check_lengths(vectors)
    starts, ends, priorities = (vectors.get(name) or () for name in (STARTS, ENDS, PRIORITIES))
    durations = vectors.get(DURATIONS) or [NO_EXPIRY] * n
    ranges = []
    for start, end, priority, duration in zip(starts, ends, priorities, durations):
        if start < 0:
            raise BadRequestError(f"input '{STARTS}' must hold token positions >= 0, got {start}", STARTS)
        if end != NO_END and end <= start:
            raise BadRequestError(f"input '{ENDS}' must hold ends > their starts, or {NO_END} for the prompt's "
                                  f"end, got [{start}, {end})", ENDS)
        ranges.append(TokenRangeRetention(start, None if end == NO_END else end, _priority(PRIORITIES, priority),
                                          _duration(DURATIONS, duration)))
    return tuple(ranges)


def retention_from_inputs(vectors: Mapping[str, Sequence[int] | None],
                          decode: Mapping[str, int | None]) -> RetentionConfig | None:
    """The RetentionConfig one request's inputs give (vectors: the four range inputs, decode: the two
    scalars; None where not sent), or None when none is sent."""
    ranges = _token_ranges(vectors)
    priority, duration = decode.get(DECODE_PRIORITY), decode.get(DECODE_DURATION)
    if not ranges and priority is None and duration is None:
        return None
    try:
        return RetentionConfig(ranges, RETENTION_PRIORITY_DEFAULT if priority is None else
                               _priority(DECODE_PRIORITY, priority),
                               None if duration is None else _duration(DECODE_DURATION, duration))
    except FieldError as exc:  # overlapping ranges: the only rule left to RetentionConfig
        raise BadRequestError(f"input '{STARTS}': the ranges {exc.rule}", STARTS) from None


def retention_arrays(config: RetentionConfig) -> dict[str, np.ndarray[Any, Any]]:
    """The six inputs (INT32, a batch of one) that read back as config: what a client sends."""
    ranges = config.token_ranges
    vectors = {STARTS: [r.token_start for r in ranges],
               ENDS: [NO_END if r.token_end is None else r.token_end for r in ranges],
               PRIORITIES: [r.priority for r in ranges],
               DURATIONS: [NO_EXPIRY if r.duration_ms is None else r.duration_ms for r in ranges]}
    arrays = {name: np.asarray([values], dtype=np.int32) for name, values in vectors.items() if ranges}
    decode_ms = NO_EXPIRY if config.decode_duration_ms is None else config.decode_duration_ms
    return arrays | {DECODE_PRIORITY: np.asarray([[config.decode_priority]], dtype=np.int32),
                     DECODE_DURATION: np.asarray([[decode_ms]], dtype=np.int32)}
