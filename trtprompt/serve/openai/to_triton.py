"""Talk to Triton's `ensemble` model with Triton's own gRPC API, asynchronously.

One gRPC channel per front end; each request is its own bidirectional
`ModelStreamInfer` call (decoupled models answer only through streaming,
docs/openai.md), sent with `triton_enable_empty_final_response` so the end of
every request is seen whether the final flag rides on the last data response
or on an empty one. Cancelling the call (a client that went away) cancels the
request in Triton, and the fused ensemble then aborts the engine request and
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Sequence

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferResult, service_pb2

from trtprompt.client import aio_channel, grpc_call_metadata, resolve_api_key, stream_request, text_inputs
from trtprompt.engine.request import SamplingParams
from trtprompt.interface import GUIDE_INPUT, GUIDE_TYPE_INPUT, SPECULATION_INPUT
from trtprompt.serve.openai.errors import APIError, from_triton, unavailable
from trtprompt.serve.openai.guided import choice_regex, client_error
from trtprompt.serve.openai.logprobs import TokenLogprob
from trtprompt.serve.openai.params import Generation, Prompt
from trtprompt.serve.wire.retention_inputs import STARTS, retention_arrays

# Always asked for when the ensemble declares them: usage and cached tokens come from these, and
# usage needs the perf outputs once, so they come on the final response only where the ensemble
# can (perf_metrics_final_only; TensorRT-LLM attaches them to every response; docs/openai.md).
REPORTING_INPUTS = ("return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens",
                    "perf_metrics_final_only")
# What a Piece reads: asking for these only keeps every streamed response small (docs/openai.md).
READ_OUTPUTS = ("text_output", "num_input_tokens", "num_output_tokens", "kv_cache_reused_blocks")


@dataclass(frozen=True)
class Piece:
    """One data response of the ensemble, or one update of an engine request's sequence."""

    text: str
    num_input_tokens: int | None
    num_output_tokens: int | None
    reused_blocks: int | None
    seq: int = 0  # which of the request's n sequences (the engine path only)
    logprobs: tuple[TokenLogprob, ...] | None = None  # the tokens whose text this piece carries
    cum_logprob: float | None = None  # the sequence's output so far
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # vLLM's field, on a sequence's first piece
    finish_reason: str | None = None  # on a sequence's last piece, where the engine says it


# Sent whatever their value; every other sampling field only where it differs from its default.
ALWAYS_SENT = ("temperature",)
_SAMPLING_DEFAULTS = SamplingParams()


def ensemble_sampling(params: SamplingParams) -> dict[str, Any]:
    """The ensemble's sampling inputs for params: its text inputs are named as SamplingParams' fields
    (max_tokens and stop words travel as inputs of their own). The ensemble has no ignore_eos input:
    min_tokens = max_tokens keeps the end token from ending the request instead (it is then masked
    rather than generated: docs/openai.md, "Extension fields")."""
    if params.ignore_eos:
        params = dataclasses.replace(params, ignore_eos=False, min_tokens=params.max_tokens)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name in ("max_tokens", "stop_token_ids") or f.name in GUIDE_FIELDS:  # guide: _guide_inputs
            continue
        if value is not None and (f.name in ALWAYS_SENT or value != getattr(_SAMPLING_DEFAULTS, f.name)):
            out[f.name] = value
    return out


# The OpenAI field each ensemble input comes from, where the names differ.
OPENAI_FIELD = {"extra_end_ids": "stop_token_ids"}
# SamplingParams' guide, sent as tensorrtllm_backend's two guided_decoding inputs instead (_guide_inputs).
GUIDE_FIELDS = ("guide_type", "guide", "guide_after")
# Guide types tensorrtllm_backend's guided_decoding_guide_type has no value for (choice goes as a regex).
ENGINE_PATH_GUIDES = ("lark_grammar", "structural_tag")


def _guide_inputs(gen: Generation, declared: frozenset[str], model: str) -> dict[str, str]:
    """The guide as tensorrtllm_backend's guided_decoding_guide_type / guided_decoding_guide inputs (BYTES
    [1, 1]); what they cannot say is refused naming the client's field, never dropped."""
    sampling, field = gen.sampling, gen.guide_field or "guide"
    if sampling.guide_type is None:
        return {}
    if GUIDE_TYPE_INPUT not in declared:
        _refuse(field, f"this server's {model!r} model has no {GUIDE_TYPE_INPUT!r} input")
    if sampling.guide_type in ENGINE_PATH_GUIDES:
        _refuse(field, f"the {sampling.guide_type!r} guide has no {GUIDE_TYPE_INPUT} value in tensorrtllm_backend: "
                "the engine path (the torch target's fused layout) serves it")
    if sampling.guide_after is not None:
        _refuse(field, "a guide held until the reasoning ends has no tensorrtllm_backend input: the engine path "
                "(the torch target's fused layout) serves it")
    if sampling.guide_type == "choice":
        return {GUIDE_TYPE_INPUT: "regex", GUIDE_INPUT: choice_regex(json.loads(sampling.guide or "[]"))}
    if sampling.guide is None:  # json: any JSON object, no guide text
        return {GUIDE_TYPE_INPUT: sampling.guide_type}
    return {GUIDE_TYPE_INPUT: sampling.guide_type, GUIDE_INPUT: sampling.guide}


