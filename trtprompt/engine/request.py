"""Requests, sampling parameters and the outputs the engine hands back."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trtprompt.error_codes import ErrorCode, FieldError

if TYPE_CHECKING:  # for one annotation only: nothing else here needs torch loaded
    import torch


@dataclass(frozen=True)
class Bound:
    """Allowed range of a float sampling input; every value must also be finite (a NaN or inf
    reaching the sampler would fail the whole batch's step, issue 11)."""

    low: float
    high: float
    low_open: bool = False  # True: the low end itself is refused

    def allows(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return (value > self.low if self.low_open else value >= self.low) and value <= self.high

    def describe(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# The one table of float bounds: SamplingParams and the serving edge both check against it.
# Penalties are bounded generously (OpenAI allows +-2); beyond these a value only means garbage.
FLOAT_BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, 100.0),
    "top_p": Bound(0.0, 1.0),
    "min_p": Bound(0.0, 1.0),
    "repetition_penalty": Bound(0.0, 100.0, low_open=True),
    "presence_penalty": Bound(-100.0, 100.0),
    "frequency_penalty": Bound(-100.0, 100.0),
    # Only used by beam search, which the torch target lacks: accepted, checked, no effect.
    "length_penalty": Bound(-100.0, 100.0),
}


def check_bound(field_name: str, value: float) -> None:
    """Raise FieldError naming field_name if value is outside its bound."""
    bound = FLOAT_BOUNDS[field_name]
    if not bound.allows(float(value)):
        raise FieldError(field_name, f"must be a finite number in {bound.describe()}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation controls, named as TensorRT-LLM's inputs.

    As in TensorRT-LLM, decoding is greedy unless `top_k` > 1 or `top_p` > 0
    asks for sampling; `temperature` only shapes a sampled distribution and
    0 forces greedy.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_id: int | None = None
    # Each stop word is a token sequence; a match ends generation and is
    # trimmed from the output.
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    # Keep tokens whose probability is at least min_p x the most likely one's (transformers' MinPLogitsWarper).
    min_p: float = 0.0
    # The end token no longer ends the request: it is generated and kept, as vLLM's ignore_eos does.
    ignore_eos: bool = False
    # Token ids that end the request as the end token does, not kept in the output (vLLM's and
    # SGLang's stop_token_ids; what transformers does with extra eos_token_id entries).
    extra_end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise FieldError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            check_bound(name, getattr(self, name))
        if self.top_p is not None:
            check_bound("top_p", self.top_p)
        check_bound("min_p", self.min_p)
        if self.top_k is not None and self.top_k < 0:
            raise FieldError("top_k", f"must be >= 0, got {self.top_k}")
        if self.min_tokens < 0:
            raise FieldError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise FieldError("seed", f"must be in [0, 2**64), got {self.seed}")
        if any(len(s) == 0 for s in self.stop_token_ids):
            raise FieldError("stop_token_ids", "must not contain an empty sequence")
        if any(t < 0 for t in self.extra_end_ids):
            raise FieldError("extra_end_ids", f"must be token ids >= 0, got {list(self.extra_end_ids)}")

    def end_ids(self, model_end_ids: frozenset[int]) -> frozenset[int]:
        """The ids that end this request: its end_id or the model's end tokens (none with
        ignore_eos), and its extra_end_ids."""
        own = frozenset([self.end_id]) if self.end_id is not None else model_end_ids
        return (frozenset() if self.ignore_eos else own) | frozenset(self.extra_end_ids)

    @property
    def greedy(self) -> bool:
        wants_sampling = (self.top_k or 0) > 1 or (self.top_p or 0.0) > 0.0
        return self.temperature == 0.0 or not wants_sampling

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# TensorRT-LLM's retention priorities (KvCacheRetentionConfig): higher is evicted later.
RETENTION_PRIORITY_MIN = 0
RETENTION_PRIORITY_MAX = 100
RETENTION_PRIORITY_DEFAULT = 35


def _check_retention(field_name: str, priority: int, duration_ms: int | None) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            RETENTION_PRIORITY_MIN <= priority <= RETENTION_PRIORITY_MAX):
        raise FieldError(f"{field_name}.priority" if field_name != "decode" else "decode_priority",
                         f"must be an integer in [{RETENTION_PRIORITY_MIN}, {RETENTION_PRIORITY_MAX}], "
                         f"got {priority!r}")
    if duration_ms is not None and (isinstance(duration_ms, bool) or not isinstance(duration_ms, int)
                                    or duration_ms <= 0):
        raise FieldError(f"{field_name}.duration_ms" if field_name != "decode" else "decode_duration_ms",
                         f"must be a positive integer (milliseconds) or unset, got {duration_ms!r}")


@dataclass(frozen=True)
class TokenRangeRetention:
    """Priority for the prompt's blocks whose first token lies in [token_start, token_end).

    token_end None: to the end of the prompt. duration_ms: how long after each release of
    a block the priority lasts before reverting to the default (None: until evicted).
    """

    token_start: int
    token_end: int | None
    priority: int
    duration_ms: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.token_start, bool) or not isinstance(self.token_start, int) or self.token_start < 0:
            raise FieldError("token_ranges.token_start", f"must be an integer >= 0, got {self.token_start!r}")
        if self.token_end is not None and (isinstance(self.token_end, bool) or not isinstance(self.token_end, int)
                                           or self.token_end <= self.token_start):
            raise FieldError("token_ranges.token_end",
                             f"must be an integer > token_start ({self.token_start}) or unset, got {self.token_end!r}")
        _check_retention("token_ranges", self.priority, self.duration_ms)

    def covers(self, token: int) -> bool:
        return self.token_start <= token and (self.token_end is None or token < self.token_end)


