"""The OpenAI-compatible front end of `trtprompt serve`, end to end against the real server:
the official `openai` client (sync and async, streaming and not), raw HTTP for the SSE framing
and error shapes, prefix-cache usage, cancellation on disconnect, and `bench` over it."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
import tritonclient.grpc as grpcclient

from serve_fixtures import Oracle, Served, wait_for
from trtprompt.serve.launch.options import EngineInfo

pytestmark = pytest.mark.server


def post(served: Served, path: str, body: Any, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=120)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, raw, {"Content-Type": "application/json"} | (headers or {}))
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def error_of(status: int, raw: bytes, expected_status: int) -> dict[str, Any]:
    assert status == expected_status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def model_name(served: Served) -> str:
    return served.engine_dir.name


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0)


def test_models_lists_the_engine(served: Served) -> None:
    models = client(served).models.list().data
    # the model's own name (trtprompt.json source.model); requests may also name the engine directory
    assert [m.id for m in models] == [json.loads((served.engine_dir / "trtprompt.json").read_text())["source"]["model"]]
    assert models[0].model_extra["max_model_len"] == EngineInfo.read(served.engine_dir).build_config["max_seq_len"]


def test_greedy_completion_equals_generate(served: Served, oracle: Oracle) -> None:
    prompt = "The quick brown fox"
    expected = oracle.text(prompt, 12)
    c = client(served)
    done = c.completions.create(model=model_name(served), prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens == len(oracle.tokenizer.encode(prompt))
    chunks = list(c.completions.create(model=model_name(served), prompt=prompt, max_tokens=12, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_fused_layout_answers_openai_requests_from_the_engine_process_directly(served: Served) -> None:
    """No tritonserver hop (docs/design.md, "Serving path"): Triton's ensemble counts no OpenAI
    request while the engine process counts each; a Triton client still reaches the same engine."""
    def ensemble_requests() -> int:  # Triton's own count of requests the `ensemble` model answered
        with grpcclient.InferenceServerClient(served.url) as triton:
            stats = triton.get_inference_statistics("ensemble", as_json=True)["model_stats"][0]
        return int(stats["inference_stats"]["success"].get("count", 0))

    def engine_finished() -> int:  # the engine process's own count (what /metrics publishes)
        return int(served.engine_stats()["finished"].get("length", 0))

    triton_before, engine_before = ensemble_requests(), engine_finished()
    c = client(served)
    for _ in range(3):
        c.completions.create(model=model_name(served), prompt="count me once", max_tokens=4, temperature=0)
    assert engine_finished() == engine_before + 3
    assert ensemble_requests() == triton_before
    result = served.text("count me once", 4, temperature=0.0)
    assert result.error is None, result.error
    deadline = time.monotonic() + 30  # Triton counts a decoupled request once its stub released it
    while ensemble_requests() < triton_before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ensemble_requests() == triton_before + 1


def test_async_client_chat_streaming_and_not_through_the_chat_template(served: Served) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    # What the ensemble itself answers for the same messages (chat template + chat window in the server).
    direct = served.text("", 10, messages=json.dumps(messages), temperature=0.0, exclude_input_in_output=True)
    assert direct.error is None, direct.error

    async def run() -> tuple[Any, list[Any]]:
        c = openai.AsyncOpenAI(base_url=served.openai_url, api_key="unused", max_retries=0)
        whole = await c.chat.completions.create(model=model_name(served), messages=messages, max_tokens=10,
                                                temperature=0)
        stream = await c.chat.completions.create(model=model_name(served), messages=messages, max_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        await c.close()
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.content == direct.text
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == direct.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 10 == whole.usage.total_tokens


def test_sse_framing(served: Served) -> None:
    body = {"model": model_name(served), "prompt": "framing", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    status, headers, raw = post(served, "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    assert {p["object"] for p in payloads} == {"text_completion"}
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    assert all(p["usage"] is None for p in payloads[:-1])
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]][-1] == "length"


def _cached(served: Served, prompt: str, salt: str | None = None) -> tuple[int, int]:
    extra = {"cache_salt": salt} if salt else {}
    done = client(served).completions.create(model=model_name(served), prompt=prompt, max_tokens=2,
                                             temperature=0, extra_body=extra)
    return done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens


def test_cached_tokens_on_a_repeated_prefix_and_not_across_salts(served: Served) -> None:
    tpb = EngineInfo.read(served.engine_dir).plugin_config["tokens_per_block"]
    prompt = f"{uuid.uuid4().hex} " + "a shared system prompt that is long enough " * 12
    n, first = _cached(served, prompt)
    assert n > 2 * tpb and first == 0
    _, again = _cached(served, prompt)
    assert again > 0 and again % tpb == 0 and again >= tpb * ((n - 1) // tpb) - tpb
    salted = f"{uuid.uuid4().hex} " + "another tenant's prompt of a fair length " * 12
    assert _cached(served, salted, "tenant-a")[1] == 0
    assert _cached(served, salted, "tenant-b")[1] == 0  # same text, other salt: no reuse
    assert _cached(served, salted, "tenant-a")[1] > 0


def test_bad_requests_name_the_field_and_bound(served: Served) -> None:
    name, limit = model_name(served), EngineInfo.read(served.engine_dir).build_config["max_seq_len"]
    err = error_of(*post(served, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": limit})[::2], 400)
    assert err["param"] == "max_tokens" and f"max_tokens must be in [1, {limit - 1}]" in err["message"]
    long_prompt = "lorem ipsum dolor " * (limit // 2)  # over max_input_len in tokens (as test_serve_faults)
    for stream in (False, True):  # refused before any byte is streamed: a plain 400 either way
        status, headers, raw = post(served, "/v1/completions", {"model": name, "prompt": long_prompt,
                                                                "max_tokens": 4, "stream": stream})
        err = error_of(status, raw, 400)
        assert err["param"] == "prompt" and "exceeds maximum input length" in err["message"]
        assert headers["content-type"] == "application/json"
    err = error_of(*post(served, "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}],
                                                          "n": 0})[::2], 400)
    assert err["param"] == "n" and "n must be an integer in [1, 128]" in err["message"]
    err = error_of(*post(served, "/v1/completions", b"{not json")[::2], 400)
    assert err["code"] == "invalid_json"
    err = error_of(*post(served, "/v1/completions", {"model": "gpt-4o", "prompt": "x"})[::2], 404)
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="logprobs must be an integer in"):
        client(served).completions.create(model=name, prompt="x", logprobs=21)


def _kv_used(served: Served) -> float | None:
    return served.metric("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_and_frees_blocks(served: Served, stream: bool) -> None:
    wait_for(lambda: _kv_used(served) == 0, "an idle engine to start with")
    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=120)
    body = {"model": model_name(served), "prompt": "go on and on " * 20, "max_tokens": 1800, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: {")  # generating now
    wait_for(lambda: (_kv_used(served) or 0) > 0, "blocks in use while generating")
    conn.close()
    wait_for(lambda: _kv_used(served) == 0 and served.metric("nv_trt_llm_request_metrics", request_type="active")
              == 0, "the engine request aborted and its blocks freed after the client went away")
    served.assert_healthy()
    # A disconnect is an outcome, not a server error (the waiting request unwinds before we answer 499).
    assert "Traceback" not in (served.run_dir / "openai.log").read_text(encoding="utf-8", errors="replace")


def test_bench_drives_the_openai_endpoint(served: Served, tmp_path: Path) -> None:
    from trtprompt.bench.runner import LoadSpec, run_load
    from trtprompt.bench.workloads import WorkloadSpec, make_workload
    from trtprompt.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(EngineInfo.read(served.engine_dir).tokenizer_dir)
    workload = make_workload(WorkloadSpec("random", num_requests=6, input_len=24, output_len=6), tokenizer)
    result = run_load(served.openai_url, workload, LoadSpec(concurrency=2, warmup=1), progress=False, api="openai")
    assert [r.error for r in result.records] == [None] * 5
    assert all(r.ok and r.num_output_tokens == 6 and r.num_input_tokens == r.prompt_len for r in result.records)