class EnsembleInputs(list[InferInput]):
    """One request's inputs, and the client's field its guide came from: the ensemble's errors about the
    guide name it."""

    def __init__(self, inputs: Sequence[InferInput], guide_field: str | None) -> None:
        super().__init__(inputs)
        self.guide_field = guide_field


def _refuse_undeclared(gen: Generation, prompt: Prompt | None, sampling: dict[str, Any],
                       declared: frozenset[str], model: str) -> None:
    """What this ensemble cannot be asked is refused, naming the field, never dropped."""
    if isinstance(prompt, tuple):
        _refuse("prompt", f"this server's {model!r} model takes text: token-id prompts need the engine path "
                "(the torch target's fused layout)")
    if not gen.skip_special_tokens:
        _refuse("skip_special_tokens", f"this server's {model!r} model always detokenizes without special tokens")
    for name in sampling:
        if name not in declared:
            field = OPENAI_FIELD.get(name, name)
            _refuse(field, f"this server's {model!r} model has no {name!r} input")


NOT_THROUGH_TRITON = "not through the Triton path yet: use the torch target's fused layout"


def _answer_fields(gen: Generation) -> dict[str, bool]:
    """The OpenAI fields the engine path answers and the ensemble cannot carry, by whether gen asks them."""
    shape, sampling = gen.shape, gen.sampling
    return {"n": shape.n > 1, "best_of": shape.best_of is not None, "logprobs": shape.logprobs is not None,
            "echo": shape.echo, "prompt_logprobs": shape.prompt_logprobs is not None,
            "logit_bias": bool(sampling.logit_bias), "allowed_token_ids": sampling.allowed_token_ids is not None,
            "bad_words": bool(gen.bad_words), "include_stop_str_in_output": sampling.include_stop_in_output,
            "use_beam_search": sampling.beam_width > 1,
            # the ensemble renders the chat itself, with no tools or template arguments (serve/openai/tools.py)
            "tools": bool(gen.chat and gen.chat.tools),
            "chat_template_kwargs": bool(gen.chat and gen.chat.template_kwargs)}


def _refuse_answer_fields(gen: Generation) -> None:
    """Refused by name, never dropped: the ensemble's inputs have no place for them yet."""
    for name, asked in _answer_fields(gen).items():
        if asked:
            _refuse(name, NOT_THROUGH_TRITON)


def _refuse(param: str, why: str) -> None:
    raise APIError(400, f"{param} is not supported here: {why}", "invalid_request_error", param,
                   "unsupported_parameter")


def _scalar(result: InferResult, name: str) -> int | None:
    arr = result.as_numpy(name)
    return None if arr is None else int(np.asarray(arr).reshape(-1)[0])


def _piece(result: InferResult) -> Piece | None:
    arr = result.as_numpy("text_output")
    if arr is None:
        return None  # the empty final response
    value = np.asarray(arr).reshape(-1)[0]
    text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return Piece(text, _scalar(result, "num_input_tokens"), _scalar(result, "num_output_tokens"),
                 _scalar(result, "kv_cache_reused_blocks"))


def _rpc_error(exc: grpc.aio.AioRpcError) -> APIError:
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return unavailable(f"tritonserver is unavailable: {exc.details()}")
    return from_triton(exc.details() or str(exc.code()))


