"""`trtprompt lint` on what survives a restart: its estimate against a real engine over a real disk
tier (a first engine runs the set and is closed, a second one over the same directory runs it
again), under write_through and selective; without tiers it says nothing survives, naming the flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest
from click.testing import CliRunner

from trtprompt.cli import main
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams
from trtprompt.prompt.lint import analyze, engine_entry_bytes
from trtprompt.prompt.lint_input import LintPrompt
from trtprompt.prompt.restart import TierSetup, restart_lines, written_hashes
from trtprompt.tokenizer import Tokenizer

SYSTEM = ("You are the support assistant of a bicycle shop. Answer in two sentences, name the part, and say "
          "whether the shop stocks it. Prices are in euros and include tax. The shop opens at nine and closes "
          "at six, every day but Sunday, and repairs take two working days unless the part must be ordered.\n")
QUESTIONS = ("My rear brake squeals when it rains and the pads look worn down to the metal on one side, what "
             "should I replace first and how long will it take?",
             "Do you have a chain for an eleven speed cassette?", "Can you true a wheel today?")
LONE = ("Write a haiku about the smell of new tyres in a small shop on a wet autumn morning, then explain in "
        "plain words why you chose each of the three images for it.")


def prompts() -> list[LintPrompt]:
    return [LintPrompt(i + 1, text=SYSTEM + q) for i, q in enumerate(QUESTIONS)] + [LintPrompt(4, text=LONE)]


def run(engine: LLMEngine, ids: Sequence[Sequence[int]]) -> list[int]:
    """The prompts one after another (max_tokens 1); each request's kv_cache_reused_blocks."""
    out = []
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", list(p), SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            out += [o.stats.kv_cache_reused_blocks for o in engine.step() if o.finished]
    return out


@pytest.fixture(scope="module")
def tok(tiny_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_engine_dir / "tokenizer")


@pytest.mark.parametrize("policy", ["write_through", "selective"])
def test_after_restart_equals_an_engine_restarted_over_its_disk_tier(policy: str, tiny_engine_dir: Path,
                                                                    tok: Tokenizer, tmp_path: Path) -> None:
    setup = TierSetup(disk_cache_path=str(tmp_path), kv_tier_write_policy=policy)
    report = analyze(prompts(), tok, 32, tiers=setup)
    restart = report.restart
    assert restart is not None
    first = LLMEngine.from_engine_dir(tiny_engine_dir, disk_cache_path=str(tmp_path), kv_tier_write_policy=policy)
    assert run(first, report.ids) == [p.reused_blocks for p in report.estimate.prompts]
    first.close()  # drains the tier's writer
    second = LLMEngine.from_engine_dir(tiny_engine_dir, disk_cache_path=str(tmp_path), kv_tier_write_policy=policy)
    try:
        assert run(second, report.ids) == [p.reused_blocks for p in restart.after_restart.prompts]
    finally:
        second.close()
    lookable = [(len(ids) - 1) // 32 for ids in report.ids]
    shared = len(tok.encode(SYSTEM)) // 32
    [prefix] = restart.shared  # the system prompt, shared by the three questions
    assert (prefix.branch.prompts, prefix.branch.num_blocks, prefix.survives) == (3, shared, True)
    after = [p.reused_blocks for p in restart.after_restart.prompts]
    if policy == "write_through":  # every prompt block was written: the whole set is cached again
        assert after == lookable and restart.kept_blocks == sum(len(ids) // 32 for ids in report.ids) - 2 * shared
    else:  # only the system prompt's blocks were reused, so only they were written
        assert after == [shared] + lookable[1:3] + [0] and restart.kept_blocks == shared
        assert lookable[0] > shared and lookable[3] > 0  # the first question and the lone prompt were lost


def test_without_tiers_nothing_survives_and_the_flags_are_named(tiny_engine_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in prompts()))
    result = CliRunner().invoke(main, ["lint", str(path), "--engine", str(tiny_engine_dir)])
    assert result.exit_code == 0, result.output
    assert ("after a restart: nothing survives: the KV pool lives in the engine process's memory and no tier is "
            "configured below it; serve with --disk-cache-path DIR (local disk) or --kv-remote-url "
            "redis://HOST:PORT/DB (shared by servers) to keep blocks across restarts") in result.output
    result = CliRunner().invoke(main, ["lint", str(path), "--engine", str(tiny_engine_dir), "--json",
                                       "--kv-remote-url", "redis://127.0.0.1:6379/0",
                                       "--kv-tier-write-policy", "selective"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)["restart"]
    assert (data["tiers"], data["write_policy"]) == (["redis"], "selective")
    assert [s["survives"] for s in data["shared_prefixes"]] == [True]
    text = CliRunner().invoke(main, ["lint", str(path), "--engine", str(tiny_engine_dir),
                                     "--disk-cache-path", str(tmp_path)]).output
    assert "after a restart (disk tier, write_through): the tiers keep" in text
    assert ", shared by 3 prompts): survives" in text


def test_the_disk_budget_keeps_the_blocks_written_last(tiny_engine_dir: Path, tok: Tokenizer,
                                                        tmp_path: Path) -> None:
    """Past --disk-cache-size the disk tier evicts the entries written first: here the shared system
    prompt. The blocks the estimate keeps are exactly the files the disk tier holds after the run."""
    budget = 1 << 20  # the knob's least: 42 entries of the tiny engine's 24,628 bytes (52-byte header)
    setup = TierSetup(disk_cache_path=str(tmp_path), disk_cache_size=budget,
                      entry_bytes=engine_entry_bytes(tiny_engine_dir))
    filler = [LintPrompt(10 + k, text=" ".join(f"item{k}x{j} costs {j * 7 + k} euros" for j in range(60)))
              for k in range(4)]
    report = analyze(prompts()[:3] + filler, tok, 32, tiers=setup)
    restart = report.restart
    assert restart is not None and setup.disk_capacity_blocks == 42
    written = sum(len(ids) // 32 for ids in report.ids) - 2 * (len(tok.encode(SYSTEM)) // 32)
    assert (restart.kept_blocks, restart.evicted_blocks) == (42, written - 42) and written > 42
    [prefix] = restart.shared
    assert (prefix.kept_blocks, prefix.survives) == (0, False)  # written first, so evicted first
    engine = LLMEngine.from_engine_dir(tiny_engine_dir, disk_cache_path=str(tmp_path), disk_cache_size=budget)
    assert engine.kv.pool.num_blocks > written  # the pool itself evicts nothing, as lint assumes
    run(engine, report.ids)
    engine.close()
    on_disk = {p.name[-32:] for p in tmp_path.rglob("*") if p.is_file() and len(p.name) == 64}
    kept = set(written_hashes(report.ids, 32, None, setup)[-42:])
    assert on_disk == {h.hex() for h in kept}
    text = "\n".join(restart_lines(restart, 32))
    assert f"holds 42 entries of 24628 bytes: the {written - 42} written first are evicted" in text
    assert "shared by 3 prompts): does not survive" in text
