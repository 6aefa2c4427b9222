"""`trtprompt lint`: the reuse estimate equals the engine's real kv_cache_reused_blocks, the
offending span is named, the suggested order reuses more, templates and CLI behave."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest
from click.testing import CliRunner

from trtprompt.cli import main
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams
from trtprompt.prompt.lint import analyze, lint_file
from trtprompt.prompt.lint_input import LintPrompt
from trtprompt.prompt.reuse import estimate_reuse
from trtprompt.tokenizer import Tokenizer

STATIC = ("You are a careful assistant who answers questions about the quarterly report below.\n"
          "Always cite the section you used, and keep every answer under three sentences.\n"
          "If the report does not say, answer that you do not know; never guess numbers.\n"
          "Report: revenue grew in every region, led by the northern stores and online sales.\n"
          "Costs rose less than sales, so the margin improved for the third quarter in a row.\n")
UUIDS = ("3f2a1b4c-0d1e-4f5a-8b6c-7d8e9f0a1b2c", "9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
         "0badf00d-1234-4abc-8def-0123456789ab", "c0ffee00-aaaa-4bbb-8ccc-dddddddddddd")
QUESTIONS = ("What was the revenue?", "Who led the growth?", "Did the margin improve?", "What about costs?")


def handmade() -> list[LintPrompt]:
    """Variable first: a request id, then the shared instructions, then the question."""
    return [LintPrompt(i + 1, text=f"Request id: {u}\n{STATIC}Question: {q}\n")
            for i, (u, q) in enumerate(zip(UUIDS, QUESTIONS))]


@pytest.fixture(scope="module")
def tok(tiny_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_engine_dir / "tokenizer")


def engine_reused_blocks(engine_dir: Path, prompts: Sequence[Sequence[int]],
                         salts: Sequence[str | None] | None = None) -> list[int]:
    """Run prompts one after another through a fresh engine; per-request kv_cache_reused_blocks."""
    engine = LLMEngine.from_engine_dir(engine_dir)
    out = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", list(ids), SamplingParams(max_tokens=1, temperature=0.0),
                           cache_salt=salts[i] if salts else None)
        while engine.has_unfinished_requests():
            out += [o.stats.kv_cache_reused_blocks for o in engine.step() if o.finished]
    return out


def test_rule_by_hand() -> None:
    """Full blocks only, last token recomputed, published blocks include a prompt's last full block."""
    a = list(range(1, 11))  # 10 tokens: 2 full blocks of 4
    b = list(range(1, 9)) + [50, 51]  # shares 8 tokens
    c = list(range(1, 9))  # 8 tokens: only 1 block may be reused (the 8th token is recomputed)
    d = [99] + list(range(2, 11))  # differs in block 0: nothing reused
    est = estimate_reuse([a, b, c, d], 4)
    assert [p.reused_blocks for p in est.prompts] == [0, 2, 1, 0]
    assert [p.prefill_tokens for p in est.prompts] == [10, 2, 4, 10]
    assert est.reusable_fraction == 12 / 38
    salted = estimate_reuse([a, b, b], 4, ["t1", "t2", "t1"])
    assert [p.reused_blocks for p in salted.prompts] == [0, 0, 2]


def test_estimate_equals_engine_and_names_the_span(tiny_engine_dir: Path, tok: Tokenizer) -> None:
    report = analyze(handmade(), tok, 32)
    engine = engine_reused_blocks(tiny_engine_dir, report.ids)
    assert [p.reused_blocks for p in report.estimate.prompts] == engine == [0, 0, 0, 0]
    assert report.reusable_fraction == 0.0  # the id in block 0 makes every prompt unique from token 1
    assert len(report.spans) == 4
    first = report.spans[0]
    assert (first.kind, first.text, first.char_start, first.token_start) == ("uuid", UUIDS[0], 0, 0)
    assert first.unit == f"Request id: {UUIDS[0]}" and first.shared_units_after == 5

    suggested_ids = [tok.encode(p.text or "") for p in report.suggested]
    assert report.suggested[0].text == f"{STATIC}Request id: {UUIDS[0]}\nQuestion: {QUESTIONS[0]}\n"
    engine_after = engine_reused_blocks(tiny_engine_dir, suggested_ids)
    shared_blocks = len(tok.encode(STATIC)) // 32
    assert shared_blocks >= 3
    assert [p.reused_blocks for p in report.suggested_estimate.prompts] == engine_after
    assert engine_after == [0] + [shared_blocks] * 3
    total = sum(len(ids) for ids in suggested_ids)
    assert report.suggested_estimate.reusable_fraction == 3 * shared_blocks * 32 / total


def test_volatile_value_early_in_a_lone_prompt(tok: Tokenizer) -> None:
    lone = analyze(handmade()[:1], tok, 32)
    assert [(s.kind, s.text, s.shared_units_after) for s in lone.spans] == [("uuid", UUIDS[0], 0)]
    reordered = analyze(analyze(handmade(), tok, 32).suggested, tok, 32)
    assert reordered.spans == []  # the ids now follow the shared text: nothing left to flag


