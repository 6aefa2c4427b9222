"""The trtllm target's preprocessing and postprocessing (serve/triton_models/pre_post.py) run in-process on
the config.pbtxt files `serve --repo-only` writes, with a stand-in for triton_python_backend_utils (which
exists only inside tritonserver's Python stub): preprocessing's EMBEDDING_BIAS ([1, vocab] FP32 from the
words and weights, [1, 0] without words) and [2, L] word lists, and postprocessing's one detokenizer per
(request id, sequence_index) when the core interleaves several returned sequences."""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main
from trtprompt.error_codes import STATUSES
from trtprompt.tokenizer import Tokenizer

VOCAB = 768  # tests/fixtures/trtllm/good/config.json pretrained_config.vocab_size


class _Tensor:
    def __init__(self, name: str, array: Any) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Any:
        return self._array


class _Response:
    def __init__(self, output_tensors: list[_Tensor], error: Any = None) -> None:
        self.tensors, self.error = {t.name(): t.as_numpy() for t in output_tensors}, error


class _Request:
    def __init__(self, tensors: dict[str, Any], request_id: str = "") -> None:
        self.tensors, self.id = tensors, request_id

    def request_id(self) -> str:
        return self.id


class _Error(str):
    """pb_utils.TritonError: the message (its status codes are set as class attributes below)."""

    def __new__(cls, message: str, code: object = None) -> "_Error":
        return super().__new__(cls, message)


class _Family:
    """pb_utils.MetricFamily: metrics that record what they are given."""

    HISTOGRAM, COUNTER = "HISTOGRAM", "COUNTER"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> Any:  # noqa: N802
        seen: list[float] = []
        return types.SimpleNamespace(seen=seen, observe=seen.append, increment=seen.append)


def _fake_pb_utils() -> types.ModuleType:
    """What pre_post.py and stub.py use of triton_python_backend_utils, as plain Python."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
    pb.Tensor = _Tensor  # type: ignore[attr-defined]
    pb.InferenceResponse = _Response  # type: ignore[attr-defined]
    for status in STATUSES.values():
        setattr(_Error, status.triton, status.triton)
    pb.TritonError = _Error  # type: ignore[attr-defined]
    pb.MetricFamily = _Family  # type: ignore[attr-defined]
    pb.get_input_tensor_by_name = lambda request, name: (  # type: ignore[attr-defined]
        _Tensor(name, request.tensors[name]) if name in request.tensors else None)
    pb.Logger = types.SimpleNamespace(log_error=print, log_warn=print, log_info=print)  # type: ignore[attr-defined]
    return pb


@pytest.fixture()
def pre_post(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """pre_post imported against the stand-in; it and stub are forgotten again afterwards, so nothing
    else in this process sees modules bound to it."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    names = ("trtprompt.serve.triton_models.pre_post", "trtprompt.serve.triton_models.stub")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    yield importlib.import_module(names[0])
    for name in names:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


@pytest.fixture(scope="module")
def repo(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trtllm-pre-post")
    engine = make_engine_dir("good", root / "engine", tiny_checkpoint_factory("llama"))
    result = CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(root / "repo")])
    assert result.exit_code == 0, result.output
    return root / "repo"


def _model(pre_post: Any, repo: Path, name: str) -> Any:
    """The model of repo/name, initialized as the Python backend does: with its config as JSON."""
    cfg = text_format.Parse((repo / name / "config.pbtxt").read_text(encoding="utf-8"), mc.ModelConfig())
    model = (pre_post.PreprocessingModel if name == "preprocessing" else pre_post.PostprocessingModel)()
    model.initialize({"model_config": json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True))})
    return model


def _strings(*values: str) -> Any:
    return np.array([[v.encode("utf-8") for v in values]], dtype=object)


