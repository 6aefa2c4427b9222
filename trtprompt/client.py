"""tritonclient gRPC helpers for the TensorRT-LLM-style interface.

Decoupled models answer only through the streaming API, so every call here
opens a stream (one per client object: tritonclient allows one), sends one
request with enable_empty_final_response and collects responses until the
one flagged final. Used by `trtprompt infer`, the benchmarks and the tests.

A server started with an API key (docs/security.md) refuses every API but health
without it; each client here sends it when given one or when TRTPROMPT_API_KEY is set.
"""

from __future__ import annotations

import os
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from trtprompt import interface

NP_TO_TRITON = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64", np.dtype(np.uint64): "UINT64",
                np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16", np.dtype(np.bool_): "BOOL",
                np.dtype(np.uint32): "UINT32"}
# The return_perf_metrics output names, as the model configs declare them.
PERF_OUTPUTS = tuple(name for name, *_ in interface.PERF_OUTPUTS)
MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's 4 MiB default would refuse long prompts and whole outputs

API_KEY_ENV = "TRTPROMPT_API_KEY"
# The header Triton's restricted APIs check when `trtprompt serve` has a key, with the value
# "Bearer KEY": what OpenAI clients send, so one key works alike on every port (docs/security.md).
AUTH_HEADER = "authorization"
# Triton 2.51 checks a restricted gRPC protocol's key under this prefix (measured: it answers
# "expecting header 'triton-grpc-protocol-authorization'"); the prefix cannot be configured.
GRPC_AUTH_HEADER = "triton-grpc-protocol-" + AUTH_HEADER


def resolve_api_key(api_key: str | None) -> str | None:
    """api_key, or with None the TRTPROMPT_API_KEY environment variable; "" (or an unset or
    empty variable) means no key."""
    key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
    return key.strip() or None


def bearer(key: str) -> str:
    return f"Bearer {key}"


def http_auth_headers(api_key: str | None) -> dict[str, str]:
    """Headers for Triton's HTTP API (tritonclient.http's headers=); empty without a key."""
    return {AUTH_HEADER: bearer(api_key)} if api_key else {}


def grpc_auth_metadata(api_key: str | None) -> dict[str, str]:
    """Metadata for Triton's gRPC API (tritonclient.grpc's headers=); empty without a key."""
    return {GRPC_AUTH_HEADER: bearer(api_key)} if api_key else {}


def grpc_call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """grpc_auth_metadata as a raw gRPC call's metadata= (a stub call on aio_channel's channel)."""
    return tuple(grpc_auth_metadata(api_key).items())


