"""Shared helpers for engine tests: tiny HF models and the transformers oracle."""

from __future__ import annotations

import zlib
from functools import lru_cache
from pathlib import Path

import torch
import transformers

from trtprompt.engine.config import DEFAULT_ATTENTION_BACKEND, EngineConfig, KvCacheConfig, ModelConfig, SchedulerConfig
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.model import load_model_from_safetensors
from trtprompt.engine.request import Request, RetentionConfig, SamplingParams
from trtprompt.engine.speculation.config import SpeculationConfig

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # head_dim != hidden / heads, and a multiple of every kernel variant's lanes (16 on AVX-512)
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
}
VOCAB = 256
EOS = 2


def make_hf_model(root: Path, arch: str, seed: int = 0, **extra) -> Path:
    cfg_cls, model_cls, arch_extra = ARCHS[arch]
    out = root / f"{arch}-{seed}-{zlib.crc32(repr(sorted(extra.items())).encode())}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
                  tie_word_embeddings=False)
    kwargs.update(arch_extra)
    kwargs.update(extra)
    model = model_cls(cfg_cls(**kwargs)).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


def model_config(path: Path) -> ModelConfig:
    c = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    rope = getattr(c, "rope_parameters", None) or {}
    scaling = dict(rope) if rope.get("rope_type", "default") != "default" else None
    return ModelConfig(
        architecture=c.architectures[0], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_size=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings, norm_epsilon=c.rms_norm_eps,
        rotary_base=rope.get("rope_theta", 10000.0), rotary_scaling=scaling,
        tie_word_embeddings=bool(c.tie_word_embeddings),
        attn_bias=c.model_type == "qwen2", qk_layernorm=c.model_type == "qwen3",
    )


def make_engine(path: Path, *, reuse: bool = True, chunked: bool = True, max_num_tokens: int = 256,
                policy: str = "guaranteed_no_evict", kv_tokens: int = 4096, tokens_per_block: int = 8,
                max_batch_size: int = 8, max_seq_len: int = 256, max_queue_size: int | None = None,
                linear_backend: str = "reference",
                attention_backend: str = DEFAULT_ATTENTION_BACKEND,
                eviction_policy: str = KvCacheConfig.eviction_policy, end_ids: tuple[int, ...] = (EOS,),
                tokenizer_dir: Path | None = None, jump_forward: bool = True,
                speculation: SpeculationConfig | None = None) -> LLMEngine:
    mc = model_config(path)
    cfg = EngineConfig(
        model=mc,
        kv_cache=KvCacheConfig(tokens_per_block=tokens_per_block, enable_block_reuse=reuse,
                               max_tokens_in_paged_kv_cache=kv_tokens, eviction_policy=eviction_policy),
        scheduler=SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                  max_seq_len=max_seq_len, enable_chunked_context=chunked,
                                  batch_scheduler_policy=policy, max_queue_size=max_queue_size),
        linear_backend=linear_backend,
        attention_backend=attention_backend,
        guided_jump_forward=jump_forward,
        speculation=speculation,
    )
    model = load_model_from_safetensors(path / "model.safetensors", mc, torch.float32,
                                        torch.device("cpu"), linear_backend)
    return LLMEngine(cfg, model, list(end_ids), tokenizer_dir=tokenizer_dir)


@lru_cache(maxsize=None)
def _hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                             torch_dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, cut before the end token (as the engine reports it)."""
    model = _hf_model(str(path))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(EOS)] if EOS in new else new


def run_to_completion(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams,
                      salts: dict[str, str] | None = None, check=None) -> dict[str, list[int]]:
    """Submit all prompts at once, step until done; returns output ids per request."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, params, (salts or {}).get(rid))
    outputs: dict[str, list[int]] = {}
    finished: dict[str, int] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
        if check is not None:
            check(engine)
    assert not engine.has_unfinished_requests()
    assert set(finished.values()) <= {1}, "every request ends exactly once"
    assert set(prompts) <= set(finished)
    return {rid: outputs.get(rid, []) for rid in prompts}


def serve_alone(kv: KVCacheManager, rid: str, tokens: list[int], retention: RetentionConfig | None = None) -> int:
    """Prefill one request alone, publish its blocks, free it; its cache hits in blocks."""
    req = Request(rid, tokens, SamplingParams(max_tokens=1), 1, frozenset(), None, 0, retention=retention)
    hits = kv.find_prefix(req)
    assert kv.allocate(req, req.num_tokens - len(hits) * kv.tokens_per_block, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed(req)
    kv.free(req)
    return len(hits)


def count_cascade_groups(monkeypatch) -> list[int]:
    """Force cascade attention on for any shared prefix; the list fills with each step's cascade groups."""
    from trtprompt.engine import attention_paged, cascade

    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)
    groups: list[int] = []
    build = attention_paged.build

    def counting_build(*args, **kwargs):
        meta = build(*args, **kwargs)
        groups.append(len(meta.groups))
        return meta

    monkeypatch.setattr(attention_paged, "build", counting_build)
    return groups


def prefill_segments(shapes: list[tuple[int, int, bool]], num_blocks: int, tpb: int,
                     rng) -> tuple[list[list[int]], list[list[int]], torch.Tensor, int]:
    """The kernels' prefill layout for (context, new tokens, causal) per sequence, on blocks drawn at
    random from num_blocks: (segments [row, new, keys, first visible key of row 0], block tables,
    the tables as one padded int32 tensor, total new rows)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    segments, tables, start = [], [], 0
    for ctx, n, causal in shapes:
        keys = ctx + n if causal else ctx
        tables.append([free.pop() for _ in range(-(-(ctx + n) // tpb))])
        segments.append([start, n, keys, ctx + 1 if causal else keys])
        start += n
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return segments, tables, table_t, start
