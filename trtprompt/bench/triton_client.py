"""One gRPC channel for every stream of a load run against Triton.

tritonclient's streaming client (trtprompt.client.LLMClient) holds a channel,
a stream and a polling thread per client object, and allows one stream per
object; at concurrency 32 those 32 channels cost the load generator more CPU
per output token than tritonserver spends relaying it, on the cores the
server shares (docs/design.md, "Serving path"). Here one grpc.aio channel on
one event-loop thread carries every request as its own ModelStreamInfer call,
as the OpenAI front end does (trtprompt.serve.openai.to_triton); the runner's
worker threads wait on a future instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator, Coroutine, Sequence, TypeVar

import grpc
from tritonclient.grpc import InferResult

from trtprompt.client import StreamResult, aio_channel, grpc_call_metadata, resolve_api_key, stream_request

T = TypeVar("T")


class SharedTritonChannel:
    """Thread-safe: any number of threads call infer() at once, each blocking on its own request.

    api_key: sent with every request (None: $TRTPROMPT_API_KEY if set; "": none).
    """

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self._metadata = grpc_call_metadata(resolve_api_key(api_key))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-grpc", daemon=True)
        self._thread.start()
        self._channel, self._stub = self._run(self._open(url))

    @staticmethod
    async def _open(url: str) -> Any:
        return aio_channel(url)  # inside the loop: the channel belongs to it

    async def _shutdown(self) -> None:
        await self._channel.close()
        # A call returns at its final response, before gRPC has read its status: let those
        # bookkeeping tasks end here rather than be destroyed pending with the loop.
        pending = asyncio.all_tasks() - {asyncio.current_task()}
        if pending:
            await asyncio.wait(pending, timeout=5.0)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self._run(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def infer(self, model: str, inputs: Sequence[Any], timeout_s: float, request_id: str,
              outputs: Sequence[str] | None = None) -> StreamResult:
        """One streamed request, as LLMClient.infer answers it: responses until the final one."""
        request = stream_request(model, inputs, request_id, outputs)
        return self._run(self._bounded(request, model, timeout_s))

    async def _bounded(self, request: Any, model: str, timeout_s: float) -> StreamResult:
        try:
            return await asyncio.wait_for(self._collect(request), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no final response from {model!r} within {timeout_s:.0f}s") from None

    async def _collect(self, request: Any) -> StreamResult:
        result = StreamResult()
        t0 = time.perf_counter()
        sent = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield request
            await sent.wait()  # keep our side open until the last response arrived

        call = self._stub.ModelStreamInfer(requests(), metadata=self._metadata)
        try:
            async for response in call:
                if _take(result, response, time.perf_counter() - t0):
                    return result
            result.error = "tritonserver closed the stream before the final response"
            return result
        except grpc.aio.AioRpcError as exc:  # the call itself refused (e.g. no API key) or broken
            code, details = await call.code(), await call.details()
            result.error = details or exc.details() or str(code or exc.code())
            result.error_code, result.finished = str(code or exc.code()), True
            if code == grpc.StatusCode.INTERNAL and not result.responses:
                result.error = await self._refusal(request.model_name) or result.error
            return result
        finally:
            sent.set()
            if not result.finished:
                call.cancel()  # a timeout or an error on our side: Triton cancels the request


    async def _refusal(self, model: str) -> str | None:
        """What the server says to a unary call on the model, when it refuses it.

        A refusal (no or a wrong API key) that races the stream's first write reaches the
        stream only as INTERNAL "Internal error from Core", its message lost (seen on 2 loaded
        cores, in about 1 of 3 runs of tests/test_serve_security.py). A unary call with the same
        metadata gets the refusal whole; None when that call is answered.
        """
        from tritonclient.grpc import service_pb2

        try:
            await self._stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=model), metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            details: str | None = exc.details()
            return details
        return None


def _take(result: StreamResult, response: Any, at_s: float) -> bool:
    """Add one stream response to the result; True when it was the request's last."""
    if response.error_message:  # an error response ends the request
        result.error, result.finished = response.error_message, True
        return True
    infer = response.infer_response
    if infer.outputs:
        parsed = InferResult(infer)
        result.responses.append({o.name: parsed.as_numpy(o.name) for o in infer.outputs})
        result.times.append(at_s)
    final = infer.parameters.get("triton_final_response")
    result.finished = bool(final is not None and final.bool_param)
    return result.finished
