"""The Starlette application: routes, authentication, errors, streaming.

A streamed request is started and its first response awaited before any
HTTP header is sent, so a refused request (bad input, queue full, engine
restarting) still gets its proper status code; an error after that arrives as
an SSE event carrying the error object, followed by `data: [DONE]`. A client
that goes away closes the Triton call (streaming: Starlette cancels the
response; non-streaming: a watcher sees the disconnect), which cancels the
engine request and frees its KV blocks.

What a connection may send (body and header size, read and keep-alive
timeouts, connections) is bounded before any of this runs: http_limits.py,
http_protocol.py. Every body is read and parsed by json_body.read_json.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Protocol, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from trtprompt.serve.openai import responses as R
from trtprompt.serve.openai import tokenize as tok
from trtprompt.serve.openai.batch import Item, merged
from trtprompt.serve.openai.chat_answer import ChoiceStream, tool_finish_reason
from trtprompt.serve.openai.config import FrontendConfig
from trtprompt.serve.openai.errors import APIError, unauthorized
from trtprompt.serve.openai.http_limits import BodyLimit, HttpLimits
from trtprompt.serve.openai.json_body import ClientGone, read_json
from trtprompt.serve.openai.lora import Adapters, load_adapter, model_cards, request_adapter, unload_adapter
from trtprompt.serve.openai.params import Generation, Prompt, parse_request
from trtprompt.serve.openai.to_triton import Piece, TritonEnsemble


class Source(Protocol):
    """Where requests go: the engine process itself (engine_path.EnginePath, the torch target's fused
    layout) or Triton's `ensemble` (triton.TritonEnsemble)."""

    async def ready(self) -> bool: ...

    async def inputs_for(self, gen: Generation, prompt: Prompt | None) -> Any: ...

    def generate(self, prepared: Any) -> AsyncGenerator[Piece, None]: ...

    async def close(self) -> None: ...


T = TypeVar("T")
SGLANG_INFO_PATHS = ("/server_info", "/model_info", "/get_server_info", "/get_model_info")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the log does
log = logging.getLogger("trtprompt.openai")


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=dict(exc.headers))


def _authorize(request: Request, cfg: FrontendConfig) -> None:
    if cfg.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(token.strip().encode("utf-8"), cfg.api_key.encode("utf-8")):
        raise unauthorized("incorrect API key")


async def health(request: Request) -> Response:
    ok = await request.app.state.source.ready()
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


async def models(request: Request) -> Response:
    cfg: FrontendConfig = request.app.state.cfg
    _authorize(request, cfg)
    adapters = await request.app.state.adapters.listing()  # the base model, then its LoRA adapters (lora.py)
    return JSONResponse({"object": "list", "data": model_cards(cfg.limits, request.app.state.started, adapters)})


async def load_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/load_lora_adapter (lora.py)."""
    cfg: FrontendConfig = request.app.state.cfg
    _authorize(request, cfg)
    return PlainTextResponse(await load_adapter(await read_json(request), cfg.limits, request.app.state.adapters))


async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/unload_lora_adapter (lora.py)."""
    _authorize(request, request.app.state.cfg)
    return PlainTextResponse(await unload_adapter(await read_json(request), request.app.state.adapters))


async def server_info(request: Request) -> Response:
    """SGLang's model and server info, under its current and older paths: sglang-router names a
    worker's model from served_model_name (else model_path) and shows it on its /v1/models."""
    cfg: FrontendConfig = request.app.state.cfg
    _authorize(request, cfg)
    return JSONResponse({"model_path": cfg.limits.name, "served_model_name": cfg.limits.name,
                         "tokenizer_path": None, "is_generation": True,
                         "max_context_length": cfg.limits.max_model_len, "vocab_size": cfg.limits.vocab_size})


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def tokenize(request: Request) -> Response:
    _authorize(request, request.app.state.cfg)
    return await tok.tokenize(request)


async def detokenize(request: Request) -> Response:
    _authorize(request, request.app.state.cfg)
    return await tok.detokenize(request)


