"""Overflow policies with exact token counts, the stricter-only rule, salts required, and
`trtprompt generate` applying the engine dir's policy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trtprompt.engine.request import SamplingParams
from trtprompt.prompt.budget import PromptBudget, PromptError, PromptPolicy, PromptTooLongError
from trtprompt.tokenizer import Tokenizer

SEP = (901, 902, 903)
BOS = 1


def budget(overflow: str = "reject", **kw: object) -> PromptBudget:
    return PromptBudget(PromptPolicy(overflow=overflow, **kw), max_input_len=20, max_seq_len=32,  # type: ignore[arg-type]
                        separator_ids=SEP, bos_token_id=BOS)


def prompt(n: int, bos: bool = True) -> list[int]:
    """n ids; with bos the first is BOS, the rest 100, 101, ..."""
    return ([BOS] if bos else []) + list(range(100, 100 + n - bos))


def test_fitting_prompt_is_unchanged_under_every_policy() -> None:
    for policy in ("reject", "truncate_left", "truncate_middle"):
        fitted = budget(policy).fit(prompt(20), max_tokens=4)
        assert fitted.ids == prompt(20) and fitted.prompt_truncated_tokens == 0 and fitted.policy == policy


def test_reject_names_prompt_length_and_limit() -> None:
    with pytest.raises(PromptTooLongError, match=r"^Prompt length \(21\) exceeds maximum input length \(20\)$"):
        budget("reject").fit(prompt(21), max_tokens=30)  # no reserve: the engine shortens the output instead


def test_reject_with_output_reserve() -> None:
    b = budget("reject", output_reserve=16)  # min(20, 32 - 16) = 16
    assert b.fit(prompt(16)).prompt_truncated_tokens == 0
    with pytest.raises(PromptTooLongError, match=r"Prompt length \(17\) exceeds maximum input length \(16\) "
                                                 r"\(the engine's 20, less 16 tokens reserved for the output\)"):
        b.fit(prompt(17))


def test_truncate_left_keeps_bos_and_the_end() -> None:
    ids = prompt(30)
    fitted = budget("truncate_left").fit(ids, max_tokens=4)  # limit min(20, 32 - 4) = 20
    assert fitted.ids == [BOS] + ids[-19:]
    assert len(fitted.ids) == 20 and fitted.prompt_truncated_tokens == 10


def test_truncate_left_without_bos() -> None:
    ids = prompt(30, bos=False)
    fitted = budget("truncate_left").fit(ids, max_tokens=4)
    assert fitted.ids == ids[-20:] and fitted.prompt_truncated_tokens == 10


def test_truncate_reserves_the_requested_output_when_no_reserve_is_set() -> None:
    ids = prompt(30)
    fitted = budget("truncate_left").fit(ids, max_tokens=16)  # limit min(20, 32 - 16) = 16
    assert fitted.ids == [BOS] + ids[-15:] and fitted.prompt_truncated_tokens == 14


def test_output_reserve_overrides_max_tokens() -> None:
    fitted = budget("truncate_left", output_reserve=24).fit(prompt(30), max_tokens=1)  # min(20, 8) = 8
    assert len(fitted.ids) == 8 and fitted.prompt_truncated_tokens == 22


def test_truncate_middle_keeps_head_and_tail_around_the_separator() -> None:
    ids = prompt(30)
    fitted = budget("truncate_middle").fit(ids, max_tokens=4)  # 20 = 8 head + 3 separator + 9 tail
    assert fitted.ids == ids[:8] + list(SEP) + ids[-9:]
    assert len(fitted.ids) == 20 and fitted.prompt_truncated_tokens == 13


def test_truncate_middle_without_room_for_the_separator_keeps_the_end() -> None:
    fitted = budget("truncate_middle", output_reserve=28).fit(prompt(30))  # limit 4 < 3 + 2
    assert fitted.ids == [BOS] + prompt(30)[-3:] and fitted.prompt_truncated_tokens == 26


def test_request_may_only_choose_a_stricter_policy() -> None:
    left, middle, reject = budget("truncate_left"), budget("truncate_middle"), budget("reject")
    ids = prompt(30)
    assert left.fit(ids, 4, overflow="truncate_middle").policy == "truncate_middle"
    with pytest.raises(PromptTooLongError):
        left.fit(ids, 4, overflow="reject")
    with pytest.raises(PromptError, match="overflow='truncate_left' is looser than the server's policy "
                                          "'truncate_middle'"):
        middle.fit(ids, 4, overflow="truncate_left")
    with pytest.raises(PromptError, match="looser than the server's policy 'reject'"):
        reject.fit(ids, 4, overflow="truncate_middle")
    with pytest.raises(PromptError, match="input 'overflow' must be one of reject, truncate_middle, truncate_left, "
                                          "got 'drop'"):
        left.fit(ids, 4, overflow="drop")
    assert left.fit(ids, 4, overflow="").policy == "truncate_left"  # empty: the profile's


def test_policy_bounds_and_salt_requirement() -> None:
    with pytest.raises(ValueError, match="overflow must be one of"):
        PromptPolicy(overflow="truncate_right")
    with pytest.raises(ValueError, match="keep_turns must be at least 1"):
        PromptPolicy(keep_turns=0)
    with pytest.raises(ValueError, match="output_reserve must be >= 0"):
        PromptPolicy(output_reserve=-1)
    PromptPolicy(require_cache_salt=False).check_salt(None)
    PromptPolicy(require_cache_salt=True).check_salt("tenant-a")
    with pytest.raises(PromptError, match="input 'cache_salt' is required"):
        PromptPolicy(require_cache_salt=True).check_salt("")


def test_real_tokenizer_separator(tiny_engine_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_engine_dir / "tokenizer")
    b = PromptBudget.for_engine(PromptPolicy("truncate_middle", truncate_separator=" [cut] "), 40, 64, tok)
    assert list(b.separator_ids) == tok.encode(" [cut] ", add_special_tokens=False)
    text = " ".join(f"word{i}" for i in range(200))
    ids = tok.encode(text)
    fitted = b.fit(ids, max_tokens=8)
    assert len(fitted.ids) == 40
    assert fitted.prompt_truncated_tokens == len(ids) - (40 - len(b.separator_ids))
    decoded = tok.decode(fitted.ids)
    assert "[cut]" in decoded and decoded.startswith("word0") and decoded.endswith("word199")


def _engine_copy(src: Path, dst: Path, **prompt_policy: object) -> Path:
    shutil.copytree(src, dst)
    meta = json.loads((dst / "trtprompt.json").read_text())
    meta["prompt"].update(prompt_policy)
    (dst / "trtprompt.json").write_text(json.dumps(meta))
    return dst


def test_generate_applies_the_engine_dirs_policy(tiny_engine_dir: Path, tmp_path: Path) -> None:
    from trtprompt.generate import generate, load

    # A large reserve keeps the prompt short (and the test fast): limit = max_seq_len - 2000.
    engine_dir = _engine_copy(tiny_engine_dir, tmp_path / "eng", overflow="truncate_left", output_reserve=2000)
    engine, tok = load(engine_dir)
    limit = engine.scheduler_config.max_seq_len - 2000
    text = " ".join(f"w{i}" for i in range(limit))
    n = len(tok.encode(text))
    assert n > limit
    g = generate(engine, tok, [text], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert g.final is not None and g.final.num_input_tokens == limit
    assert g.prompt_truncated_tokens == n - limit and g.as_json()["prompt_truncated_tokens"] == n - limit
    strict = PromptBudget.for_engine(PromptPolicy("reject", output_reserve=2000), engine.max_input_len,
                                     engine.scheduler_config.max_seq_len, tok)
    with pytest.raises(PromptTooLongError, match=rf"Prompt length \({n}\) exceeds maximum input length "
                                                 rf"\({limit}\)"):
        generate(engine, tok, [text], SamplingParams(max_tokens=3), budget=strict)


def test_prompt_edge(tiny_engine_dir: Path) -> None:
    from trtprompt.prompt.edge import PromptEdge, engine_dir_limits

    assert engine_dir_limits(tiny_engine_dir) == (2047, 2048)  # chunked context: max_seq_len - 1
    tok = Tokenizer.from_dir(tiny_engine_dir / "tokenizer")
    asked = []
    policy = PromptPolicy("truncate_left", output_reserve=2048 - 12, require_cache_salt=True)
    edge = PromptEdge(policy, tok, True, lambda: asked.append(1) or (2047, 2048))
    with pytest.raises(PromptError, match="input 'cache_salt' is required"):
        edge.prepare("hi", None, None, None, 4)
    text = " ".join(f"x{i}" for i in range(30))
    out = edge.prepare(text, None, None, "t", 4)
    assert len(out.ids) == 12 and out.prompt_truncated_tokens == len(tok.encode(text)) - 12
    chat = [{"role": "user", "content": "a"}]  # objects: parsed where the request came in
    assert edge.prepare("", chat, None, "t", 4).ids == tok.encode_chat([{"role": "user", "content": "a"}])
    with pytest.raises(PromptError, match="give either 'text_input' or 'messages'"):
        edge.prepare("text", chat, None, "t", 4)
    assert edge.fit_text("short", 4).ids == tok.encode("short")  # no salt check on this path
    assert asked == [1]  # the engine's limits are asked once
