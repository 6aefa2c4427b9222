"""The GPU target's upstream layout (preprocessing -> tensorrt_llm -> postprocessing
behind a Triton ensemble), exercised on CPU over the torch `tensorrt_llm` model."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Iterator

import pytest

from serve_fixtures import Oracle, Served, _alive, check_stopped_cleanly, start_server
from trtprompt.serve.launch.process_group import descendants

from test_triton_logits import BOTH, PROMPT, _check, _ok, checkpoint  # noqa: F401 - checkpoint is a fixture

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def upstream(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = start_server(tiny_engine_dir, tmp_path_factory.mktemp("upstream") / "run",
                          "--layout", "upstream", "--no-restart", "--engine-threads", "1")
    yield server
    if server.proc.poll() is None:  # the last test stops it by killing the engine
        check_stopped_cleanly(server)


# The upstream layout's server of this module carries the torch core's logits (tests/test_triton_logits.py's checks).
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_upstream_ensemble_returns_the_torch_cores_logits(upstream: Served, oracle: Oracle, checkpoint: Path,
                                                          stream: bool) -> None:
    gen = oracle.run(PROMPT, 8)
    result = _ok(upstream.text(PROMPT, 8, stream=stream, temperature=0.0, **BOTH))
    assert result.text
    _check(result.responses, checkpoint, gen.prompt_ids, gen.output_ids)


def test_streams_whole_characters_per_request_id(upstream: Served, oracle: Oracle) -> None:
    for prompt in ("Grüße aus Köln, 世界! 🚀", "The quick brown fox"):
        gen = oracle.run(prompt, 24)
        result = upstream.text(prompt, 24, temperature=0.0, speculative_decoding=False)  # one token per response
        assert result.error is None, result.error
        # The postprocessing keeps one detokenizer per request id (the client
        # sends one), so the chunks concatenate to the decoded output, except
        # that it cannot see a stream's end to flush a dangling partial
        # character (Triton shows it only tensorrt_llm's tensors).
        full = oracle.tokenizer.decode(gen.output_ids)
        assert full.startswith(result.text)
        assert set(full[len(result.text):]) <= {"\ufffd"}
        assert "\ufffd" not in "".join(p[-1:] for p in result.pieces if p)
        assert len(result.responses) >= 20


def test_engine_process_runs_the_threads_it_was_given(upstream: Served) -> None:
    assert upstream.engine_info()["torch_threads"] == 1  # --engine-threads 1 (leaves a core to Triton)


def test_non_streaming_and_perf_metrics_through_the_ensemble(upstream: Served, oracle: Oracle) -> None:
    prompt = "shared prefix for the upstream layout " * 4
    gen = oracle.run(prompt, 12)
    first = upstream.text(prompt, 12, stream=False, exclude_input_in_output=True, return_perf_metrics=True)
    assert first.error is None, first.error
    assert len(first.responses) == 1
    assert first.text == oracle.tokenizer.decode(gen.output_ids)
    again = upstream.text(prompt, 12, stream=False, exclude_input_in_output=True, return_perf_metrics=True)
    assert again.last("kv_cache_reused_blocks") > 0
    assert again.last("kv_cache_alloc_total_blocks") == first.last("kv_cache_alloc_total_blocks")


def test_infer_json_sends_only_inputs_the_layout_declares(upstream: Served, oracle: Oracle) -> None:
    import json

    from click.testing import CliRunner

    from trtprompt.cli import main

    prompt = "The quick brown fox"
    out = CliRunner().invoke(main, ["infer", prompt, "--url", upstream.url, "--max-tokens", "8", "--json",
                                    "--no-stream"])  # in this process (tests/test_serve_e2e.py runs the process)
    assert out.exit_code == 0, out.output
    record = json.loads(out.stdout)
    assert record["text"] == oracle.tokenizer.decode(oracle.run(prompt, 8).output_ids)
    assert record["kv_cache_alloc_total_blocks"] >= 1
    assert record["num_input_tokens"] == len(oracle.tokenizer.encode(prompt))
    assert record["num_output_tokens"] == len(oracle.run(prompt, 8).output_ids)


def test_openai_chat_and_usage_through_the_upstream_ensemble(upstream: Served, oracle: Oracle) -> None:
    """The OpenAI front end sends messages, a salt and the count requests; the upstream ensemble takes them."""
    import openai

    client = openai.OpenAI(base_url=upstream.openai_url, api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Hello there"}]
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0.0,
                                           extra_body={"cache_salt": "tenant-a"})
    prompt_ids = oracle.tokenizer.encode_chat(messages)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
    done = reply.choices[0].finish_reason
    assert reply.usage.completion_tokens == 6 if done == "length" else 1 <= reply.usage.completion_tokens < 6


def test_guided_decoding_through_preprocessing(upstream: Served) -> None:
    """guided_decoding_guide_type / guided_decoding_guide travel ensemble -> preprocessing (checked) -> the torch
    core, on gRPC and HTTP generate (tests/test_triton_guided_served.py's checks)."""
    from test_triton_guided_served import check_ensemble, check_http_generate

    check_ensemble(upstream, stream=False)
    check_http_generate(upstream)


def test_errors_reach_the_client_and_the_server_keeps_serving(upstream: Served) -> None:
    assert "input 'text_input' is empty" in (upstream.text("", 4).error or "")
    assert "input 'beam_width' (2) exceeds max_beam_width (1)" in (upstream.text("hi", 4, beam_width=2).error or "")
    upstream.assert_healthy()


def test_no_restart_stops_the_server_when_the_engine_dies(upstream: Served) -> None:
    children = descendants(upstream.proc.pid)
    os.kill(upstream.engine_info()["pid"], signal.SIGKILL)
    assert upstream.proc.wait(60) == 1
    assert "--no-restart: stopping the server" in upstream.log_path.read_text()
    assert [pid for pid in children if _alive(pid)] == []
