"""tensorrtllm_backend's guided decoding on the Triton side, without a server (docs/structured-outputs.md,
"Triton"): how `guided_decoding_guide_type` / `guided_decoding_guide` become SamplingParams on both torch
models, the engine's refusals renamed to the inputs, the `guided_decoding_backend` parameter, and what the
repositories declare and write for every layout and target (the trtllm and llmapi targets' files are
contract-checked: TensorRT-LLM cannot run here). The served behaviour is tests/test_triton_guided_served.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from google.protobuf import text_format
from test_trtllm_pre_post import _model, _Request, _strings, pre_post  # noqa: F401 - pre_post is a fixture
from tritonclient.grpc import model_config_pb2 as mc
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main
from trtprompt.error_codes import BadRequestError, ErrorCode
from trtprompt.serve.triton_models import guided, inputs
from trtprompt.serve.wire.protocol import EngineError

TYPE, GUIDE = "guided_decoding_guide_type", "guided_decoding_guide"
SCHEMA = '{"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}'


def _text(value: str) -> Any:
    return np.array([[value.encode("utf-8")]], dtype=object)


def _text_request(**given: str) -> Any:
    tensors = {"text_input": _text("hi"), "max_tokens": np.array([[4]], dtype=np.int32)}
    return inputs.parse_text_item(tensors | {k: _text(v) for k, v in given.items()}, 0, False).sampling


def _token_request(**given: str) -> Any:
    tensors = {"input_ids": np.array([[1, 2, 3]], dtype=np.int32), "input_lengths": np.array([[3]], dtype=np.int32),
               "request_output_len": np.array([[4]], dtype=np.int32)}
    return inputs.parse_token_item(tensors | {k: _text(v) for k, v in given.items()}, 0, False).sampling


@pytest.mark.parametrize("parse", [_text_request, _token_request], ids=["ensemble", "tensorrt_llm"])
@pytest.mark.parametrize(("given", "expected"), [
    ({}, (None, None)),
    ({TYPE: "json"}, ("json", None)),  # any JSON object
    ({TYPE: "json", GUIDE: ""}, ("json", None)),  # an empty guide is no guide
    ({TYPE: "json", GUIDE: SCHEMA}, ("json_schema", SCHEMA)),  # honoured, where TensorRT-LLM drops it
    ({TYPE: "json_schema", GUIDE: SCHEMA}, ("json_schema", SCHEMA)),
    ({TYPE: "regex", GUIDE: "(yes|no)"}, ("regex", "(yes|no)")),
    ({TYPE: "ebnf_grammar", GUIDE: 'root ::= "a"'}, ("ebnf_grammar", 'root ::= "a"')),
    ({TYPE: "structural_tag", GUIDE: '{"structures": [], "triggers": []}'},
     ("structural_tag", '{"structures": [], "triggers": []}')),
    ({TYPE: "", GUIDE: ""}, (None, None)),
])
def test_inputs_become_the_guide(parse: Callable[..., Any], given: dict[str, str],
                                 expected: tuple[str | None, str | None]) -> None:
    sampling = parse(**given)
    assert (sampling.guide_type, sampling.guide, sampling.guide_after) == (*expected, None)


@pytest.mark.parametrize("parse", [_text_request, _token_request], ids=["ensemble", "tensorrt_llm"])
@pytest.mark.parametrize(("given", "named", "says"), [
    ({TYPE: "xml", GUIDE: "x"}, TYPE, "must be one of json, json_schema, regex, ebnf_grammar, structural_tag, "
                                      "got 'xml'"),
    ({TYPE: "JSON"}, TYPE, "got 'JSON'"),  # exact names, as tensorrtllm_backend maps them
    ({TYPE: "choice", GUIDE: '["a"]'}, TYPE, "got 'choice'"),  # the OpenAI front end's; not a Triton type
    ({TYPE: "regex"}, GUIDE, "is required with guided_decoding_guide_type 'regex'"),
    ({TYPE: "json_schema", GUIDE: ""}, GUIDE, "is required with guided_decoding_guide_type 'json_schema'"),
    ({GUIDE: "(yes|no)"}, TYPE, "input 'guided_decoding_guide' needs input 'guided_decoding_guide_type'"),
    ({TYPE: "regex", GUIDE: "a" * (256 * 1024 + 1)}, GUIDE, "more than the 262144 a guide may be"),
])
def test_bad_guides_are_refused_naming_the_input(parse: Callable[..., Any], given: dict[str, str], named: str,
                                                 says: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        parse(**given)
    assert f"'{named}'" in str(caught.value) and says in str(caught.value)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT


def test_engine_refusals_are_renamed_to_the_inputs() -> None:
    """The engine compiles the guide at admission and refuses it naming its field ("guide ..."); the
    Triton models answer with the client's input instead (stub.Job)."""
    bad = guided.client_error(EngineError(ErrorCode.INVALID_ARGUMENT, "guide is not a valid regex guide: ("))
    assert (bad.message, bad.field, bad.code) == ("input 'guided_decoding_guide' is not a valid regex guide: (",
                                                  GUIDE, ErrorCode.INVALID_ARGUMENT)
    kind = guided.client_error(EngineError(ErrorCode.INVALID_ARGUMENT, "guide_type needs a fast tokenizer"))
    assert kind.message == "input 'guided_decoding_guide_type' needs a fast tokenizer"
    other = EngineError(ErrorCode.INVALID_ARGUMENT, "guidelines are not a field")
    assert guided.client_error(other) is other


