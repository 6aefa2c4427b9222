"""What the int8 scenarios share: engines built once under build/bench-int8/, greedy runs, and quality measures
(perplexity on a held-out text, greedy agreement, teacher-forced top-1) against a reference engine."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from trtprompt.bench import machine
from trtprompt.bench.machine import ROOT

OUT = ROOT / "build/bench-int8"
# SmolLM2's chat template (build/smollm2/chat_template.jinja) with its default system turn.
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWrite a short paragraph about {topic}.<|im_end|>\n<|im_start|>assistant\n")
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
PPL_CHUNK, PPL_TOKENS = 512, 4096
TOPICS = ("the moon", "bread baking", "volcanoes", "the French revolution", "photosynthesis", "chess openings",
          "honey bees", "the printing press", "black holes", "coral reefs", "jazz music", "the Roman empire",
          "electric cars", "penguins", "the water cycle", "origami", "tea ceremonies", "glaciers",
          "the internet", "dinosaurs", "rainbows", "the stock market", "yoga", "lighthouses", "vaccines",
          "the Olympic games", "deserts", "submarines", "coffee", "the human heart", "windmills", "kites")


def cpu_line() -> str:
    """The machine in one line (trtprompt/bench/machine.py), with torch's version and threads."""
    return f"{machine.one_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def built(checkpoint: Path, out: Path, quantization: str, overrides: dict[str, Any]) -> Path:
    """The engine at out, built (profile cpu-dev, these overrides) when it is not there yet."""
    from trtprompt.build import BuildRequest, run_build

    if (out / "config.json").exists():
        return out
    path = run_build(BuildRequest(checkpoint, out, "cpu-dev", overrides={**overrides, "quantization": quantization},
                                  force=True, progress=False))
    if path is None:
        raise RuntimeError(f"building {out} from {checkpoint} produced no engine")
    return path


def run_greedy(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt at once, exactly max_tokens greedy tokens each; the tokens and the wall seconds."""
    from trtprompt.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, list(p), params)
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks[o.request_id].extend(o.new_token_ids)
    return [toks[rid] for rid in ids], time.perf_counter() - t0


def forward_all(engine: Any, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of one sequence, prefilled in one step into the engine's pool."""
    from trtprompt.engine.attention import SeqSlice, build_attention_metadata

    tpb = engine.kv.tokens_per_block
    meta = build_attention_metadata([SeqSlice(0, len(ids), list(range(-(-len(ids) // tpb))))], tpb, engine.device)
    with torch.inference_mode():
        out: torch.Tensor = engine.runner.model(torch.tensor(ids), torch.arange(len(ids)), meta,
                                                engine.runner.kv_caches, torch.arange(len(ids)))
    return out


def perplexity(engine: Any, tokens: Sequence[int]) -> float:
    """exp of the mean next-token loss over tokens, in chunks of PPL_CHUNK scored independently."""
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, PPL_CHUNK):
        chunk = list(tokens[start:start + PPL_CHUNK + 1])
        if len(chunk) < 2:
            break
        logits = forward_all(engine, chunk[:-1])
        nll += F.cross_entropy(logits.float(), torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Free-running greedy agreement: tokens equal by position, common prefix, identical sequences."""
    same = sum(a == b for r, o in zip(ref, other) for a, b in zip(r, o))
    total = sum(len(r) for r in ref)
    prefix = []
    for r, o in zip(ref, other):
        k = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
        prefix.append(k)
    return {"position_match": same / total, "mean_common_prefix": statistics.fmean(prefix),
            "identical_sequences": sum(p == len(r) for p, r in zip(prefix, ref)) / len(ref)}


def teacher_forced(engine: Any, prompts: list[list[int]], ref: list[list[int]]) -> float:
    """Share of fp32's greedy tokens that this engine also ranks first, fed fp32's own sequence."""
    hits = total = 0
    for p, r in zip(prompts, ref):
        logits = forward_all(engine, p + r[:-1])[len(p) - 1:]
        hits += int((logits.argmax(-1) == torch.tensor(r)).sum())
        total += len(r)
    return hits / total
