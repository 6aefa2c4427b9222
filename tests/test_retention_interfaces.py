"""Retention priorities reach the engine from the interfaces (issue 24, item 6): TensorRT-LLM's six
retention inputs on the Triton models, the OpenAI endpoint's cache_control marks and `retention`
field, the submit frame between them, and one server proving a pinned prefix survives a flood
that evicts the same prompts sent without retention (docs/prefix-pool.md, "Retention")."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import openai
import pytest
from serve_fixtures import Served, Stops, start_server

from trtprompt.engine.request import RetentionConfig, SamplingParams, TokenRangeRetention
from trtprompt.error_codes import BadRequestError
from trtprompt.interface import RETENTION_INPUTS
from trtprompt.serve.launch.options import EngineInfo, resolve_options
from trtprompt.serve.launch.repository import RepoContext, model_configs
from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.params import ModelLimits, parse_request
from trtprompt.serve.openai.retention import CACHE_CONTROL_PRIORITY, CacheMark, mark_ranges
from trtprompt.serve.triton_models import inputs
from trtprompt.serve.wire.requests import TokenRequest, retention_from_wire
from trtprompt.serve.wire.retention_inputs import retention_arrays
from trtprompt.tokenizer import Tokenizer

NAMES = [name for name, *_ in RETENTION_INPUTS]
STARTS, ENDS, PRIORITIES, DURATIONS, DECODE, DECODE_MS = NAMES
LIMITS = ModelLimits("m", 2048, 768)
FULL = RetentionConfig((TokenRangeRetention(0, 64, 100, None), TokenRangeRetention(64, None, 60, 30_000)),
                       decode_priority=10, decode_duration_ms=5_000)


# ---------------------------------------------------------------- the six Triton inputs


def _batch(**rows: list[list[int]]) -> dict[str, Any]:
    return {name: np.asarray(value, dtype=np.int32) for name, value in rows.items()}


def test_the_triton_inputs_read_back_what_a_client_sends() -> None:
    assert inputs.retention(retention_arrays(FULL), 0) == FULL
    assert inputs.retention({}, 0) is None
    # Without durations every range lasts until evicted; decode settings alone are a config too.
    plain = inputs.retention(_batch(**{STARTS: [[0]], ENDS: [[-1]], PRIORITIES: [[80]]}), 0)
    assert plain == RetentionConfig((TokenRangeRetention(0, None, 80),))
    assert inputs.retention(_batch(**{DECODE: [[0]]}), 0) == RetentionConfig(decode_priority=0)


def test_each_batch_row_gets_its_own_ranges() -> None:
    batch = _batch(**{STARTS: [[0], [32]], ENDS: [[32], [-1]], PRIORITIES: [[90], [20]]})
    assert [inputs.retention(batch, i).token_ranges for i in (0, 1)] == [  # type: ignore[union-attr]
        (TokenRangeRetention(0, 32, 90),), (TokenRangeRetention(32, None, 20),)]


@pytest.mark.parametrize("rows, named, words", [
    ({STARTS: [[0, 32]], ENDS: [[32]], PRIORITIES: [[90, 90]]}, ENDS, "as many values as"),
    ({STARTS: [[0]], ENDS: [[-1]], PRIORITIES: [[90]], DURATIONS: [[5, 6]]}, DURATIONS, "as many values as"),
    ({STARTS: [[0]], PRIORITIES: [[90]]}, ENDS, "is required with"),
    ({ENDS: [[8]]}, ENDS, "needs 'retention_token_range_starts'"),
    ({STARTS: [[0]], ENDS: [[-1]], PRIORITIES: [[101]]}, PRIORITIES, "[0, 100], got 101"),
    ({STARTS: [[0]], ENDS: [[-1]], PRIORITIES: [[-1]]}, PRIORITIES, "got -1"),
    ({STARTS: [[-2]], ENDS: [[-1]], PRIORITIES: [[9]]}, STARTS, ">= 0, got -2"),
    ({STARTS: [[16]], ENDS: [[8]], PRIORITIES: [[9]]}, ENDS, "got [16, 8)"),
    ({STARTS: [[0]], ENDS: [[-1]], PRIORITIES: [[9]], DURATIONS: [[0]]}, DURATIONS, ">= 1, or -1 for none, got 0"),
    ({STARTS: [[0, 8]], ENDS: [[-1, 16]], PRIORITIES: [[9, 9]]}, STARTS, "must not overlap"),
    ({DECODE: [[101]]}, DECODE, "got 101"),
    ({DECODE_MS: [[-7]]}, DECODE_MS, "got -7"),
])
def test_a_bad_retention_input_is_refused_naming_it(rows: dict[str, Any], named: str, words: str) -> None:
    with pytest.raises(BadRequestError) as err:
        inputs.retention(_batch(**rows), 0)
    assert f"input '{named}'" in str(err.value) and words in str(err.value)


def test_both_models_read_the_retention_inputs() -> None:
    arrays = retention_arrays(FULL)
    text = inputs.parse_text_item({"text_input": np.array([[b"hi"]], dtype=object),
                                   "max_tokens": np.array([[4]], dtype=np.int32), **arrays}, 0, True)
    token = inputs.parse_token_item({"input_ids": np.array([[1, 2, 3]], dtype=np.int32),
                                     "input_lengths": np.array([[3]], dtype=np.int32),
                                     "request_output_len": np.array([[4]], dtype=np.int32), **arrays}, 0, True)
    assert text.retention == token.retention == FULL


def test_the_submit_frame_carries_retention_and_the_engine_process_checks_it_again() -> None:
    req = TokenRequest((1, 2, 3), SamplingParams(max_tokens=2), False, retention=FULL)
    frame = req.to_wire("r")
    assert retention_from_wire(frame["retention"]) == FULL
    assert "retention" not in TokenRequest((1,), SamplingParams(), False).to_wire("r")
    assert retention_from_wire(None) is None
    for bad in ({"token_ranges": [[0, None, 500, None]]}, {"token_ranges": [[0, None, 9]]}, {"pin": 1},
                {"token_ranges": [[0, None, 9, None]], "decode_priority": "high"}):
        with pytest.raises(BadRequestError):
            retention_from_wire(bad)


def test_both_layouts_declare_the_inputs_and_the_upstream_ensemble_hands_them_to_the_core(
        tiny_engine_dir: Path) -> None:
    engine = EngineInfo.read(tiny_engine_dir)
    for layout in ("fused", "upstream"):
        configs = {cfg.name: cfg for cfg, _ in model_configs(RepoContext(engine, resolve_options(
            engine, {"layout": layout}), "/tmp/x.sock"))}
        for model in ("ensemble", "tensorrt_llm"):
            declared = {t.name: t for t in configs[model].input}
            assert all(declared[n].optional and declared[n].data_type == 8 for n in NAMES), (layout, model)  # INT32
        if layout == "upstream":
            core = configs["ensemble"].ensemble_scheduling.step[1]
            assert {n: core.input_map[n] for n in NAMES} == {n: n for n in NAMES}


# ---------------------------------------------------------------- the OpenAI endpoint


def _chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def _part(text: str, **cache: Any) -> dict[str, Any]:
    return {"type": "text", "text": text, **({"cache_control": cache} if cache else {})}


def test_cache_control_marks_are_read_from_content_parts() -> None:
    gen = parse_request("chat", _chat({"role": "system", "content": [_part("A"), _part("B", type="ephemeral")]},
                                      {"role": "user", "content": [_part("C", type="ephemeral", ttl="1h")]}), LIMITS)
    assert gen.cache_marks == (CacheMark(0, "AB", 300_000), CacheMark(1, "C", 3_600_000))
    assert gen.retention is None


@pytest.mark.parametrize("cache, param, words", [
    ({"type": "ephemeral", "ttl": "10m"}, "messages[0].content[0].cache_control.ttl", "must be one of 5m, 1h"),
    ({"type": "persistent"}, "messages[0].content[0].cache_control.type", 'must be "ephemeral"'),
    ({"type": "ephemeral", "scope": "global"}, "messages[0].content[0].cache_control", "must be an object"),
])
def test_a_bad_cache_control_is_refused_naming_the_field(cache: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as err:
        parse_request("chat", _chat({"role": "system", "content": [_part("A", **cache)]}), LIMITS)
    assert (err.value.status, err.value.param) == (400, param) and words in err.value.message


def test_the_retention_field_in_both_its_forms() -> None:
    whole = parse_request("completion", {"model": "m", "prompt": "x", "retention": {"priority": 100}}, LIMITS)
    assert whole.retention == RetentionConfig((TokenRangeRetention(0, None, 100),))
    ranges = {"token_ranges": [{"start": 0, "end": 64, "priority": 100},
                               {"start": 64, "end": None, "priority": 60, "duration_ms": 30_000}],
              "decode_priority": 10, "decode_duration_ms": 5_000}
    assert parse_request("completion", {"model": "m", "prompt": "x", "retention": ranges}, LIMITS).retention == FULL


@pytest.mark.parametrize("retention, param", [
    ({"priority": 101}, "retention.priority"),
    ({"priority": 50, "duration_ms": 0}, "retention.duration_ms"),
    ({"duration_ms": 10}, "retention.priority"),
    ({"priority": 50, "token_ranges": []}, "retention.token_ranges"),
    ({"token_ranges": [{"start": 5, "end": 5, "priority": 1}]}, "retention.token_ranges.end"),
    ({"token_ranges": [{"start": 0, "priority": 1}, {"start": 3, "priority": 2}]}, "retention.token_ranges"),
    ({"token_ranges": [{"end": 3, "priority": 1}]}, "retention.token_ranges"),
    ({"decode_priority": True}, "retention.decode_priority"),
    ({"pin": True}, "retention"),
    ("high", "retention"),
])
def test_a_bad_retention_field_is_refused_naming_it(retention: Any, param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_request("completion", {"model": "m", "prompt": "x", "retention": retention}, LIMITS)
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_marks_and_prompt_ranges_together_are_refused_but_decode_settings_join_marks() -> None:
    marked = {"role": "system", "content": [_part("A", type="ephemeral")]}
    with pytest.raises(APIError, match="give one"):
        parse_request("chat", _chat(marked, retention={"priority": 100}), LIMITS)
    gen = parse_request("chat", _chat(marked, retention={"decode_priority": 5}), LIMITS)
    assert gen.retention == RetentionConfig(decode_priority=5) and len(gen.cache_marks) == 1


def test_through_triton_retention_becomes_the_six_inputs_and_cache_control_is_refused() -> None:
    from types import SimpleNamespace

    from trtprompt.serve.openai.to_triton import TritonEnsemble

    ensemble, declared = SimpleNamespace(model="ensemble"), frozenset(NAMES)
    gen = parse_request("completion", {"model": "m", "prompt": "x", "retention": {"priority": 100}}, LIMITS)
    sent = TritonEnsemble._retention(ensemble, gen, declared)  # type: ignore[arg-type]
    assert inputs.retention(sent, 0) == gen.retention
    with pytest.raises(APIError) as err:
        TritonEnsemble._retention(ensemble, gen, frozenset())  # type: ignore[arg-type]
    assert err.value.param == "retention"
    marked = parse_request("chat", _chat({"role": "user", "content": [_part("A", type="ephemeral")]}), LIMITS)
    with pytest.raises(APIError) as err:
        TritonEnsemble._retention(ensemble, marked, declared)  # type: ignore[arg-type]
    assert err.value.param == "cache_control" and "engine path" in err.value.message


def _chars(messages: list[dict[str, str]]) -> int:
    """A stand-in renderer for the range arithmetic: one token per character, 1 per message header."""
    return sum(1 + len(m["content"]) for m in messages)


def test_marks_become_ranges_over_the_fitted_prompt() -> None:
    chat = [{"role": "system", "content": "S" * 10}, {"role": "user", "content": "U" * 5},
            {"role": "assistant", "content": "A" * 3}, {"role": "user", "content": "V" * 4}]
    marks = (CacheMark(0, "S" * 10, 300_000), CacheMark(3, "VV", 3_600_000))
    assert mark_ranges(marks, chat, 0, _chars) == (
        TokenRangeRetention(0, 11, CACHE_CONTROL_PRIORITY, 300_000),
        TokenRangeRetention(11, 11 + 6 + 4 + 3, CACHE_CONTROL_PRIORITY, 3_600_000))
    # The window dropped the first turn (user + assistant): the later mark's prefix shrinks by it, and a
    # mark inside the dropped turn is gone with its text.
    assert mark_ranges(marks + (CacheMark(1, "U", 300_000),), chat, 1, _chars) == (
        TokenRangeRetention(0, 11, CACHE_CONTROL_PRIORITY, 300_000),
        TokenRangeRetention(11, 14, CACHE_CONTROL_PRIORITY, 3_600_000))


# ---------------------------------------------------------------- one server: a pinned prefix survives a flood


@pytest.fixture(scope="module")
def small_pool(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               stops: Stops) -> Iterator[Served]:
    """The fused layout over a pool of 64 blocks (2048 tokens, one max_seq_len sequence)."""
    server = start_server(tiny_engine_dir, tmp_path_factory.mktemp("retention") / "run",
                          "--max-tokens-in-paged-kv-cache", "2048")
    yield server
    stops.server(server)


SYSTEM = " You are a careful assistant who answers in short sentences."


def _prompt() -> str:
    return uuid.uuid4().hex + SYSTEM * 4  # 4 to 5 blocks, unique to this run


def _triton_reused(served: Served, prompt: str, **retention: Any) -> int:
    result = served.text(prompt, 1, temperature=0.0, return_perf_metrics=True, **retention)
    assert result.error is None, result.error
    return int(result.last("kv_cache_reused_blocks"))


def _openai_cached(served: Served, kind: str, text: str, cache: dict[str, Any] | None = None,
                   retention: dict[str, Any] | None = None) -> int:
    c = openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0)
    extra = {"retention": retention} if retention else {}
    if kind == "chat":
        part = {"type": "text", "text": text, **({"cache_control": cache} if cache else {})}
        done: Any = c.chat.completions.create(model=served.engine_dir.name, max_tokens=1, temperature=0,
                                              messages=[{"role": "system", "content": [part]},  # type: ignore
                                                        {"role": "user", "content": "hi"}], extra_body=extra)
    else:
        done = c.completions.create(model=served.engine_dir.name, prompt=text, max_tokens=1, temperature=0,
                                    extra_body=extra)
    return int(done.usage.prompt_tokens_details.cached_tokens)


def test_a_pinned_prefix_survives_a_flood_through_triton_and_openai(small_pool: Served) -> None:
    served, tpb = small_pool, 32
    pin = {STARTS: np.array([[0]]), ENDS: np.array([[-1]]), PRIORITIES: np.array([[100]])}
    prompts = {name: _prompt() for name in ("ensemble", "ensemble-plain", "tokens", "tokens-plain", "chat",
                                            "chat-plain", "completion")}
    tok = Tokenizer.from_dir(served.engine_dir / "tokenizer")
    ids = tok.encode(prompts["tokens"]), tok.encode(prompts["tokens-plain"])
    assert _triton_reused(served, prompts["ensemble"], **pin) == 0
    assert _triton_reused(served, prompts["ensemble-plain"]) == 0
    for token_ids, extra in zip(ids, (pin, {})):
        assert served.tokens(token_ids, 1, temperature=0.0, **extra).error is None
    assert _openai_cached(served, "chat", prompts["chat"], {"type": "ephemeral", "ttl": "1h"}) == 0
    assert _openai_cached(served, "chat", prompts["chat-plain"]) == 0
    assert _openai_cached(served, "completion", prompts["completion"], retention={"priority": 100}) == 0
    # The flood: 3 prompts of 1000 one-off tokens, 94 blocks through a pool of 64.
    for k in range(3):
        flood = served.tokens([(k * 1000 + i) % 700 + 50 for i in range(1000)], 1, temperature=0.0)
        assert flood.error is None, flood.error
    assert served.engine_stats()["evicted_blocks"] >= 30
    # Pinned: every full block of the prompt (each is at least 4 blocks), through each interface.
    assert _triton_reused(served, prompts["ensemble"]) >= 4
    assert _openai_cached(served, "completion", prompts["completion"]) >= 4 * tpb
    system_end = len(tok.encode_chat([{"role": "system", "content": prompts["chat"]}], add_generation_prompt=False))
    assert _openai_cached(served, "chat", prompts["chat"]) >= tpb * (system_end // tpb) >= 4 * tpb
    with_pin = served.tokens(ids[0], 1, temperature=0.0, return_perf_metrics=True)
    assert int(with_pin.last("kv_cache_reused_blocks")) >= 4
    # The same shapes sent without retention were evicted by the flood.
    assert _triton_reused(served, prompts["ensemble-plain"]) == 0
    assert _openai_cached(served, "chat", prompts["chat-plain"]) == 0
    plain = served.tokens(ids[1], 1, temperature=0.0, return_perf_metrics=True)
    assert int(plain.last("kv_cache_reused_blocks")) == 0


def test_cache_control_and_retention_errors_reach_the_client(small_pool: Served) -> None:
    c = openai.OpenAI(base_url=small_pool.openai_url, api_key="unused", max_retries=0)
    part = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2d"}}
    with pytest.raises(openai.BadRequestError, match="5m, 1h") as err:
        c.chat.completions.create(model=small_pool.engine_dir.name, max_tokens=1,
                                  messages=[{"role": "user", "content": [part]}])  # type: ignore[list-item]
    assert err.value.body["param"] == "messages[0].content[0].cache_control.ttl"  # type: ignore[index]
    result = small_pool.text("hi", 1, **{PRIORITIES: np.array([[7]])})
    assert result.error is not None and f"input '{PRIORITIES}' needs '{STARTS}'" in result.error
