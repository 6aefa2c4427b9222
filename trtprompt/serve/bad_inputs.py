"""The catalogue of bad inputs and what each gets: one source for docs/bad-inputs.md, its test
(tests/test_bad_inputs.py, against the real server) and scripts/chaos.py.

A case builds one request to `ensemble` or `tensorrt_llm` (gRPC streaming) or to Triton's
HTTP generate endpoint, and names the status and a message fragment the answer must carry.
Fragments may hold {max_input_len}, {max_seq_len} and {text_bound} (the engine's numbers).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from trtprompt.engine.request import FLOAT_BOUNDS
from trtprompt.error_codes import ErrorCode, classify
from trtprompt.interface import RETENTION_INPUTS

# gRPC streaming carries no status code in-band: the stream's final response is an error whose
# message starts with its code as a tag (trtprompt/error_codes.py); the answer is that code.
GRPC_INVALID = f"error: {ErrorCode.INVALID_ARGUMENT.value}"
GRPC_TOO_LONG = f"error: {ErrorCode.TOO_LONG.value}"
HTTP_400 = "HTTP 400"
HTTP_500 = "HTTP 500"  # what tritonserver itself answers for a body it cannot parse


@dataclass(frozen=True)
class Limits:
    max_input_len: int
    max_seq_len: int
    text_bound: int  # bytes: max_input_len x the tokenizer's longest token


@dataclass(frozen=True)
class Case:
    endpoint: str  # "ensemble", "tensorrt_llm" or "HTTP generate"
    what: str
    status: str
    message: str
    # gRPC: a function of the limits giving the inputs; HTTP: that, a JSON-able dict or raw bytes
    build: Callable[[Limits], Any] | Mapping[str, Any] | bytes

    def expected(self, limits: Limits) -> str:
        return self.message.format(max_input_len=limits.max_input_len, max_seq_len=limits.max_seq_len,
                                   text_bound=limits.text_bound)


def _i(name: str, value: Any, dtype: Any) -> Any:
    from trtprompt.client import make_input

    return make_input(name, value, dtype)


def _assemble(required: dict[str, Callable[[], Any]], drop: tuple[str, ...], extra: dict[str, Any]) -> list[Any]:
    """The required inputs but those dropped, then each extra (name -> (value, dtype))."""
    out = [make() for name, make in required.items() if name not in drop]
    return out + [_i(name, value, dtype) for name, (value, dtype) in extra.items()]


def _text(prompt: Any = "hi", max_tokens: Any = 4, drop: tuple[str, ...] = (), **extra: Any) -> Callable[[Limits], Any]:
    def build(limits: Limits) -> list[Any]:
        p = prompt(limits) if callable(prompt) else prompt
        return _assemble({"text_input": lambda: _i("text_input", p, None),
                          "max_tokens": lambda: _i("max_tokens", max_tokens, np.int32)}, drop, extra)
    return build


def _tok(ids: Any = (1, 2, 3), length: Any = None, out_len: int = 4, drop: tuple[str, ...] = (),
         **extra: Any) -> Callable[[Limits], Any]:
    def build(limits: Limits) -> list[Any]:
        seq = ids(limits) if callable(ids) else list(ids)
        arr = np.asarray(seq, dtype=np.int32).reshape(1, -1)
        n = len(seq) if length is None else length
        return _assemble({"input_ids": lambda: _i("input_ids", arr, np.int32),
                          "input_lengths": lambda: _i("input_lengths", n, np.int32),
                          "request_output_len": lambda: _i("request_output_len", out_len, np.int32)}, drop, extra)
    return build


F32, I32 = np.float32, np.int32
NAN, INF = math.nan, math.inf
# The engine's float bounds (engine/request.py FLOAT_BOUNDS), under the inputs' names on both models.
INPUT_FIELDS = {"runtime_top_p": "top_p", "len_penalty": "length_penalty"}
FLOAT_RANGES = {name: FLOAT_BOUNDS[INPUT_FIELDS.get(name, name)].describe()
                for name in (*FLOAT_BOUNDS, *INPUT_FIELDS)}


def _float_case(endpoint: str, name: str, value: float) -> Case:
    extra: dict[str, Any] = {name: (value, F32)}
    build = _text(**extra) if endpoint == "ensemble" else _tok(**extra)
    return Case(endpoint, f"`{name}` = {value}", GRPC_INVALID,
                f"input '{name}' must be a finite number in {FLOAT_RANGES[name]}, got {value!r}", build)


def _too_long_ids(limits: Limits) -> list[int]:
    return [5] * (limits.max_input_len + 1)


def _too_long_text(limits: Limits) -> str:
    return "a" * (limits.text_bound + 1)


def _too_many_tokens(limits: Limits) -> str:
    return "ab " * limits.max_input_len  # under the byte bound, over max_input_len tokens


def _ranges(*values: int) -> Any:
    """An INT32 [1, n] retention vector (a batch of one row) and its dtype, as an extra input."""
    return np.asarray([list(values)], dtype=np.int32), I32


# TensorRT-LLM's retention inputs (docs/prefix-pool.md, "Retention"): the four range vectors.
R_STARTS, R_ENDS, R_PRIORITIES, R_DURATIONS = (name for name, *_ in RETENTION_INPUTS[:4])
ONE_RANGE = {R_STARTS: _ranges(0), R_ENDS: _ranges(-1), R_PRIORITIES: _ranges(90)}

E, T, H = "ensemble", "tensorrt_llm", "HTTP generate"
CASES: tuple[Case, ...] = (
    Case(E, "`text_input` empty", GRPC_INVALID, "input 'text_input' is empty", _text("")),
    Case(E, "`text_input` not UTF-8", GRPC_INVALID, "input 'text_input' is not valid UTF-8: byte 0xff at position 3",
         _text(b"ok \xff\xfe")),
    Case(E, "`text_input` missing", GRPC_INVALID, "text_input", _text(drop=("text_input",))),
    Case(E, "`max_tokens` missing", GRPC_INVALID, "max_tokens", _text(drop=("max_tokens",))),
    Case(E, "`max_tokens` = 0", GRPC_INVALID, "max_tokens must be a positive integer, got 0", _text(max_tokens=0)),
    Case(E, "`max_tokens` = -3", GRPC_INVALID, "max_tokens must be a positive integer, got -3", _text(max_tokens=-3)),
    Case(E, "`max_tokens` past max_seq_len - 1", GRPC_INVALID, "exceeds the engine's maximum output length",
         _text(max_tokens=100_000)),
    Case(E, "`max_tokens` sent as FP32", GRPC_INVALID, "expects 'INT32'",
         lambda lim: [_i("text_input", "hi", None), _i("max_tokens", 4.0, F32)]),
    Case(E, "prompt past max_input_len tokens", GRPC_TOO_LONG, "exceeds maximum input length ({max_input_len})",
         _text(_too_many_tokens)),
    Case(E, "text past max_input_len x longest token (bytes)", GRPC_TOO_LONG,
         "bytes, more than the {text_bound} bytes", _text(_too_long_text)),
    *(_float_case(E, n, v) for n, v in (("temperature", NAN), ("temperature", INF), ("temperature", -1.0),
                                        ("top_p", 1.5), ("top_p", NAN), ("repetition_penalty", 0.0),
                                        ("repetition_penalty", NAN), ("presence_penalty", INF),
                                        ("frequency_penalty", -INF), ("length_penalty", NAN))),
    Case(E, "`top_k` = -1", GRPC_INVALID, "input 'top_k': top_k must be >= 0, got -1", _text(top_k=(-1, I32))),
    Case(E, "`min_tokens` = -1", GRPC_INVALID, "input 'min_tokens': min_tokens must be >= 0, got -1",
         _text(min_tokens=(-1, I32))),
    Case(E, "`end_id` outside the vocabulary", GRPC_INVALID, "end_id 999999 is outside the vocabulary",
         _text(end_id=(999_999, I32))),
    Case(E, "`beam_width` past max_beam_width (1, the default)", GRPC_INVALID,
         "input 'beam_width' (2) exceeds max_beam_width (1)", _text(beam_width=(2, I32))),
    Case(E, "`num_return_sequences` = 0", GRPC_INVALID, "input 'num_return_sequences' must be >= 1, got 0",
         _text(num_return_sequences=(0, I32))),
    Case(E, "`num_return_sequences` past the engine's max_batch_size", GRPC_INVALID,
         "exceeds the engine's max_batch_size", _text(num_return_sequences=(100, I32))),
    Case(E, "`embedding_bias_words` and `embedding_bias_weights` of different lengths", GRPC_INVALID,
         "inputs 'embedding_bias_words' (2 words) and 'embedding_bias_weights' (1 weights) must have the same length",
         lambda lim: _text()(lim) + [_i("embedding_bias_words", ["a", "b"], None),
                                     _i("embedding_bias_weights", np.array([[1.0]]), F32)]),
    Case(E, "`embedding_bias_weights` = NaN", GRPC_INVALID,
         "input 'embedding_bias_weights' must hold finite numbers, got nan",
         lambda lim: _text()(lim) + [_i("embedding_bias_words", ["a"], None),
                                     _i("embedding_bias_weights", np.array([[NAN]]), F32)]),
    Case(E, "`lora_task_id` of an adapter never sent, without `lora_weights`", GRPC_INVALID,
         "input 'lora_task_id': LoRA task 987654321 not found in cache. Please send LoRA weights with request",
         _text(lora_task_id=(987654321, np.uint64))),
    Case(E, "`lora_weights` / `lora_config` without `lora_task_id`", GRPC_INVALID,
         "input 'lora_task_id' must be set for LoRA inference",
         _text(lora_weights=(np.zeros((1, 1, 8)), np.float16), lora_config=(np.array([[[1, 0, 1]]]), I32))),
    Case(E, "`lora_config` without `lora_weights`", GRPC_INVALID,
         "input 'lora_weights' is required with 'lora_config'",
         _text(lora_task_id=(987654321, np.uint64), lora_config=(np.array([[[1, 0, 1]]]), I32))),
    Case(E, "`overflow` unknown", GRPC_INVALID, "input 'overflow' must be one of",
         lambda lim: _text()(lim) + [_i("overflow", "chop", None)]),
    Case(E, "`overflow` looser than the server's", GRPC_INVALID, "is looser than the server's policy",
         lambda lim: _text()(lim) + [_i("overflow", "truncate_left", None)]),
    Case(E, "`messages` and `text_input` both", GRPC_INVALID, "give either 'text_input' or 'messages'",
         lambda lim: _text()(lim) + [_i("messages", '[{"role": "user", "content": "a"}]', None)]),
    Case(E, "`messages` not JSON", GRPC_INVALID, "messages",
         lambda lim: _text("")(lim) + [_i("messages", "{not json", None)]),
    Case(E, "an input the model does not declare", GRPC_INVALID, "unexpected inference input 'nonsense'",
         _text(nonsense=(1, I32))),
    Case(E, "`retention_token_range_priorities` = 101", GRPC_INVALID,
         "input 'retention_token_range_priorities' must hold priorities in [0, 100], got 101",
         _text(**(ONE_RANGE | {R_PRIORITIES: _ranges(101)}))),
    Case(E, "`retention_token_range_ends` shorter than the starts", GRPC_INVALID,
         "input 'retention_token_range_ends' must have as many values as 'retention_token_range_starts' (2), got 1",
         _text(**(ONE_RANGE | {R_STARTS: _ranges(0, 64), R_PRIORITIES: _ranges(90, 90)}))),
    Case(E, "`retention_decode_priority` = -1", GRPC_INVALID,
         "input 'retention_decode_priority' must hold priorities in [0, 100], got -1",
         _text(retention_decode_priority=(-1, I32))),
    Case(T, "`input_ids` empty", GRPC_INVALID, "input 'input_ids' is empty: at least one token id is required",
         _tok(ids=(), length=0)),
    Case(T, "`input_ids` past max_input_len", GRPC_TOO_LONG,
         "exceeds maximum input length ({max_input_len}, the engine's max_input_len)", _tok(ids=_too_long_ids)),
    Case(T, "`input_lengths` > number of ids", GRPC_INVALID, "input_lengths (5) must be in [1, 3]", _tok(length=5)),
    Case(T, "`input_lengths` = 0", GRPC_INVALID, "input_lengths (0) must be in [1, 3]", _tok(length=0)),
    Case(T, "`input_lengths` missing", GRPC_INVALID, "input_lengths", _tok(drop=("input_lengths",))),
    Case(T, "`request_output_len` = 0", GRPC_INVALID, "request_output_len must be a positive integer, got 0",
         _tok(out_len=0)),
    Case(T, "token id outside the vocabulary", GRPC_INVALID, "input token id 999999 is outside the vocabulary",
         _tok(ids=(1, 999_999))),
    Case(T, "negative token id", GRPC_INVALID, "input token id -5 is outside the vocabulary", _tok(ids=(1, -5))),
    *(_float_case(T, n, v) for n, v in (("runtime_top_p", NAN), ("temperature", INF), ("len_penalty", NAN),
                                        ("repetition_penalty", -1.0), ("presence_penalty", NAN))),
    Case(T, "`stop_words_list` of shape [3, 2] (Triton's shape check)", GRPC_INVALID,
         "unexpected shape for input 'stop_words_list' for model 'tensorrt_llm'. Expected [-1,2,-1], got [1,3,2]",
         _tok(stop_words_list=(np.zeros((1, 3, 2)), I32))),
    Case(T, "`stop_words_list` offset past its ids", GRPC_INVALID, "input 'stop_words_list' has an offset 9",
         _tok(stop_words_list=(np.array([[[5, 6], [9, -1]]]), I32))),
    Case(T, "`bad_words_list` offset past its ids", GRPC_INVALID, "input 'bad_words_list' has an offset 9",
         _tok(bad_words_list=(np.array([[[5, 6], [9, -1]]]), I32))),
    Case(T, "`embedding_bias` not one per vocabulary entry", GRPC_INVALID,
         "input 'embedding_bias' must hold one bias per vocabulary entry", _tok(embedding_bias=(np.ones((1, 3)), F32))),
    Case(T, "`retention_token_range_ends` not past its start", GRPC_INVALID,
         "input 'retention_token_range_ends' must hold ends > their starts, or -1 for the prompt's end, got [32, 32)",
         _tok(**(ONE_RANGE | {R_STARTS: _ranges(32), R_ENDS: _ranges(32)}))),
    Case(T, "`retention_token_range_durations_ms` = 0", GRPC_INVALID,
         "input 'retention_token_range_durations_ms' must hold durations in ms >= 1, or -1 for none, got 0",
         _tok(**(ONE_RANGE | {R_DURATIONS: _ranges(0)}))),
    Case(T, "`retention_token_range_priorities` without starts", GRPC_INVALID,
         "input 'retention_token_range_priorities' needs 'retention_token_range_starts'",
         _tok(**{R_PRIORITIES: _ranges(90)})),
    Case(T, "retention token ranges that overlap", GRPC_INVALID,
         "input 'retention_token_range_starts': the ranges must not overlap: [0, 64) and [32, None)",
         _tok(**{R_STARTS: _ranges(0, 32), R_ENDS: _ranges(64, -1), R_PRIORITIES: _ranges(90, 50)})),
    Case(H, "body is not JSON (Triton's own parser)", HTTP_500, "failed to parse the request JSON buffer",
         b"{not json"),
    Case(H, "`text_input` missing", HTTP_400, "text_input", {"max_tokens": 4}),
    Case(H, "`max_tokens` missing", HTTP_400, "max_tokens", {"text_input": "hi"}),
    Case(H, "`max_tokens` a string (Triton's own parser)", HTTP_500, "Unable to parse 'data'",
         {"text_input": "hi", "max_tokens": "four"}),
    Case(H, "`max_tokens` = 0", HTTP_400, "max_tokens must be a positive integer, got 0",
         {"text_input": "hi", "max_tokens": 0}),
    Case(H, "`temperature` = -1", HTTP_400, "input 'temperature' must be a finite number in [0, 100], got -1.0",
         {"text_input": "hi", "max_tokens": 4, "temperature": -1}),
    Case(H, "`top_p` = 2", HTTP_400, "input 'top_p' must be a finite number in [0, 1], got 2.0",
         {"text_input": "hi", "max_tokens": 4, "top_p": 2}),
    Case(H, "`text_input` empty", HTTP_400, "input 'text_input' is empty", {"text_input": "", "max_tokens": 4}),
    Case(H, "prompt past max_input_len tokens", HTTP_400, "exceeds maximum input length ({max_input_len})",
         lambda lim: {"text_input": _too_many_tokens(lim), "max_tokens": 4}),
)


def render_table(cases: tuple[Case, ...] = CASES) -> str:
    """The markdown table docs/bad-inputs.md carries (kept equal by tests/test_bad_inputs.py)."""
    rows = ["| # | endpoint | bad input | answer | the message contains |", "| --- | --- | --- | --- | --- |"]
    for n, c in enumerate(cases, 1):
        message = c.message.replace("|", "\\|") or "(Triton's JSON parse error)"
        what = c.what.replace("|", "\\|")
        rows.append(f"| {n} | {c.endpoint} | {what} | {c.status} | `{message}` |")
    return "\n".join(rows)


@dataclass(frozen=True)
class Answer:
    status: str
    message: str


def ask(case: Case, limits: Limits, grpc_url: str, http_base: str, timeout_s: float = 60.0) -> Answer:
    """Send the case's request to a running server; the status and message it got."""
    built: Any = case.build(limits) if callable(case.build) else case.build  # its endpoint's kind of request
    if case.endpoint == H:
        return _ask_http(built, http_base, timeout_s)
    from trtprompt.client import LLMClient

    with LLMClient(grpc_url) as client:
        res = client.infer(case.endpoint, built, timeout_s)
    if res.error is None:
        return Answer("OK", res.text)
    return Answer(f"error: {classify(res.error).value}", res.error)


def _ask_http(body: Any, base: str, timeout_s: float) -> Answer:
    data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(f"{base}/v2/models/ensemble/generate", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Answer(f"HTTP {resp.status}", resp.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        text = exc.read().decode("utf-8", errors="replace")
        try:
            text = json.loads(text).get("error", text)
        except (ValueError, AttributeError):
            pass
        return Answer(f"HTTP {exc.code}", text)


def limits_of(info: Mapping[str, Any], max_token_bytes: int) -> Limits:
    return Limits(int(info["max_input_len"]), int(info["max_seq_len"]),
                  int(info["max_input_len"]) * max_token_bytes)
