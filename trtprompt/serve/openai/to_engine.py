"""The OpenAI front end's path straight to the torch target's engine process.

Through Triton every streamed token costs a Python-backend IPC send, a gRPC
message out of tritonserver and one into this front end, on the cores the
engine uses (docs/design.md, "Serving path"). On the torch target's fused
layout the front end therefore does what the fused `ensemble` model does,
with the same code: the request built once as a `TextRequest` (serve/wire/requests.py, no
Triton tensors on the way), the same prompt edge (budget, chat window, salt rule), one
multiplexed engine connection (serve/wire/engine_client.py), the same streaming detokenizer,
the same error codes. Triton
keeps serving Triton clients; the trtllm target and the upstream layout answer
OpenAI requests through Triton (serve/openai/to_triton.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import AsyncGenerator

from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.engine.request import RetentionConfig, SamplingParams
from trtprompt.error_codes import BadRequestError, RequestError
from trtprompt.prompt.budget import PromptError, PromptPolicy
from trtprompt.prompt.chat import encode_messages
from trtprompt.prompt.chat_tools import ChatRender
from trtprompt.prompt.edge import PromptEdge
from trtprompt.serve.openai.answer_params import Shape, bad_word_ids
from trtprompt.serve.openai.engine_pieces import Echo, PieceReader
from trtprompt.serve.openai.errors import APIError, from_error
from trtprompt.serve.openai.guided import client_error
from trtprompt.serve.openai.params import Generation, Prompt
from trtprompt.serve.openai.reasoning import end_tag
from trtprompt.serve.openai.retention import mark_ranges
from trtprompt.serve.openai.to_triton import Piece
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.engine_client import EngineClient
from trtprompt.serve.wire.frames import StepEntry
from trtprompt.serve.wire.refusals import refusal_reason, report_refused
from trtprompt.serve.wire.requests import (
    ADD_SPECIAL_TOKENS,
    Prepared,
    TextRequest,
    TokenRequest,
    prepare,
    prepare_ids,
)
from trtprompt.tokenizer import Tokenizer

log = logging.getLogger("trtprompt.openai")
# Tokens at the end of a rendered chat that are decoded to see whether it closed the reasoning.
REASONING_TAIL_TOKENS = 16


@dataclass(frozen=True)
class EngineInputs:
    """One prompt's engine request and how its output is detokenized."""

    request: TokenRequest
    skip_special_tokens: bool  # the OpenAI extension; the fused ensemble's own is SKIP_SPECIAL_TOKENS
    shape: Shape = Shape()
    echo: Echo | None = None  # completions' echo: the prompt as the answer starts with it
    guide_field: str | None = None  # the client's field the guide came from: the engine's guide errors name it
    # The rendered chat already closed the reasoning (Qwen3's empty think block with enable_thinking false):
    # the answer has none to split, and a guide holds from the first token.
    reasoning_closed: bool = False


def api_error_of(exc: BaseException) -> APIError:
    """The API error for a failure on this path: typed to the edge (errors.from_error)."""
    return from_error(exc)


