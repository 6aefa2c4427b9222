"""`trtprompt lint`: how much of a prompt set's prefill block reuse can skip, what
breaks reuse, and the order that would reuse more.

Estimates follow the engine exactly (trtprompt/prompt/reuse.py): prompts in
file order, each prefilled before the next, full blocks only, the last
prompt token always recomputed, no eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from trtprompt.errors import UserError
from trtprompt.knobs import KNOBS
from trtprompt.prompt import segments as seg
from trtprompt.prompt.lint_input import LintPrompt, Template, parse_template, read_lint_file
from trtprompt.prompt.prefix_tree import Branch, build_tree
from trtprompt.prompt.restart import RestartReport, TierSetup, restart_report
from trtprompt.prompt.reuse import ReuseEstimate, estimate_reuse
from trtprompt.rules import max_input_len

ASSUMPTIONS = ("prompts run in file order, each prefilled before the next starts; only full blocks are "
               "reused and a prompt's last token is always recomputed; the cache evicts nothing")


@dataclass(frozen=True)
class Unit:
    """A unit of a prompt and where it sits: message index (None for text prompts), offset in it."""

    text: str
    message: int | None
    offset: int


@dataclass(frozen=True)
class Span:
    """A place in one prompt that breaks reuse."""

    prompt: int
    line: int
    kind: str  # "variable" or a volatile kind (timestamp, uuid, date, ...)
    text: str
    unit: str
    message: int | None
    unit_index: int
    char_start: int
    token_start: int
    num_tokens: int
    shared_units_after: int

    def as_dict(self, tokens_per_block: int) -> dict[str, Any]:
        return {"prompt": self.prompt, "line": self.line, "kind": self.kind, "text": self.text,
                "unit": self.unit, "message": self.message, "unit_index": self.unit_index,
                "char_start": self.char_start,
                "token_start": self.token_start, "block": self.token_start // tokens_per_block,
                "tokens_after": self.num_tokens - self.token_start,
                "shared_units_after": self.shared_units_after}


@dataclass
class LintReport:
    file: str
    mode: str
    tokens_per_block: int
    prompts: list[LintPrompt]
    ids: list[list[int]]
    estimate: ReuseEstimate
    tree: list[Branch]
    spans: list[Span]
    suggested: list[LintPrompt]
    suggested_estimate: ReuseEstimate
    template: Template | None = None
    reordered_template: str | None = None
    placeholders_before_static: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    restart: RestartReport | None = None  # what a restart keeps (prompt/restart.py)

    @property
    def reusable_fraction(self) -> float:
        return self.estimate.reusable_fraction


def prompt_units(p: LintPrompt) -> list[Unit]:
    if p.text is not None:
        out, pos = [], 0
        for u in seg.split_units(p.text):
            out.append(Unit(u, None, pos))
            pos += len(u)
        return out
    units = []
    for i, m in enumerate(p.messages or ()):
        pos = 0
        for u in seg.split_units(m["content"]):
            units.append(Unit(u, i, pos))
            pos += len(u)
    return units


def encode(tokenizer: Any, p: LintPrompt) -> list[int]:
    if p.text is not None:
        return tokenizer.encode(p.text)
    return tokenizer.encode_chat(list(p.messages or ()), add_generation_prompt=True)


def reorder_prompt(p: LintPrompt, shared: set[str]) -> LintPrompt:
    if p.text is not None:
        return replace(p, text=seg.reorder(seg.split_units(p.text), shared))
    messages = tuple({**m, "content": seg.reorder(seg.split_units(m["content"]), shared)}
                     for m in p.messages or ())
    return replace(p, messages=messages)


def _token_start(tokenizer: Any, p: LintPrompt, unit: Unit) -> int:
    """Approximate index of the unit's first token (tokens of the text before it)."""
    if p.text is not None:
        return len(tokenizer.encode(p.text[:unit.offset])) if unit.offset else 0
    rendered = tokenizer.apply_chat_template(list(p.messages or ()), add_generation_prompt=True)
    cursor = 0
    for i, m in enumerate(p.messages or ()):
        found = rendered.find(m["content"], cursor)
        if found < 0:
            return 0
        if i == unit.message:
            return len(tokenizer.encode(rendered[:found + unit.offset], add_special_tokens=False))
        cursor = found + len(m["content"])
    return 0


def find_span(index: int, p: LintPrompt, units: list[Unit], shared: set[str], tokenizer: Any,
              num_tokens: int, tokens_per_block: int) -> Span | None:
    """The first variable unit followed by shared text, or else a volatile value early on."""
    texts = [u.text for u in units]
    brk = seg.first_break(texts, shared)
    if brk is not None:
        unit = units[brk.unit_index]
        kind, text = ("variable", brk.unit.strip()) if not brk.volatile else (brk.volatile[0].kind,
                                                                              brk.volatile[0].text)
        return Span(index, p.line, kind, text, brk.unit.strip(), unit.message, brk.unit_index, unit.offset,
                    _token_start(tokenizer, p, unit), num_tokens, brk.shared_after)
    if any(seg.unit_key(t) in shared and seg.unit_key(t) for t in texts):
        return None  # the set shows what is shared, and no volatile value precedes it
    # No evidence from other prompts: a volatile value with a block or more after it is suspect.
    for k, unit in enumerate(units):
        vol = seg.find_volatile(unit.text)
        if vol and seg.unit_key(unit.text) not in shared:
            start = _token_start(tokenizer, p, unit)
            if num_tokens - start > tokens_per_block:  # a full block or more follows it
                return Span(index, p.line, vol[0].kind, vol[0].text, unit.text.strip(), unit.message, k,
                            unit.offset, start, num_tokens, 0)
    return None


