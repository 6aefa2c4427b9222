"""The llmapi repository in a real (CPU, bundled) tritonserver: this project's `ensemble` (prompt edge,
then BLS streaming into `tensorrt_llm`) against a stand-in for TensorRT-LLM's llmapi model.py (the real one
needs TensorRT-LLM and a GPU). The stand-in answers with what it was asked (text, max_tokens, stop words,
streaming), so the test sees the edge's mapping, the streamed relay, the renamed perf output and the
edge's refusals (bounds wording, cache salt) through Triton's own gRPC API."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from test_trtllm_triton_validation import _triton

from trtprompt.cli import main
from trtprompt.client import LLMClient, text_inputs
from trtprompt.serve.launch.llmapi_repository import MODEL_DIR_ENV

pytestmark = pytest.mark.server
GRPC, HTTP = 18731, 18730
STAND_IN = '''
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _get(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    """Stand-in for TensorRT-LLM's llmapi model.py: echoes its request in two streamed pieces."""

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = _get(request, "text_input")[0].decode()
            n = int(_get(request, "sampling_param_max_tokens")[0])
            stop = _get(request, "sampling_param_stop")
            stream = _get(request, "streaming")
            words = ",".join(w.decode() for w in stop) if stop is not None else ""
            head = f"[{text}|{n}|{words}|{bool(stream[0]) if stream is not None else None}]"
            for i, piece in enumerate((head, "tail")):
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array([piece.encode()], dtype=object)),
                    pb_utils.Tensor("kv_cache_reused_block", np.array([i + 2], dtype=np.int32))]))
            sender.send(flags=FINAL)
        return None
'''


@pytest.fixture(scope="module")
def server(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("llmapi-triton")
    engine, profile = root / "engine", root / "small.toml"
    # Small bounds and the reject policy, so an overlong prompt is refused rather than cut.
    profile.write_text('[build]\nmax_batch_size = 4\nmax_seq_len = 256\nmax_num_tokens = 256\n'
                       '[runtime]\nenable_chunked_context = true\nenable_kv_cache_reuse = true\n'
                       '[prompt]\noverflow = "reject"\n')
    built = CliRunner().invoke(main, ["build", str(tiny_checkpoint_factory("llama")), "-o", str(engine), "--target",
                                      "trtllm", "--trtllm-api", "llmapi", "--profile", str(profile), "--no-progress"])
    assert built.exit_code == 0, built.output
    installed = root / "installed"
    (installed / "1").mkdir(parents=True)
    (installed / "1" / "model.py").write_text(STAND_IN)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MODEL_DIR_ENV, str(installed))
        written = CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(root / "repo")])
    assert written.exit_code == 0, written.output
    proc, log = _triton(root / "repo", root, HTTP, wait_ready=True, grpc_port=GRPC)
    if proc.poll() is not None:
        pytest.fail(f"tritonserver exited; log tail:\n{log.read_text()[-3000:]}")
    yield log
    proc.terminate()
    proc.wait(30)


def _ask(prompt: str, **more: object):  # type: ignore[no-untyped-def]
    with LLMClient(f"127.0.0.1:{GRPC}") as client:
        return client.infer("ensemble", text_inputs(prompt, 8, True, **more), timeout_s=60)


def test_streams_through_the_edge(server: Path) -> None:
    result = _ask("Hello there", stop_words=["END"], return_perf_metrics=True)
    assert result.error is None, f"{result.error}\n{server.read_text()[-3000:]}"
    assert result.pieces == ["[Hello there|8|END|True]", "tail"]
    assert result.last("kv_cache_reused_blocks") == 3  # kv_cache_reused_block, under the ensemble's name


def test_bounds_refused_with_the_same_wording(server: Path) -> None:
    result = _ask("word " * 400)
    assert result.error is not None and "exceeds maximum input length (255)" in result.error


def test_cache_salt_refused(server: Path) -> None:
    result = _ask("Hello", cache_salt="tenant-a")
    assert result.error is not None and "cache_salt' cannot be honoured" in result.error


def test_retention_refused_naming_the_input(server: Path) -> None:
    """Declared by the ensemble (Triton accepts the tensor), refused by the edge: TensorRT-LLM's llmapi model
    passes no KvCacheRetentionConfig (docs/prefix-pool.md, "TensorRT-LLM targets")."""
    result = _ask("Hello", retention_decode_priority=90)
    assert result.error is not None and "'retention_decode_priority' cannot be honoured" in result.error
