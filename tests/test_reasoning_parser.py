"""Reasoning parsers (serve/openai/reasoning.py): `<think>…</think>` split from the answer, whole and
streamed, the stream giving the same two texts at every split of the output."""

from __future__ import annotations

import pytest

from trtprompt.serve.openai.reasoning import (
    END_TAG,
    REASONING_PARSERS,
    ReasoningStream,
    end_tag,
    parser_for_template,
    split_reasoning,
)

# (parser, output, reasoning_content, content)
CASES = [
    ("deepseek_r1", "Let me think.\nSo 4.\n</think>\n\nThe answer is 4.", "Let me think.\nSo 4.", "The answer is 4."),
    ("deepseek_r1", "<think>\nHmm.\n</think>\n\n4", "Hmm.", "4"),
    ("deepseek_r1", "  <think>x</think>y  ", "x", "y  "),
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("deepseek_r1", "cut at </thi", "cut at </thi", None),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "</think>only an answer", None, "only an answer"),
    ("deepseek_r1", "a</think>\n\n", "a", None),
    ("deepseek_r1", "a </think> b </think> c", "a", "b </think> c"),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>\nWeigh it.\n</think>\n\nYes.", "Weigh it.", "Yes."),
    ("qwen3", "\n<think>\n\n</think>\n\nYes.", None, "Yes."),
    ("qwen3", "Just an answer, no thinking.", None, "Just an answer, no thinking."),
    ("qwen3", "\n\n  Answer with leading space\n", None, "\n\n  Answer with leading space\n"),
    ("qwen3", "Answer mentions </think> and <think> as text", None, "Answer mentions </think> and <think> as text"),
    ("qwen3", "<think>never closed, cut off", "never closed, cut off", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "  ", None, "  "),
    ("qwen3", "", None, None),
]


def _stream(parser: str, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser)
    reasoning, content = [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_whole_output(parser: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(parser, text) == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_stream_matches_whole_at_every_split(parser: str, text: str, reasoning: str | None,
                                             content: str | None) -> None:
    expected = (reasoning or "", content or "")
    assert _stream(parser, list(text)) == expected  # one character a delta
    for k in range(len(text) + 1):
        assert _stream(parser, [text[:k], text[k:]]) == expected, k


def test_stream_holds_only_what_is_undecided() -> None:
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<think>\nStep one") == ("Step one", "")
    assert stream.feed(".\n</th") == (".", "")  # the newline may end the reasoning, "</th" may be the tag
    assert stream.feed("ink>\n\nThe") == ("", "The")
    assert stream.feed(" end") == ("", " end")
    assert stream.finish() == ("", "")
    qwen = ReasoningStream("qwen3")
    assert qwen.feed("<th") == ("", "")
    assert qwen.feed("e answer") == ("", "<the answer")
    assert qwen.finish() == ("", "")
    assert qwen.finish() == ("", "")
    with pytest.raises(ValueError, match="after finish"):
        qwen.feed("x")


def test_end_tag_and_names() -> None:
    assert REASONING_PARSERS == ("deepseek_r1", "qwen3")
    assert END_TAG == "</think>"
    assert [end_tag(p) for p in REASONING_PARSERS] == ["</think>", "</think>"]
    with pytest.raises(ValueError, match="reasoning parser must be one of deepseek_r1, qwen3, got 'granite'"):
        end_tag("granite")
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        ReasoningStream("granite")


def test_parser_for_template() -> None:
    r1 = ("{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
          "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    qwen3_thinking = ("{%- if '</think>' in content %}...{%- endif %}"
                      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
    qwen3_hybrid = ("{%- if '</think>' in content %}...{%- endif %}"
                    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                    "{%- if enable_thinking is defined and enable_thinking is false %}"
                    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
    assert parser_for_template(r1) == "deepseek_r1"
    assert parser_for_template(qwen3_thinking) == "deepseek_r1"
    assert parser_for_template(qwen3_hybrid) == "qwen3"
    assert parser_for_template("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert parser_for_template(None) is None
