"""A reasoning model's thinking split from its answer (docs/structured-outputs.md, "Tool-call and
reasoning parsers"): `reasoning_content` and `content`, whole (`split_reasoning`) or as it streams
(`ReasoningStream`).

Both families write `<think>…</think>`:
- deepseek_r1 (DeepSeek-R1 and its distills, Qwen3 "Thinking" checkpoints): the template ends the prompt
  with `<think>\\n`, so the output begins inside the reasoning, usually without the opening tag. Everything
  up to the first `</think>` is reasoning; an output with no `</think>` is all reasoning (cut off while
  thinking).
- qwen3 (hybrid Qwen3, `enable_thinking`): reasoning only where the output opens with `<think>`; with no
  opening tag the whole output is content (thinking was off). An opened `<think>` never closed is all
  reasoning.

The tags appear in neither part. Reasoning is stripped of surrounding whitespace; the answer after
`</think>` loses its leading whitespace (the template's blank line); an output with no reasoning at all is
content exactly as written. Either part is None when empty.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START_TAG = "<think>"
END_TAG = "</think>"


def check_parser(parser: str) -> None:
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")


def end_tag(parser: str) -> str:
    """The text that ends a parser's reasoning (SamplingParams.guide_after: a grammar holds after it)."""
    check_parser(parser)
    return END_TAG


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output."""
    check_parser(parser)
    opened = text.lstrip().startswith(START_TAG)
    if not opened and parser == "qwen3":
        return None, text or None
    body = text.lstrip()[len(START_TAG):] if opened else text
    reasoning, closed, answer = body.partition(END_TAG)
    return reasoning.strip() or None, (answer.lstrip() or None) if closed else None


def parser_for_template(chat_template: str | None) -> str | None:
    """The family a checkpoint's chat template thinks in, or None when it has no `<think>`. A template whose
    generation prompt opens `<think>` itself (DeepSeek-R1's, Qwen3 Thinking's) is deepseek_r1; one that only
    writes `<think>` to turn thinking off or to drop old reasoning (hybrid Qwen3's) is qwen3."""
    if not chat_template or (START_TAG not in chat_template and END_TAG not in chat_template):
        return None
    if "<｜Assistant｜>" in chat_template:  # DeepSeek's own role marker (fullwidth bars)
        return "deepseek_r1"
    cut = chat_template.rfind("add_generation_prompt")
    prompt_end = chat_template[cut:] if cut >= 0 else ""
    if START_TAG in prompt_end and END_TAG not in prompt_end:
        return "deepseek_r1"
    return "qwen3"


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held until decided); the tool-call
    stream holds its markers back by the same rule."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One request's streamed output split as split_reasoning splits it whole: each feed gives the
    (reasoning, content) text decided so far. A partial tag, and whitespace that may end the reasoning, are
    held until the following text decides them."""

    def __init__(self, parser: str) -> None:
        check_parser(parser)
        self.parser = parser
        self._mode = "start"  # start (is there an opening tag?), reasoning, answer, content (no reasoning)
        self._pending = ""
        self._ws = ""  # reasoning's trailing whitespace: dropped if the reasoning ends there
        self._reasoned = False  # some reasoning went out (its leading whitespace is dropped before)
        self._finished = False

    def feed(self, text_delta: str) -> tuple[str, str]:
        if self._finished:
            raise ValueError("ReasoningStream.feed after finish")
        self._pending += text_delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            r, c, progressed = self._step()
            reasoning.append(r)
            content.append(c)
            if not progressed:
                return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: held text is decided (a partial tag is plain text)."""
        if self._finished:
            return "", ""
        reasoning, content = self.feed("")
        self._finished = True
        pending, self._pending = self._pending, ""
        if self._mode == "reasoning" or (self._mode == "start" and self.parser == "deepseek_r1"):
            return reasoning + self._reason(pending), content
        return reasoning, content + pending

    def _step(self) -> tuple[str, str, bool]:
        """(reasoning, content, progressed) of one move through the held text."""
        if self._mode == "start":
            return self._start()
        if self._mode == "reasoning":
            return self._reasoning()
        text, self._pending = self._pending, ""
        if self._mode == "answer":
            text = text.lstrip()
            if text:
                self._mode = "content"
            else:
                return "", "", False
        return "", text, False

    def _start(self) -> tuple[str, str, bool]:
        visible = self._pending.lstrip()
        if visible.startswith(START_TAG):
            self._pending, self._mode = visible[len(START_TAG):], "reasoning"
            return "", "", True
        if START_TAG.startswith(visible):
            return "", "", False  # whitespace, or part of the opening tag: not decided yet
        self._mode = "reasoning" if self.parser == "deepseek_r1" else "content"
        return "", "", True

    def _reasoning(self) -> tuple[str, str, bool]:
        i = self._pending.find(END_TAG)
        if i < 0:
            keep = held_back(self._pending, END_TAG)
            text = self._pending[:len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
            return self._reason(text), "", False
        text, self._pending = self._pending[:i], self._pending[i + len(END_TAG):]
        reasoning = self._reason(text)
        self._ws, self._mode = "", "answer"
        return reasoning, "", True

    def _reason(self, text: str) -> str:
        """Reasoning text to send: none of its leading whitespace, its trailing whitespace held back."""
        if not self._reasoned:
            text = text.lstrip()
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._reasoned = True
        return body
