"""Read what `trtprompt lint` checks: JSONL of prompts or a template with {placeholders}.

JSONL: one object per line, {"prompt": "..."} or {"messages": [{role, content}, ...]},
optionally with "cache_salt". Template: any other text file; `{name}`
marks a variable part (Python format syntax, `{{`/`}}` for literal braces),
and lint makes `samples` instances of it with distinct made-up values.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtprompt.errors import UserError
from trtprompt.prompt.budget import PromptError
from trtprompt.prompt.chat import parse_messages

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
# Plain words for made-up placeholder values: varied enough that no two instances share a block.
_WORDS = tuple("alpha river stone window quiet orange market signal garden copper lantern meadow "
               "harbor velvet thunder pencil ribbon canyon marble falcon silver forest candle beacon".split())


@dataclass(frozen=True)
class LintPrompt:
    line: int  # 1-based line of the file (template instances: instance number)
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class Template:
    text: str
    pieces: tuple[tuple[str, str | None], ...]  # (literal, placeholder name or None)

    @property
    def placeholders(self) -> list[str]:
        return list(dict.fromkeys(name for _, name in self.pieces if name is not None))

    def fill(self, values: dict[str, str]) -> str:
        return "".join(lit + (values[name] if name is not None else "") for lit, name in self.pieces)


def parse_template(text: str, where: str = "template") -> Template:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise UserError(f"{where}: not a valid template: {exc}") from None
    pieces = tuple((lit, None if name is None else (name or "<positional>")) for lit, name, _, _ in parsed)
    return Template(text, pieces)


def sample_values(names: list[str], instance: int, words: int, seed: int = 0) -> dict[str, str]:
    rng = random.Random(f"{seed}:{instance}")
    return {n: " ".join(rng.choice(_WORDS) for _ in range(words)) + f" #{instance}" for n in names}


def _jsonl_prompt(obj: Any, line: int, where: str) -> LintPrompt:
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise UserError(f"{where}:{line}: expected an object with either \"prompt\" or \"messages\"")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise UserError(f"{where}:{line}: \"cache_salt\" must be a string")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise UserError(f"{where}:{line}: \"prompt\" must be a non-empty string")
        return LintPrompt(line, text=obj["prompt"], cache_salt=salt)
    try:
        messages = parse_messages(json.dumps(obj["messages"]))
    except PromptError as exc:
        raise UserError(f"{where}:{line}: {exc}".replace("input 'messages'", "\"messages\"")) from None
    return LintPrompt(line, messages=tuple(messages), cache_salt=salt)


def _parse_jsonl(text: str, where: str) -> list[LintPrompt]:
    out = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}:{line_no}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        out.append(_jsonl_prompt(obj, line_no, where))
    if not out:
        raise UserError(f"{where}: no prompts in the file")
    return out


def _looks_like_jsonl(text: str) -> bool:
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def read_lint_file(path: Path, samples: int, fill_words: int
                   ) -> tuple[list[LintPrompt], Template | None]:
    """The prompts to analyse, plus the template they came from (None for JSONL)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None
    if path.suffix.lower() in JSONL_SUFFIXES or _looks_like_jsonl(text):
        return _parse_jsonl(text, str(path)), None
    template = parse_template(text, str(path))
    if not template.placeholders:
        raise UserError(f"{path} is neither JSONL of prompts nor a template with {{placeholders}}")
    if samples < 2:
        raise UserError(f"--samples must be at least 2 to compare template instances, got {samples}")
    prompts = [LintPrompt(k + 1, text=template.fill(sample_values(template.placeholders, k, fill_words)))
               for k in range(samples)]
    return prompts, template
