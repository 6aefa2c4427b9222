"""Make small Hugging Face checkpoints with random weights, fully offline.

Used by `trtprompt demo-checkpoint` (scripts/make_demo_checkpoint.py wraps it) and by
the tests. The tokenizer is a byte-level BPE trained on the text shipped in `trtprompt/data/`, so nothing is
downloaded. Weights are deterministic for a seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtprompt.engine.config import MODEL_TYPES

ARCHITECTURES = MODEL_TYPES  # --arch takes the model_type
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=768),
    # ~27M parameters with untied embeddings: the benchmark model.
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=7168),
    # The shape of the side-by-side against vLLM's CPU build (scripts/bench_vs_vllm.py,
    # docs/peer-vllm.md): "small" with a 4,000-token vocabulary, 27.3M parameters.
    "peer": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=4000),
}
ROPE_CHOICES: tuple[str, ...] = ("default", "llama3")
BOS, EOS, PAD, END_OF_TURN = "<s>", "</s>", "<pad>", "<|end|>"
ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, END_OF_TURN, *ROLE_TOKENS)
MAX_POSITION_EMBEDDINGS = 4096
# Large init: with HF's default 0.02 a tiny model's logits are nearly flat and
# greedy ties flip on float-order noise (docs/design.md, "Machines and test models").
INITIALIZER_RANGE = 0.3

# Bos is in the template *and* added by the post-processor, like Llama 3:
# tokenize a rendered chat with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class DemoSpec:
    """What to make. `tie=None` means the family's usual choice (Qwen ties)."""

    arch: str = "llama"
    size: str = "tiny"
    seed: int = 0
    tie: bool | None = None
    vocab_size: int | None = None
    rope: str = "default"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}")
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, got {self.size!r}")
        if self.rope not in ROPE_CHOICES:
            raise ValueError(f"rope must be one of {', '.join(ROPE_CHOICES)}, got {self.rope!r}")
        if self.rope == "llama3" and self.arch != "llama":
            raise ValueError("rope 'llama3' is only made for arch 'llama'")
        minimum = 256 + len(SPECIAL_TOKENS)
        if self.vocab_size is not None and self.vocab_size < minimum:
            raise ValueError(f"vocab_size must be at least {minimum} (bytes + special tokens), "
                             f"got {self.vocab_size}")

    @property
    def tied(self) -> bool:
        return self.tie if self.tie is not None else self.arch in ("qwen2", "qwen3")

    @property
    def target_vocab_size(self) -> int:
        return self.vocab_size or SIZES[self.size]["vocab_size"]


def corpus_files() -> list[Path]:
    files = sorted((Path(__file__).parent / "data").glob("*.txt"))
    if not files:
        raise FileNotFoundError("no tokenizer corpus found in trtprompt/data/")
    return files


# Qwen's split rule. transformers 5 rebuilds a qwen2 checkpoint's tokenizer
# with this rule and NFC whatever tokenizer.json says, so Qwen-family
# checkpoints use it too: AutoTokenizer and tokenizer.json then agree.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _set_pipeline(tok: Any, qwen_style: bool) -> None:
    from tokenizers import Regex, normalizers, pre_tokenizers

    if qwen_style:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)


def train_tokenizer(vocab_size: int, qwen_style: bool = False) -> Any:
    """Byte-level BPE on the shipped corpus; the same input gives the same merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    _set_pipeline(tok, qwen_style)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(p) for p in corpus_files()], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A:0", pair=f"{BOS} $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)],
    )
    return tok


def _hf_tokenizer(vocab_size: int, qwen_style: bool) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, qwen_style),
        # Byte-level BPE never needs unk; naming one stops transformers 5's
        # Qwen2Tokenizer from appending its own "<|endoftext|>" past the vocab.
        bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=EOS,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _rope_parameters(spec: DemoSpec) -> dict[str, Any]:
    if spec.rope == "llama3":
        # Llama 3.1's shape of scaling, shrunk to this model's context.
        return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024}
    return {"rope_type": "default", "rope_theta": 10000.0}


def model_config(spec: DemoSpec, vocab_size: int, token_ids: dict[str, int]) -> Any:
    from transformers import AutoConfig

    kwargs: dict[str, Any] = dict(SIZES[spec.size])
    kwargs.update(
        vocab_size=vocab_size, max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE, rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tied, rope_parameters=_rope_parameters(spec),
        bos_token_id=token_ids[BOS], eos_token_id=token_ids[EOS], pad_token_id=token_ids[PAD],
        architectures=[ARCHITECTURES[spec.arch]], dtype="float32",
    )
    if spec.arch == "mistral":
        kwargs["sliding_window"] = None
    if spec.arch == "qwen2":
        kwargs["use_sliding_window"] = False
    if spec.arch == "qwen3":
        # Differs from hidden/heads on purpose, so code that derives it is caught.
        kwargs["head_dim"] = 2 * kwargs["hidden_size"] // kwargs["num_attention_heads"]
        kwargs["use_sliding_window"] = False
    return AutoConfig.for_model(spec.arch, **kwargs)


def _random_model(config: Any, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF inits norms to one and biases to zero; perturb them so that an engine
    # which ignores a norm weight or a bias fails the parity tests.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _generation_config(token_ids: dict[str, int]) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=token_ids[BOS], pad_token_id=token_ids[PAD],
        # A chat turn ends with <|end|>; plain text ends with </s>.
        eos_token_id=[token_ids[EOS], token_ids[END_OF_TURN]],
    )


def make_demo_checkpoint(out: str | Path, spec: DemoSpec | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer."""
    spec = spec or DemoSpec()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _hf_tokenizer(spec.target_vocab_size, qwen_style=spec.arch in ("qwen2", "qwen3"))
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # The model's vocab equals the tokenizer's, so every sampled id decodes.
    config = model_config(spec, len(tokenizer), token_ids)
    model = _random_model(config, spec.seed)
    model.generation_config = _generation_config(token_ids)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out)
    return out


def _portable_tokenizer_class(out: Path) -> None:
    """transformers 5 writes "TokenizersBackend", which 4.x (the GPU container's) cannot load."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
