"""LLMEngine: add_request / step / abort / stats over scheduler, KV cache, model and sampler."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from trtprompt.engine import isa, kernels
from trtprompt.engine.attention import allocate_kv_cache, log_attention_backend, resolve_attention_backend
from trtprompt.engine.beam_search import Hypothesis
from trtprompt.engine.beams import BeamSearches, finish_reason, output_tokens
from trtprompt.engine.config import EngineConfig
from trtprompt.engine.engine_dir import EngineDir
from trtprompt.engine.errors import DuplicateRequestError, EngineRequestError, QueueFullError
from trtprompt.engine.guided import GuideCompiler, guide_rows
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.kv_events import KvEventPublisher, kv_events_config
from trtprompt.engine.loader import engine_config, read_engine_files
from trtprompt.engine.lora.adapter import LoraAdapter, LoraError
from trtprompt.engine.lora.engine_dir import lora_dirs
from trtprompt.engine.lora.manager import LoraManager
from trtprompt.engine.model import DTYPES, DecoderModel, load_engine_model
from trtprompt.engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    RetentionConfig,
    SamplingParams,
    TokenLogprob,
)
from trtprompt.engine.runner import ModelRunner, PromptRows, StepLogits
from trtprompt.engine.sampler import (
    SampleFailure,
    argmax_only,
    attach_logprobs,
    greedy_tokens,
    logprob_entries,
    raw_logprobs,
    sample,
)
from trtprompt.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from trtprompt.engine.speculation.drafting import Drafter, DraftModel
from trtprompt.engine.stopping import check_stop, visible_output_len
from trtprompt.engine.tiers.config import TIER_KNOBS, TierConfig
from trtprompt.engine.tiers.fingerprint import fingerprint_engine_files
from trtprompt.engine.tiers.open import kv_layout, open_stores, open_tiers
from trtprompt.engine.tiers.store import BlockStore
from trtprompt.engine.tiers.tiered import TierSnapshot
from trtprompt.engine.validation import RequestLimits, ValidatedRequest, validate_request
from trtprompt.error_codes import ErrorCode

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class EngineStats:
    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    cached_free_blocks: int
    tokens_per_block: int
    reused_blocks: int
    missed_blocks: int
    cache_hit_rate: float
    queried_tokens: int  # prompt tokens of every prefix lookup
    hit_tokens: int  # of those, tokens served from reused blocks
    evicted_blocks: int  # reusable blocks evicted to be handed out again
    fragmentation: float  # docs/monitoring/README.md, "KV fragmentation"
    preemptions: int
    iteration_counter: int
    active_requests: int
    waiting_requests: int
    max_batch_size: int
    scheduled_requests: int
    context_requests: int
    generation_requests: int
    total_context_tokens: int
    paused_requests: int
    timestamp_ns: int
    # The tiers below the pool (docs/prefix-pool.md): reused_blocks = pool hits + every tier's hit_blocks.
    pool_hit_blocks: int = 0
    loading_requests: int = 0  # waiting for their prefix blocks from a tier
    kv_tiers: tuple[TierSnapshot, ...] = ()
    # Speculative decoding totals (engine/speculation/drafting.py SpecCounters; zero without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class Fault:
    """Why one request fails in a step that goes on for the others (its one final output's error)."""

    message: str


class LLMEngine:
    def __init__(self, config: EngineConfig, model: DecoderModel, end_ids: Sequence[int],
                 fingerprint: bytes | None = None, tier_stores: Sequence[BlockStore] | None = None,
                 tokenizer_dir: Path | None = None, draft_model: DraftModel | None = None) -> None:
        """fingerprint: the engine's (tiers/fingerprint.py), needed with tiers; tier_stores: stores to use
        instead of those config.tiers names; tokenizer_dir: the checkpoint's tokenizer (guided decoding
        reads it; an engine without one refuses guided requests); draft_model: the drafter of
        speculative_decoding draft_target (speculation/draft_model.py)."""
        self.config = config
        self.model_config = config.model
        self.scheduler_config = config.scheduler
        self.device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        tpb = config.kv_cache.tokens_per_block
        num_blocks = self._num_blocks(config, dtype)
        self.kv = KVCacheManager(num_blocks, tpb, config.kv_cache.enable_block_reuse,
                                 config.kv_cache.eviction_policy)
        kv_dtype = config.kv_cache.kv_cache_dtype
        caches = allocate_kv_cache(config.model, num_blocks, tpb, dtype, self.device, kv_dtype)
        log.info("KV cache: %d blocks of %d tokens (%d tokens), %s, %d bytes per token", num_blocks, tpb,
                 num_blocks * tpb, "int8 + float16 scale per row" if kv_dtype == "int8" else config.dtype,
                 config.model.kv_bytes_per_token(torch.finfo(dtype).bits // 8, kv_dtype))
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device,
                                                           config.model.head_size, tpb)
        log_attention_backend(config.attention_backend, self.attention_backend)
        log.info("compute: %s", model.compute_summary())
        if model.weight_pages is not None:
            log.info("%s", model.weight_pages)
        if self.attention_backend == "compiled" and model.decode_layers is not None and kv_dtype != "int8":
            log.info("decode steps: %s", model.decode_layers.summary())
        slow_bf16 = isa.bf16_problem(isa.cpu_flags()) if dtype == torch.bfloat16 and self.device.type == "cpu" else None
        if slow_bf16 is not None:
            log.warning("dtype bfloat16: %s (compute_dtype bfloat16; unset, this CPU computes in float32)", slow_bf16)
        self.lora = LoraManager(config.model, config.lora, self.device,
                                kernels.lora_kernel_lanes() if self.attention_backend == "compiled" else None)
        self.runner = ModelRunner(model, caches, tpb, self.device, self.attention_backend, self.lora)
        stores = list(tier_stores) if tier_stores is not None else open_stores(config.tiers)
        if stores and config.kv_cache.enable_block_reuse:
            self.kv.tiers = open_tiers(stores, fingerprint, kv_layout(config.model, tpb, dtype, kv_dtype), caches,
                                       config.tiers.kv_tier_write_policy, config.tiers.queue_blocks, self.kv.pool)
        elif stores:
            log.warning("KV tiers are off: they hold reusable blocks, and KV block reuse is disabled")
        self.scheduler = Scheduler(config.scheduler, self.kv, use_tiers=self.kv.tiers is not None, lora=self.lora)
        self.beams = BeamSearches(self.kv, self.scheduler, self.runner.copy_blocks)
        self.kv_events = self._open_kv_events(config)
        self.end_ids = frozenset(end_ids)
        self.guides = GuideCompiler(tokenizer_dir, sorted(self.end_ids), config.model.vocab_size)
        self.drafter = None if config.speculation is None else Drafter(config.speculation, draft_model)
        self.limits = RequestLimits(config.scheduler.max_input_len, config.scheduler.max_seq_len,
                                    config.model.vocab_size, num_blocks, tpb, config.scheduler.max_batch_size)
        self.requests: dict[str, Request] = {}  # by engine id: a request's sequences each have one
        self.groups: dict[str, list[Request]] = {}  # by request id: its sequences, index order
        # Sequences 1.. of a request with n > 1, held until sequence 0 has computed the prompt (by its
        # engine id); then queued first and admitted on its blocks (scheduler._admit_fork).
        self._forks: dict[str, list[Request]] = {}
        self.iteration_counter = 0
        self._pending: list[RequestOutput] = []
        self._last_step = SchedulerOutput()
        self.files: EngineDir | None = None

    def _open_kv_events(self, config: EngineConfig) -> KvEventPublisher | None:
        """The KV event publisher listening to the pool (docs/kv-events.md), when configured."""
        if config.kv_events is None:
            return None
        if not config.kv_cache.enable_block_reuse:
            log.warning("KV events are off: they describe reusable blocks, and KV block reuse is disabled")
            return None
        publisher = KvEventPublisher(config.kv_events, config.kv_cache.tokens_per_block)
        self.kv.pool.add_listener(publisher.recorder)
        log.info("KV events on %s (%s layout)", config.kv_events.endpoint, config.kv_events.layout)
        return publisher

    @staticmethod
    def _num_blocks(config: EngineConfig, dtype: torch.dtype) -> int:
        tpb = config.kv_cache.tokens_per_block
        per_token = config.model.kv_bytes_per_token(torch.finfo(dtype).bits // 8, config.kv_cache.kv_cache_dtype)
        num_blocks = config.kv_num_blocks(per_token)  # the build plan sizes the pool with the same rule
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget holds no block of {tpb} tokens "
                             f"({per_token * tpb} bytes per block)")
        return num_blocks

    @classmethod
    def from_engine_dir(cls, path: str | Path, **overrides: Any) -> "LLMEngine":
        files = read_engine_files(path)
        tiers = TierConfig(**{k: v for k, v in overrides.items() if k in TIER_KNOBS and v is not None})
        config = dataclasses.replace(engine_config(files, overrides), tiers=tiers,
                                     kv_events=kv_events_config(overrides))
        dtype = DTYPES[config.dtype]
        model = load_engine_model(files.weights_path, config.model, dtype, torch.device(config.device),
                                  config.linear_backend, files.pretrained_config.get("quantization"))
        eos = files.pretrained_config.get("eos_token_id")
        end_ids = [eos] if isinstance(eos, int) else list(eos or [])
        fingerprint = None
        if config.tiers.enabled:
            layout = kv_layout(config.model, config.kv_cache.tokens_per_block, dtype, config.kv_cache.kv_cache_dtype)
            fingerprint = fingerprint_engine_files(files.weights_path, files.tokenizer_dir, layout, config.dtype)
        draft = None
        if config.speculation is not None and config.speculation.mode == "draft_target":
            from trtprompt.engine.speculation.draft_model import open_draft_model  # only this mode loads a model
            draft = open_draft_model(config.speculation, files, config)
        engine = cls(config, model, end_ids, fingerprint, tokenizer_dir=files.tokenizer_dir, draft_model=draft)
        engine.files = files
        for name, adapter_dir in lora_dirs(files.path, overrides.get("lora_modules")).items():
            engine.lora.load_dir(name, adapter_dir)
        return engine

    @property
    def max_input_len(self) -> int:
        return self.limits.max_input_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.end_ids

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      lora: str | None = None) -> ValidatedRequest:
        """Validate without touching engine state (safe from any thread); add_validated admits the result.
        A guided request's grammar compiles here, in the caller's thread: the step loop never waits for one;
        so is its LoRA adapter read (`lora`: a name the engine knows, engine/lora/manager.py)."""
        checked = validate_request(prompt_token_ids, params, self.limits)
        if lora is not None:
            checked = dataclasses.replace(checked, lora=self._adapter(lora))
        if params.guide_type is None:
            return checked
        return dataclasses.replace(checked, matcher=self.guides.matcher(params))

    def _adapter(self, name: str) -> LoraAdapter:
        try:
            return self.lora.get(name)
        except LoraError as exc:  # its directory changed since it was loaded: this request fails, not the server
            raise EngineRequestError(str(exc)) from exc

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time_ns: int | None = None,
                    retention: RetentionConfig | None = None, lora: str | None = None) -> None:
        self._refuse_duplicate(request_id)  # first: a duplicate is refused as such, whatever it holds
        self.add_validated(request_id, self.check_request(prompt_token_ids, params, lora), cache_salt,
                           arrival_time_ns, retention)

    def add_validated(self, request_id: str, checked: ValidatedRequest, cache_salt: str | None = None,
                      arrival_time_ns: int | None = None, retention: RetentionConfig | None = None) -> None:
        """Admit a request check_request passed, without validating it again."""
        self._refuse_duplicate(request_id)
        limit = self.scheduler_config.max_queue_size
        if limit is not None and self.scheduler.num_waiting >= limit:
            raise QueueFullError(limit)
        params = checked.params
        end_ids = params.end_ids(self.end_ids)
        arrival = arrival_time_ns or time.time_ns()
        group = [Request(request_id if i == 0 else f"{request_id}#{i}", list(checked.prompt_token_ids), params,
                         checked.max_output_tokens, end_ids, cache_salt, arrival, checked.warning, retention,
                         request_id, i, checked.lora) for i in range(max(params.n, params.beam_width))]
        for req in group:
            self.requests[req.request_id] = req
        if checked.matcher is not None:  # each sequence follows the grammar on its own
            for req in group:
                req.matcher = checked.matcher if req is group[0] else checked.matcher.deep_copy()
        self.groups[request_id] = group
        if self.drafter is not None:
            self.drafter.admitted(group[0])
        for fork in group[1:]:
            fork.held_fork = True
        if params.beam_width > 1:
            self.beams.start(group)  # the first beam step forks the others (engine/beams.py)
        elif len(group) > 1:
            self._forks[request_id] = group[1:]
        self.scheduler.add(group[0])

    def _refuse_duplicate(self, request_id: str) -> None:
        if request_id in self.groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")

    def abort(self, request_id: str) -> bool:
        group = self.groups.get(request_id)
        if group is None:
            return False
        beams = self.beams.owns(group[0])
        for req in group:
            if not req.is_finished:
                self._finish(req, FinishReason.ABORTED)
                out = self._output(req)
                if not beams or out.finished:  # a beam search's running beams are no sequences: one final only
                    self._pending.append(dataclasses.replace(out, new_token_ids=[]) if beams else out)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or a final output (e.g. of an abort) awaits step()."""
        return bool(self.requests) or bool(self._pending)

    def _release_forks(self, req: Request) -> None:
        """req (sequence 0) has computed its prompt: its held sequences queue first, forked from it."""
        forks = self._forks.pop(req.request_id, None)
        if forks:
            for fork in forks:
                fork.fork_of, fork.held_fork = req, False
            self.scheduler.add_first(forks)

    def close(self) -> None:
        """Stop the tiers' threads (queued writes get a few seconds to finish)."""
        if self.kv.tiers is not None:
            self.kv.tiers.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.guides.close()

    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            # Blocks to save are copied before the next scheduling pass may hand them out again.
            if self.kv.tiers is not None:
                self.kv.tiers.flush()
            if self.kv_events is not None:
                self.kv_events.flush()  # one batch per step, sent by the publisher's thread

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self._last_step = sched
        if self.kv.tiers is not None:
            self.kv.tiers.flush()  # blocks reused this step (selective policy), while their requests hold them
        if not sched.scheduled:
            if self.scheduler.loading and self.kv.tiers is not None:
                self.kv.tiers.loader.ready.wait(0.005)  # nothing else to run: don't spin while a load reads
            return outputs
        self.iteration_counter += 1
        now = time.time_ns()
        for s in sched.scheduled:
            if s.request.stats.first_scheduled_time_ns is None:
                s.request.stats.first_scheduled_time_ns = now
        with torch.inference_mode():
            try:
                logits = self.runner.execute(sched, self.kv)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                log.exception("model step failed; failing the %d requests it held", len(sched.scheduled))
                outputs.extend(self._fail_step(sched, f"engine error: the model step failed: "
                                                      f"{type(exc).__name__}: {exc}"))
                return outputs
            self._record_prompt_rows(logits)
            samplers = [s.request for s in sched.scheduled if s.samples]
            # A speculating request's rows (its last token's, then one per draft) are verified on their own.
            verify = {r.request_id: torch.cat([logits.sampled[j:j + 1], logits.drafts[r.request_id]])
                      for j, r in enumerate(samplers) if r.request_id in logits.drafts}
            plain = [j for j, r in enumerate(samplers) if not self.beams.owns(r) and r.request_id not in verify]
            rows = logits.sampled if len(plain) == len(samplers) else logits.sampled[plain]
            tokens, logprobs, raw_rows = self._sample(rows, [samplers[j] for j in plain])
            outputs.extend(self._update(sched, tokens, logprobs, raw_rows, verify))
            for j, req in enumerate(samplers):
                if self.beams.owns(req) and not req.is_finished:
                    outputs.extend(self._beam_step(req, logits.sampled[j]))
            self._propose(sched)
        return outputs

    def _propose(self, sched: SchedulerOutput) -> None:
        """Drafts for the requests of this step that generate next (none while the batch is compute-bound)."""
        if self.drafter is None or self.drafter.paused(len(self.scheduler.running)):
            return
        self.drafter.propose([s.request for s in sched.scheduled if self._speculates(s.request)])

    def _speculates(self, req: Request) -> bool:
        return (not req.is_finished and req.params.speculative_decoding and req.num_output > 0
                and req.num_tokens - req.num_computed_tokens == 1 and not self.beams.owns(req))

    def _beam_step(self, req: Request, row: torch.Tensor) -> list[RequestOutput]:
        """Hand a beam's row to its search; the request's outputs once the search is done."""
        try:
            best = self.beams.collect(req, row)
        except RuntimeError as exc:  # no KV block for a beam's copy (max_utilization): this request only
            log.warning("beam search of request %s failed: %s", req.group_id, exc)
            return [self._fail(req, f"engine error: beam search failed: {exc}")]
        return [] if best is None else self._finish_beams(req.group_id, best)

    def _finish_beams(self, group_id: str, best: list[Hypothesis]) -> list[RequestOutput]:
        """The request's best hypotheses as its sequences, best first; every beam's KV released."""
        first = self.groups[group_id][0]
        now = time.time_ns()
        first.stats.first_token_time_ns = first.stats.first_token_time_ns or now
        first.stats.last_token_time_ns = now
        self._finish_unfinished(self.groups[group_id], FinishReason.STOP)
        outputs = []
        for rank, hyp in enumerate(best):
            tokens = output_tokens(hyp)
            outputs.append(RequestOutput(
                request_id=group_id, new_token_ids=tokens, finished=rank == len(best) - 1,
                num_input_tokens=first.num_prompt_tokens, num_output_tokens=len(tokens),
                finish_reason=finish_reason(hyp), warning=first.warning, stats=first.stats,
                stopped_by_end_id=hyp.ended_by_end_id, sequence_index=rank, sequence_finished=True,
                cum_logprob=hyp.sum_logprob))
        return outputs

    def _sample(self, rows: torch.Tensor, reqs: list[Request]) -> tuple[list[int | SampleFailure],
                                                                       list[TokenLogprob | None],
                                                                       list[torch.Tensor | None]]:
        """Each request's token (rows: one logits row each), its log probabilities and its raw logits
        row where asked for (both taken before the rows are masked and processed in place)."""
        if not reqs:
            return [], [], []
        raw = raw_logprobs(rows, reqs)
        kept = [rows[i].clone() if r.params.return_generation_logits else None for i, r in enumerate(reqs)]
        guide_rows(rows, reqs, self.guides)  # a guided row may only choose what its grammar allows
        tokens = sample(rows, reqs)
        return tokens, attach_logprobs(raw, reqs, tokens), kept

    def _guide_takes_over(self, req: Request) -> bool:
        """After an accepted draft: the grammar is complete, or forces the next tokens (jump-forward appends
        them), so the rows after it are not what a step without drafts would sample."""
        assert req.matcher is not None
        if req.matcher.is_stopped():
            return True
        return self.config.guided_jump_forward and not req.reports_extras and bool(req.matcher.compute_ff_tokens())

    @staticmethod
    def _record_prompt_rows(logits: StepLogits) -> None:
        """Consume the prompt positions' logits: prompt log probabilities, context logits."""
        for rows, values in logits.prompt:
            req, first = rows.request, rows.first_position
            if req.params.return_context_logits:
                req.context_logits.append(values.clone())  # a view of the step's logits otherwise
            scoring = min(rows.count, req.num_prompt_tokens - 1 - first)  # rows that score a prompt token
            if req.params.prompt_logprobs is not None and scoring > 0:
                scored = req.all_token_ids[first + 1:first + 1 + scoring]
                req.prompt_logprobs.extend(prompt_logprobs(rows, values[:scoring], scored))
            req.prompt_rows_done = first + rows.count

    def _fail_step(self, sched: SchedulerOutput, message: str) -> list[RequestOutput]:
        """Finish every request of a step whose forward raised; requests outside it go on.

        Their blocks are freed without being registered for reuse (cache_computed was not
        called), so no half-written KV is ever shared."""
        outputs = []
        for s in sched.scheduled:
            if not s.request.is_finished:
                outputs.append(self._fail(s.request, message))
        return outputs

    def _fail(self, req: Request, message: str) -> RequestOutput:
        """Finish req's whole request (every sequence) with an error: its one final output."""
        self._finish_unfinished(self.groups.get(req.group_id, [req]), FinishReason.ERROR)
        return self._output(req, error=message)

    def _finish_unfinished(self, members: list[Request], reason: FinishReason) -> None:
        for member in members:
            if not member.is_finished:
                self._finish(member, reason)

    def _update(self, sched: SchedulerOutput, tokens: list[int | SampleFailure],
                logprobs: list[TokenLogprob | None], raw_rows: list[torch.Tensor | None],
                verify: dict[str, torch.Tensor]) -> list[RequestOutput]:
        """Take each sampling request's token(s): tokens (and their extras) in order for the plain ones,
        verify's rows for the speculating ones."""
        outputs = []
        now = time.time_ns()
        it = iter(zip(tokens, logprobs, raw_rows))
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens = s.context_len + s.num_new_tokens - s.num_draft
            if s.is_context:
                req.stats.prefill_tokens_computed += s.num_new_tokens
            self.kv.cache_computed(req)
            if not s.samples or self.beams.owns(req):
                continue
            if s.num_draft:
                result = None if req.is_finished else self._verify(req, s, verify[req.request_id])
            else:
                token, logprob, raw_row = next(it)
                result = None if req.is_finished else self._take(req, token, logprob, raw_row)
            if req.is_finished:  # a sibling's failure earlier in this step ended its whole request
                continue
            self._release_forks(req)
            if req.stats.first_token_time_ns is None:
                req.stats.first_token_time_ns = now
            req.stats.last_token_time_ns = now
            if result is None and req.matcher is not None:
                result = self._guide_end_or_jump(req)
                if req.matcher.is_error():
                    result = Fault(f"engine error: guided decoding: {req.matcher.get_error()}")
            if isinstance(result, Fault):
                outputs.append(self._fail(req, result.message))
                continue
            if result is not None:
                self._finish(req, result)
            out = self._output(req)
            if out.new_token_ids or out.sequence_finished or out.prompt_logprobs is not None \
                    or out.context_logits is not None:
                outputs.append(out)
        return outputs

    def _take(self, req: Request, token: int | SampleFailure, logprob: TokenLogprob | None,
              raw_row: torch.Tensor | None) -> FinishReason | Fault | None:
        """Record one sampled token: the request's grammar, its end conditions, its logits row. Returns
        why it finished, or the Fault that fails it, or None while it goes on."""
        if isinstance(token, SampleFailure):
            log.warning("request %s failed sampling: %s", req.request_id, token.reason)
            return Fault(f"engine error: sampling failed for this request (the rest of its batch went on): "
                         f"{token.reason}")
        before = req.num_output
        if req.matcher is not None and not self._advance_guide(req, token):
            return Fault(f"engine error: guided decoding: the grammar refused the sampled token {token}: "
                         f"{req.matcher.get_error()}")
        # max_tokens 0 (prompt scoring): the prompt is computed, nothing is generated.
        reason = FinishReason.LENGTH if req.max_output_tokens == 0 else check_stop(req, token, logprob)
        if raw_row is not None and req.num_output > before:
            req.generation_logits.append(raw_row)
        return reason

    def _verify(self, req: Request, s: ScheduledRequest, rows: torch.Tensor) -> FinishReason | Fault | None:
        """Speculative decoding's check of req's drafts: rows [1 + drafts, vocab] score its next token and each
        draft's successor. Each row is sampled exactly as a one-token step samples it (penalties, grammar, stop
        conditions see the tokens accepted before it; a sampled row draws once from the request's generator), and
        a draft is accepted when the row's token equals it. The tokens are those of decoding without drafts, draw
        for draw, and a sampled draft is accepted with probability p(draft), as speculative sampling's rejection
        rule accepts a draft it is certain of. The first token that differs from its draft is the step's last.
        KV written for rejected drafts is dropped (kv.trim)."""
        drafts = req.drafts[:s.num_draft]
        fast = greedy_tokens(rows) if argmax_only(req) else None
        accepted, result = 0, None
        for j in range(len(drafts) + 1):
            draft = drafts[j] if j < len(drafts) else None
            token: int | SampleFailure
            if fast is not None:
                token, logprob, raw_row = fast[0][j], None, None
                if fast[1][j]:
                    token = SampleFailure("its logits are NaN or all -inf")
            else:
                tokens, logprobs, kept = self._sample(rows[j:j + 1], [req])
                token, logprob, raw_row = tokens[0], logprobs[0], kept[0]
            result = self._take(req, token, logprob, raw_row)
            if draft is None or token != draft:
                break
            accepted += 1
            if result is not None:
                break
            req.num_computed_tokens += 1  # the draft's KV, written this step, holds
            if req.matcher is not None and self._guide_takes_over(req):
                break  # _update ends the request or appends the forced tokens, as it does without drafts
        assert self.drafter is not None
        self.drafter.verified(req, len(drafts), accepted)
        self.kv.cache_computed(req)
        self.kv.trim(req)
        return result

    @staticmethod
    def _advance_guide(req: Request, token: int) -> bool:
        """The matcher takes the sampled token (an end token is no text: check_stop ends the request)."""
        assert req.matcher is not None
        return token in req.end_ids or req.matcher.consume_token(token)

    def _guide_end_or_jump(self, req: Request) -> FinishReason | None:
        """STOP once the grammar is complete; else append the tokens it forces (jump-forward), which the
        next step computes as one chunk instead of one step each. Not for a request reporting log
        probabilities or logits: forced tokens have no model row of their own."""
        matcher = req.matcher
        assert matcher is not None
        if matcher.is_stopped():
            return FinishReason.STOP
        if not self.config.guided_jump_forward or req.reports_extras:
            return None
        for token in matcher.compute_ff_tokens():
            if not matcher.consume_token(token):  # never appended: _update fails the request on the error
                return None
            reason = check_stop(req, token)
            if reason is not None:
                return reason
        return FinishReason.STOP if matcher.is_stopped() else None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        if self.drafter is not None:
            self.drafter.finished(req)
        if req.held_fork:
            req.status = RequestStatus.FINISHED  # the scheduler never had it
        else:
            self.scheduler.finish(req)
        del self.requests[req.request_id]
        group = self.groups.get(req.group_id)
        if group is not None and all(member.is_finished for member in group):
            del self.groups[req.group_id]
            self._forks.pop(group[0].request_id, None)
            self.beams.forget(req.group_id)

    def _output(self, req: Request, error: str | None = None) -> RequestOutput:
        visible = visible_output_len(req)
        start = req.num_emitted
        new = req.output_token_ids[start:visible]
        req.num_emitted = max(req.num_emitted, visible)
        return RequestOutput(
            request_id=req.group_id, new_token_ids=new, finished=req.group_id not in self.groups,
            num_input_tokens=req.num_prompt_tokens, num_output_tokens=req.num_emitted,
            finish_reason=req.finish_reason, error=error, warning=req.warning, stats=req.stats,
            error_code=None if error is None else ErrorCode.INTERNAL,  # a step or sampling fault
            stopped_by_end_id=req.finish_reason is FinishReason.STOP and not req.stopped_by_word,
            sequence_index=req.sequence_index, sequence_finished=req.is_finished,
            **(self._logprob_fields(req, start, req.num_emitted) if req.reports_extras else {}),
        )

    @staticmethod
    def _logprob_fields(req: Request, start: int, end: int) -> dict[str, Any]:
        """The output's logprobs (for its new tokens), cum_logprob, and the prompt's once computed."""
        fields: dict[str, Any] = {}
        if req.params.logprobs is not None:
            fields["logprobs"] = req.token_logprobs[start:end]
            req.cum_emitted += sum(lp.logprob for lp in fields["logprobs"])
            fields["cum_logprob"] = req.cum_emitted
            if req.is_finished and req.end_logprob is not None:
                fields["end_logprob"] = req.end_logprob
        if req.params.return_generation_logits and end > start:
            # Only rows not yet sent are kept (those of tokens a possible stop word holds back stay).
            fields["generation_logits"] = torch.stack(req.generation_logits[:end - start])
            req.generation_logits = req.generation_logits[end - start:]
        fields.update(LLMEngine._prompt_extras(req))
        return fields

    @staticmethod
    def _prompt_extras(req: Request) -> dict[str, Any]:
        """The prompt log probabilities and context logits, once the prompt is computed (sequence 0)."""
        asked = req.params.prompt_logprobs is not None or req.params.return_context_logits
        computed = req.num_computed_tokens >= req.num_prompt_tokens and req.prompt_rows_done >= req.prompt_rows_wanted
        if not asked or req.sequence_index != 0 or req.prompt_extras_sent or not computed:
            return {}
        req.prompt_extras_sent = True
        extras: dict[str, Any] = {}
        if req.params.prompt_logprobs is not None:
            extras["prompt_logprobs"] = [None, *req.prompt_logprobs]
        if req.params.return_context_logits:
            extras["context_logits"] = torch.cat(req.context_logits)
            req.context_logits = []
        return extras

    def stats(self) -> EngineStats:
        kv, sched = self.kv, self.scheduler
        # The per-iteration counts describe the latest step while work remains; idle is zero.
        last = self._last_step if self.requests else SchedulerOutput()
        lookups = kv.reused_blocks + kv.missed_blocks
        # Every count below is kept as requests move (scheduler, KV manager): O(1) per step.
        reserved = sched.outstanding_reservations if sched.guaranteed else 0
        return EngineStats(
            max_num_blocks=kv.pool.num_blocks, free_num_blocks=kv.num_free_blocks,
            used_num_blocks=kv.num_used_blocks(), cached_free_blocks=kv.pool.num_cached_free,
            tokens_per_block=kv.tokens_per_block, reused_blocks=kv.reused_blocks,
            missed_blocks=kv.missed_blocks, cache_hit_rate=kv.reused_blocks / lookups if lookups else 0.0,
            queried_tokens=kv.queried_tokens, hit_tokens=kv.reused_blocks * kv.tokens_per_block,
            evicted_blocks=kv.pool.evicted_blocks,
            fragmentation=fragmentation_ratio(kv.num_empty_slots, reserved, kv.num_used_blocks(),
                                              kv.tokens_per_block),
            preemptions=sched.num_preemptions, iteration_counter=self.iteration_counter,
            active_requests=len(self.requests), waiting_requests=sched.num_waiting,
            max_batch_size=self.scheduler_config.max_batch_size,
            scheduled_requests=len(last.scheduled), context_requests=last.num_context_requests,
            generation_requests=last.num_generation_requests,
            total_context_tokens=last.total_context_tokens, paused_requests=sched.num_paused,
            timestamp_ns=time.time_ns(), **self._tier_stats(), **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.drafter is None:
            return {}
        c = self.drafter.counters
        return {"spec_num_drafts": c.num_drafts, "spec_num_draft_tokens": c.num_draft_tokens,
                "spec_num_accepted_tokens": c.num_accepted_tokens, "spec_accepted_per_pos": tuple(c.accepted_per_pos)}

    def _tier_stats(self) -> dict[str, Any]:
        tiers = self.kv.tiers
        if tiers is None:
            return {"pool_hit_blocks": self.kv.reused_blocks}
        snaps = tuple(tiers.snapshot())
        return {"pool_hit_blocks": self.kv.reused_blocks - sum(t.hit_blocks for t in snaps),
                "loading_requests": len(self.scheduler.loading), "kv_tiers": snaps}


def prompt_logprobs(rows: PromptRows, logits: torch.Tensor, scored: list[int]) -> list[TokenLogprob]:
    """TokenLogprob of each scored prompt token from the logits rows before it (one log_softmax)."""
    values = torch.log_softmax(logits.float(), dim=-1)
    k = rows.request.params.prompt_logprobs or 0
    return logprob_entries(values, scored, [k] * len(scored))


def kv_fragmentation(kv: KVCacheManager, requests: Iterable[Request], reserving: bool) -> float:
    """Share of the KV slots held for requests that hold no token (0.0 when none are held).

    Held slots: every used block's, plus, under guaranteed_no_evict, the blocks reserved
    for a request's whole output but not allocated yet. Empty among them: the unwritten
    tail of each request's blocks (its partly filled last block, blocks allocated ahead)
    and every reserved block. Shared prefix blocks are full, so counting them once per
    request adds no empty slot.

    The definition, by recount over requests: stats() gets the same value in O(1) from
    the counts the scheduler and the KV manager keep (tests compare the two).
    """
    tpb = kv.tokens_per_block
    empty = reserved = 0
    for req in requests:
        held = len(kv.block_tables.get(req.request_id, ()))
        empty += max(held * tpb - req.num_computed_tokens, 0)
        if reserving:
            reserved += max(req.reserved_blocks - held, 0)
    return fragmentation_ratio(empty, reserved, kv.num_used_blocks(), tpb)


def fragmentation_ratio(empty_slots: int, reserved_blocks: int, used_blocks: int, tokens_per_block: int) -> float:
    """Empty slots (unwritten ones of used blocks, and all of the reserved blocks) over all held slots."""
    slots = (used_blocks + reserved_blocks) * tokens_per_block
    return (empty_slots + reserved_blocks * tokens_per_block) / slots if slots else 0.0
