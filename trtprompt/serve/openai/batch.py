"""The pieces of several generations as one stream: a batch of prompts answers as choices.

OpenAI's /v1/completions takes a batch of prompts (strings or token-id lists) and answers
one choice per prompt, each with its index; streamed, the choices' chunks interleave as they
come. One prompt (every chat, most completions) is passed through without a task or a queue.
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Sequence

from trtprompt.serve.openai.to_triton import Piece

Item = tuple[int, Piece | None]  # (choice index, piece); None: that choice ended


def merged(streams: Sequence[AsyncGenerator[Piece, None]]) -> AsyncGenerator[Item, None]:
    """Each stream's pieces tagged with its index, and (index, None) when it ends. An error in
    one stream closes the others (their engine or Triton requests are aborted) and is raised."""
    return _one(streams[0]) if len(streams) == 1 else _many(streams)


async def _one(stream: AsyncGenerator[Piece, None]) -> AsyncGenerator[Item, None]:
    try:
        async for piece in stream:
            yield 0, piece
        yield 0, None
    finally:
        await stream.aclose()


async def _many(streams: Sequence[AsyncGenerator[Piece, None]]) -> AsyncGenerator[Item, None]:
    queue: asyncio.Queue[Item | BaseException] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[Piece, None]) -> None:
        try:
            async for piece in stream:
                queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            running -= item[1] is None
            yield item
    finally:
        for task in tasks:
            task.cancel()  # a cancelled pump closes its stream, which aborts that request
        await asyncio.gather(*tasks, return_exceptions=True)