class TritonEnsemble:
    """The `ensemble` model of one tritonserver; create inside the running event loop.

    api_key: Triton's key, sent with every call (None: $TRTPROMPT_API_KEY if set, which is how
    `trtprompt serve` hands it to the front end; docs/security.md).
    """

    def __init__(self, url: str, model: str = "ensemble", api_key: str | None = None) -> None:
        self.model = model
        self._metadata = grpc_call_metadata(resolve_api_key(api_key))
        self._channel, self._stub = aio_channel(url)
        self._inputs: frozenset[str] | None = None
        self._outputs: tuple[str, ...] = ()

    async def close(self) -> None:
        await self._channel.close()

    async def ready(self) -> bool:
        try:
            reply = await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=2.0,
                                                metadata=self._metadata)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.ready)

    async def declared_inputs(self) -> frozenset[str]:
        """The ensemble's input names, read once (layouts differ: upstream lacks `messages`)."""
        if self._inputs is None:
            try:
                meta = await self._stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=self.model),
                                                      timeout=10.0, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                raise _rpc_error(exc) from None
            self._inputs = frozenset(t.name for t in meta.inputs)
            declared = {t.name for t in meta.outputs}
            self._outputs = tuple(name for name in READ_OUTPUTS if name in declared)
        return self._inputs

    async def inputs_for(self, gen: Generation, prompt: Prompt | None) -> EnsembleInputs:
        if gen.lora is not None:  # lora.py never resolves one on this path; a LoRA request never runs as the base
            raise APIError(400, f"model {gen.lora!r}: LoRA adapters are served on the torch target's fused layout "
                           "(this front end answers through Triton)", "invalid_request_error", "model",
                           "lora_unsupported")
        declared = await self.declared_inputs()
        if gen.messages is not None and "messages" not in declared:
            raise APIError(400, f"this server's {self.model!r} model has no 'messages' input (the upstream "
                           "layout or the trtllm target): use /v1/completions", "invalid_request_error",
                           "messages", "unsupported_parameter")
        if gen.cache_salt is not None and "cache_salt" not in declared:
            raise APIError(400, f"this server's {self.model!r} model has no 'cache_salt' input",
                           "invalid_request_error", "cache_salt", "unsupported_parameter")
        _refuse_answer_fields(gen)
        optional: dict[str, Any] = ensemble_sampling(gen.sampling)
        if SPECULATION_INPUT not in declared:
            # The opt-out asks for no token of its own (greedy tokens and sampled distributions are the same
            # with drafts or without): where the model cannot take it there is nothing to refuse.
            optional.pop(SPECULATION_INPUT, None)
        _refuse_undeclared(gen, prompt, optional, declared, self.model)
        optional.update(_guide_inputs(gen, declared, self.model))
        optional.update(self._retention(gen, declared))
        # The chat becomes the `messages` input's JSON here, at the Triton edge, and nowhere else.
        chat = None if gen.messages is None else json.dumps(list(gen.messages), ensure_ascii=False)
        optional.update(exclude_input_in_output=True, messages=chat, cache_salt=gen.cache_salt)
        optional.update({name: True for name in REPORTING_INPUTS})
        # stop_words unfiltered: a server without the input must refuse it, not ignore the stops
        text = prompt if isinstance(prompt, str) else ""
        inputs = text_inputs(text, gen.max_tokens, gen.stream, stop_words=list(gen.stop) or None,
                             **{k: v for k, v in optional.items() if k in declared})
        return EnsembleInputs(inputs, gen.guide_field)

    def _retention(self, gen: Generation, declared: frozenset[str]) -> dict[str, Any]:
        """The body's retention as TensorRT-LLM's six inputs. cache_control marks need the fitted prompt's
        token positions, which only the engine path knows (the ensemble renders and fits the chat)."""
        if gen.cache_marks:
            _refuse("cache_control", f"this server's {self.model!r} model renders the chat itself, so the token "
                    "range a mark covers is unknown here: cache_control needs the engine path (the torch target's "
                    "fused layout); send `retention` with token_ranges instead")
        if gen.retention is None:
            return {}
        if STARTS not in declared:
            _refuse("retention", f"this server's {self.model!r} model has no retention inputs")
        return retention_arrays(gen.retention)

    async def generate(self, inputs: Sequence[InferInput]) -> AsyncGenerator[Piece, None]:
        """Data responses of one request until its final one; APIError on an error.

        Closing the iterator early (the HTTP client went away) cancels the call.
        """
        request = stream_request(self.model, inputs, uuid.uuid4().hex, self._outputs)
        guide_field = inputs.guide_field if isinstance(inputs, EnsembleInputs) else None
        finished = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield request
            await finished.wait()  # keep our side open until the last response arrived

        call = self._stub.ModelStreamInfer(requests(), metadata=self._metadata)
        ended = False
        try:
            async for response in call:
                if response.error_message:
                    ended = True  # an error response is the request's last
                    raise client_error(from_triton(response.error_message), guide_field)
                piece = _piece(InferResult(response.infer_response))
                final = response.infer_response.parameters["triton_final_response"].bool_param
                ended = final
                if piece is not None:
                    yield piece
                if final:
                    return
            raise unavailable("tritonserver closed the stream before the final response")
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc) from None
        finally:
            finished.set()  # ends our side of the stream: a finished call closes cleanly
            if not ended:
                call.cancel()  # left early (client gone): Triton cancels the request
