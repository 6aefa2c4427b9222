"""Workloads of the speculative decoding benchmark (trtprompt/bench/speculative.py, scripts/bench_spec_peers.py).

Four chat requests whose answer repeats its input, the cases n-gram drafting is for, each built from text
shipped in this repository (no downloads), read at run time by name (a function, a doc section, a JSON
key), so a moved line does not change them:

- `code_rewrite`: a function of this repository's engine (stopping.py's `check_stop`, about 30 lines), one
  identifier to rename;
- `extract_quotes`: a passage of docs/security.md, "copy every sentence that contains the word salt";
- `json_reformat`: a test fixture's JSON object, pretty-printed, to give back with its keys in camelCase;
- `multi_turn_restate`: a conversation whose last user turn asks for a summary quoting the earlier answers.

SmolLM2-135M-Instruct answers these phrasings by copying (measured): "quote, word for word" got a paraphrase,
"repeat your first answer" got the latest one, the sampler's 27-line `sample` got a shorter rewrite of its own,
and a one-line JSON object to pretty-print got a differently spaced one (few runs of tokens in common). A model
this small seldom performs the rename it is asked for: it copies, which is the part these workloads measure.

Plus random prompts (token ids from a seeded generator, past the special tokens) for the throughput run.
Everything is deterministic; `digest` names the exact token ids a run used, so two runs (or two peers)
can be checked to have sent the same prompts.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]  # the repository: docs/, tests/fixtures/ and the sources
Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class Workload:
    """One chat request: its name and messages (the chat template adds the assistant's turn)."""

    name: str
    messages: tuple[Message, ...]

    def __post_init__(self) -> None:
        if not self.messages or self.messages[-1][0] != "user":
            raise ValueError(f"Workload.messages of {self.name!r} must end with a user turn")

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def _read(relative: str) -> str:
    path = ROOT / relative
    if not path.exists():  # an installed wheel has no docs/ or tests/: the workloads need the repository
        raise FileNotFoundError(f"{path}: the speculative workloads are built from the repository's files")
    return path.read_text(encoding="utf-8")


def function_source(relative: str, name: str) -> str:
    """The source of the top-level function `name` of a repository file, decorators excluded."""
    text = _read(relative)
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            source = ast.get_source_segment(text, node)
            if source is not None:
                return source
    raise LookupError(f"{relative}: no top-level function {name!r}")


def doc_paragraphs(relative: str, heading: str, count: int) -> str:
    """The first `count` paragraphs (blank-line separated) under a Markdown heading."""
    lines = _read(relative).splitlines()
    try:
        start = lines.index(heading) + 1
    except ValueError:
        raise LookupError(f"{relative}: no heading {heading!r}") from None
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines[start:] + [""]:
        if line.startswith("#"):
            break
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append("\n".join(current))
            current = []
        if len(paragraphs) == count:
            break
    if current and len(paragraphs) < count:
        paragraphs.append("\n".join(current))
    return "\n\n".join(paragraphs[:count])


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def code_rewrite() -> Workload:
    code = function_source("trtprompt/engine/stopping.py", "check_stop")
    return Workload("code_rewrite", (("user", "Rewrite this code with `req` renamed to `request`. Output only "
                                              f"the code.\n\n```python\n{code}\n```"),))


def extract_quotes() -> Workload:
    passage = doc_paragraphs("docs/security.md", "## Prefix cache: what one user can learn about another", 4)
    return Workload("extract_quotes", (("user", "Copy, exactly as written, every sentence of the text below that "
                                                f"contains the word \"salt\".\n\n{passage}"),))


def json_reformat() -> Workload:
    config = json.loads(_read("tests/fixtures/trtllm/good/config.json"))["pretrained_config"]
    flat = {k: v for k, v in config.items() if not isinstance(v, dict)}  # the scalar fields
    example = next(k for k in flat if "_" in k)
    return Workload("json_reformat", (("user", "Rename every key of this JSON object from snake_case to camelCase "
                                               f"(for example `{example}` becomes `{camel(example)}`). Keep every "
                                               "value and the formatting. Output only the JSON.\n\n"
                                               + json.dumps(flat, indent=2)),))


def multi_turn_restate() -> Workload:
    first = doc_paragraphs("docs/prefix-pool.md", "# The prefix pool", 1)
    return Workload("multi_turn_restate", (
        ("user", "Where does trtprompt keep a prompt's KV blocks after the request ends?"),
        ("assistant", first),
        ("user", "Which knob sets the disk tier's byte budget?"),
        ("assistant", "`disk_cache_size`; it is 4 GiB unless you set it."),
        ("user", "Thanks. Summarize the whole conversation so far, quoting your answers."),
    ))


def workloads() -> tuple[Workload, ...]:
    return (code_rewrite(), extract_quotes(), json_reformat(), multi_turn_restate())


WORKLOAD_NAMES = ("code_rewrite", "extract_quotes", "json_reformat", "multi_turn_restate")


def load_tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def chat_token_ids(tokenizer: Any, workload: Workload) -> list[int]:
    """The prompt as the model's chat template renders it, generation prompt added, no extra BOS."""
    text = tokenizer.apply_chat_template(workload.as_chat(), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenized(tokenizer_dir: Path) -> dict[str, list[int]]:
    """Every workload's prompt token ids, by name."""
    tokenizer = load_tokenizer(tokenizer_dir)
    return {w.name: chat_token_ids(tokenizer, w) for w in workloads()}


def token_id_range(tokenizer: Any) -> tuple[int, int]:
    """Ids past the special (added) tokens, below the tokenizer's size: plain text pieces only."""
    specials = list(tokenizer.added_tokens_decoder) or [-1]
    return max(specials) + 1, len(tokenizer)


def random_prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn from a generator seeded with `seed`."""
    low, high = token_id_range(tokenizer)
    if high - low < 2:
        raise ValueError(f"the tokenizer has no plain token ids to draw from ({low}..{high})")
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


def digest(prompts: Sequence[Sequence[int]]) -> str:
    """A short name of exact token ids (sha256 of their JSON, 16 hex digits)."""
    return hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:16]