def _preprocess(pre_post: Any, repo: Path, **extra: Any) -> dict[str, Any]:
    tensors = {"QUERY": _strings("hello world"), "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32), **extra}
    (response,) = _model(pre_post, repo, "preprocessing").execute([_Request(tensors)])
    assert response.error is None, response.error
    return dict(response.tensors)


def test_embedding_bias_from_words_and_weights(pre_post: Any, repo: Path) -> None:
    from trtprompt.serve.triton_models.inputs import bias_from_words

    tok = Tokenizer.from_dir(repo.parent / "engine" / "tokenizer")
    words, weights = ["hello", "hello world", " cat"], [1.5, -0.25, 2.0]
    out = _preprocess(pre_post, repo, EMBEDDING_BIAS_WORDS=_strings(*words),
                      EMBEDDING_BIAS_WEIGHTS=np.array([weights], dtype=np.float32))
    bias = out["EMBEDDING_BIAS"]
    assert bias.dtype == np.float32 and bias.shape == (1, VOCAB)
    expected = np.zeros(VOCAB, dtype=np.float32)
    for word, weight in zip(words, weights):  # every token of a word, summed where words share one
        for token in tok.encode(word, add_special_tokens=False):
            expected[token] += weight
    assert np.allclose(bias[0], expected) and np.count_nonzero(bias) > 1
    shared = set(tok.encode("hello", add_special_tokens=False)) & set(tok.encode("hello world",
                                                                                 add_special_tokens=False))
    assert shared and all(bias[0, t] == pytest.approx(1.25) for t in shared)
    # the torch target's helper gives the same pairs (pre_post reuses it)
    pairs = bias_from_words({"embedding_bias_words": _strings(*words)[0:1],
                             "embedding_bias_weights": np.array([weights], dtype=np.float32)}, 0,
                            lambda w: tok.encode(w, add_special_tokens=False))
    assert [(t, pytest.approx(w)) for t, w in pairs] == [(int(t), bias[0, t]) for t in np.flatnonzero(bias[0])]


def test_no_words_give_an_empty_bias(pre_post: Any, repo: Path) -> None:
    """[1, 0]: TensorRT-LLM's backend reads an empty embedding_bias as none (utils.cc squeezes it to [0])."""
    bias = _preprocess(pre_post, repo)["EMBEDDING_BIAS"]
    assert bias.shape == (1, 0) and bias.dtype == np.float32


def test_bias_words_and_weights_must_pair(pre_post: Any, repo: Path) -> None:
    tensors = {"QUERY": _strings("hi"), "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32),
               "EMBEDDING_BIAS_WORDS": _strings("a", "b"),
               "EMBEDDING_BIAS_WEIGHTS": np.array([[1.0]], dtype=np.float32)}
    (response,) = _model(pre_post, repo, "preprocessing").execute([_Request(tensors)])
    assert "inputs 'embedding_bias_words' (2 words) and 'embedding_bias_weights' (1 weights)" in str(response.error)


def test_bias_tensor_refuses_nothing_and_zero_fills(pre_post: Any) -> None:
    """A batch of a row with words beside one without: the one without gets zeros (no effect)."""
    out = pre_post.bias_tensor([((3, 0.5), (7, -1.0)), ()], 10)
    assert out.tolist() == [[0, 0, 0, 0.5, 0, 0, 0, -1.0, 0, 0], [0.0] * 10]
    assert pre_post.bias_tensor([(), ()], 10).shape == (2, 0)


def test_bad_and_stop_words_as_tensorrt_llm_word_lists(pre_post: Any, repo: Path) -> None:
    tok = Tokenizer.from_dir(repo.parent / "engine" / "tokenizer")
    out = _preprocess(pre_post, repo, BAD_WORDS_DICT=_strings("hello", " world"), STOP_WORDS_DICT=_strings("cat"))
    bad = [tok.encode(w, add_special_tokens=False) for w in ("hello", " world")]
    ids = [t for w in bad for t in w]
    assert out["BAD_WORDS_IDS"].shape == (1, 2, len(ids))
    assert out["BAD_WORDS_IDS"][0].tolist() == [ids, [len(bad[0]), len(ids)] + [-1] * (len(ids) - 2)]
    stop = tok.encode("cat", add_special_tokens=False)
    assert out["STOP_WORDS_IDS"][0, 0, :len(stop)].tolist() == stop and out["STOP_WORDS_IDS"][0, 1, 0] == len(stop)


def _core_response(tokens: list[int], sequence: int | None) -> dict[str, Any]:
    """One streamed response of the tensorrtllm backend as the ensemble hands it to postprocessing
    (sequence_index only with num_return_sequences > 1, as the backend sends it)."""
    out = {"TOKENS_BATCH": np.array([[tokens]], dtype=np.int32),
           "SEQUENCE_LENGTH": np.array([[len(tokens)]], dtype=np.int32)}
    return out if sequence is None else out | {"SEQUENCE_INDEX": np.array([[sequence]], dtype=np.int32)}


def test_one_detokenizer_per_request_and_sequence(pre_post: Any, repo: Path) -> None:
    """Two sequences of one request, interleaved token by token: each one's chunks concatenate to its
    own text (one shared detokenizer would mix them); a request without sequence_index is sequence 0."""
    tok = Tokenizer.from_dir(repo.parent / "engine" / "tokenizer")
    texts = ["Grüße aus Köln", "The quick brown fox jumps"]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    post = _model(pre_post, repo, "postprocessing")
    pieces: dict[int, list[str]] = {0: [], 1: []}
    for step in range(max(map(len, seqs))):
        for index, ids in enumerate(seqs):
            if step < len(ids):
                (response,) = post.execute([_Request(_core_response([ids[step]], index), "r1")])
                pieces[index].append(response.tensors["OUTPUT"][0, 0].decode("utf-8"))
    for index, ids in enumerate(seqs):
        full = tok.decode(ids)
        assert "".join(pieces[index]) == full, (index, pieces[index])
    assert {key for key in post.streams} == {("r1", 0), ("r1", 1)}
    (plain,) = post.execute([_Request(_core_response(seqs[1][:2], None), "r2")])
    assert plain.tensors["OUTPUT"][0, 0].decode("utf-8") == tok.decode(seqs[1][:2])
    assert ("r2", 0) in post.streams
