"""Chat sliding window: the system message stays, whole oldest turns go, keep_turns holds;
every bad `messages` input gets its error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtprompt.prompt.budget import PromptBudget, PromptError, PromptPolicy, PromptTooLongError
from trtprompt.prompt.chat import fit_chat, parse_messages, split_turns
from trtprompt.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def tok(tiny_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_engine_dir / "tokenizer")


def chat(turns: int) -> list[dict[str, str]]:
    out = [SYSTEM]
    for i in range(turns):
        out += [{"role": "user", "content": f"question number {i} about topic {i * 7}"},
                {"role": "assistant", "content": f"answer number {i} is {i * 13}"}]
    return out[:-1]  # the last turn awaits its answer


def budget(tok: Tokenizer, limit: int, overflow: str = "truncate_left", keep_turns: int | None = None
           ) -> PromptBudget:
    # max_seq_len large and output_reserve 0: the limit is exactly max_input_len.
    return PromptBudget.for_engine(PromptPolicy(overflow, keep_turns=keep_turns, output_reserve=0),
                                   limit, 10_000, tok)


def test_fitting_chat_is_rendered_whole(tok: Tokenizer) -> None:
    msgs = chat(3)
    fitted = fit_chat(msgs, tok, budget(tok, 1000))
    assert fitted.ids == tok.encode_chat(msgs) and fitted.dropped_turns == 0 and fitted.num_turns == 3


def test_window_keeps_system_and_drops_whole_oldest_turns(tok: Tokenizer) -> None:
    msgs = chat(6)
    kept_two = [SYSTEM, *msgs[-3:]]  # system + the last two turns (user, assistant, user)
    limit = len(tok.encode_chat(kept_two))
    assert len(tok.encode_chat([SYSTEM, *msgs[-5:]])) > limit  # three turns would not fit
    fitted = fit_chat(msgs, tok, budget(tok, limit))
    assert fitted.dropped_turns == 4
    assert fitted.ids == tok.encode_chat(kept_two)
    text = tok.decode(fitted.ids, skip_special_tokens=False)
    assert text.startswith("<s><|system|>\nYou are terse.<|end|>\n<|user|>\nquestion number 4 ")
    assert "number 3" not in text


def test_keep_turns_bounds_the_window(tok: Tokenizer) -> None:
    msgs = chat(6)
    limit = len(tok.encode_chat([SYSTEM, *msgs[-3:]]))
    with pytest.raises(PromptError, match=r"even after dropping its 3 oldest turns \(\d+ tokens; keep_turns=3\)"):
        fit_chat(msgs, tok, budget(tok, limit, keep_turns=3))
    assert fit_chat(msgs, tok, budget(tok, limit, keep_turns=2)).dropped_turns == 4


def test_system_message_alone_too_long(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "rule " * 200}, {"role": "user", "content": "hi"}]
    alone = len(tok.encode_chat(msgs[:1]))
    with pytest.raises(PromptError, match=rf"the system message alone is {alone} tokens, more than the maximum "
                                          r"input length \(50\)"):
        fit_chat(msgs, tok, budget(tok, 50))


def test_reject_never_drops_turns(tok: Tokenizer) -> None:
    msgs = chat(6)
    n = len(tok.encode_chat(msgs))
    with pytest.raises(PromptTooLongError, match=rf"Prompt length \({n}\) exceeds maximum input length \(60\)"):
        fit_chat(msgs, tok, budget(tok, 60, overflow="reject"))
    with pytest.raises(PromptTooLongError):  # a request may ask for reject under a truncating profile
        fit_chat(msgs, tok, budget(tok, 60), overflow="reject")


def test_turns_group_answers_with_their_question() -> None:
    msgs = [SYSTEM, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}, {"role": "user", "content": "d"}]
    system, turns = split_turns(msgs)
    assert system == [SYSTEM]
    assert [[m["content"] for m in t] for t in turns] == [["Hello!"], ["a", "b", "c"], ["d"]]


@pytest.mark.parametrize("raw, message", [
    ("{not json", r"input 'messages' is not valid JSON: .* at line 1 column 2"),
    ('{"role": "user", "content": "hi"}', r"input 'messages' must be a non-empty JSON list"),
    ("[]", r"input 'messages' must be a non-empty JSON list"),
    ('["hi"]', r"messages\[0\] must be an object with 'role' and 'content', got str"),
    ('[{"role": "wizard", "content": "hi"}]', r"messages\[0\] has unknown role 'wizard'; allowed: system, user, "
                                             r"assistant, tool"),
    ('[{"role": "user"}]', r"messages\[0\] \('user'\) must have a string 'content'"),
    ('[{"role": "user", "content": 5}]', r"messages\[0\] \('user'\) must have a string 'content'"),
    (b'[{"role": "user", "content": "\xff"}]', r"input 'messages' is not valid UTF-8 \(byte offset 30\)"),
])
def test_bad_messages(raw: str | bytes, message: str) -> None:
    with pytest.raises(PromptError, match=message):
        parse_messages(raw)


def test_parse_accepts_bytes_and_drops_extra_keys() -> None:
    raw = json.dumps([{"role": "user", "content": "héllo", "name": "x"}]).encode()
    assert parse_messages(raw) == [{"role": "user", "content": "héllo"}]


def test_only_system_and_template_refusals(tok: Tokenizer) -> None:
    with pytest.raises(PromptError, match="holds only system messages"):
        fit_chat([SYSTEM], tok, budget(tok, 100))
    # The demo template knows system/user/assistant only (it raises on any other role) and no tools: a tool
    # result reaches it as a user message (prompt/chat_tools.py, the fallback), never as role "tool".
    fitted = fit_chat([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], tok, budget(tok, 100))
    assert fitted.ids == tok.encode_chat([{"role": "user", "content": "x"},
                                          {"role": "user", "content": "<tool_response>\ny\n</tool_response>"}])
