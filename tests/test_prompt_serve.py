"""Prompt budget, chat window, lint's reordering and tenant salts through the running server.

The shared `served` server runs the tiny engine with cpu-dev's policy (reject, no salt
required). A second server (module-scoped) runs a copy of that engine whose
trtprompt.json asks for truncate_middle, a large output reserve (limit 80 tokens),
keep_turns 1 and a mandatory cache salt; it runs once per layout (fused, and the GPU
target's upstream preprocessing -> tensorrt_llm -> postprocessing), so every `strict`
test checks that both layouts give clients the same interface.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from serve_fixtures import Served, Stops, start_server
from trtprompt.prompt.budget import PromptBudget, PromptPolicy
from trtprompt.prompt.chat import fit_chat
from trtprompt.prompt.lint import analyze
from trtprompt.prompt.lint_input import LintPrompt
from trtprompt.tokenizer import Tokenizer

STRICT = {"overflow": "truncate_middle", "output_reserve": 1968, "keep_turns": 1,
          "truncate_separator": "\n...\n", "require_cache_salt": True}
LIMIT = 2048 - 1968


@pytest.fixture(scope="module")
def tok(tiny_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_engine_dir / "tokenizer")


def _serve_with_policy(src: Path, root: Path, policy: dict[str, Any], *extra: str) -> Served:
    engine_dir = root / "engine"
    shutil.copytree(src, engine_dir)
    meta = json.loads((engine_dir / "trtprompt.json").read_text())
    meta["prompt"].update(policy)
    (engine_dir / "trtprompt.json").write_text(json.dumps(meta))
    return start_server(engine_dir, root / "run", *extra)


@pytest.fixture(scope="module", params=["fused", "upstream"])
def strict(request: pytest.FixtureRequest, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           stops: Stops) -> Iterator[Served]:
    server = _serve_with_policy(tiny_engine_dir, tmp_path_factory.mktemp(f"strict-{request.param}"), STRICT,
                                "--layout", request.param)
    yield server
    stops.server(server)


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def error(result: Any) -> str:
    assert result.error is not None, "expected an error"
    return result.error


def test_salt_required_on_both_models(strict: Served) -> None:
    message = "input 'cache_salt' is required: this server isolates tenants (require_cache_salt = true)"
    assert message in error(strict.text("hello", 2, temperature=0.0))
    assert message in error(strict.tokens([1, 2, 3], 2))
    assert strict.text("hello", 2, temperature=0.0, cache_salt="tenant-a").error is None


def test_truncate_middle_through_the_server(strict: Served, tok: Tokenizer) -> None:
    text = words(120, "w")
    n = len(tok.encode(text))
    sep = len(tok.encode(STRICT["truncate_separator"], add_special_tokens=False))
    res = strict.text(text, 2, temperature=0.0, cache_salt="t", return_num_input_tokens=True)
    assert res.error is None, res.error
    assert res.last("num_input_tokens") == LIMIT
    assert res.last("prompt_truncated_tokens") == n - (LIMIT - sep)
    assert res.last("dropped_turns") == 0


def test_request_overflow_stricter_only(strict: Served, served: Served, tok: Tokenizer) -> None:
    text = words(120, "s")
    n = len(tok.encode(text))
    assert (f"Prompt length ({n}) exceeds maximum input length ({LIMIT}) (the engine's 2047, less 1968 tokens "
            "reserved for the output)") in error(strict.text(text, 2, cache_salt="t", overflow="reject"))
    assert "overflow='truncate_left' is looser than the server's policy 'truncate_middle'" in \
        error(strict.text(text, 2, cache_salt="t", overflow="truncate_left"))
    assert "looser than the server's policy 'reject'" in error(served.text("hi", 2, overflow="truncate_middle"))
    assert "input 'overflow' must be one of reject, truncate_middle, truncate_left, got 'cut'" in \
        error(served.text("hi", 2, overflow="cut"))
    ok = served.text("hi there", 2, temperature=0.0, overflow="reject", return_num_input_tokens=True)
    assert ok.error is None and ok.last("prompt_truncated_tokens") == 0


def test_chat_window_through_the_server(strict: Served, tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"question {i} " + words(4, "q")},
                 {"role": "assistant", "content": f"answer {i}"}]
    msgs = msgs[:-1]
    budget = PromptBudget.for_engine(PromptPolicy(**STRICT), 2047, 2048, tok)  # type: ignore[arg-type]
    expected = fit_chat(msgs, tok, budget, max_tokens=2)
    assert 0 < expected.dropped_turns < 5
    res = strict.text("", 2, temperature=0.0, cache_salt="t", messages=json.dumps(msgs),
                      return_num_input_tokens=True)
    assert res.error is None, res.error
    assert res.last("dropped_turns") == expected.dropped_turns
    assert res.last("num_input_tokens") == len(expected.ids)
    assert res.last("prompt_truncated_tokens") == 0


@pytest.mark.parametrize("messages, text, message", [
    ("[{", "", "input 'messages' is not valid JSON"),
    ('[{"role": "robot", "content": "x"}]', "", "messages[0] has unknown role 'robot'"),
    ('[{"role": "user", "content": "x"}]', "also text", "give either 'text_input' or 'messages'"),
    (json.dumps([{"role": "system", "content": words(100, "r")}, {"role": "user", "content": "x"}]), "",
     "the system message alone is"),
])
def test_bad_chat_inputs(strict: Served, messages: str, text: str, message: str) -> None:
    assert message in error(strict.text(text, 2, cache_salt="t", messages=messages))
    assert strict.text("still fine", 2, temperature=0.0, cache_salt="t").error is None


def test_salts_isolate_on_both_layouts(strict: Served) -> None:
    prompt = f"Tenant data {uuid.uuid4().hex}: " + words(20, "t")
    assert [reused(strict, prompt, cache_salt=s) for s in ("a", "b")] == [0, 0]
    assert reused(strict, prompt, cache_salt="a") > 0


def reused(server: Served, prompt: str, **optional: Any) -> int:
    res = server.text(prompt, 1, temperature=0.0, return_perf_metrics=True, **optional)
    assert res.error is None, res.error
    return int(res.last("kv_cache_reused_blocks"))


def test_lint_reordering_raises_reused_blocks(served: Served, tok: Tokenizer) -> None:
    nonce = uuid.uuid4().hex[:8]  # this run's static text: nothing cached from other tests
    static = "".join(f"Rule {k} ({nonce}): answer from the report only and cite the section used.\n"
                     for k in range(8))
    prompts = [LintPrompt(i + 1, text=f"Request id: {uuid.uuid4()}\n{static}Question: what about item {i}?\n")
               for i in range(4)]
    report = analyze(prompts, tok, 32)
    assert report.spans[0].kind == "uuid"
    before = [reused(served, p.text or "") for p in report.prompts]
    after = [reused(served, p.text or "") for p in report.suggested]
    assert before == [p.reused_blocks for p in report.estimate.prompts] == [0, 0, 0, 0]
    assert after == [p.reused_blocks for p in report.suggested_estimate.prompts]
    assert sum(after) >= 3 * 3 > sum(before)


def test_salts_isolate_and_share(served: Served) -> None:
    prompt = f"Tenant data {uuid.uuid4().hex}: " + words(80, "t")
    assert reused(served, prompt, cache_salt="tenant-a") == 0
    assert reused(served, prompt, cache_salt="tenant-b") == 0  # same text, other tenant: nothing shared
    shared = reused(served, prompt, cache_salt="tenant-a")
    assert shared > 0  # same tenant: shared
    assert reused(served, prompt) == 0  # no salt is its own namespace
    assert reused(served, prompt, cache_salt="tenant-b") == shared


def test_the_engine_gets_the_fitted_prompt(strict: Served, tok: Tokenizer) -> None:
    """Each layout truncates before the engine allocates (upstream: the GPU target's preprocessing, over the
    torch core): the KV holds the fitted prompt, not the whole one."""
    text = words(150, "u")
    assert len(tok.encode(text)) > 4 * 32
    res = strict.text(text, 2, temperature=0.0, cache_salt=uuid.uuid4().hex, return_perf_metrics=True)
    assert res.error is None, res.error
    # LIMIT (80) prompt tokens + 1 generated token: 3 blocks of 32, not the 5+ of the whole prompt.
    assert res.last("kv_cache_alloc_total_blocks") == 3
