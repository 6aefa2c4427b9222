"""Speculative decoding through `trtprompt serve` (docs/speculative-decoding.md, "Serving"): the eight serve
options reach the torch engine process (config.pbtxt parameters -> engine_overrides -> the engine's
SpeculationConfig) and every replica; the trtllm target logs that it cannot act on them; a request opts out
with the OpenAI extension field `speculative_decoding` or the Triton BOOL input of that name, and a greedy
request's text is the same either way (on the session's served engine, which speculates: ngram by default)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from click.testing import CliRunner
from serve_fixtures import Served, openai_model, openai_post
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main
from trtprompt.engine.loader import engine_config, read_engine_files
from trtprompt.engine.speculation.config import SPECULATION_KNOBS, SpeculationConfig
from trtprompt.interface import SPECULATION_INPUT
from trtprompt.knobs import KNOBS
from trtprompt.serve.engine_process.server import engine_overrides
from trtprompt.serve.launch.options import EngineInfo, resolve_options
from trtprompt.serve.launch.replicas import replica_options
from trtprompt.serve.launch.repository import RepoContext, runtime_parameters, untaken_speculation
from trtprompt.serve.openai import extensions
from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.params import ModelLimits, parse_request
from trtprompt.serve.triton_models import inputs
from trtprompt.serve.wire.model_config import read_parameters

LIMITS = ModelLimits("tiny", 2048, vocab_size=256)
GIVEN = ("--speculative-decoding", "ngram", "--max-draft-len", "4", "--max-matching-ngram-size", "2",
         "--no-is-keep-all", "--no-is-use-oldest", "--no-is-public-pool", "--speculation-max-concurrency", "3")
# A prompt whose continuation repeats what it has seen (n-gram drafts find matches in it).
PROMPT = "one two three four one two three four one two three four one two"


def _repo_only(engine: Path, repo: Path, *options: str) -> Any:
    return CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(repo), *options])


# ---------------------------------------------------------------- serve options, no server


def test_serve_help_shows_every_speculation_option() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in SPECULATION_KNOBS:
        flag = (KNOBS[name].flag or "--" + name.replace("_", "-")).split("/")[0]
        assert flag in result.output, name


def test_options_reach_the_engine_process(tiny_engine_dir: Path, tmp_path: Path) -> None:
    """Given options -> tensorrt_llm's config.pbtxt -> engine_overrides -> the engine's SpeculationConfig."""
    result = _repo_only(tiny_engine_dir, tmp_path / "repo", *GIVEN)
    assert result.exit_code == 0, result.output
    overrides = engine_overrides(read_parameters(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt"))
    assert {k: overrides.get(k) for k in SPECULATION_KNOBS} == {
        "speculative_decoding": "ngram", "max_draft_len": 4, "max_matching_ngram_size": 2, "is_keep_all": False,
        "is_use_oldest": False, "is_public_pool": False, "speculation_max_concurrency": 3, "speculative_model": None}
    assert engine_config(read_engine_files(tiny_engine_dir), overrides).speculation == SpeculationConfig(
        mode="ngram", max_draft_len=4, max_matching_ngram_size=2, is_keep_all=False, is_use_oldest=False,
        is_public_pool=False, max_concurrency=3)


def test_none_turns_speculation_off_and_the_defaults_speculate(tiny_engine_dir: Path, tmp_path: Path) -> None:
    files = read_engine_files(tiny_engine_dir)
    for options, expected in ((("--speculative-decoding", "none"), None), ((), SpeculationConfig())):
        repo = tmp_path / f"repo{len(options)}"
        assert _repo_only(tiny_engine_dir, repo, *options).exit_code == 0
        overrides = engine_overrides(read_parameters(repo / "tensorrt_llm" / "config.pbtxt"))
        assert engine_config(files, overrides).speculation == expected


def test_draft_target_names_the_draft_engine_by_its_absolute_path(tiny_engine_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny_engine_dir.parent)  # a relative path: the engine process may run elsewhere
    result = _repo_only(tiny_engine_dir, tmp_path / "repo", "--speculative-decoding", "draft_target",
                        "--speculative-model", tiny_engine_dir.name)
    assert result.exit_code == 0, result.output
    params = read_parameters(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    assert params["speculative_decoding"] == "draft_target"
    assert params["speculative_model"] == str(tiny_engine_dir.resolve())


@pytest.mark.parametrize("options, message", [
    (("--speculative-decoding", "draft_target"), "draft_target needs speculative_model"),
    (("--speculative-decoding", "draft_target", "--speculative-model", "/nonexistent/draft"), "does not exist"),
    (("--speculative-decoding", "eagle"), "'eagle' is not one of"),
    (("--max-draft-len", "0"), "max_draft_len must be an integer in [1, 64], got 0"),
])
def test_bad_options_are_refused_naming_them(tiny_engine_dir: Path, tmp_path: Path, options: tuple[str, ...],
                                             message: str) -> None:
    result = _repo_only(tiny_engine_dir, tmp_path / "repo", *options)
    assert result.exit_code != 0
    assert message in result.output


def test_every_replica_gets_the_options(tiny_engine_dir: Path) -> None:
    engine = EngineInfo.read(tiny_engine_dir)
    options = resolve_options(engine, {"replicas": 2, "max_draft_len": 3, "is_public_pool": False,
                                       "speculative_decoding": "ngram"})
    for index in range(2):
        params = runtime_parameters(RepoContext(engine, replica_options(options, frozenset({index}), index), "s"))
        assert (params["max_draft_len"], params["is_public_pool"], params["speculative_decoding"]) == \
            (3, False, "ngram")


def test_trtllm_target_logs_that_it_does_not_apply_them(tiny_checkpoint_factory: Callable[..., Path],
                                                        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Not refused (the default is ngram): a warning naming the options given, a note for the default alone."""
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    with caplog.at_level(logging.INFO, logger="trtprompt.serve"):
        result = _repo_only(engine, tmp_path / "repo", "--max-draft-len", "4")
    assert result.exit_code == 0, result.output
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "max_draft_len=4" in r.getMessage()]
    assert len(warned) == 1 and "not applied on the trtllm target" in warned[0].getMessage()
    assert "trtllm-build --speculative_decoding_mode" in warned[0].getMessage()
    default = untaken_speculation(resolve_options(EngineInfo.read(engine), {}))
    assert default is not None and default[0] == logging.INFO and "default ngram" in default[1]
    assert untaken_speculation(resolve_options(EngineInfo.read(engine), {"speculative_decoding": "none"})) is None


