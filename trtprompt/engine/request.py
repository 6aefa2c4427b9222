"""Requests, sampling parameters and the outputs the engine hands back."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from trtprompt.engine.guide import check_guide
from trtprompt.error_codes import ErrorCode, FieldError

if TYPE_CHECKING:  # for annotations only: nothing else here needs torch or llguidance loaded
    import torch
    from llguidance import LLMatcher

    from trtprompt.engine.lora.adapter import LoraAdapter
    from trtprompt.engine.speculation.ngram import NgramIndex


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
    # Beam search's (SamplingParams.length_penalty); checked by the edges that take it without beams too.
    "length_penalty": Bound(-100.0, 100.0),
}


# The most top log probabilities one token may ask for (OpenAI's top_logprobs bound; vLLM's max_logprobs
# default). Each costs a (token id, log probability) pair per token on the wire.
MAX_LOGPROBS = 20
# The most bytes of raw logits one request may ask for (return_context_logits, return_generation_logits):
# they travel in one frame of the engine protocol (its limit 64 MiB, base64 adds a third).
MAX_LOGITS_BYTES = 32 * 1024 * 1024
# The most sequences one request may ask for (OpenAI's n and best_of, Triton's num_return_sequences); the
# engine also refuses more than its max_batch_size (validation.py), since they run side by side.
MAX_SEQUENCES = 128


# What beam search does not combine with yet, and each field's value when it is off: refused, not ignored.
BEAM_SEARCH_EXCLUDES: tuple[tuple[str, object], ...] = (
    ("top_k", None), ("top_p", None), ("min_p", 0.0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0), ("min_tokens", 0), ("stop_token_ids", ()), ("logprobs", None),
    ("prompt_logprobs", None), ("logit_bias", ()), ("bad_words", ()), ("allowed_token_ids", None),
    ("return_context_logits", False), ("return_generation_logits", False), ("guide_type", None))


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
    # Sequences generated from the one prompt, prefilled once (engine.py, "forks"); each samples
    # with its own generator, seeded seed + index.
    n: int = 1
    # Log probabilities of each output token (None: none; 0: the chosen token's; k: also the k most
    # likely), and of each prompt token after the first. Taken from the model's logits before any
    # processing (temperature, penalties, bias, masks): vLLM's default "raw" mode (docs/logprobs.md).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # (token id, bias) added to that token's logit before choosing (OpenAI logit_bias, TensorRT-LLM's
    # embedding bias); sorted by id, one entry per id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Token sequences never generated: the last token of each is banned where the output so far ends
    # with the rest of it (a one-token word is always banned).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Only these token ids may be chosen (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: tuple[int, ...] | None = None
    # A matched stop word stays in the output (vLLM's include_stop_str_in_output).
    include_stop_in_output: bool = False
    # Beam search over beam_width beams (1: none); n of them are returned, best first. length_penalty
    # and early_stopping as transformers' and TensorRT-LLM's (engine/beam_search.py).
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # TensorRT-LLM's raw logits outputs: every prompt position's ([prompt tokens, vocab]) and each
    # output token's ([output tokens, vocab]), float32, before any processing; bounded by
    # MAX_LOGITS_BYTES per request (validation.py).
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # Guided decoding (engine/guide.py, docs/structured-outputs.md): the output matches the guide of this
    # type (tensorrtllm_backend's guided_decoding_guide_type / guided_decoding_guide); guide_after holds it
    # only after that text (a reasoning model's end-of-thinking tag), anything before.
    guide_type: str | None = None
    guide: str | None = None
    guide_after: str | None = None
    # False: this request takes no drafts where the engine speculates (docs/speculative-decoding.md); its
    # greedy tokens are the same either way, its sampled ones are drawn from the same distribution.
    speculative_decoding: bool = True

    def __post_init__(self) -> None:
        scoring_only = self.max_tokens == 0 and self.prompt_logprobs is not None
        if not isinstance(self.max_tokens, int) or (self.max_tokens <= 0 and not scoring_only):
            raise FieldError("max_tokens", f"must be a positive integer (0 only with prompt_logprobs), "
                                           f"got {self.max_tokens!r}")
        self._check_vocabulary_controls()
        check_guide(self.guide_type, self.guide, self.guide_after)
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

    def _check_vocabulary_controls(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SEQUENCES:
            raise FieldError("n", f"must be an integer in [1, {MAX_SEQUENCES}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise FieldError(name, f"must be an integer in [0, {MAX_LOGPROBS}] or unset, got {k!r}")
        self._check_beams()
        ids = [t for t, _ in self.logit_bias]
        if any(t < 0 for t in ids) or len(set(ids)) != len(ids):
            raise FieldError("logit_bias", "must map distinct token ids >= 0 to biases")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise FieldError("logit_bias", "biases must be finite numbers")
        if any(len(w) == 0 or min(w) < 0 for w in self.bad_words):
            raise FieldError("bad_words", "must be non-empty token sequences of ids >= 0")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise FieldError("allowed_token_ids", "must be a non-empty list of token ids >= 0")

    def _check_beams(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or \
                not 1 <= self.beam_width <= MAX_SEQUENCES:
            raise FieldError("beam_width", f"must be an integer in [1, {MAX_SEQUENCES}], got {self.beam_width!r}")
        check_bound("length_penalty", self.length_penalty)
        if self.early_stopping not in (True, False, "never"):
            raise FieldError("early_stopping", f"must be true, false or \"never\", got {self.early_stopping!r}")
        if self.beam_width == 1:
            return
        if self.n > self.beam_width:
            raise FieldError("n", f"({self.n}) must be at most beam_width ({self.beam_width}): the beams returned")
        unsupported = [name for name, off in BEAM_SEARCH_EXCLUDES if getattr(self, name) != off]
        if unsupported:
            raise FieldError(unsupported[0], "is not supported with beam search (beam_width > 1) yet")

    def token_ids_named(self) -> list[int]:
        """Every token id this request names outside its prompt (the engine checks them against its vocabulary)."""
        named = [t for t, _ in self.logit_bias] + [t for w in self.bad_words for t in w]
        return named + list(self.allowed_token_ids or ()) + list(self.extra_end_ids)

    @property
    def has_vocabulary_controls(self) -> bool:
        return bool(self.logit_bias or self.bad_words) or self.allowed_token_ids is not None

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
    # Speculative decoding: draft tokens verified for this request, and those accepted (TensorRT-LLM's
    # per-request total_draft_tokens / total_accepted_draft_tokens).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log probability: the token there, its value and the `top` most likely
    (token id, log probability) pairs, most likely first (as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One update for a request: the tokens new since the last update.

    With n > 1 a request's sequences report apart (sequence_index); `finished` is set once, on
    the output that finishes the last of them, `sequence_finished` on each sequence's own last.
    """

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
    sequence_index: int = 0
    sequence_finished: bool = False
    # With params.logprobs set: one per new token, and the sum over the whole output so far.
    logprobs: list[TokenLogprob] | None = None
    cum_logprob: float | None = None
    # With params.prompt_logprobs set, on the first output of each sequence: one per prompt token,
    # None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Raw float32 logits: the prompt's [prompt tokens, vocab] once, the new tokens' [new tokens, vocab].
    context_logits: torch.Tensor | None = None
    generation_logits: torch.Tensor | None = None
    # With params.logprobs set, on the output of a sequence the end token finished: that token's
    # log probability (the token is not in the output, TensorRT-LLM's rule; vLLM reports it).
    end_logprob: TokenLogprob | None = None