def aio_channel(url: str) -> Any:
    """A grpc.aio channel to tritonserver and its inference stub; create both inside the event
    loop that uses them (a grpc.aio channel belongs to the loop it was made in). A server with an
    API key wants grpc_call_metadata(key) as each call's metadata= (per call, not an interceptor:
    grpc.aio's interceptors wrap every streamed response)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.aio.insecure_channel(url, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def stream_request(model: str, inputs: Sequence[Any], request_id: str, outputs: Sequence[str] | None) -> Any:
    """One ModelStreamInfer request (outputs: the names to return; None: all). The empty final response
    is enabled: the final flag may come after the last data response."""
    from tritonclient.grpc import InferRequestedOutput
    from tritonclient.grpc._utils import _get_inference_request  # the request builder tritonclient itself uses

    request = _get_inference_request(
        model_name=model, inputs=list(inputs), model_version="", request_id=request_id,
        outputs=[InferRequestedOutput(name) for name in outputs] if outputs else None, sequence_id=0,
        sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=None)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


@dataclass
class StreamResult:
    """Everything one streamed request returned."""

    responses: list[dict[str, np.ndarray[Any, Any]]] = field(default_factory=list)
    # Seconds from sending to each data response's arrival.
    times: list[float] = field(default_factory=list)
    error: str | None = None
    error_code: str | None = None
    finished: bool = False

    @property
    def pieces(self) -> list[str]:
        return [_text(r["text_output"]) for r in self.responses if "text_output" in r]

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def output_ids(self) -> list[int]:
        ids: list[int] = []
        for r in self.responses:
            if "output_ids" in r:
                ids.extend(int(t) for t in np.asarray(r["output_ids"]).reshape(-1))
        return ids

    def last(self, name: str) -> Any:
        """The last value of an output across responses (None if never sent)."""
        for r in reversed(self.responses):
            if name in r:
                return np.asarray(r[name]).reshape(-1)[0].item()
        return None

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] if self.times else None


def _text(arr: np.ndarray[Any, Any]) -> str:
    value = np.asarray(arr).reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def input_array(value: Any, dtype: Any = None) -> np.ndarray[Any, Any]:
    """One [1, ...] input value (batch of one), typed like the model config; text as BYTES."""
    if isinstance(value, (str, bytes)):
        return np.array([[value.encode("utf-8") if isinstance(value, str) else value]], dtype=object)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (str, bytes)):  # a words list
        return np.array([[w.encode("utf-8") if isinstance(w, str) else w for w in value]], dtype=object)
    arr = np.asarray(value)
    if dtype is not None:
        arr = arr.astype(dtype)
    return arr.reshape(1, 1) if arr.ndim == 0 else arr


def make_input(name: str, value: Any, dtype: Any = None) -> Any:  # dtype: anything numpy's astype takes
    """One [1, ...] input (batch of one), typed like the model config."""
    return _infer_input(name, input_array(value, dtype))


def _infer_input(name: str, arr: np.ndarray[Any, Any]) -> Any:
    import tritonclient.grpc as grpcclient

    inp = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else NP_TO_TRITON[arr.dtype])
    inp.set_data_from_numpy(arr)
    return inp


def text_arrays(prompt: str | bytes, max_tokens: int, stream: bool = True,
                **optional: Any) -> dict[str, np.ndarray[Any, Any]]:
    """`ensemble`'s input arrays; optional names as TensorRT-LLM's ensemble has them (temperature=0.0, ...)."""
    types = {"temperature": np.float32, "top_p": np.float32, "length_penalty": np.float32,
             "repetition_penalty": np.float32, "presence_penalty": np.float32,
             "frequency_penalty": np.float32, "seed": np.uint64, "random_seed": np.uint64}
    arrays = {"text_input": input_array(prompt), "max_tokens": input_array(max_tokens, np.int32),
              "stream": input_array(stream, np.bool_)}
    for name, value in optional.items():
        if value is None:
            continue
        if isinstance(value, bool):
            arrays[name] = input_array(value, np.bool_)
        elif isinstance(value, (str, bytes)) or name in ("stop_words", "bad_words"):
            arrays[name] = input_array(value)
        else:
            arrays[name] = input_array(value, types.get(name, np.int32))
    return arrays


def text_inputs(prompt: str | bytes, max_tokens: int, stream: bool = True, **optional: Any) -> list[Any]:
    """Inputs for `ensemble` (text_arrays as tritonclient InferInputs)."""
    return [_infer_input(name, arr) for name, arr in text_arrays(prompt, max_tokens, stream, **optional).items()]


def token_inputs(input_ids: Sequence[int], max_tokens: int, streaming: bool = True,
                 **optional: Any) -> list[Any]:
    """Inputs for `tensorrt_llm` (token ids)."""
    inputs = [make_input("input_ids", np.asarray([list(input_ids)], dtype=np.int32)),
              make_input("input_lengths", len(input_ids), np.int32),
              make_input("request_output_len", max_tokens, np.int32),
              make_input("streaming", streaming, np.bool_)]
    for name, value in optional.items():
        if value is None:
            continue
        dtype = np.bool_ if isinstance(value, bool) else np.float32 if isinstance(value, float) else np.int32
        inputs.append(make_input(name, value, dtype))
    return inputs


class LLMClient:
    """One gRPC connection and one stream; not thread-safe (make one per thread).

    api_key: sent with every call (None: $TRTPROMPT_API_KEY if set; "": none).
    """

    def __init__(self, url: str = interface.DEFAULT_GRPC_URL, api_key: str | None = None) -> None:
        import tritonclient.grpc as grpcclient

        self.url = url
        self._headers = grpc_auth_metadata(resolve_api_key(api_key)) or None
        self._client = grpcclient.InferenceServerClient(url)
        self._queue: queue.SimpleQueue[tuple[Any, Any, float]] = queue.SimpleQueue()
        self._client.start_stream(callback=lambda result, error: self._queue.put((result, error, time.perf_counter())),
                                  headers=self._headers)

    def close(self, cancel: bool = False) -> None:
        self._client.stop_stream(cancel_requests=cancel)
        self._client.close()

    def input_names(self, model: str) -> set[str]:
        """Inputs the model declares (layouts differ: upstream has no return_num_* inputs)."""
        return self.declared_names(model)[0]

    def declared_names(self, model: str) -> tuple[set[str], set[str]]:
        """The model's input and output names, from one metadata call."""
        meta = self._client.get_model_metadata(model, headers=self._headers)
        return {t.name for t in meta.inputs}, {t.name for t in meta.outputs}

    def __enter__(self) -> "LLMClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def infer(self, model: str, inputs: Sequence[Any], timeout_s: float = 120.0,
              on_response: Callable[[dict[str, np.ndarray[Any, Any]]], None] | None = None,
              stop_after: int | None = None, parameters: Mapping[str, Any] | None = None,
              request_id: str = "", outputs: Sequence[str] | None = None) -> StreamResult:
        """Send one request and collect its responses until the final one.

        stop_after=N returns after N data responses without waiting (the
        caller then cancels with close(cancel=True)). outputs names the
        outputs to return (None: all the model declares).
        """
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        result = StreamResult()
        t0 = time.perf_counter()
        try:
            # The upstream layout's postprocessing keys its detokenizer by request id.
            self._client.async_stream_infer(model, list(inputs), request_id=request_id or uuid.uuid4().hex,
                                            enable_empty_final_response=True,
                                            parameters=dict(parameters) if parameters else None,
                                            outputs=None if outputs is None else
                                            [grpcclient.InferRequestedOutput(name) for name in outputs])
        except InferenceServerException:
            # The stream ended before this request (Triton refused it, e.g. for want of the API key):
            # tritonclient says only "no longer in valid state"; the reason is in the queue.
            if not self._take_stream_error(result):
                raise
            return result
        deadline = t0 + timeout_s
        while not result.finished:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(f"no final response from {model!r} within {timeout_s:.0f}s")
            try:
                res, err, at = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if err is not None:
                result.error, result.finished = str(err), True
                result.error_code = getattr(err, "status", lambda: None)()
                break
            response = res.get_response()
            arrays = {o.name: res.as_numpy(o.name) for o in response.outputs}
            if arrays:
                result.responses.append(arrays)
                result.times.append(at - t0)
                if on_response is not None:
                    on_response(arrays)
            final = response.parameters.get("triton_final_response")
            result.finished = bool(final and final.bool_param)
            if stop_after is not None and len(result.responses) >= stop_after:
                break
        return result


    def _take_stream_error(self, result: StreamResult, wait_s: float = 5.0) -> bool:
        """Put the error that ended the stream into result; False if none comes within wait_s (tritonclient
        marks the stream dead just before its callback queues the reason)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                _, err, _ = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if err is not None:
                result.error, result.finished = str(err), True
                result.error_code = getattr(err, "status", lambda: None)()
                return True


def generate(url: str, prompt: str, max_tokens: int, model: str = "ensemble", stream: bool = True,
             timeout_s: float = 120.0, on_text: Callable[[str], None] | None = None,
             **optional: Any) -> StreamResult:
    """Stream one text request through `ensemble`; on_text sees each piece as it arrives."""
    callback = (lambda out: on_text(_text(out["text_output"]))) if on_text else None
    with LLMClient(url) as client:
        return client.infer(model, text_inputs(prompt, max_tokens, stream, **optional), timeout_s,
                            on_response=callback)
