"""The engine tokenizer: parity with transformers, and the streaming detokenizer.

Two tokenizers are trained here offline, one byte-level BPE (GPT-2/Qwen
style) and one Metaspace BPE with byte fallback (Llama/Mistral style), on
text with multi-byte characters so that split UTF-8 sequences really occur.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from trtprompt.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged KV caches reuse blocks across requests that share a prefix.",
    "hello world, hello there, hello again",
    "naïve café déjà vu — Grüße aus Köln",
    "日本語のテキストも少し入れておく。",
] * 20
# Characters the tokenizers never saw: they fall back to bytes, 3-4 per char.
UNSEEN = "emoji 🙂🚀 and 中文 plus ñ"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>"]


def _write(tok: HFTokenizer, path: Path) -> Path:
    path.mkdir(parents=True)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return path


def _byte_level(path: Path) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return _write(tok, path)


def _metaspace_byte_fallback(path: Path) -> Path:
    """Llama-style: train a Metaspace BPE, then rebuild it with <0xNN> byte tokens."""
    base = HFTokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    trained = json.loads(base.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return _write(tok, path)


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tok_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    build = _byte_level if request.param == "byte_level" else _metaspace_byte_fallback
    return build(root / "tokenizer")


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    det = tok.stream()
    pieces = [det.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(det.flush())
    return pieces


def test_special_tokens_and_encode_roundtrip(tok: Tokenizer) -> None:
    assert tok.bos_token_id == tok.backend.token_to_id("<s>")
    assert tok.eos_token_id == tok.backend.token_to_id("</s>")
    ids = tok.encode(UNSEEN)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(UNSEEN, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == UNSEEN
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_parity_with_transformers(tok_dir: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True, trust_remote_code=False)
    for text in [CORPUS[0], CORPUS[3], UNSEEN, " leading space", ""]:
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🙂"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        theirs = ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours == theirs
    assert tok.encode_chat(messages) == tok.encode(ours_text := tok.apply_chat_template(messages),
                                                   add_special_tokens=False)
    assert ours_text.startswith("<s><|system|>be brief</s>")


def test_stream_keeps_multibyte_characters_whole(tok: Tokenizer) -> None:
    ids = tok.encode(UNSEEN, add_special_tokens=False)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == UNSEEN
    assert all("\ufffd" not in p for p in pieces)
    # The emoji really spans several tokens: some steps had to hold text back.
    assert len(ids) > len([p for p in pieces if p])
    assert "🙂" in pieces or any("🙂" in p for p in pieces)


def test_stream_keeps_word_leading_spaces(tok: Tokenizer) -> None:
    text = "hello world, hello there"
    pieces = _stream(tok, tok.encode(text, add_special_tokens=False))
    assert "".join(pieces) == text
    # Each word after the first is emitted with its own leading space
    # (decoding the new token alone would drop it for Metaspace).
    assert any(p.startswith(" ") for p in pieces)


def test_stream_chunks_equal_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(" ".join(CORPUS[:5]) + UNSEEN, add_special_tokens=False)
    for chunk in (1, 2, 3, 7):
        assert "".join(_stream(tok, ids, chunk)) == tok.decode(ids)


def test_stream_skips_special_tokens_and_flushes_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    # Drop the emoji's last byte token: the sequence ends mid-character.
    dangling = ids[:-1]
    det = tok.stream()
    streamed = "".join(det.step([i]) for i in dangling)
    assert "\ufffd" not in streamed
    tail = det.flush()
    assert streamed + tail == tok.decode(dangling)
    assert tail.endswith("\ufffd")
    assert det.flush() == ""
    # An eos token at the end adds no text.
    assert "".join(_stream(tok, ids + [tok.eos_token_id])) == "ok 🙂"


def test_stream_random_ids_equal_full_decode(tok: Tokenizer) -> None:
    # ByteFallback turns a whole run of byte tokens into U+FFFDs once the run
    # turns out invalid, which no incremental decoder can anticipate; the
    # byte-level tokenizer is checked over its whole vocabulary.
    vocab = [i for i in range(tok.vocab_size) if not tok.backend.id_to_token(i).startswith("<0x")]
    rng = random.Random(7)
    for _ in range(40):
        ids = [rng.choice(vocab) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parity_on_demo_checkpoints(tiny_checkpoint_factory, arch: str) -> None:
    from transformers import AutoTokenizer

    path = tiny_checkpoint_factory(arch)
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    for text in ["Héllo wörld, 世界! 🚀 def f(x): return x**2", " two  spaces\n\ttab", ""]:
        assert ours.encode(text) == ref(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🚀"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert ours.eos_token_id == ref.eos_token_id and ours.bos_token_id == ref.bos_token_id