@pytest.mark.parametrize(("value", "expected"), [("", "llguidance"), ("llguidance", "llguidance"),
                                                 ("xgrammar", "xgrammar")])
def test_guided_decoding_backend_parameter(value: str, expected: str) -> None:
    assert guided.check_backend({"guided_decoding_backend": value}) == expected
    assert guided.check_backend({}) == "llguidance"


def test_an_unknown_guided_decoding_backend_refuses_to_load() -> None:
    with pytest.raises(ValueError, match="parameter 'guided_decoding_backend' must be one of llguidance, xgrammar "
                                         "on the torch target .* got 'outlines'"):
        guided.check_backend({"guided_decoding_backend": "outlines"})


def _configs(repo: Path) -> dict[str, mc.ModelConfig]:
    return {p.parent.name: text_format.Parse(p.read_text(encoding="utf-8"), mc.ModelConfig())
            for p in repo.glob("*/config.pbtxt")}


def _repo_only(engine: Path, repo: Path, *extra: str) -> dict[str, mc.ModelConfig]:
    result = CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(repo), *extra])
    assert result.exit_code == 0, result.output
    return _configs(repo)


def _declares(cfg: mc.ModelConfig) -> dict[str, tuple[int, list[int], bool]]:
    return {t.name: (t.data_type, list(t.dims), t.optional) for t in cfg.input if t.name in (TYPE, GUIDE)}


STRING_SCALAR = (mc.TYPE_STRING, [1], True)


def _step(cfg: mc.ModelConfig, model: str) -> Any:
    return next(s for s in cfg.ensemble_scheduling.step if s.model_name == model)