class Request:
    """Engine-internal state of one request. Not thread-safe: the engine loop owns it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_output_tokens: int, end_ids: frozenset[int], cache_salt: str | None,
                 arrival_time_ns: int, warning: str | None = None,
                 retention: RetentionConfig | None = None, group_id: str | None = None,
                 sequence_index: int = 0, lora: LoraAdapter | None = None) -> None:
        self.request_id = request_id  # unique in the engine; a sequence of n > 1 has its own
        self.group_id = request_id if group_id is None else group_id  # the id its outputs carry
        self.sequence_index = sequence_index
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_output_tokens = max_output_tokens
        self.end_ids = end_ids
        self.cache_salt = cache_salt
        self.lora = lora  # its LoRA adapter (engine/lora/); None: the base model
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
        # A sequence forked from another's prompt (engine.py): admitted on that request's blocks.
        self.fork_of: Request | None = None
        self.held_fork = False  # a sequence 1.. waiting for sequence 0's prompt, not yet scheduled
        # Its outputs carry log probabilities or logits (decided once: a plain request's output skips them).
        self.reports_extras = (params.logprobs is not None or params.prompt_logprobs is not None
                               or params.return_context_logits or params.return_generation_logits)
        # sampler.vocabulary_tensors: (bias ids, biases, allowed ids), made once
        self.vocabulary: tuple[torch.Tensor | None, ...] | None = None
        self.token_logprobs: list[TokenLogprob] = []  # params.logprobs: one per output token
        self.cum_emitted = 0.0  # the sum of the emitted tokens' log probabilities
        self.stopped_by_word = False  # finished by a stop word (kept in the output or not)
        self.end_logprob: TokenLogprob | None = None  # the end token's that finished it (params.logprobs)
        # params.prompt_logprobs: the log probabilities of prompt tokens 1, 2, ... computed so far
        self.prompt_logprobs: list[TokenLogprob] = []
        self.prompt_rows_done = 0  # prompt positions whose logits were consumed (prompt_rows_wanted)
        self.prompt_extras_sent = False  # prompt log probabilities / context logits, sent once
        self.context_logits: list[torch.Tensor] = []  # params.return_context_logits: per chunk
        self.generation_logits: list[torch.Tensor] = []  # params.return_generation_logits: per token
        self.matcher: LLMatcher | None = None  # params.guide_type: this sequence's grammar state (engine/guided.py)
        # Speculative decoding (engine/speculation/): tokens proposed to follow all_token_ids when it held
        # drafts_at tokens (stale once it holds more), the adaptive draft length, the own n-gram index and
        # this request's sequence in it.
        self.draft_token_ids: list[int] = []
        self.drafts_at: int | None = None
        self.draft_len: int | None = None
        self.ngram: tuple[NgramIndex, int] | None = None

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name

    @property
    def reuses_prefix(self) -> bool:
        """False when every prompt position must be computed (its prompt log probabilities or context
        logits need their logits)."""
        return self.params.prompt_logprobs is None and not self.params.return_context_logits

    @property
    def prompt_rows_wanted(self) -> int:
        """Prompt positions whose logits this request needs: all for context logits, all but the last
        for prompt log probabilities (position p scores token p + 1), none otherwise."""
        if self.sequence_index != 0:
            return 0  # a request's other sequences share its prompt
        if self.params.return_context_logits:
            return self.num_prompt_tokens
        return self.num_prompt_tokens - 1 if self.params.prompt_logprobs is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def drafts(self) -> list[int]:
        """The draft tokens to verify with the next token's step (none once tokens came after them)."""
        return self.draft_token_ids if self.drafts_at == len(self.all_token_ids) else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.all_token_ids.append(token_id)
        self.num_output += 1
        if logprob is not None:
            self.token_logprobs.append(logprob)
