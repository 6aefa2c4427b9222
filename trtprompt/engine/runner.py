"""Pack one scheduled step into model inputs, run the model, return logits of sampling rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from trtprompt.engine.attention import AttentionMetadata, SeqSlice, build_attention_metadata
from trtprompt.engine.host_memory import keep_freed_memory
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.layer_ops import layer_ops
from trtprompt.engine.lora.manager import LoraManager
from trtprompt.engine.lora.stacks import LoraStep
from trtprompt.engine.model import DecoderModel
from trtprompt.engine.request import Request
from trtprompt.engine.sampler import screen_bans
from trtprompt.engine.scheduler import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRows:
    """Logits rows of one request's prompt positions this step, for its prompt log probabilities
    (the row at position p scores prompt token p + 1) or its context logits."""

    request: Request
    first_position: int
    count: int


@dataclass(frozen=True)
class StepInputs:
    """One step's packed model inputs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # Packed rows whose logits are wanted: the sampled rows in scheduling order, then each
    # PromptRows' rows in turn, then each speculating request's draft rows (draft_rows) in turn.
    logits_rows: torch.Tensor
    prompt_rows: tuple[PromptRows, ...] = ()
    draft_rows: tuple[tuple[Request, int], ...] = ()  # (request, its drafts this step)
    lora: LoraStep | None = None  # the adapters' products; None: no row has an adapter
    # Per logits row, the tokens it may not take before its argmax is read (sampler.screen_bans); None: a row is
    # read for more, and the model's float head runs (greedy_head.py)
    screen_bans: tuple[list[int], ...] | None = None


@dataclass(frozen=True)
class StepLogits:
    """float32 logits of one step: [sampling requests, vocab] in scheduling order, and each
    PromptRows' [count, vocab]."""

    sampled: torch.Tensor
    prompt: tuple[tuple[PromptRows, torch.Tensor], ...] = ()
    # By request id: the rows after each of its draft tokens ([drafts, vocab]); the row before its first
    # draft is its row of `sampled`.
    drafts: dict[str, torch.Tensor] = field(default_factory=dict)