class EnginePath:
    """Create inside the running event loop; the engine connection's reader thread feeds it."""

    def __init__(self, socket_path: str, engine_dir: str, tokenizer_dir: str | None = None) -> None:
        engine = read_engine_dir(engine_dir, tokenizer_dir)
        self.socket = socket_path
        self.tokenizer = Tokenizer.from_dir(engine.tokenizer_dir)
        self.edge = PromptEdge(PromptPolicy.from_mapping(engine.prompt), self.tokenizer, ADD_SPECIAL_TOKENS,
                               functools.partial(P.engine_limits, socket_path))
        self.client = EngineClient(socket_path)

    async def close(self) -> None:
        self.client.close()

    async def ready(self) -> bool:
        try:
            await asyncio.to_thread(P.call, self.socket, {"op": "info"}, 2.0)
        except (OSError, P.EngineError, ValueError):  # not up, restarting, or a bad reply
            return False
        return True

    async def inputs_for(self, gen: Generation, prompt: Prompt | None) -> EngineInputs:
        """Parse and fit one prompt (None: the chat) off the event loop (tokenizing a long prompt takes a while)."""
        return await asyncio.to_thread(self._prepare, gen, prompt)

    def _prepare(self, gen: Generation, prompt: Prompt | None) -> EngineInputs:
        try:
            sampling = self._with_bad_words(gen)
            if isinstance(prompt, tuple):  # token ids: no tokenizing, the same budget and salt rule
                ids = TokenRequest(prompt, sampling, gen.stream, cache_salt=gen.cache_salt, retention=gen.retention,
                                   lora=gen.lora)
                prepared = prepare_ids(ids, gen.stop, self.edge, self.tokenizer)
            else:
                text = TextRequest(text=prompt or "", sampling=sampling, stream=gen.stream,
                                   messages=gen.messages, cache_salt=gen.cache_salt, stop_words=gen.stop,
                                   retention=gen.retention, chat_render=gen.chat.render if gen.chat else None,
                                   lora=gen.lora)
                prepared = prepare(text, self.edge, self.tokenizer)
            closed = self._reasoning_closed(gen, prepared.request.prompt_token_ids)
            return EngineInputs(self._after_reasoning(self._marked(gen, prepared), closed), gen.skip_special_tokens,
                                gen.shape, self._echo(gen, prompt, prepared), gen.guide_field, closed)
        except Exception as exc:  # noqa: BLE001 - answered to the client, counted as the ensemble counts it
            if not isinstance(exc, RequestError):
                log.exception("preparing a request failed")
            report_refused(refusal_reason(exc), self.socket)
            raise api_error_of(exc) from None

    def _reasoning_closed(self, gen: Generation, ids: tuple[int, ...]) -> bool:
        """Whether the rendered chat ends right after the reasoning parser's end tag (a template that
        renders an empty think block when thinking is off): the model then answers without reasoning."""
        if gen.chat is None or gen.chat.reasoning_parser is None:
            return False
        tag = end_tag(gen.chat.reasoning_parser)
        tail = self.tokenizer.decode(ids[-REASONING_TAIL_TOKENS:], skip_special_tokens=False)
        return tail.rstrip().endswith(tag)

    @staticmethod
    def _after_reasoning(request: TokenRequest, closed: bool) -> TokenRequest:
        """A guide held back until the reasoning's end tag holds from the start when the prompt closed it."""
        if not closed or request.sampling.guide_after is None:
            return request
        return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, guide_after=None))

    def _with_bad_words(self, gen: Generation) -> SamplingParams:
        """gen's sampling with its bad words as token sequences, encoded as vLLM encodes them."""
        if not gen.bad_words:
            return gen.sampling
        ids = bad_word_ids(gen.bad_words, lambda w: self.tokenizer.encode(w, add_special_tokens=False))
        return dataclasses.replace(gen.sampling, bad_words=ids)

    def _echo(self, gen: Generation, prompt: Prompt | None, prepared: Prepared) -> Echo | None:
        """The prompt as sent when it is text and was not cut, else the fitted prompt's ids decoded."""
        if not gen.shape.echo:
            return None
        ids = prepared.request.prompt_token_ids
        cut = prepared.prompt.prompt_truncated_tokens > 0
        text = prompt if isinstance(prompt, str) and not cut else \
            self.tokenizer.decode(ids, skip_special_tokens=gen.skip_special_tokens)
        return Echo(text, ids)

    def _marked(self, gen: Generation, prepared: Prepared) -> TokenRequest:
        """The request with its chat's cache_control marks as token ranges over the fitted prompt
        (serve/openai/retention.py), beside the body's decode retention if any."""
        if not gen.cache_marks or gen.messages is None:
            return prepared.request
        render = gen.chat.render if gen.chat else None
        ranges = mark_ranges(gen.cache_marks, list(gen.messages), prepared.prompt.dropped_turns,
                             functools.partial(self._prefix_tokens, render=render))
        base = gen.retention or RetentionConfig()
        return dataclasses.replace(prepared.request, retention=dataclasses.replace(base, token_ranges=ranges))

    def _prefix_tokens(self, messages: list[dict[str, str]], render: ChatRender | None = None) -> int:
        """Tokens of a chat prefix as the template renders it (with the request's tools), without the
        generation prompt."""
        try:
            return len(encode_messages(self.tokenizer, messages, render, add_generation_prompt=False))
        except PromptError as exc:  # e.g. a template that wants a user message last
            raise BadRequestError(f"cache_control: the chat template cannot render the chat up to a marked "
                                  f"part on its own ({exc})", "cache_control") from None

    async def generate(self, inputs: EngineInputs) -> AsyncGenerator[Piece, None]:
        """Pieces until the final one; APIError on an error. Leaving early aborts the engine request."""
        req = inputs.request
        loop = asyncio.get_running_loop()
        entries: asyncio.Queue[StepEntry] = asyncio.Queue()

        def handle(entry: StepEntry) -> None:  # on the engine client's reader thread
            loop.call_soon_threadsafe(entries.put_nowait, entry)

        try:
            rid = self.client.submit(req, handle)
        except Exception as exc:  # noqa: BLE001 - engine unavailable or a refused submit
            raise client_error(api_error_of(exc), inputs.guide_field) from None
        reader = PieceReader(self.tokenizer, req.prompt_token_ids, inputs.shape, req.stream,
                             inputs.skip_special_tokens, inputs.echo)
        finished = False
        try:
            while not finished:
                entry = await entries.get()
                error = P.entry_error(entry)
                if error is not None:
                    finished = True
                    raise client_error(api_error_of(error), inputs.guide_field)  # e.g. its schema does not compile
                finished = entry["finished"]
                if finished and entry.get("warning"):
                    log.warning("%s", entry["warning"])  # as the fused ensemble logs it
                piece = reader.read(entry)
                if piece is not None:
                    yield piece
        finally:
            if not finished:
                self.client.abort([rid])  # the HTTP client went away: free the KV blocks now

