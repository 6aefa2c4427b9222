"""Guided decoding in the engine (docs/structured-outputs.md), on llguidance.

- GuideCompiler: a request's guide becomes a matcher at admission (LLMEngine.check_request runs in the
  submitting thread, never the step loop), from a cache keyed by the guide's digest; a compile runs in a
  worker thread (llguidance drops the GIL while it builds) and is bounded in time.
- guide_masks: each step, every guided row's allowed tokens in one parallel pass (llguidance's executor),
  applied to the logits in one vectorized operation; `apply_masks_reference` is the plain per-token rule
  tests compare it with.
- The engine advances each matcher on the token it accepted (engine.py) and appends the tokens the grammar
  forces (jump-forward) as one chunk computed on the next step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from trtprompt.engine.guide import grammar_of
from trtprompt.engine.request import Request, SamplingParams
from trtprompt.error_codes import FieldError

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

log = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first): a service sends a few schemas many times.
GRAMMAR_CACHE_SIZE = 256
# A guide that does not compile in this long is refused (an adversarial or runaway schema); its compile
# may still finish in its worker, and then serves the next identical guide from the cache.
COMPILE_TIMEOUT_S = 10.0


class GuideCompiler:
    """The engine's guides: its llguidance tokenizer (made once, on the first guided request), the
    compile cache and the mask executor. Thread-safe: check_request may run in any thread."""

    def __init__(self, tokenizer_dir: Path | None, end_ids: Sequence[int], vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.end_ids = sorted(end_ids)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Future[LLMatcher]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: LLTokenizer | None = None
        self._markers: dict[str, int] = {}  # the tokenizer's added tokens, text -> id (guide.with_marker_tokens)
        self._executor: LLExecutor | None = None
        self.compiles = 0  # grammars compiled (not served from the cache), for tests and stats

    def matcher(self, params: SamplingParams) -> LLMatcher:
        """A fresh matcher for a guided request, or FieldError('guide') naming what is wrong."""
        assert params.guide_type is not None  # callers check; the guide itself was checked by SamplingParams
        key = hashlib.sha256("\0".join([params.guide_type, params.guide or "", params.guide_after or ""])
                             .encode()).digest()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool_now().submit(self._compile, params)
                self._cache[key] = future
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            template = future.result(timeout=COMPILE_TIMEOUT_S)
        except FutureTimeout:
            raise FieldError("guide", f"did not compile within {COMPILE_TIMEOUT_S:g} s (COMPILE_TIMEOUT_S): "
                                      "simplify the schema or grammar") from None
        except FieldError as exc:  # a new one each time: re-raising the cached one would grow its traceback
            raise FieldError(exc.field, exc.rule) from None
        return template.deep_copy()

    def _pool_now(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="guide-compile")
        return self._pool

    def _compile(self, params: SamplingParams) -> LLMatcher:
        from llguidance import LLMatcher, LLParserLimits

        assert params.guide_type is not None
        tokenizer = self.tokenizer()
        grammar = grammar_of(params.guide_type, params.guide, params.guide_after, self._markers)
        # llguidance's own bounds on grammar size and per-step work (a guide past them ends its request);
        # errors without the grammar's text, which is the client's and may be large.
        limits = LLParserLimits(verbose_errors=False)
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise FieldError("guide", f"is not a valid {params.guide_type} guide: {_first_line(matcher.get_error())}")
        self.compiles += 1
        return matcher

    def tokenizer(self) -> LLTokenizer:
        """The llguidance view of the engine's tokenizer (about 0.5 s to make, once)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def _load_tokenizer(self) -> LLTokenizer:
        """From the checkpoint's tokenizer.json directly (transformers is not imported: it took seconds in the
        engine process); a model vocabulary padded past the tokenizer's leaves those ids never allowed."""
        from llguidance import LLTokenizer

        path = None if self.tokenizer_dir is None else self.tokenizer_dir / "tokenizer.json"
        if path is None or not path.is_file():
            raise FieldError("guide_type", "guided decoding needs the engine's tokenizer (tokenizer.json), and "
                                           "this engine has none")
        text = path.read_text(encoding="utf-8")
        added = json.loads(text).get("added_tokens") or []
        self._markers = {t["content"]: t["id"] for t in added if isinstance(t.get("content"), str)
                         and len(t["content"]) > 1 and isinstance(t.get("id"), int)}
        eos = self.end_ids or None
        tokenizer = LLTokenizer(text, eos_token=eos)
        if tokenizer.vocab_size < self.vocab_size:
            tokenizer = LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        return tokenizer

    def executor(self) -> LLExecutor:
        if self._executor is None:
            from llguidance import LLExecutor

            # As many threads as torch's: the model is idle while masks fill (llguidance's default, 80 % of
            # the CPUs, is one thread on two cores).
            self._executor = LLExecutor(num_threads=max(1, torch.get_num_threads()))
        return self._executor

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(message: str) -> str:
    """llguidance's error, on one line and bounded (its later lines quote the client's own grammar)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3])[:400] if lines else "unknown error"


def _penalty_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit b (low bit first) is set and -inf where not. A mask's
    bytes become additive penalties by one index_select; masked_fill over a bool tensor of the whole vocab
    measured 8x slower (docs/structured-outputs.md, "Cost per step")."""
    values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    bits = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool()
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(~bits, float("-inf")).to(device)