def prompt_positions(req: Request, start: int, end: int) -> range:
    """Positions in [start, end) whose logits req still needs (Request.prompt_rows_wanted): a position
    computed again after a preemption is not taken twice."""
    return range(max(start, req.prompt_rows_done), min(end, req.prompt_rows_wanted))


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 tokens_per_block: int, device: torch.device, attention_backend: str,
                 lora: LoraManager | None = None) -> None:
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.tokens_per_block = tokens_per_block
        self.device = device
        # Resolved by the engine ("compiled", "torch" or "reference"; resolve_attention_backend), so no
        # default here: the one default is config.DEFAULT_ATTENTION_BACKEND, which is not yet resolved.
        self.attention_backend = attention_backend
        self.ops = layer_ops(attention_backend)
        if self.device.type == "cpu":  # activations live in host memory: keep their pages mapped
            log.info("host memory: %s", keep_freed_memory())

    def metadata(self, slices: list[SeqSlice]) -> AttentionMetadata:
        return build_attention_metadata(slices, self.tokens_per_block, self.device,
                                        self.attention_backend, self.model.dtype)

    def _packing_order(self, out: SchedulerOutput, lora: LoraManager | None) -> list[ScheduledRequest]:
        """The scheduled requests in the order their rows are packed: scheduling order, except that with
        adapters each adapter's requests are packed together (a stable sort by slot), so that a step of prompt
        chunks has one run of rows per adapter (LoraStep)."""
        if lora is None:
            return out.scheduled
        return sorted(out.scheduled, key=lambda s: -1 if s.request.lora is None else lora.slot(s.request.lora))

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        row_slot: list[int] = []
        first_row: dict[str, int] = {}  # by request id: its first packed row
        lora = self.lora if self.lora is not None and self.lora.active else None
        for s in self._packing_order(out, lora):
            start, end = s.context_len, s.context_len + s.num_new_tokens
            first_row[s.request.request_id] = len(ids)
            ids.extend(s.request.all_token_ids[start:end - s.num_draft])
            ids.extend(s.request.drafts[:s.num_draft])
            positions.extend(range(start, end))
            if lora is not None:
                adapter = s.request.lora
                row_slot.extend([-1 if adapter is None else lora.slot(adapter)] * s.num_new_tokens)
            slices.append(SeqSlice(start, s.num_new_tokens, kv.block_ids(s.request.request_id)))
        logits_rows, prompt_rows, draft_rows = self._logits_rows(out, first_row)
        dev = self.device
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=dev),
                          torch.tensor(positions, dtype=torch.long, device=dev),
                          self.metadata(slices), torch.tensor(logits_rows, dtype=torch.long, device=dev),
                          tuple(prompt_rows), tuple(draft_rows),
                          None if lora is None else lora.step(row_slot),
                          None if prompt_rows else self._screen_bans(out))

    @staticmethod
    def _screen_bans(out: SchedulerOutput) -> tuple[list[int], ...] | None:
        """StepInputs.screen_bans of a step without prompt rows: its sampled rows', then its draft rows' (a
        speculating request's rows are screened only where nothing is banned: each row's bans would differ)."""
        sampled: list[list[int]] = []
        drafts: list[list[int]] = []
        for s in out.scheduled:
            bans = screen_bans(s.request) if s.samples or s.num_draft else []
            if bans is None or (s.num_draft and bans):
                return None
            if s.samples:
                sampled.append(bans)
            drafts.extend([bans] * s.num_draft)
        return tuple(sampled + drafts)

    @staticmethod
    def _logits_rows(out: SchedulerOutput, first_row: dict[str, int]
                     ) -> tuple[list[int], list[PromptRows], list[tuple[Request, int]]]:
        """The packed rows whose logits are wanted (StepInputs.logits_rows: sampled rows in scheduling order,
        then prompt rows, then draft rows), with the PromptRows and draft counts they belong to."""
        sampled: list[int] = []
        prompt_rows: list[PromptRows] = []
        extra_rows: list[int] = []
        draft_rows: list[tuple[Request, int]] = []
        draft_row_ids: list[int] = []
        for s in out.scheduled:
            first, end = first_row[s.request.request_id], s.context_len + s.num_new_tokens
            after = first + s.num_new_tokens  # the packed row after its last
            if s.samples:
                sampled.append(after - 1 - s.num_draft)
            if s.num_draft:
                draft_rows.append((s.request, s.num_draft))
                draft_row_ids.extend(range(after - s.num_draft, after))
            wanted = prompt_positions(s.request, s.context_len, end)
            if wanted:
                prompt_rows.append(PromptRows(s.request, wanted.start, len(wanted)))
                extra_rows.extend(first + p - s.context_len for p in wanted)
        return sampled + extra_rows + draft_row_ids, prompt_rows, draft_rows

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source id, destination id) in every layer, K and V."""
        src = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.device)
        for layer in self.kv_caches:
            for cache in layer[:2]:
                cache[dst] = cache[src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> StepLogits:
        """The step's logits (StepLogits) in float32."""
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        step = self.prepare(out, kv)
        logits: torch.Tensor = self.model(step.input_ids, step.positions, step.meta, self.kv_caches,
                                          step.logits_rows, self.ops, step.lora,
                                          step.screen_bans)  # nn.Module calls are typed Any
        num_sampled = len(step.logits_rows) - sum(r.count for r in step.prompt_rows) \
            - sum(n for _, n in step.draft_rows)
        prompt, at = [], num_sampled
        for rows in step.prompt_rows:
            prompt.append((rows, logits[at:at + rows.count]))
            at += rows.count
        drafts = {}
        for req, n in step.draft_rows:
            drafts[req.request_id] = logits[at:at + n]
            at += n
        return StepLogits(logits[:num_sampled], tuple(prompt), drafts)
