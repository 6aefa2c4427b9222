"""`trtprompt lint` output: a JSON document or a text report, and the command's logic."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from trtprompt.prompt.lint import (
    ASSUMPTIONS,
    LintReport,
    Span,
    engine_entry_bytes,
    lint_file,
    load_tokenizer_and_block,
    preview,
)
from trtprompt.prompt.lint_input import LintPrompt
from trtprompt.prompt.prefix_tree import render_tree
from trtprompt.prompt.restart import TierSetup, restart_lines
from trtprompt.prompt.reuse import ReuseEstimate
from trtprompt.prompt.segments import mask_volatile


def _totals(est: ReuseEstimate) -> dict[str, Any]:
    return {"prompt_tokens": est.total_tokens, "reused_blocks": est.reused_blocks,
            "reusable_tokens": est.reused_tokens, "prefill_tokens": est.prefill_tokens,
            "reusable_fraction": round(est.reusable_fraction, 6)}


def prompt_json(p: LintPrompt) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt": p.text} if p.text is not None else {"messages": list(p.messages or ())}
    if p.cache_salt is not None:
        out["cache_salt"] = p.cache_salt
    return out


def as_dict(report: LintReport, tokenizer: Any) -> dict[str, Any]:
    tpb = report.tokens_per_block
    data: dict[str, Any] = {
        "file": report.file, "mode": report.mode, "tokens_per_block": tpb,
        "num_prompts": len(report.prompts), **_totals(report.estimate),
        "prompts": [{"index": i, "line": p.line, "num_tokens": r.num_tokens, "reused_blocks": r.reused_blocks,
                     "prefill_tokens": r.prefill_tokens}
                    for i, (p, r) in enumerate(zip(report.prompts, report.estimate.prompts))],
        "prefix_tree": [b.as_dict(tpb, lambda br: preview(report, tokenizer, br)) for b in report.tree],
        "breaks": [s.as_dict(tpb) for s in report.spans],
        "suggestion": {"description": "shared text first, variable parts (and volatile values) after it",
                       **_totals(report.suggested_estimate),
                       "prompts": [prompt_json(p) for p in report.suggested]},
        "assumptions": ASSUMPTIONS, "warnings": report.warnings,
    }
    if report.restart is not None:
        data["restart"] = report.restart.as_dict(tpb)
    if report.template is not None:
        data["template"] = {"placeholders": report.template.placeholders,
                            "placeholders_before_static": report.placeholders_before_static,
                            "reordered": report.reordered_template}
    return data


def _span_lines(report: LintReport) -> list[str]:
    def shape(s: Span) -> tuple[str, str]:
        # Same kind of value in the same line shape: one finding, however many prompts.
        return s.kind, mask_volatile(s.unit) if s.kind != "variable" else f"unit {s.unit_index}"

    groups = Counter(shape(s) for s in report.spans)
    first: dict[tuple[str, str], Span] = {}
    for s in report.spans:
        first.setdefault(shape(s), s)
    lines = []
    for key, n in groups.most_common(10):
        s, kind = first[key], key[0]
        what = f"{kind} {s.text!r}" if kind != "variable" else f"variable text {s.text[:60]!r}"
        where = f"line {s.line}" + (f", message {s.message}" if s.message is not None else "")
        tail = (f"precedes {s.shared_units_after} shared line(s)" if s.shared_units_after else
                f"is early: the {s.num_tokens - s.token_start} tokens after it are never reused if they repeat")
        lines.append(f"  {what} at token ~{s.token_start} (block {s.token_start // report.tokens_per_block}) "
                     f"{tail} [{n} prompt(s), first: {where}]")
    if len(groups) > 10:
        lines.append(f"  ... and {len(groups) - 10} more kinds of span")
    return lines


def as_text(report: LintReport, tokenizer: Any) -> str:
    est, sug, tpb = report.estimate, report.suggested_estimate, report.tokens_per_block
    out = [f"{report.file}: {len(report.prompts)} prompt(s), {est.total_tokens} tokens, "
           f"tokens_per_block {tpb}",
           f"reusable: {est.reused_tokens} of {est.total_tokens} prompt tokens "
           f"({est.reusable_fraction:.1%}), {est.reused_blocks} blocks; prefill computes {est.prefill_tokens}",
           "", "per prompt (line: tokens, estimated prefill tokens):"]
    rows = list(zip(report.prompts, est.prompts))
    for p, r in rows[:20]:
        out.append(f"  {p.line}: {r.num_tokens} tokens, prefill {r.prefill_tokens}")
    if len(rows) > 20:
        out.append(f"  ... {len(rows) - 20} more (see --json)")
    out += ["", "prefix tree (in blocks):"]
    out += ["  " + ln for ln in render_tree(report.tree, tpb, lambda b: preview(report, tokenizer, b))] or \
        ["  (no block shared by two prompts)"]
    out += ["", "spans that break reuse:"] + (_span_lines(report) or ["  none found"])
    if report.template is not None:
        out += ["", f"template placeholders: {', '.join(report.template.placeholders)}"]
        for f in report.placeholders_before_static:
            out.append(f"  {{{'}, {'.join(f['placeholders'])}}} on line {f['line']} precedes "
                       f"{f['static_tokens_after']} tokens of static text")
    out += ["", f"suggested order: shared text first, variable parts after it -> reusable "
                f"{sug.reusable_fraction:.1%} ({sug.reused_blocks} blocks; prefill computes {sug.prefill_tokens})"]
    if report.reordered_template is not None:
        out += ["reordered template:", report.reordered_template]
    if report.restart is not None:
        out += [""] + restart_lines(report.restart, tpb, est)
    out += [f"warning: {w}" for w in report.warnings]
    out += ["", f"assumes: {ASSUMPTIONS}"]
    return "\n".join(out)


def run_lint(file: Path, engine: Path | None, tokenizer_dir: Path | None, tokens_per_block: int | None,
             as_json: bool, fail_under: float | None, samples: int, write_reordered: Path | None,
             echo: Callable[[str], None], echo_err: Callable[[str], None], tiers: TierSetup | None = None) -> int:
    """The command: print the report; 1 when the reusable fraction is under --fail-under."""
    tokenizer, tpb, max_input_len = load_tokenizer_and_block(engine, tokenizer_dir, tokens_per_block)
    if tiers is not None and engine is not None:
        tiers = dataclasses.replace(tiers, entry_bytes=engine_entry_bytes(engine))  # to model the disk budget
    report = lint_file(file, tokenizer, tpb, samples=samples, max_input_len=max_input_len, tiers=tiers)
    echo(json.dumps(as_dict(report, tokenizer), ensure_ascii=False, indent=2) if as_json
         else as_text(report, tokenizer))
    if write_reordered is not None:
        write_reordered.write_text("".join(json.dumps(prompt_json(p), ensure_ascii=False) + "\n"
                                           for p in report.suggested), encoding="utf-8")
    if fail_under is not None and report.reusable_fraction < fail_under:
        echo_err(f"reusable fraction {report.reusable_fraction:.4f} is below --fail-under {fail_under}")
        return 1
    return 0
