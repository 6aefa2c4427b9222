"""The engine's tokenizer: encode, decode, chat templates, streaming detokenizer.

Loaded from an engine's `tokenizer/` directory with the `tokenizers` library
only, offline. `transformers` would give the same ids (tests check parity)
but costs seconds to import, and every Triton Python-backend model that
tokenizes pays that at load time.

The streaming detokenizer decodes a sliding window of ids (prefix offset /
read offset), so a multi-byte UTF-8 character split over tokens is never
cut between two pieces and Metaspace tokenizers keep the leading space of
each new word; `flush()` returns whatever a final full decode still owes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import Tokenizer as _HFTokenizer

# U+FFFD: what a byte-level decoder yields for an incomplete UTF-8 sequence.
_REPLACEMENT = "\ufffd"
# A token never stands for less than this many bytes of input in our bound: one unknown or
# byte-fallback token may consume a whole UTF-8 character (up to 4 bytes).
_MIN_TOKEN_BYTES = 4


def longest_token_bytes(backend: _HFTokenizer) -> int:
    """The most UTF-8 bytes of text one token can stand for, by decoding every token once.

    An upper bound for the usual decoder tokenizers (byte-level BPE, Metaspace, added tokens):
    a token covering part of a character decodes to U+FFFD, 3 bytes, at least what it covered.
    A normalizer that shrinks text (NFKC ligatures) could beat it; see docs/bad-inputs.md.
    """
    n = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return max([_MIN_TOKEN_BYTES, *(len(t.encode("utf-8")) for t in texts)])


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(path: str | Path) -> str | None:
    """A tokenizer directory's chat template, read without loading the tokenizer (the OpenAI front end
    picks its tool-call and reasoning parsers from it)."""
    path = Path(path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    return _read_chat_template(path, cfg if isinstance(cfg, dict) else {})


def _read_chat_template(path: Path, cfg: Mapping[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = path / "chat_template.json"
    if json_file.is_file():
        return json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer plus the special-token facts generation needs."""

    backend: _HFTokenizer
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool | None
    chat_template: str | None
    # Bounds the bytes of text that can fit N tokens (computed once, at load).
    max_token_bytes: int = _MIN_TOKEN_BYTES

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = _HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        pad = _token_content(cfg.get("pad_token"))
        return cls(
            backend=backend,
            bos_token=bos,
            eos_token=eos,
            bos_token_id=backend.token_to_id(bos) if bos else None,
            eos_token_id=backend.token_to_id(eos) if eos else None,
            pad_token_id=backend.token_to_id(pad) if pad else None,
            add_bos_token=cfg.get("add_bos_token"),
            chat_template=_read_chat_template(path, cfg),
            max_token_bytes=longest_token_bytes(backend),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt being
        # tokenized on one thread of a Triton stub must not stall the threads streaming others'
        # tokens (measured: 4 MB held the GIL 20 s with encode, < 0.4 s with encode_batch).
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        # tokenizer_config's add_bos_token overrides the file's post-processor,
        # as transformers does for Llama-style tokenizers.
        if add_special_tokens and self.bos_token_id is not None and self.add_bos_token is not None:
            has_bos = bool(ids) and ids[0] == self.bos_token_id
            if self.add_bos_token and not has_bos:
                ids = [self.bos_token_id, *ids]
            elif not self.add_bos_token and has_bos:
                ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render the checkpoint's chat template to text (encode it with
        add_special_tokens=False: templates write their own BOS). extra: more template
        variables, as transformers passes them (`tools`, a request's chat_template_kwargs)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            **{"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **extra},
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    def stream(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
               ) -> "StreamDetokenizer":
        return StreamDetokenizer(self, prompt_ids, skip_special_tokens)


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]],
                         add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render a Hugging Face chat template the way transformers does
    (sandboxed jinja2, trim_blocks + lstrip_blocks, raise_exception, tojson)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **extra)


class StreamDetokenizer:
    """Incremental decode of one sequence.

    `prefix_offset..read_offset` is the window already turned into text; each
    step decodes `prefix_offset..end` and emits only what lies beyond the
    window's text. Decoding from a few tokens back (not from the new token
    alone) keeps Metaspace's word-leading spaces, and holding back text that
    ends in U+FFFD keeps a split multi-byte character whole.
    """

    # Tokens of context kept before the read offset; enough for any decoder
    # to see the previous word boundary.
    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - self._CONTEXT)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def step(self, token_ids: Iterable[int]) -> str:
        """Add new tokens; return the text they complete ("" if none yet)."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        piece = new_text[len(prefix_text):]
        # Re-anchor the window on the tokens just emitted.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return piece

    def flush(self) -> str:
        """Text still held back at the end of the sequence (e.g. a dangling
        partial character, which decodes to U+FFFD as a full decode would)."""
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