def test_torch_repositories_declare_and_route_the_inputs(tiny_engine_dir: Path, tmp_path: Path) -> None:
    from trtprompt.serve.launch import repository

    assert repository.TORCH_GUIDE_TYPES == guided.TRITON_GUIDE_TYPES  # repeated: launch/ imports no triton_models/
    fused = _repo_only(tiny_engine_dir, tmp_path / "fused")
    for name in ("ensemble", "tensorrt_llm"):
        assert _declares(fused[name]) == {TYPE: STRING_SCALAR, GUIDE: STRING_SCALAR}, name
    params = {k: v.string_value for k, v in fused["tensorrt_llm"].parameters.items()}
    assert params["guided_decoding_backend"] == "llguidance"
    upstream = _repo_only(tiny_engine_dir, tmp_path / "upstream", "--layout", "upstream")
    assert _declares(upstream["ensemble"]) == {TYPE: STRING_SCALAR, GUIDE: STRING_SCALAR}
    pre, core = _step(upstream["ensemble"], "preprocessing"), _step(upstream["ensemble"], "tensorrt_llm")
    assert dict(pre.input_map)["GUIDED_DECODING_GUIDE_TYPE"] == TYPE
    assert dict(pre.input_map)["GUIDED_DECODING_GUIDE"] == GUIDE
    assert dict(core.input_map)[TYPE] == dict(pre.output_map)["GUIDED_DECODING_GUIDE_TYPE"]
    assert dict(core.input_map)[GUIDE] == dict(pre.output_map)["GUIDED_DECODING_GUIDE"]
    pre_params = {k: v.string_value for k, v in upstream["preprocessing"].parameters.items()}
    assert pre_params["guided_decoding_guide_types"] == "json,json_schema,regex,ebnf_grammar,structural_tag"