def fill_masks(compiler: GuideCompiler, reqs: Sequence[Request]) -> torch.Tensor:
    """[len(reqs), words] int32 bitmasks of each matcher's allowed tokens, filled in one parallel pass
    (llguidance's executor writes them in place). The tokenizer's end tokens are the request's own: allowed
    where the matcher accepts the output so far, never where the request does not end on them (ignore_eos,
    its own end_id)."""
    words = (compiler.tokenizer().vocab_size + 31) // 32
    masks = torch.full((len(reqs), words), -1, dtype=torch.int32)
    matchers = [(r.matcher, i) for i, r in enumerate(reqs) if r.matcher is not None]
    compiler.executor().unsafe_compute_mask_ptr(matchers, masks.data_ptr(), words * 4, len(reqs))
    for i, req in enumerate(reqs):
        accepting = req.matcher is not None and req.matcher.is_accepting()
        for t in set(compiler.end_ids) | req.end_ids:
            _set_bit(masks, i, t, accepting and t in req.end_ids)
    return masks


def _set_bit(masks: torch.Tensor, row: int, token: int, allowed: bool) -> None:
    word = int(masks[row, token // 32]) & 0xFFFFFFFF
    word = word | 1 << (token % 32) if allowed else word & ~(1 << (token % 32))
    masks[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32's bit 31 is its sign


def mask_penalties(masks: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, words] int32 bitmasks (little-endian words) -> [rows, vocab] additive penalties: 0 allowed, -inf not."""
    as_bytes = masks.contiguous().view(torch.uint8).reshape(-1).long()
    table = _penalty_table(dtype, as_bytes.device)
    return table.index_select(0, as_bytes).view(masks.shape[0], -1)[:, :vocab]


def apply_masks(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> None:
    """In place: every token a row's mask disallows gets -inf (one add over the guided rows)."""
    penalties = mask_penalties(masks, logits.shape[1], logits.dtype).to(logits.device)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.add_(penalties)
        return
    index = torch.tensor(list(rows), dtype=torch.long)
    logits[index] = logits[index] + penalties


def apply_masks_reference(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> None:
    """The rule apply_masks implements, token by token: bit t % 32 of word t // 32 allows token t."""
    words = masks.tolist()
    for r, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (words[r][t // 32] >> (t % 32)) & 1:
                logits[row, t] = float("-inf")


def guide_rows(logits: torch.Tensor, reqs: Sequence[Request], compiler: GuideCompiler) -> None:
    """Mask every guided row of a step's logits (rows: one per request, reqs' order). Should the masks fail,
    the guided rows are all -inf: those requests fail in the sampler, the batch's other rows go on."""
    guided = [i for i, r in enumerate(reqs) if r.matcher is not None]
    if not guided:
        return
    try:
        apply_masks(logits, guided, fill_masks(compiler, [reqs[i] for i in guided]))
    except Exception:  # noqa: BLE001 - fails the guided requests only
        log.exception("guided decoding masks failed; failing the %d guided requests of this step", len(guided))
        logits[torch.tensor(guided, dtype=torch.long)] = float("-inf")