@dataclass(frozen=True)
class RetentionConfig:
    """Per-request KV retention, as TensorRT-LLM's KvCacheRetentionConfig.

    Prompt blocks take the priority of the range holding their first token (none: the
    block keeps the priority it has, the default for a new one); blocks starting past the
    prompt take decode_priority. Ranges are kept sorted by start and must not overlap.
    """

    token_ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = RETENTION_PRIORITY_DEFAULT
    decode_duration_ms: int | None = None

    def __post_init__(self) -> None:
        ranges = tuple(sorted(self.token_ranges, key=lambda r: r.token_start))
        for a, b in zip(ranges, ranges[1:]):
            if a.token_end is None or a.token_end > b.token_start:
                raise FieldError("token_ranges", f"must not overlap: [{a.token_start}, {a.token_end}) and "
                                 f"[{b.token_start}, {b.token_end})")
        object.__setattr__(self, "token_ranges", ranges)
        _check_retention("decode", self.decode_priority, self.decode_duration_ms)

    def for_block(self, index: int, tokens_per_block: int, num_prompt_tokens: int) -> tuple[int, int | None] | None:
        """(priority, duration_ms) for the block at index of a table, or None to leave it as it is.

        A linear scan of the ranges: a request names a handful, and this runs once per claimed block.
        """
        first = index * tokens_per_block
        if first >= num_prompt_tokens:
            return self.decode_priority, self.decode_duration_ms
        for r in self.token_ranges:
            if r.covers(first):
                return r.priority, r.duration_ms
        return None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # end_id or a stop word
    LENGTH = "length"      # max_tokens (possibly shortened by max_seq_len)
    ABORTED = "aborted"
    ERROR = "error"


@dataclass
class RequestStats:
    """What TensorRT-LLM reports per request with return_perf_metrics."""

    arrival_time_ns: int = 0
    first_scheduled_time_ns: int | None = None
    first_token_time_ns: int | None = None
    last_token_time_ns: int | None = None
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    prefill_tokens_computed: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """One update for a request: the tokens new since the last update."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: ErrorCode | None = None  # set with error
    # Set when prompt + max_tokens exceeded max_seq_len and the output was shortened.
    warning: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    # STOP by the end token rather than a stop word (monitoring counts them apart).
    stopped_by_end_id: bool = False


class Request:
    """Engine-internal state of one request. Not thread-safe: the engine loop owns it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_output_tokens: int, end_ids: frozenset[int], cache_salt: str | None,
                 arrival_time_ns: int, warning: str | None = None,
                 retention: RetentionConfig | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_output_tokens = max_output_tokens
        self.end_ids = end_ids
        self.cache_salt = cache_salt
        self.warning = warning
        self.retention = retention
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_emitted = 0
        self.num_output = 0
        self.stop_trim = 0  # tokens of a matched stop word removed from the output
        self.block_hashes: list[bytes] = []
        self.reserved_blocks = 0
        self.tier_checked = False  # its prefix was looked up below the pool once (engine/tiers/)
        self.generator: torch.Generator | None = None  # the sampler's, seeded on first use
        self.stats = RequestStats(arrival_time_ns=arrival_time_ns)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_output += 1