# ---------------------------------------------------------------- the per-request opt-out, no server


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_openai_field_maps_to_sampling_params(kind: str) -> None:
    main_field = {"prompt": "Hi"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = {"model": "tiny", "max_tokens": 4} | main_field
    assert parse_request(kind, body, LIMITS).sampling.speculative_decoding is True
    assert parse_request(kind, body | {"speculative_decoding": False}, LIMITS).sampling.speculative_decoding is False
    assert parse_request(kind, body | {"speculative_decoding": True}, LIMITS).sampling.speculative_decoding is True
    with pytest.raises(APIError) as err:
        parse_request(kind, body | {"speculative_decoding": "no"}, LIMITS)
    assert err.value.param == "speculative_decoding"


def test_ngram_corpus_id_is_noted_naming_cache_salt() -> None:
    gen = parse_request("completion", {"model": "tiny", "prompt": "Hi", "ngram_corpus_id": "docs"}, LIMITS)
    assert len(gen.notes) == 1 and "ngram_corpus_id" in gen.notes[0] and "cache_salt" in gen.notes[0]
    assert "ngram_corpus_id" in extensions.names("chat")


def test_triton_input_maps_to_sampling_params() -> None:
    base = {"text_input": np.array([[b"Hi"]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32)}
    assert inputs.parse_text_item(base, 0, True).sampling.speculative_decoding is True
    for value, expected in ((False, False), (True, True)):
        tensors = base | {SPECULATION_INPUT: np.array([[value]], dtype=np.bool_)}
        assert inputs.parse_text_item(tensors, 0, True).sampling.speculative_decoding is expected
    tokens = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "input_lengths": np.array([[3]], dtype=np.int32),
              "request_output_len": np.array([[4]], dtype=np.int32),
              SPECULATION_INPUT: np.array([[False]], dtype=np.bool_)}
    assert inputs.parse_token_item(tokens, 0, True).sampling.speculative_decoding is False


# ---------------------------------------------------------------- on the served engine


@pytest.mark.parametrize("path, kind", [("/v1/completions", "completion"), ("/v1/chat/completions", "chat")])
def test_opting_out_gives_the_same_greedy_text(served: Served, path: str, kind: str) -> None:
    main_field = {"prompt": PROMPT} if kind == "completion" else {"messages": [{"role": "user", "content": PROMPT}]}
    body = {"model": openai_model(served), "max_tokens": 12, "temperature": 0} | main_field
    texts = []
    for extra in ({}, {"speculative_decoding": False}, {"speculative_decoding": True}):
        status, answer = openai_post(served, path, body | extra)
        assert status == 200, answer
        choice = answer["choices"][0]
        texts.append(choice["text"] if kind == "completion" else choice["message"]["content"])
    assert texts[0] and texts[0] == texts[1] == texts[2]


def test_triton_input_opts_out_with_the_same_greedy_text(served: Served) -> None:
    plain = served.text(PROMPT, 12, stream=False, temperature=0.0, exclude_input_in_output=True)
    before = _draft_tokens(served)
    opted = served.text(PROMPT, 12, stream=False, temperature=0.0, exclude_input_in_output=True,
                        **{SPECULATION_INPUT: False})
    assert _draft_tokens(served) == before  # the input reached the engine: no drafts were verified
    assert plain.error is None and opted.error is None, (plain.error, opted.error)
    assert plain.text and plain.text == opted.text
    ids = [5, 6, 7, 5, 6, 7, 5, 6]
    a = served.tokens(ids, 8, streaming=False, temperature=0.0)
    b = served.tokens(ids, 8, streaming=False, temperature=0.0, **{SPECULATION_INPUT: False})
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.output_ids == b.output_ids


def _draft_tokens(served: Served) -> int:
    return int(served.engine_stats()["spec_num_draft_tokens"])


def test_the_served_engine_speculates_and_an_opted_out_request_takes_no_drafts(served: Served) -> None:
    body = {"model": openai_model(served), "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    before = _draft_tokens(served)
    assert openai_post(served, "/v1/completions", body)[0] == 200
    middle = _draft_tokens(served)
    assert openai_post(served, "/v1/completions", body | {"speculative_decoding": False})[0] == 200
    assert middle > before and _draft_tokens(served) == middle



def test_through_the_front_ends_triton_path_the_opt_out_is_the_ensembles_input(served: Served) -> None:
    """The OpenAI front end's Triton path (openai/to_triton.py) sends the field as the BOOL input."""
    from trtprompt.serve.openai.to_triton import TritonEnsemble

    async def run(extra: dict[str, Any]) -> tuple[set[str], str]:
        ensemble = TritonEnsemble(served.url, api_key="")
        try:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0} | extra
            gen = parse_request("completion", body, LIMITS)
            sent = await ensemble.inputs_for(gen, gen.prompts[0])
            return {i.name() for i in sent}, "".join([p.text async for p in ensemble.generate(sent)])
        finally:
            await ensemble.close()

    plain_inputs, plain = asyncio.run(run({}))
    opted_inputs, opted = asyncio.run(run({"speculative_decoding": False}))
    assert SPECULATION_INPUT not in plain_inputs and SPECULATION_INPUT in opted_inputs
    assert plain and plain == opted