def test_salts_in_the_estimate_match_the_engine(tiny_engine_dir: Path, tok: Tokenizer) -> None:
    prompts = [LintPrompt(i, text=f"{STATIC}Question: {q}\n", cache_salt=s)
               for i, (q, s) in enumerate(zip(QUESTIONS, ("a", "b", "a", None)))]
    report = analyze(prompts, tok, 32)
    engine = engine_reused_blocks(tiny_engine_dir, report.ids, [p.cache_salt for p in prompts])
    shared = len(tok.encode(STATIC)) // 32
    assert [p.reused_blocks for p in report.estimate.prompts] == engine == [0, 0, shared, 0]


def test_chat_prompts_reorder_within_messages(tok: Tokenizer) -> None:
    prompts = [LintPrompt(i, messages=({"role": "system", "content": f"Current time: 2026-12-02T10:{i:02d}:00Z\n"
                                                                       f"{STATIC}"},
                                       {"role": "user", "content": q}))
               for i, q in enumerate(QUESTIONS)]
    report = analyze(prompts, tok, 32)
    assert report.spans[0].kind == "timestamp" and report.spans[0].text == "2026-12-02T10:00:00Z"
    assert report.spans[0].message == 0
    moved = report.suggested[1].messages
    assert moved is not None and moved[0]["content"] == f"{STATIC}Current time: 2026-12-02T10:01:00Z\n"
    assert report.suggested_estimate.reusable_fraction > report.reusable_fraction


def test_template_flags_placeholders_before_static_text(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "prompt.txt"
    path.write_text("Date: {date}\n" + STATIC + "Question: {question}\n", encoding="utf-8")
    report = lint_file(path, tok, 32, samples=4)
    assert report.mode == "template" and len(report.prompts) == 4
    assert report.template is not None and report.template.placeholders == ["date", "question"]
    assert [f["placeholders"] for f in report.placeholders_before_static] == [["date"]]
    assert report.placeholders_before_static[0]["line"] == 1
    assert report.reordered_template == STATIC + "Date: {date}\nQuestion: {question}\n"
    assert report.reusable_fraction == 0.0 and report.suggested_estimate.reusable_fraction > 0.3


def _write_jsonl(path: Path, prompts: list[LintPrompt]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in prompts), encoding="utf-8")
    return path


def test_cli_json_fail_under_and_reordered_file(tmp_path: Path, tiny_engine_dir: Path, tok: Tokenizer) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", handmade())
    out_file = tmp_path / "reordered.jsonl"
    runner = CliRunner()
    res = runner.invoke(main, ["lint", str(path), "--engine", str(tiny_engine_dir), "--json",
                               "--write-reordered", str(out_file)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["reusable_fraction"] == 0.0 and data["tokens_per_block"] == 32
    assert data["breaks"][0]["kind"] == "uuid" and data["breaks"][0]["text"] == UUIDS[0]
    assert data["suggestion"]["reusable_fraction"] > 0.3
    assert [json.loads(ln)["prompt"] for ln in out_file.read_text().splitlines()] == \
        [p["prompt"] for p in data["suggestion"]["prompts"]]
    res = runner.invoke(main, ["lint", str(path), "--tokenizer", str(tiny_engine_dir / "tokenizer"),
                               "--tokens-per-block", "32", "--fail-under", "0.25"])
    assert res.exit_code == 1
    assert "uuid '3f2a1b4c-0d1e-4f5a-8b6c-7d8e9f0a1b2c'" in res.output
    assert "reusable fraction 0.0000 is below --fail-under 0.25" in res.output
    res = runner.invoke(main, ["lint", str(out_file), "--tokenizer", str(tiny_engine_dir / "tokenizer"),
                               "--tokens-per-block", "32", "--fail-under", "0.25"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("content, args, message", [
    ('{"prompt": "a"}\n{"prompt": \n', ["--tokenizer", "T"], "p.jsonl:2: not valid JSON"),
    ('{"text": "a"}\n', ["--tokenizer", "T"], 'p.jsonl:1: expected an object with either "prompt" or "messages"'),
    ('{"messages": [{"role": "bot", "content": "x"}]}\n', ["--tokenizer", "T"],
     "p.jsonl:1: messages[0] has unknown role 'bot'"),
    ('{"prompt": "a"}\n', [], "give exactly one of --engine ENGINE_DIR or --tokenizer DIR"),
    ('{"prompt": "a"}\n', ["--tokenizer", "T", "--tokens-per-block", "48"],
     "--tokens-per-block must be a power of two in [1, 1024], got 48"),
    ('{"prompt": "a"}\n', ["--engine", "E", "--tokens-per-block", "32"], "--tokens-per-block comes from the engine"),
])
def test_cli_bad_input(tmp_path: Path, tiny_engine_dir: Path, content: str, args: list[str], message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    args = [{"T": str(tiny_engine_dir / "tokenizer"), "E": str(tiny_engine_dir)}.get(a, a) for a in args]
    res = CliRunner().invoke(main, ["lint", str(path), *args])
    assert res.exit_code == 1 and message in res.output, res.output


def test_cli_plain_text_without_placeholders(tmp_path: Path, tiny_engine_dir: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("just text\n", encoding="utf-8")
    res = CliRunner().invoke(main, ["lint", str(path), "--engine", str(tiny_engine_dir)])
    assert res.exit_code == 1 and "neither JSONL of prompts nor a template with {placeholders}" in res.output
