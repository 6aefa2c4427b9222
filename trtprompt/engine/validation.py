"""Admission checks with TensorRT-LLM's wording; pure, so any thread may call them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from trtprompt.engine.errors import EngineRequestError, InputTooLongError
from trtprompt.engine.request import MAX_LOGITS_BYTES, SamplingParams
from trtprompt.error_codes import FieldError

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from trtprompt.engine.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class RequestLimits:
    max_input_len: int
    max_seq_len: int
    vocab_size: int
    num_blocks: int
    tokens_per_block: int
    max_batch_size: int | None = None  # a request's n sequences run side by side: at most this many


@dataclass(frozen=True)
class ValidatedRequest:
    """A prompt and parameters that passed validate_request, with the output it was granted.

    The engine admits one as it is: a request is validated once, where it enters (the
    caller's thread for EngineLoop.add, so a refusal is raised to that caller at once).
    The prompt is a tuple, so what runs is what was checked."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_output_tokens: int
    warning: str | None
    matcher: LLMatcher | None = None  # a guided request's, compiled at admission (engine/guided.py)
    lora: LoraAdapter | None = None  # its LoRA adapter, read where it was checked (engine/lora/manager.py)


def validate_request(prompt: Sequence[int], params: SamplingParams, limits: RequestLimits) -> ValidatedRequest:
    """The request with the output tokens granted and any warning, or raise EngineRequestError.

    The one bounds rule for every entry point (generate, serve, the OpenAI API):
    max_tokens no prompt could leave room for is refused; otherwise a prompt +
    output past max_seq_len shortens the output, with a warning (TensorRT-LLM).
    """
    tokens = tuple(prompt)  # a copy first: a caller changing its list later changes nothing checked
    bound = limits.max_seq_len - 1
    if params.max_tokens > bound:
        raise EngineRequestError(f"max_tokens ({params.max_tokens}) exceeds the engine's maximum output length "
                                 f"({bound} = max_seq_len - 1)")
    n = len(tokens)
    if n == 0:
        raise EngineRequestError("prompt is empty: at least one input token is required")
    if n > limits.max_input_len:
        raise InputTooLongError(n, limits.max_input_len)
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise EngineRequestError(f"input token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if params.end_id is not None and not 0 <= params.end_id < limits.vocab_size:
        raise EngineRequestError(f"end_id {params.end_id} is outside the vocabulary [0, {limits.vocab_size})")
    _check_sequences(params, limits)
    max_out, warning = params.max_tokens, None
    if n + max_out > limits.max_seq_len:
        max_out = limits.max_seq_len - n
        warning = (f"prompt length ({n}) + max_tokens ({params.max_tokens}) exceeds max_seq_len "
                   f"({limits.max_seq_len}); output shortened to {max_out} tokens")
    capacity = limits.num_blocks * limits.tokens_per_block
    if n + max_out > capacity:
        raise EngineRequestError(
            f"prompt length ({n}) + output ({max_out}) needs {n + max_out} KV-cache tokens, "
            f"more than the whole cache holds ({capacity} tokens in {limits.num_blocks} blocks)")
    _check_beams_fit(n + max_out, params, limits)
    _check_logits_size(n, max_out, params, limits)
    return ValidatedRequest(tokens, params, max_out, warning)


def _check_beams_fit(tokens: int, params: SamplingParams, limits: RequestLimits) -> None:
    """A beam search steps only with all its beams' KV in the cache at once: refuse one the cache
    cannot hold (counting no sharing, as beams may diverge from the first token)."""
    if params.beam_width == 1:
        return
    per_beam = -(-tokens // limits.tokens_per_block)
    if params.beam_width * per_beam > limits.num_blocks:
        raise EngineRequestError(
            f"beam_width ({params.beam_width}) x {per_beam} KV blocks per beam (prompt + output {tokens} tokens) "
            f"is more than the whole cache holds ({limits.num_blocks} blocks): lower beam_width or max_tokens")


def _check_sequences(params: SamplingParams, limits: RequestLimits) -> None:
    """n within max_batch_size, and every token id the parameters name inside the vocabulary."""
    for name in ("n", "beam_width"):
        value = getattr(params, name)
        if limits.max_batch_size is not None and value > limits.max_batch_size:
            raise FieldError(name, f"({value}) exceeds the engine's max_batch_size ({limits.max_batch_size}): "
                                   "a request's sequences run side by side")
    if params.n > 1 and params.max_tokens == 0:
        raise FieldError("n", "must be 1 when max_tokens is 0 (prompt scoring generates no sequence)")
    bad = next((t for t in params.token_ids_named() if t >= limits.vocab_size), None)
    if bad is not None:
        raise EngineRequestError(f"token id {bad} in the sampling parameters is outside the vocabulary "
                                 f"[0, {limits.vocab_size})")


def _check_logits_size(prompt: int, output: int, params: SamplingParams, limits: RequestLimits) -> None:
    """Raw logits travel whole: refuse what would pass MAX_LOGITS_BYTES, naming the input and the bound."""
    # Context logits come once (sequence 0); generation logits for each of the n sequences.
    for name, asked, rows, shorter in (("return_context_logits", params.return_context_logits, prompt, "prompt"),
                                       ("return_generation_logits", params.return_generation_logits,
                                        output * params.n, "max_tokens or n")):
        size = rows * limits.vocab_size * 4
        if asked and size > MAX_LOGITS_BYTES:
            raise FieldError(name, f"asks for {rows} x {limits.vocab_size} float32 logits ({size} bytes), more than "
                                   f"the {MAX_LOGITS_BYTES} bytes a request may return (MAX_LOGITS_BYTES): send "
                                   f"a shorter {shorter}")
