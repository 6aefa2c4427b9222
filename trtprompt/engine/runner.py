"""Pack one scheduled step into model inputs, run the model, return logits of sampling rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trtprompt.engine.attention import AttentionMetadata, SeqSlice, build_attention_metadata
from trtprompt.engine.host_memory import keep_freed_memory
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.layer_ops import layer_ops
from trtprompt.engine.model import DecoderModel
from trtprompt.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """One step's packed model inputs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # packed rows whose logits are sampled, in scheduling order


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 tokens_per_block: int, device: torch.device, attention_backend: str) -> None:
        self.model = model
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

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        logits_rows: list[int] = []
        for s in out.scheduled:
            start, end = s.context_len, s.context_len + s.num_new_tokens
            ids.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slices.append(SeqSlice(start, s.num_new_tokens, kv.block_ids(s.request.request_id)))
            if s.samples:
                logits_rows.append(len(ids) - 1)
        dev = self.device
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=dev),
                          torch.tensor(positions, dtype=torch.long, device=dev),
                          self.metadata(slices),
                          torch.tensor(logits_rows, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> torch.Tensor:
        """Logits [num sampling requests, vocab] in float32, in scheduling order."""
        step = self.prepare(out, kv)
        logits: torch.Tensor = self.model(step.input_ids, step.positions, step.meta, self.kv_caches,
                                          step.logits_rows, self.ops)  # nn.Module calls are typed Any
        return logits