async def _generate(request: Request, kind: str) -> Response:
    cfg: FrontendConfig = request.app.state.cfg
    _authorize(request, cfg)
    body = await read_json(request)
    gen = parse_request(kind, body, cfg.limits, await request_adapter(body, cfg.limits, request.app.state.adapters))
    if gen.notes:
        log.warning("openai front end: accepted, changing nothing here: %s", "; ".join(gen.notes))
    source: Source = request.app.state.source
    # Every prompt of a batch is fitted before any is submitted: a refused one starts nothing.
    prepared = [await source.inputs_for(gen, prompt) for prompt in gen.inputs]
    gen = _answered(gen, prepared)
    items = merged([source.generate(p) for p in prepared])
    env = R.Envelope(kind, gen.lora or cfg.limits.name)  # an adapter's answer names it, as vLLM's do
    if not gen.stream:
        grid = await _unless_gone(request, _collect(items, len(prepared), gen.shape.sequences))
        if grid is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(R.full_response(env, gen, grid, cfg.tokens_per_block))
    first = await _unless_gone(request, _first(items))  # queued requests wait here: watch the client
    if first is None:
        return Response(status_code=CLIENT_CLOSED)
    return StreamingResponse(_events(env, gen, first, items, len(prepared), cfg.tokens_per_block),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _answered(gen: Generation, prepared: list[Any]) -> Generation:
    """gen with no reasoning to split when its rendered chat already closed the reasoning (the engine
    path's EngineInputs.reasoning_closed; through Triton the ensemble renders, and nothing says so)."""
    if gen.chat is None or not any(getattr(p, "reasoning_closed", False) for p in prepared):
        return gen
    return dataclasses.replace(gen, chat=gen.chat.without_reasoning())


def _grid(prompts: int, sequences: int) -> R.Grid:
    return [[R.Tally() for _ in range(sequences)] for _ in range(prompts)]


async def _collect(items: AsyncGenerator[Item, None], prompts: int, sequences: int) -> R.Grid:
    grid = _grid(prompts, sequences)
    async for index, piece in items:
        if piece is not None:
            grid[index][piece.seq].add(piece)
    return grid


async def _first(items: AsyncGenerator[Item, None]) -> tuple[Item | None]:
    """The first item (in a 1-tuple, so None can mean "the client went away")."""
    try:
        return (await items.__anext__(),)
    except StopAsyncIteration:
        return (None,)


async def _unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None if the client disconnected first (work is then cancelled, which
    closes the Triton call: the engine request is aborted)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # takes effect at the task's next await: wait for it to unwind
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _events(env: R.Envelope, gen: Generation, head: tuple[Item | None], items: AsyncGenerator[Item, None],
                  n: int, tokens_per_block: int | None) -> AsyncIterator[bytes]:
    grid, opened = _grid(n, gen.shape.n), [False] * (n * gen.shape.n)  # best_of > n is not streamed
    # Each chat choice's own parsers, where its answer is parsed (reasoning, tool calls): chat_answer.py.
    streams = [ChoiceStream(gen.chat) for _ in opened] if gen.chat is not None and gen.chat.changes_answer \
        else None
    try:
        if head[0] is not None:
            for out in _event(env, gen, head[0], grid, opened, streams):
                yield out
        async for item in items:
            for out in _event(env, gen, item, grid, opened, streams):
                yield out
        if gen.include_usage:
            yield R.usage_chunk(env, grid, tokens_per_block)
    except APIError as exc:
        yield R.sse(exc.body())
    finally:
        await items.aclose()  # cancelled mid-stream (client gone): cancels the engine or Triton calls now
    yield R.DONE


def _event(env: R.Envelope, gen: Generation, item: Item, grid: R.Grid, opened: list[bool],
           streams: list[ChoiceStream] | None = None) -> list[bytes]:
    """The chunks one item of prompt `p` makes: a piece of its sequence s is choice p * n + s, sent when
    it is the choice's first (chat: with the role) or carries text or log probabilities; the prompt's
    end closes each of its choices with a chunk carrying only the finish_reason. With `streams` a piece's
    text goes through its choice's parsers first (reasoning_content, content, tool-call deltas)."""
    p, piece = item
    n = gen.shape.n
    if piece is None:
        return [out for s in range(n) for out in _closing(env, gen, grid[p][s], p * n + s, opened, streams)]
    index, tally = p * n + piece.seq, grid[p][piece.seq]
    first = not opened[index]
    opened[index] = True
    logprobs = R.shown_logprobs(env, gen, piece.logprobs, tally.offset)
    tally.add(piece)
    if streams is not None:
        carries = first or (logprobs is not None and bool(piece.logprobs))
        return _parsed(env, gen, streams[index].feed(piece.text), first, index, logprobs, carries)
    if not (piece.text or first or (logprobs is not None and piece.logprobs)):
        return []
    return [R.chunk(env, gen, piece.text, None, first, index, logprobs)]


def _parsed(env: R.Envelope, gen: Generation, deltas: list[dict[str, Any]], first: bool, index: int,
            logprobs: dict[str, Any] | None, carries: bool) -> list[bytes]:
    """A piece's chunks once parsed: one per delta, the first with the role (a choice's first piece) and the
    piece's log probabilities; a piece whose text the parsers hold back still opens its choice or carries
    its log probabilities (`carries`), with an empty delta."""
    if not deltas and carries:
        deltas = [{}]
    return [R.chunk(env, gen, None, None, first and i == 0, index, logprobs if i == 0 else None, delta)
            for i, delta in enumerate(deltas)]


def _closing(env: R.Envelope, gen: Generation, tally: R.Tally, index: int, opened: list[bool],
             streams: list[ChoiceStream] | None = None) -> list[bytes]:
    """The choice's last chunks: what its parsers still held, then the finish_reason ("tool_calls" when
    it called tools)."""
    first = not opened[index]
    opened[index] = True
    reason = tally.finish_reason(gen.max_tokens)
    if streams is None:
        return [R.chunk(env, gen, None, reason, first, index)]
    held = _parsed(env, gen, streams[index].finish(), first, index, None, False)
    reason = tool_finish_reason(streams[index].called, reason)
    return held + [R.chunk(env, gen, None, reason, first and not held, index)]


async def _api_error(_request: Request, exc: Any) -> Response:
    return error_response(exc)


async def _http_error(_request: Request, exc: Any) -> Response:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), kind))


