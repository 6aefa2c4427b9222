"""`trtprompt serve` end to end: a real tritonserver, real gRPC clients (tritonclient).

One server for the session (tests/serve_fixtures.py); the oracle is
`trtprompt generate`'s greedy output from the same engine directory.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from click.testing import CliRunner

from serve_fixtures import ROOT, Oracle, Served
from trtprompt.cli import main
from trtprompt.client import LLMClient, make_input, text_inputs, token_inputs

pytestmark = pytest.mark.server

PROMPTS = ["The quick brown fox", "Grüße aus Köln, 世界! 🚀", "def f(x):\n    return", "a"]


def test_streamed_text_equals_generate_greedy_text(served: Served, oracle: Oracle) -> None:
    for prompt in PROMPTS:
        result = served.text(prompt, 24, temperature=0.0)
        assert result.error is None, result.error
        assert result.finished
        assert result.text == oracle.text(prompt, 24)
        # Responses as text is produced, not one at the end (a step with accepted drafts streams several tokens).
        assert len(result.responses) > 1


def test_non_streaming_returns_one_response(served: Served, oracle: Oracle) -> None:
    prompt = PROMPTS[1]
    gen = oracle.run(prompt, 16)
    only_output = served.text(prompt, 16, stream=False, exclude_input_in_output=True)
    assert only_output.error is None, only_output.error
    assert len(only_output.responses) == 1
    assert only_output.text == gen.text
    with_input = served.text(prompt, 16, stream=False, exclude_input_in_output=False)
    tok = oracle.tokenizer
    assert with_input.text == tok.decode(gen.prompt_ids + gen.output_ids)
    assert with_input.text.startswith(prompt)


def test_token_model_called_directly(served: Served, oracle: Oracle) -> None:
    gen = oracle.run(PROMPTS[0], 12)
    # One response per step; without drafts a step yields one token (with them, several: docs/speculative-decoding.md).
    streamed = served.tokens(gen.prompt_ids, 12, speculative_decoding=False)
    assert streamed.error is None, streamed.error
    assert streamed.output_ids == gen.output_ids
    assert len(streamed.responses) == 12
    whole = served.tokens(gen.prompt_ids, 12, streaming=False)
    assert len(whole.responses) == 1
    assert whole.output_ids == gen.prompt_ids + gen.output_ids
    assert whole.last("sequence_length") == len(gen.prompt_ids) + 12
    excluded = served.tokens(gen.prompt_ids, 12, streaming=False, exclude_input_in_output=True)
    assert excluded.output_ids == gen.output_ids


def test_perf_metrics_come_from_the_engine(served: Served, oracle: Oracle) -> None:
    prompt = "perf " * 40
    n_prompt = len(oracle.tokenizer.encode(prompt))
    result = served.text(prompt, 10, temperature=0.0, return_perf_metrics=True,
                         return_num_input_tokens=True, return_num_output_tokens=True)
    assert result.error is None, result.error
    assert result.last("num_input_tokens") == n_prompt
    gen = oracle.run(prompt, 10)
    assert result.last("num_output_tokens") == len(gen.output_ids)
    arrival, scheduled = result.last("arrival_time_ns"), result.last("first_scheduled_time_ns")
    first, last = result.last("first_token_time_ns"), result.last("last_token_time_ns")
    assert 0 < arrival <= scheduled <= first <= last
    assert abs(arrival / 1e9 - time.time()) < 60
    total = result.last("kv_cache_alloc_total_blocks")
    tpb = served.engine_stats()["tokens_per_block"]
    assert total == gen.final.stats.kv_cache_alloc_total_blocks
    assert total == math.ceil((n_prompt + 9) / tpb)  # the last sampled token is never cached
    assert result.last("kv_cache_alloc_new_blocks") + result.last("kv_cache_reused_blocks") == total


def test_perf_outputs_on_the_final_response_only_when_asked(served: Served) -> None:
    """TensorRT-LLM attaches perf outputs to every response; perf_metrics_final_only keeps the
    per-token responses light (the OpenAI front end asks for it: it needs them once, for usage)."""
    prompt = "perf on the final response " * 6
    # Without drafts both runs take one response per token (drafts from the first could shorten the second's).
    every = served.text(prompt, 6, temperature=0.0, min_tokens=6, return_perf_metrics=True, speculative_decoding=False)
    final_only = served.text(prompt, 6, temperature=0.0, min_tokens=6, return_perf_metrics=True,
                             perf_metrics_final_only=True, speculative_decoding=False)
    assert every.error is None and final_only.error is None
    assert len(every.responses) > 2 and len(final_only.responses) == len(every.responses)
    assert all("first_token_time_ns" in r for r in every.responses)
    assert ["first_token_time_ns" in r for r in final_only.responses] == [False] * (len(every.responses) - 1) + [True]
    assert final_only.text == every.text
    assert final_only.last("kv_cache_alloc_total_blocks") == every.last("kv_cache_alloc_total_blocks")
    assert 0 < final_only.last("first_token_time_ns") <= final_only.last("last_token_time_ns")


def test_only_the_outputs_a_client_names_come_back(served: Served, oracle: Oracle) -> None:
    """A client that names its outputs gets those and no others (the serving models build only
    those: most of a streamed response's cost); naming none returns every declared output."""
    prompt = "name the outputs you read " * 4
    gen = oracle.run(prompt, 8)
    # Without drafts: one response per token, the same count for both runs (the first's answer would draft
    # for the second).
    reporting = dict(temperature=0.0, return_perf_metrics=True, return_num_output_tokens=True,
                     speculative_decoding=False)
    every = served.text(prompt, 8, **reporting)
    named = served.text(prompt, 8, outputs=["text_output", "num_output_tokens", "first_token_time_ns"],
                        **reporting)
    assert every.error is None and named.error is None, (every.error, named.error)
    assert {"text_output", "batch_index", "sequence_index", "num_output_tokens",
            "kv_cache_alloc_total_blocks"} <= set(every.responses[-1])
    assert len(named.responses) == len(every.responses) > 1
    assert [set(r) for r in named.responses] == [{"text_output", "num_output_tokens", "first_token_time_ns"}] * \
        len(every.responses)
    assert named.text == every.text == oracle.tokenizer.decode(gen.output_ids)
    assert named.last("num_output_tokens") == len(gen.output_ids) and named.last("first_token_time_ns") > 0
    ids = served.tokens(gen.prompt_ids, 8, outputs=["output_ids"], speculative_decoding=False)
    assert ids.error is None, ids.error
    assert [set(r) for r in ids.responses] == [{"output_ids"}] * len(gen.output_ids)
    assert ids.output_ids == gen.output_ids


def test_shared_prefix_reuses_blocks(served: Served) -> None:
    prefix = "You are a terse assistant. Answer in one line. " * 8
    first = served.text(prefix + "Question one?", 4, return_perf_metrics=True)
    second = served.text(prefix + "Another question?", 4, return_perf_metrics=True)
    assert first.error is None and second.error is None
    assert second.last("kv_cache_reused_blocks") > 0
    deadline = time.monotonic() + 60
    while (served.metric("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused") or 0) <= 0:
        assert time.monotonic() < deadline, "reused-blocks metric never moved"
        time.sleep(0.1)
    assert served.metric("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="cache_hit_rate") > 0


def test_sixteen_concurrent_streams(served: Served, oracle: Oracle) -> None:
    prompts = [f"Stream number {i}: tell me" for i in range(16)]
    expected = {p: oracle.text(p, 20) for p in prompts}
    results: dict[str, object] = {}

    def run(p: str) -> None:
        results[p] = served.text(p, 20, temperature=0.0)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for p in prompts:
        r = results[p]
        assert r.error is None, r.error  # type: ignore[attr-defined]
        assert r.text == expected[p]  # type: ignore[attr-defined]


def test_genai_perf_style_request(served: Served) -> None:
    """text_input, max_tokens, stream, exclude_input_in_output, min_length, empty final response."""
    inputs = [make_input("text_input", "genai-perf says hi"), make_input("max_tokens", 8, np.int32),
              make_input("stream", True, np.bool_), make_input("exclude_input_in_output", True, np.bool_),
              make_input("min_length", 8, np.int32)]
    with LLMClient(served.url) as client:
        result = client.infer("ensemble", inputs)
    assert result.error is None, result.error
    assert result.finished and result.text
    num = served.text("genai-perf says hi", 8, min_length=8, return_num_output_tokens=True)
    assert num.last("num_output_tokens") == 8


def test_end_to_end_client_style_request(served: Served, oracle: Oracle) -> None:
    """tensorrtllm_backend's end_to_end_grpc_client: beam_width, temperature, end_id, pad_id."""
    tok = oracle.tokenizer
    inputs = [make_input("text_input", PROMPTS[0]), make_input("max_tokens", 16, np.int32),
              make_input("stream", False, np.bool_), make_input("beam_width", 1, np.int32),
              make_input("temperature", 1.0, np.float32), make_input("end_id", tok.eos_token_id, np.int32),
              make_input("pad_id", tok.pad_token_id, np.int32), make_input("exclude_input_in_output", True, np.bool_)]
    with LLMClient(served.url) as client:
        result = client.infer("ensemble", inputs)
    assert result.error is None, result.error
    assert result.text == oracle.text(PROMPTS[0], 16)


def test_model_config_metadata_and_statistics(served: Served) -> None:
    client = grpcclient.InferenceServerClient(served.url)
    config = client.get_model_config("ensemble", as_json=True)["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"] for i in config["input"]} >= {"text_input", "max_tokens", "stream", "min_length"}
    meta = client.get_model_metadata("tensorrt_llm", as_json=True)
    assert {o["name"] for o in meta["outputs"]} >= {"output_ids", "sequence_length"}

    def count(model: str) -> int:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
        return int(stats["inference_stats"]["success"].get("count", 0))

    before = count("ensemble"), count("tensorrt_llm")
    served.text("count me", 2)
    served.tokens([1, 2, 3], 2)
    assert count("ensemble") == before[0] + 1
    assert count("tensorrt_llm") == before[1] + 1
    client.close()


def test_metrics_named_like_the_tensorrt_llm_backend(served: Served) -> None:
    served.text("metrics please", 4)
    deadline = time.monotonic() + 60  # the metrics model publishes on its next stats poll
    while not served.metric("trtprompt_time_to_first_token_seconds_count"):
        assert time.monotonic() < deadline, "the request never reached /metrics"
        time.sleep(0.05)
    for kind in ("max", "free", "used", "tokens_per", "reused", "fraction"):
        assert served.metric("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type=kind) is not None, kind
    assert served.metric("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per") == 32
    for kind in ("active", "max", "scheduled", "context", "waiting"):
        assert served.metric("nv_trt_llm_request_metrics", request_type=kind) is not None, kind
    assert served.metric("nv_trt_llm_request_metrics", request_type="max") == 16
    for kind in ("total_context_tokens", "generation_requests", "paused_requests"):
        assert served.metric("nv_trt_llm_inflight_batcher_metrics", inflight_batcher_specific_metric=kind) is not None
    assert served.metric("nv_trt_llm_general_metrics", general_type="iteration_counter") > 0
    assert served.metric("trtprompt_time_to_first_token_seconds_count") > 0
    assert served.metric("trtprompt_prefill_time_seconds_count") > 0
    assert served.metric("trtprompt_prefill_time_seconds_bucket", le="+Inf") is not None


def test_infer_command_streams_and_prints_json(served: Served, oracle: Oracle) -> None:
    args = ["infer", PROMPTS[0], "--url", served.url, "--max-tokens", "12", "--temperature", "0"]
    # As a user runs it: its own process, which prints as it streams and exits.
    out = subprocess.run([sys.executable, "-m", "trtprompt.cli", *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == oracle.text(PROMPTS[0], 12) + "\n"
    # Its options and refusals, in this process.
    whole = CliRunner().invoke(main, [*args, "--json", "--no-stream"])
    assert whole.exit_code == 0, whole.output
    record = json.loads(whole.stdout)
    assert record["text"] == oracle.text(PROMPTS[0], 12)
    assert record["num_output_tokens"] == 12
    assert record["kv_cache_alloc_total_blocks"] >= 1 and record["first_token_time_ns"] > 0
    bad = CliRunner().invoke(main, ["infer", "x", "--url", served.url, "--max-tokens", "0"])
    assert bad.exit_code == 1 and "max_tokens must be a positive integer" in bad.stderr


def test_batch_of_two_rows_in_one_request(served: Served, oracle: Oracle) -> None:
    prompts = [PROMPTS[0], PROMPTS[2]]
    text = grpcclient.InferInput("text_input", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([[p.encode()] for p in prompts], dtype=object))
    max_tokens = grpcclient.InferInput("max_tokens", [2, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[8], [8]], dtype=np.int32))
    with LLMClient(served.url) as client:
        result = client.infer("ensemble", [text, max_tokens, make_input("stream", [[False], [False]], np.bool_),
                                           make_input("exclude_input_in_output", [[True], [True]], np.bool_)])
    assert result.error is None, result.error
    by_row = {int(r["batch_index"].reshape(-1)[0]): r["text_output"].reshape(-1)[0].decode() for r in result.responses}
    assert by_row == {0: oracle.text(prompts[0], 8), 1: oracle.text(prompts[1], 8)}


def test_text_inputs_helper_types() -> None:
    inputs = text_inputs("x", 4, True, temperature=0.5, seed=3, beam_width=1)
    types = {i.name(): i.datatype() for i in inputs}
    assert types == {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL",
                     "temperature": "FP32", "seed": "UINT64", "beam_width": "INT32"}


def test_http_generate_endpoints(served: Served, oracle: Oracle) -> None:
    """Triton's generate extension, as TensorRT-LLM's docs query the ensemble with curl."""
    def post(path: str, body: dict) -> str:
        req = urllib.request.Request(f"http://127.0.0.1:{served.http}/v2/models/ensemble/{path}",
                                     data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.read().decode("utf-8")

    expected = oracle.text(PROMPTS[1], 10)
    body = {"text_input": PROMPTS[1], "max_tokens": 10, "exclude_input_in_output": True}
    assert json.loads(post("generate", body))["text_output"] == expected
    events = [json.loads(line[len("data: "):]) for line in post("generate_stream", {**body, "stream": True}).splitlines()
              if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected


def test_token_model_stop_words_and_end_id(served: Served, oracle: Oracle) -> None:
    gen = oracle.run(PROMPTS[2], 16)
    ids = gen.output_ids
    cut = next(i for i in range(2, 12) if ids[i] not in ids[:i] and tuple(ids[i:i + 2]) not in
               {tuple(ids[j:j + 2]) for j in range(i)})
    stop = np.array([[ids[cut], ids[cut + 1]], [2, -1]], dtype=np.int32)[None]
    with LLMClient(served.url) as client:
        stopped = client.infer("tensorrt_llm", token_inputs(gen.prompt_ids, 16, True)
                               + [make_input("stop_words_list", stop)])
    assert stopped.error is None, stopped.error
    assert stopped.output_ids == ids[:cut]  # the stop word is trimmed, as TensorRT-LLM does
    ended = served.tokens(gen.prompt_ids, 16, end_id=ids[cut])
    assert ended.output_ids == ids[:cut]  # the end token itself is not output
