"""The draft engine of speculative_decoding draft_target: a smaller model with the target's vocabulary drafts
each speculating request's next tokens greedily, in batched forwards over its own paged KV cache.

Per target request it keeps a mirror Request (its own id) whose all_token_ids are the target's tokens and the
drafts so far, so the engine's ModelRunner and KVCacheManager run it unchanged. Each propose() first rolls a
mirror back to the longest prefix its KV shares with the target's tokens (drafts the target rejected drop out),
catches it up, then takes one argmax token per forward until each request has its k drafts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from trtprompt.engine.attention import allocate_kv_cache, resolve_attention_backend
from trtprompt.engine.config import DEFAULT_ATTENTION_BACKEND, EngineConfig, ModelConfig
from trtprompt.engine.engine_dir import EngineDir
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.loader import engine_config, read_engine_files
from trtprompt.engine.model import DTYPES, DecoderModel, load_engine_model
from trtprompt.engine.request import Request, SamplingParams
from trtprompt.engine.runner import ModelRunner
from trtprompt.engine.scheduler import ScheduledRequest, SchedulerOutput
from trtprompt.engine.speculation.config import SpeculationConfig
from trtprompt.knobs import NO_DRAFT_MODEL

log = logging.getLogger(__name__)

# A mirror samples nothing itself (drafts are argmax of its rows); it needs some params to be a Request.
MIRROR_PARAMS = SamplingParams(max_tokens=1)
# Differing tokens a refusal names, at most (a whole vocabulary would drown the message).
MAX_NAMED_TOKENS = 3


@dataclass
class _Mirror:
    """The draft side of one target request: target is the request it drafts for (identity, not id, so a
    later request reusing the id never inherits this KV); synced: the target's token count at the last
    propose, a prefix the mirror's tokens share with the target's for sure (a request's tokens only grow)."""

    target: Request
    request: Request
    synced: int = 0


@dataclass
class _Work:
    """One request's drafting in a propose(): where its drafts go, how many it wants."""

    index: int
    mirror: Request
    k: int


class DraftEngine:
    """Drafts greedily for the target's requests (the DraftModel protocol of drafting.py)."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_num_tokens: int, max_positions: int) -> None:
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.runner = runner
        self.kv = kv
        self.max_num_tokens = max_num_tokens  # per forward: the target's bound, so a draft step fits beside it
        self.max_positions = max_positions  # the draft model computes positions below this only
        self._mirrors: dict[str, _Mirror] = {}  # by target request id
        self.forward_failures = 0

    @classmethod
    def from_model(cls, model: DecoderModel, model_config: ModelConfig, kv_tokens: int, tokens_per_block: int,
                   max_num_tokens: int, attention_backend: str = DEFAULT_ATTENTION_BACKEND,
                   kv_cache_dtype: str = "auto", max_positions: int | None = None) -> DraftEngine:
        """A draft engine over a loaded model, with a KV pool of kv_tokens tokens (block reuse off: a mirror's
        blocks hold drafts nobody else shares). max_positions: the model's max_position_embeddings unless given."""
        num_blocks = kv_tokens // tokens_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_tokens ({kv_tokens}) must hold at least one block of {tokens_per_block} tokens")
        device = model.device
        backend = resolve_attention_backend(attention_backend, device, model_config.head_size, tokens_per_block)
        caches = allocate_kv_cache(model_config, num_blocks, tokens_per_block, model.dtype, device, kv_cache_dtype)
        runner = ModelRunner(model, caches, tokens_per_block, device, backend)
        kv = KVCacheManager(num_blocks, tokens_per_block, enable_block_reuse=False)
        return cls(runner, kv, max_num_tokens, max_positions or model_config.max_position_embeddings)

    def propose(self, requests: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to k argmax draft tokens for each (request, k). A request whose draft KV cannot be allocated
        drafts no further; a forward that raises leaves every request without drafts (the target goes on)."""
        drafts: list[list[int]] = [[] for _ in requests]
        try:
            work = []
            for i, (req, k) in enumerate(requests):
                # The last draft is never computed: positions up to num_tokens + k - 2 must exist.
                k = min(k, self.max_positions - req.num_tokens + 1)
                if k > 0:
                    work.append(_Work(i, self._sync(req), k))
            while work:
                work = self._forward(work, drafts)
        except Exception:  # noqa: BLE001 - drafts only save time: the target's step must not fail over them
            self._log_failure()
            return [[] for _ in requests]
        return drafts

    def release(self, request: Request) -> None:
        """Free the draft KV and mirror of a finished target request (a no-op for one that never drafted)."""
        entry = self._mirrors.pop(request.request_id, None)
        if entry is not None:
            self.kv.free(entry.request)

    @property
    def num_mirrors(self) -> int:
        return len(self._mirrors)

    def _sync(self, req: Request) -> Request:
        """req's mirror, rolled back to the longest prefix its KV shares with req's tokens (never past req's
        last token, whose row gives the first draft), then extended with req's tokens past it."""
        entry = self._mirrors.get(req.request_id)
        if entry is None or entry.target is not req:
            if entry is not None:
                self.kv.free(entry.request)
            entry = _Mirror(req, Request(f"draft/{req.request_id}", [], MIRROR_PARAMS, 1, frozenset(), None, 0))
            self._mirrors[req.request_id] = entry
        mirror, tokens = entry.request, req.all_token_ids
        keep = min(mirror.num_computed_tokens, len(tokens) - 1)
        start = min(entry.synced, keep)  # below synced the two agree: compare only what came after
        held = mirror.all_token_ids
        while start < keep and held[start] == tokens[start]:
            start += 1
        mirror.num_computed_tokens = start
        del held[start:]
        held.extend(tokens[start:])
        entry.synced = len(tokens)
        self.kv.trim(mirror)  # blocks only rejected drafts were written to
        self.kv.cache_computed(mirror)
        return mirror

    def _forward(self, work: list[_Work], drafts: list[list[int]]) -> list[_Work]:
        """One batched forward of every request's next tokens within max_num_tokens (a catch-up longer than
        what is left goes on in the next forward); returns the work still to do."""
        scheduled: list[tuple[ScheduledRequest, _Work]] = []
        later: list[_Work] = []
        budget = self.max_num_tokens
        for w in work:
            m = w.mirror
            n = min(m.num_tokens - m.num_computed_tokens, budget)
            if n == 0:
                later.append(w)
            elif self.kv.allocate(m, n):
                scheduled.append((ScheduledRequest(m, m.num_computed_tokens, n, is_context=True), w))
                budget -= n
        if not scheduled:
            return []
        logits = self.runner.execute(SchedulerOutput(scheduled=[s for s, _ in scheduled]), self.kv)
        tokens = iter(logits.sampled.argmax(dim=-1).tolist())
        for s, w in scheduled:
            samples = s.samples  # before the draft joins the mirror's tokens
            w.mirror.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed(w.mirror)
            if samples:
                token = int(next(tokens))
                w.mirror.all_token_ids.append(token)
                drafts[w.index].append(token)
            if len(drafts[w.index]) < w.k:
                later.append(w)
        return later

    def _log_failure(self) -> None:
        """Log the first failed forward with its traceback, then every power of two (no flood at each step)."""
        self.forward_failures += 1
        n = self.forward_failures
        if n == 1:
            log.exception("draft model forward failed; these requests go on without drafts")
        elif n & (n - 1) == 0:
            log.warning("draft model forward failed again (%d times so far); requests go on without drafts", n)


def open_draft_model(config: SpeculationConfig, target_files: EngineDir, target_config: EngineConfig) -> DraftEngine:
    """The draft engine config.draft_engine_dir names, on the target's device, after checking that it shares
    the target's vocabulary. Its KV pool holds the target's max_batch_size full-length sequences, or less
    where the draft engine's own KV budget is smaller."""
    if config.draft_engine_dir is None:
        raise ValueError(NO_DRAFT_MODEL)
    files = read_engine_files(config.draft_engine_dir)
    draft_model_config = ModelConfig.from_pretrained_config(files.pretrained_config)
    check_same_vocabulary(target_files, target_config.model, files, draft_model_config)
    overrides: dict[str, Any] = {"device": target_config.device, "linear_backend": target_config.linear_backend,
                                 "attention_backend": target_config.attention_backend}
    if target_config.kv_cache.memory_budget_bytes is not None:
        overrides["memory_budget_bytes"] = target_config.kv_cache.memory_budget_bytes
    cfg = engine_config(files, overrides)
    dtype = DTYPES[cfg.dtype]
    model = load_engine_model(files.weights_path, cfg.model, dtype, torch.device(cfg.device), cfg.linear_backend,
                              files.pretrained_config.get("quantization"))
    kv_dtype = cfg.kv_cache.kv_cache_dtype
    per_token = cfg.model.kv_bytes_per_token(torch.finfo(dtype).bits // 8, kv_dtype)
    target = target_config.scheduler
    num_blocks = cfg.kv_cache.num_blocks(per_token, target.max_batch_size, target.max_seq_len)
    tpb = cfg.kv_cache.tokens_per_block
    if cfg.scheduler.max_seq_len < target.max_seq_len:
        log.warning("draft engine %s: max_seq_len %d < the target's %d: longer sequences go on without drafts",
                    files.path, cfg.scheduler.max_seq_len, target.max_seq_len)
    engine = DraftEngine.from_model(model, cfg.model, num_blocks * tpb, tpb, target.max_num_tokens,
                                    cfg.attention_backend, kv_dtype, cfg.scheduler.max_seq_len)
    log.info("draft engine %s: %d layers, KV cache %d blocks of %d tokens", files.path,
             cfg.model.num_hidden_layers, num_blocks, tpb)
    return engine


def check_same_vocabulary(target: EngineDir, target_model: ModelConfig, draft: EngineDir,
                          draft_model: ModelConfig) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's: vocab_size, and where both engines'
    tokenizers list their token -> id maps (tokenizer.json or vocab.json), those maps."""
    target_vocab, draft_vocab = token_vocabulary(target.tokenizer_dir), token_vocabulary(draft.tokenizer_dir)
    differences = []
    if target_model.vocab_size != draft_model.vocab_size:
        differences.append("vocab_size differs")
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        differences.append(f"the tokenizers differ: {vocabulary_difference(target_vocab, draft_vocab)}")
    if not differences:
        return

    def named(role: str, files: EngineDir, model: ModelConfig, vocab: dict[str, int] | None) -> str:
        tokens = f"{len(vocab)} tokens" if vocab is not None else "no token list read"
        return f"{role} {files.path} (vocab_size {model.vocab_size}, tokenizer {files.tokenizer_dir}: {tokens})"

    raise ValueError(f"speculative_model {draft.path}: its vocabulary is not the target's, so its draft token ids "
                     f"would name other tokens; {named('target', target, target_model, target_vocab)}, "
                     f"{named('draft', draft, draft_model, draft_vocab)}: {'; '.join(differences)}")


def token_vocabulary(tokenizer_dir: Path) -> dict[str, int] | None:
    """The token -> id map of a tokenizer: tokenizer.json's model.vocab (a map, or Unigram's [token, score]
    list) and added_tokens, else vocab.json; None when neither lists one (a tokenizer.model only)."""
    path = tokenizer_dir / "tokenizer.json"
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            table = {str(token): int(i) for token, i in vocab.items()}
        elif isinstance(vocab, list):
            table = {str(entry[0]): i for i, entry in enumerate(vocab)}
        else:
            return None
        for added in data.get("added_tokens") or ():
            table[str(added["content"])] = int(added["id"])
        return table
    path = tokenizer_dir / "vocab.json"
    if path.is_file():
        return {str(token): int(i) for token, i in json.loads(path.read_text(encoding="utf-8")).items()}
    return None


def vocabulary_difference(target: dict[str, int], draft: dict[str, int]) -> str:
    """Where two token -> id maps differ, in counts and the first few tokens (by target id)."""
    only_target = sorted(target.keys() - draft.keys(), key=target.__getitem__)
    only_draft = sorted(draft.keys() - target.keys(), key=draft.__getitem__)
    moved = sorted((t for t in target.keys() & draft.keys() if target[t] != draft[t]), key=target.__getitem__)
    parts = []
    if moved:
        shown = ", ".join(f"{t!r} is {target[t]} in the target, {draft[t]} in the draft"
                          for t in moved[:MAX_NAMED_TOKENS])
        parts.append(f"{len(moved)} tokens have other ids ({shown})")
    for side, tokens, ids in (("target", only_target, target), ("draft", only_draft, draft)):
        if tokens:
            shown = ", ".join(f"{t!r} ({ids[t]})" for t in tokens[:MAX_NAMED_TOKENS])
            parts.append(f"{len(tokens)} tokens only in the {side}'s ({shown})")
    return "; ".join(parts)
