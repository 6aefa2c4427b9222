"""Offline generation through the embedded engine (`trtprompt generate`).

Several prompts run as one in-flight batch; text is detokenized
incrementally, the same way the serving layer does it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import RequestOutput, SamplingParams
from trtprompt.prompt.budget import PromptBudget, budget_for_engine
from trtprompt.tokenizer import StreamDetokenizer, Tokenizer


@dataclass
class Generation:
    prompt: str
    prompt_ids: list[int]
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    final: RequestOutput | None = None
    prompt_truncated_tokens: int = 0

    def as_json(self) -> dict:
        f = self.final
        assert f is not None, "as_json is only called on finished generations"
        return {
            "text": self.text,
            "output_ids": self.output_ids,
            "num_input_tokens": f.num_input_tokens,
            "prompt_truncated_tokens": self.prompt_truncated_tokens,
            "num_output_tokens": f.num_output_tokens,
            "kv_cache_reused_blocks": f.stats.kv_cache_reused_blocks,
            "kv_cache_alloc_new_blocks": f.stats.kv_cache_alloc_new_blocks,
            "finish_reason": f.finish_reason.value if f.finish_reason else None,
            "warning": f.warning,
        }


def generate(engine: LLMEngine, tokenizer: Tokenizer, prompts: Sequence[str], params: SamplingParams,
             on_text: Callable[[int, str], None] | None = None,
             budget: PromptBudget | None = None) -> list[Generation]:
    """Run all prompts as one batch; on_text(index, piece) sees each new piece of text.

    Each prompt first passes the length budget (default: the engine dir's prompt policy)."""
    budget = budget or budget_for_engine(engine, tokenizer)
    gens = []
    for p in prompts:
        fitted = budget.fit(tokenizer.encode(p), params.max_tokens)
        gens.append(Generation(p, fitted.ids, prompt_truncated_tokens=fitted.prompt_truncated_tokens))
    detoks: dict[str, tuple[int, StreamDetokenizer]] = {}
    for i, g in enumerate(gens):
        rid = f"gen-{i}"
        engine.add_request(rid, g.prompt_ids, params)
        detoks[rid] = (i, tokenizer.stream(g.prompt_ids))
    while engine.has_unfinished_requests():
        for out in engine.step():
            i, detok = detoks[out.request_id]
            g = gens[i]
            g.output_ids.extend(out.new_token_ids)
            piece = detok.step(out.new_token_ids)
            if out.finished:
                piece += detok.flush()
                g.final = out
            g.text += piece
            if piece and on_text is not None:
                on_text(i, piece)
    return gens


def sampling_params(max_tokens: int, temperature: float | None, top_k: int | None,
                    top_p: float | None, seed: int | None) -> SamplingParams:
    """CLI sampling flags: a temperature alone samples from the full distribution.

    The engine keeps TensorRT-LLM's rule (greedy unless top_k/top_p ask for
    sampling); a person typing --temperature 0.8 means "sample", so say so here.
    """
    if temperature and top_k is None and top_p is None:
        top_p = 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
                          top_k=top_k, top_p=top_p, seed=seed)


def load(engine_dir: Path, **overrides) -> tuple[LLMEngine, Tokenizer]:
    engine = LLMEngine.from_engine_dir(engine_dir, **overrides)
    return engine, Tokenizer.from_dir(Path(engine_dir) / "tokenizer")