@pytest.fixture(scope="module")
def trtllm_engine(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1.2 engine directory with the xgrammar tokenizer info TensorRT-LLM's script writes beside it
    (its content is TensorRT-LLM's business: trtprompt only points the backend at it)."""
    engine = make_engine_dir("good", tmp_path_factory.mktemp("trtllm-guided") / "engine",
                             tiny_checkpoint_factory("llama"))
    (engine / "xgrammar_tokenizer_info.json").write_text('{"encoded_vocab": [], "tokenizer_str": "", '
                                                         '"stop_token_ids": []}', encoding="utf-8")
    return engine


def test_trtllm_core_gets_xgrammar_and_the_tokenizer_info(trtllm_engine: Path, tmp_path: Path) -> None:
    configs = _repo_only(trtllm_engine, tmp_path / "repo")
    core = configs["tensorrt_llm"]
    params = {k: v.string_value for k, v in core.parameters.items()}
    assert params["guided_decoding_backend"] == "xgrammar"
    assert params["xgrammar_tokenizer_info_path"] == str((trtllm_engine / "xgrammar_tokenizer_info.json").resolve())
    inputs_ = {t.name: t for t in core.input}
    for name in (TYPE, GUIDE):  # as tensorrtllm_backend 1.2's template: STRING [1], optional, ragged, no reshape
        t = inputs_[name]
        assert (t.data_type, list(t.dims), t.optional, t.allow_ragged_batch, t.HasField("reshape")) == \
            (mc.TYPE_STRING, [1], True, True, False)
    ensemble = configs["ensemble"]
    assert _declares(ensemble) == {TYPE: STRING_SCALAR, GUIDE: STRING_SCALAR}
    pre, step = _step(ensemble, "preprocessing"), _step(ensemble, "tensorrt_llm")
    assert dict(step.input_map)[TYPE] == dict(pre.output_map)["GUIDED_DECODING_GUIDE_TYPE"]
    pre_params = {k: v.string_value for k, v in configs["preprocessing"].parameters.items()}
    assert pre_params["guided_decoding_guide_types"] == "json,json_schema,regex,ebnf_grammar"


def test_trtllm_without_tokenizer_info_leaves_the_path_out(tiny_checkpoint_factory: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    """Without the file TensorRT-LLM would refuse to load (a path that does not exist) or leave guided decoding
    off (no path): the path is left out and preprocessing refuses guided requests, naming why."""
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    configs = _repo_only(engine, tmp_path / "repo")
    params = {k: v.string_value for k, v in configs["tensorrt_llm"].parameters.items()}
    assert params["guided_decoding_backend"] == "xgrammar" and "xgrammar_tokenizer_info_path" not in params
    pre_params = {k: v.string_value for k, v in configs["preprocessing"].parameters.items()}
    assert pre_params["guided_decoding_guide_types"] == ""


def _preprocess(module: Any, repo: Path, **guide: str) -> Any:
    tensors = {"QUERY": _strings("hello"), "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32)}
    tensors |= {name.upper(): _strings(value) for name, value in guide.items()}
    (response,) = _model(module, repo, "preprocessing").execute([_Request(tensors)])
    return response


def test_trtllm_preprocessing_checks_and_normalizes_the_guide(pre_post: Any, trtllm_engine: Path,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """The C++ backend maps four guide types and drops any other silently, and ignores a guide under `json`:
    preprocessing refuses the others by name and hands the core `json_schema` for `json` with a schema."""
    _repo_only(trtllm_engine, tmp_path / "repo")
    repo = tmp_path / "repo"

    def out(response: Any) -> tuple[str, str]:
        assert response.error is None, response.error
        return tuple(response.tensors[name][0, 0].decode() for name in ("GUIDED_DECODING_GUIDE_TYPE",
                                                                        "GUIDED_DECODING_GUIDE"))

    assert out(_preprocess(pre_post, repo)) == ("", "")  # no guide: empty strings, which the backend ignores
    assert out(_preprocess(pre_post, repo, **{TYPE: "json"})) == ("json", "")
    assert out(_preprocess(pre_post, repo, **{TYPE: "json", GUIDE: SCHEMA})) == ("json_schema", SCHEMA)
    assert out(_preprocess(pre_post, repo, **{TYPE: "regex", GUIDE: "(yes|no)"})) == ("regex", "(yes|no)")
    refused = _preprocess(pre_post, repo, **{TYPE: "structural_tag", GUIDE: "{}"})
    assert "input 'guided_decoding_guide_type' must be one of json, json_schema, regex, ebnf_grammar, got " \
           "'structural_tag'" in str(refused.error)
    assert "input 'guided_decoding_guide' is required" in str(_preprocess(pre_post, repo, **{TYPE: "regex"}).error)


def test_trtllm_preprocessing_refuses_guides_when_guided_decoding_is_off(
        pre_post: Any, tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:  # noqa: F811
    engine = make_engine_dir("good", tmp_path / "engine", tiny_checkpoint_factory("llama"))
    _repo_only(engine, tmp_path / "repo")
    refused = _preprocess(pre_post, tmp_path / "repo", **{TYPE: "json"})
    assert "input 'guided_decoding_guide_type' cannot be honoured: guided decoding is off on this server" \
           in str(refused.error) and "xgrammar_tokenizer_info.json" in str(refused.error)
    assert _preprocess(pre_post, tmp_path / "repo").error is None  # unguided requests go on


def test_llmapi_model_yaml_names_the_guided_decoding_backend(llmapi_engine: Path, tmp_path: Path) -> None:
    """TensorRT-LLM's LLM API leaves guided decoding off (and ignores response_format) without it."""
    assert yaml.safe_load((llmapi_engine / "model.yaml").read_text())["guided_decoding_backend"] == "xgrammar"
    configs = _repo_only(llmapi_engine, tmp_path / "repo")
    served = yaml.safe_load((tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert served["guided_decoding_backend"] == "xgrammar"
    assert _declares(configs["ensemble"]) == {TYPE: STRING_SCALAR, GUIDE: STRING_SCALAR}  # declared to refuse


def test_llmapi_edge_refuses_guides_by_name() -> None:
    """TensorRT-LLM's llmapi Triton model passes no guided decoding to the LLM API: refused, not dropped."""
    from trtprompt.serve.triton_models.llmapi_edge import refuse_uncarried

    for name in (TYPE, GUIDE):
        with pytest.raises(BadRequestError, match=f"input '{name}' cannot be honoured: TensorRT-LLM's llmapi "
                                                  "Triton model passes no SamplingParams 'guided_decoding'"):
            refuse_uncarried({name: _text("regex")})