async def _client_gone(request: Request, _exc: Exception) -> Response:
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    log.warning("openai front end: %s disconnected before its request body arrived (%s %s)", client,
                request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED)


async def _internal_error(_request: Request, exc: Exception) -> Response:
    # The exception's text may carry internals (paths, reprs of values): it goes to the log (Starlette
    # re-raises it to uvicorn, which logs the traceback), the client gets its type only.
    return error_response(APIError(500, f"internal error ({type(exc).__name__}); see the server's log",
                                   "server_error"))


def _source(cfg: FrontendConfig) -> Source:
    if cfg.engine_socket is None:
        return TritonEnsemble(cfg.grpc_url, cfg.triton_model, cfg.api_key or "")
    from trtprompt.serve.openai.to_engine import EnginePath  # loads the tokenizer

    return EnginePath(cfg.engine_socket, cfg.engine_dir, cfg.tokenizer_dir)


def create_app(cfg: FrontendConfig, http: HttpLimits) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.source = _source(cfg)  # needs the running loop
        try:
            yield
        finally:
            await app.state.source.close()

    routes = [Route("/health", health), Route("/v1/models", models),
              *(Route(path, server_info) for path in SGLANG_INFO_PATHS),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
              Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(BodyLimit, max_bytes=http.max_request_bytes)],
                    exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                        ClientGone: _client_gone, Exception: _internal_error})
    app.state.cfg = cfg
    app.state.adapters = Adapters(cfg.engine_socket)  # no socket: through Triton, no adapters (lora.py)
    app.state.started = int(time.time())
    return app