def _salts(prompts: Sequence[LintPrompt]) -> list[str | None]:
    return [p.cache_salt for p in prompts]


def analyze(prompts: list[LintPrompt], tokenizer: Any, tokens_per_block: int, file: str = "",
            template: Template | None = None, tiers: TierSetup | None = None) -> LintReport:
    """tiers: the serve tier knobs, for what survives a restart (none configured: nothing does)."""
    ids = [encode(tokenizer, p) for p in prompts]
    estimate = estimate_reuse(ids, tokens_per_block, _salts(prompts))
    units = [prompt_units(p) for p in prompts]
    shared = seg.shared_keys([u.text for u in us] for us in units)
    spans = [s for i, p in enumerate(prompts)
             if (s := find_span(i, p, units[i], shared, tokenizer, len(ids[i]), tokens_per_block))]
    suggested = [reorder_prompt(p, shared) for p in prompts]
    suggested_ids = [encode(tokenizer, p) for p in suggested]
    tree = build_tree(ids, tokens_per_block, _salts(prompts))
    report = LintReport(file, "template" if template else "jsonl", tokens_per_block, prompts, ids, estimate,
                        tree, spans, suggested, estimate_reuse(suggested_ids, tokens_per_block, _salts(suggested)),
                        template, restart=restart_report(ids, tokens_per_block, _salts(prompts), tree,
                                                         tiers or TierSetup()))
    if template is not None:
        _template_findings(report, tokenizer)
    return report


def _template_findings(report: LintReport, tokenizer: Any) -> None:
    """Placeholders that precede static text, and the template with static lines first."""
    assert report.template is not None
    units = seg.split_units(report.template.text)
    static = {seg.unit_key(u) for u in units if "{" not in u.replace("{{", "")}
    report.reordered_template = seg.reorder(units, static)
    for i, u in enumerate(units):
        names = [n for _, n in parse_template(u).pieces if n]
        after = "".join(v for v in units[i + 1:] if seg.unit_key(v) in static)
        if names and after.strip():
            report.placeholders_before_static.append(
                {"placeholders": names, "line": 1 + sum(v.count("\n") for v in units[:i]),
                 "static_tokens_after": len(tokenizer.encode(after, add_special_tokens=False))})


def preview(report: LintReport, tokenizer: Any, branch: Branch, chars: int = 48) -> str:
    ids = report.ids[branch.example_prompt]
    tpb = report.tokens_per_block
    text = tokenizer.decode(ids[branch.first_block * tpb:(branch.last_block + 1) * tpb])
    text = " ".join(text.split())
    return text if len(text) <= chars else text[:chars - 3] + "..."


def lint_file(path: Path, tokenizer: Any, tokens_per_block: int, samples: int = 8,
              fill_words: int = 6, max_input_len: int | None = None, tiers: TierSetup | None = None) -> LintReport:
    prompts, template = read_lint_file(path, samples, fill_words)
    report = analyze(prompts, tokenizer, tokens_per_block, str(path), template, tiers)
    if max_input_len is not None:
        for p, ids in zip(prompts, report.ids):
            if len(ids) > max_input_len:
                report.warnings.append(f"line {p.line}: {len(ids)} tokens exceed the engine's maximum input "
                                       f"length ({max_input_len})")
    return report


def _max_input_len(eng: Any) -> int:
    """TensorRT-LLM's runtime rule, as the engine applies it."""
    build = eng.build_config
    return max_input_len(int(build["max_seq_len"]), int(build["max_num_tokens"]),
                         bool(eng.runtime.get("enable_chunked_context")))


def engine_entry_bytes(engine: Path) -> int | None:
    """Bytes of one KV block as the disk tier stores it, header included (docs/prefix-pool.md, "Stored
    blocks"); None off the torch target or when the engine does not record its KV bytes per token."""
    from trtprompt.engine.engine_dir import read_engine_dir
    from trtprompt.engine.tiers.codec import HEADER_BYTES

    eng = read_engine_dir(engine)
    per_token = (eng.meta.get("memory_plan") or {}).get("kv_bytes_per_token")
    if eng.target != "torch" or not isinstance(per_token, int):
        return None
    return HEADER_BYTES + per_token * eng.tokens_per_block


def load_tokenizer_and_block(engine: Path | None, tokenizer_dir: Path | None,
                             tokens_per_block: int | None) -> tuple[Any, int, int | None]:
    """(tokenizer, tokens_per_block, max_input_len or None) from --engine or --tokenizer."""
    from trtprompt.tokenizer import Tokenizer

    if (engine is None) == (tokenizer_dir is None):
        raise UserError("give exactly one of --engine ENGINE_DIR or --tokenizer DIR")
    if engine is not None:
        if tokens_per_block is not None:
            raise UserError("--tokens-per-block comes from the engine; do not pass it with --engine")
        from trtprompt.engine.engine_dir import read_engine_dir

        eng = read_engine_dir(engine)
        return Tokenizer.from_dir(eng.tokenizer_dir), eng.tokens_per_block, _max_input_len(eng)
    knob = KNOBS["tokens_per_block"]
    tpb = knob.default if tokens_per_block is None else tokens_per_block
    problem = knob.problem(tpb)
    if problem:
        raise UserError(f"--tokens-per-block {problem}")
    try:
        return Tokenizer.from_dir(tokenizer_dir), tpb, None  # type: ignore[arg-type]
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
