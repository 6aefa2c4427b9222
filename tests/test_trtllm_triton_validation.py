"""The trtllm repository against the real (CPU, bundled) tritonserver: Triton's own model-config
validator accepts the tensorrtllm `tensorrt_llm` config (it then stops only because the tensorrtllm
backend library is absent here), the ensemble's wiring to that model's exact input/output
signature loads once the core's backend is swapped for a python stub, the trtllm target's
`postprocessing` turns the perf outputs TensorRT-LLM's backend would send into the request metrics, and
the 1.2 tensors travel the written ensemble (embedding bias words to the core's embedding_bias, several
returned sequences decoded apart by sequence_index).
TensorRT-LLM cannot run here: the C++ backend is the only part replaced (by a stub, or by this
test sending what it would send)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from trtllm_fixtures import make_engine_dir

from trtprompt.cli import main

pytestmark = pytest.mark.server
STUB = "class TritonPythonModel:\n    def execute(self, requests):\n        return None\n"


def _triton(repo: Path, run: Path, port: int, wait_ready: bool, metrics_port: int | None = None,
            grpc_port: int | None = None) -> tuple[subprocess.Popen, Path]:
    from trtprompt.serve.launch.launcher import TritonInstall, child_env, make_backend_dir

    install = TritonInstall.find()
    metrics = ["--allow-metrics=true", f"--metrics-port={metrics_port}", "--metrics-address=127.0.0.1"] \
        if metrics_port else ["--allow-metrics=false"]
    grpc = ["--allow-grpc=true", f"--grpc-port={grpc_port}", "--grpc-address=127.0.0.1"] \
        if grpc_port else ["--allow-grpc=false"]
    cmd = [str(install.binary), f"--model-repository={repo}", "--http-address=127.0.0.1", f"--http-port={port}",
           *grpc, *metrics, "--exit-timeout-secs=5"]
    if install.bundled:
        cmd += [f"--backend-directory={make_backend_dir(run)}", "--disable-auto-complete-config",
                "--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false"]
    log = run / "triton.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(install, ""))
    if wait_ready:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
    return proc, log


@pytest.fixture(scope="module")
def trtllm_repo(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trtllm-triton")
    engine = make_engine_dir("good", root / "engine", tiny_checkpoint_factory("llama"))
    result = CliRunner().invoke(main, ["serve", str(engine), "--repo-only", str(root / "repo")])
    assert result.exit_code == 0, result.output
    return root / "repo"


def test_triton_validator_accepts_the_core_config(trtllm_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "tensorrt_llm" / "1").mkdir(parents=True)
    (repo / "tensorrt_llm" / "config.pbtxt").write_text((trtllm_repo / "tensorrt_llm" / "config.pbtxt").read_text())
    proc, log = _triton(repo, tmp_path, 18630, wait_ready=False)
    assert proc.wait(60) != 0
    text = log.read_text()
    # Validation (dims/reshape/types/batching) passed; loading stopped at the missing C++ backend.
    assert "Poll failed" not in text
    assert "unable to find backend library for backend 'tensorrtllm'" in text


def _stub_core(trtllm_repo: Path, repo: Path, model: str) -> None:
    """Copy the repository with the core's C++ backend swapped for a python model (model.py text)."""
    shutil.copytree(trtllm_repo, repo)
    core = repo / "tensorrt_llm" / "config.pbtxt"
    text = core.read_text()
    assert text.count('backend: "tensorrtllm"') == 1
    core.write_text(text.replace('backend: "tensorrtllm"', 'backend: "python"'))
    (repo / "tensorrt_llm" / "1" / "model.py").write_text(model)


def test_ensemble_loads_against_the_core_signature(trtllm_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _stub_core(trtllm_repo, repo, STUB)
    proc, log = _triton(repo, tmp_path, 18640, wait_ready=True)
    try:
        with urllib.request.urlopen("http://127.0.0.1:18640/v2/models/ensemble/ready", timeout=2) as r:
            assert r.status == 200
    except OSError as exc:
        pytest.fail(f"ensemble not ready ({exc}); log tail:\n{log.read_text()[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(30)


# Two requests' perf outputs as TensorRT-LLM's backend attaches them to every response (ns; blocks);
# times chosen so every difference and sum is exact in binary floating point.
PERF_A = {"kv_cache_alloc_new_blocks": 3, "kv_cache_reused_blocks": 2, "kv_cache_alloc_total_blocks": 5,
          "arrival_time_ns": 1_000_000_000, "first_scheduled_time_ns": 1_250_000_000,
          "first_token_time_ns": 1_750_000_000}
PERF_B = {"kv_cache_alloc_new_blocks": 3, "kv_cache_reused_blocks": 0, "kv_cache_alloc_total_blocks": 3,
          "arrival_time_ns": 4_000_000_000, "first_scheduled_time_ns": 4_125_000_000,
          "first_token_time_ns": 4_250_000_000}
PERF_UNNAMED = {"kv_cache_alloc_new_blocks": 1, "kv_cache_reused_blocks": 1, "kv_cache_alloc_total_blocks": 2,
                "arrival_time_ns": 8_000_000_000, "first_scheduled_time_ns": 8_062_500_000,
                "first_token_time_ns": 8_312_500_000}


def _core_response(tokens: list[int], perf: dict[str, int], last_token_ns: int) -> list[object]:
    """One streamed response of the tensorrtllm backend, as the ensemble hands it to postprocessing."""
    import numpy as np
    import tritonclient.http as http

    from trtprompt.interface import PERF_OUTPUTS

    values = {**perf, "last_token_time_ns": last_token_ns}
    arrays = {"TOKENS_BATCH": np.array([[tokens]], dtype=np.int32),
              "SEQUENCE_LENGTH": np.array([[len(tokens)]], dtype=np.int32)}
    arrays |= {name.upper(): np.array([[values[name]]], dtype=np.int32 if dtype == "INT32" else np.int64)
               for name, dtype, *_ in PERF_OUTPUTS if name in values}  # the speculative decoding ones left out
    out = []
    for name, array in arrays.items():
        tensor = http.InferInput(name, list(array.shape), "INT32" if array.dtype == np.int32 else "INT64")
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def _send_streams(port: int) -> None:
    """Request a: three responses; b: two; one without a request id: two (interleaved)."""
    import tritonclient.http as http

    sends = [(PERF_A, "a")] * 3 + [(PERF_B, "b"), (PERF_UNNAMED, ""), (PERF_B, "b"), (PERF_UNNAMED, "")]
    with http.InferenceServerClient(f"127.0.0.1:{port}") as client:
        for i, (perf, rid) in enumerate(sends):
            result = client.infer("postprocessing", _core_response([5 + i], perf, perf["first_token_time_ns"] + i),
                                  request_id=rid)
            assert result.as_numpy("OUTPUT").shape == (1, 1)


def test_postprocessing_publishes_one_observation_per_request(trtllm_repo: Path, tmp_path: Path) -> None:
    from trtprompt.bench.runner import scrape_metrics
    from trtprompt.serve import metrics_catalog as C

    repo = tmp_path / "repo"
    shutil.copytree(trtllm_repo / "postprocessing", repo / "postprocessing")  # as `serve --repo-only` wrote it
    proc, log = _triton(repo, tmp_path, 18650, wait_ready=True, metrics_port=18651)
    try:
        assert proc.poll() is None, log.read_text()[-3000:]
        _send_streams(18650)
        expected = {  # tokens_per_block 32 (tests/fixtures/trtllm/good)
            "trtprompt_request_queue_time_seconds": (3.0, 0.25 + 0.125 + 0.0625),
            C.TTFT: (3.0, 0.75 + 0.25 + 0.3125),
            C.PREFILL_TIME: (3.0, 0.5 + 0.125 + 0.25),
            "trtprompt_request_prefix_cache_hit_tokens": (3.0, 2 * 32 + 0 + 1 * 32),
        }
        deadline, scraped = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            scraped = scrape_metrics("http://127.0.0.1:18651/metrics")
            if scraped.get(f"{C.PREFILL_TIME}_count") == 3.0:
                break
            time.sleep(0.1)
        assert {name: (scraped.get(f"{name}_count"), scraped.get(f"{name}_sum")) for name in expected} == expected
        assert (scraped[C.PREFIX_HIT_BLOCKS], scraped[C.PREFIX_QUERIED_BLOCKS]) == (3.0, 10.0)
        assert scraped[f'{C.TTFT}_bucket{{le="0.25"}}'] == 1.0 and scraped[f'{C.TTFT}_bucket{{le="0.5"}}'] == 2.0
        # Not known at the first token, so not published (only the engine process has them).
        assert not [k for k in scraped if k.startswith(("trtprompt_e2e_", "trtprompt_inter_token_", "nv_trt_llm_"))]
    finally:
        proc.terminate()
        proc.wait(30)
    # The metric families are released in finalize(): left to the stub's teardown they crashed it
    # (faulthandler, enabled by the model, writes the crash into this log).
    crashes = [line for line in log.read_text().splitlines() if "Fatal Python error" in line or "Segmentation" in line]
    assert not crashes, crashes


# Stands in for TensorRT-LLM's C++ backend (which cannot run here): two streamed responses per request,
# carrying the perf outputs only when the request asked for them, as the backend does.
PERF_CORE_STUB = f"""
import numpy as np
import triton_python_backend_utils as pb_utils

PERF = {dict(PERF_A, last_token_time_ns=1_800_000_000)!r}
INT32 = {{"kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks"}}


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            flag = pb_utils.get_input_tensor_by_name(request, "return_perf_metrics")
            asked = flag is not None and bool(flag.as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            for step in (0, 1):
                outs = [pb_utils.Tensor("output_ids", np.array([[[5 + step]]], dtype=np.int32)),
                        pb_utils.Tensor("sequence_length", np.array([[1]], dtype=np.int32))]
                if asked:
                    outs += [pb_utils.Tensor(k, np.array([[v]], dtype=np.int32 if k in INT32 else np.int64))
                             for k, v in PERF.items()]
                sender.send(pb_utils.InferenceResponse(output_tensors=outs),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if step else 0)
        return None
"""


def test_ensemble_asks_the_core_for_perf_outputs_and_publishes_them(trtllm_repo: Path, tmp_path: Path) -> None:
    """The client's return_perf_metrics=false is overridden (preprocessing forces it), the perf outputs
    come back to the client, and postprocessing observes the request once across its two responses."""
    from trtprompt.bench.runner import scrape_metrics
    from trtprompt.client import LLMClient, text_inputs
    from trtprompt.serve import metrics_catalog as C

    repo = tmp_path / "repo"
    _stub_core(trtllm_repo, repo, PERF_CORE_STUB)
    proc, log = _triton(repo, tmp_path, 18660, wait_ready=True, metrics_port=18661, grpc_port=18662)
    try:
        with LLMClient("127.0.0.1:18662") as client:
            result = client.infer("ensemble", text_inputs("hello", 2, True, return_perf_metrics=False), 60.0)
        assert result.error is None, log.read_text()[-3000:]
        assert [r["kv_cache_reused_blocks"].item() for r in result.responses if "kv_cache_reused_blocks" in r] == [2, 2]
        deadline, scraped = time.monotonic() + 60, {}
        while time.monotonic() < deadline and scraped.get(f"{C.TTFT}_count") != 1.0:
            scraped = scrape_metrics("http://127.0.0.1:18661/metrics")
            time.sleep(0.1)
        assert (scraped.get(f"{C.TTFT}_count"), scraped.get(f"{C.TTFT}_sum"), scraped.get(C.PREFIX_HIT_BLOCKS),
                scraped.get(C.PREFIX_QUERIED_BLOCKS)) == (1.0, 0.75, 2.0, 5.0)
    finally:
        proc.terminate()
        proc.wait(30)


# Stands in for the C++ backend with num_return_sequences: each sequence's tokens one per response,
# the sequences interleaved, sequence_index only when more than one (as the backend sends it), and
# what it got as embedding_bias reported back as cum_log_probs ([length, sum]).
SEQUENCES_CORE_STUB = """
import numpy as np
import triton_python_backend_utils as pb_utils

SEQUENCES = {sequences!r}


def _get(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = _get(request, "num_return_sequences")
            n = 1 if n is None else int(n.reshape(-1)[0])
            bias = _get(request, "embedding_bias")
            bias = np.zeros(0, np.float32) if bias is None else bias.reshape(-1)
            sends = [(s, t) for step in range(max(map(len, SEQUENCES))) for s in range(n)
                     for t in SEQUENCES[s][step:step + 1]]
            sender = request.get_response_sender()
            for k, (s, token) in enumerate(sends):
                outs = [pb_utils.Tensor("output_ids", np.array([[[token]]], dtype=np.int32)),
                        pb_utils.Tensor("sequence_length", np.array([[1]], dtype=np.int32)),
                        pb_utils.Tensor("cum_log_probs", np.array([[bias.size, bias.sum()]], dtype=np.float32))]
                if n > 1:
                    outs.append(pb_utils.Tensor("sequence_index", np.array([[s]], dtype=np.int32)))
                sender.send(pb_utils.InferenceResponse(output_tensors=outs),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if k == len(sends) - 1 else 0)
        return None
"""


def test_sequences_and_embedding_bias_through_the_ensemble(trtllm_repo: Path, tmp_path: Path) -> None:
    """The written ensemble end to end around a stand-in core: preprocessing's EMBEDDING_BIAS reaches the
    core's embedding_bias ([1, vocab] with words, empty without), postprocessing decodes two interleaved
    sequences with one detokenizer each, and a response without sequence_index (one sequence) still
    reaches postprocessing (its SEQUENCE_INDEX is optional)."""
    import numpy as np

    from trtprompt.client import LLMClient, make_input, text_inputs
    from trtprompt.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(trtllm_repo.parent / "engine" / "tokenizer")
    texts = ["Grüße aus Köln", "The quick brown fox"]
    sequences = [tok.encode(t, add_special_tokens=False) for t in texts]
    repo = tmp_path / "repo"
    _stub_core(trtllm_repo, repo, SEQUENCES_CORE_STUB.format(sequences=sequences))
    proc, log = _triton(repo, tmp_path, 18670, wait_ready=True, grpc_port=18672)
    try:
        with LLMClient("127.0.0.1:18672") as client:
            bias = [make_input("embedding_bias_words", ["hello", "hello world"]),
                    make_input("embedding_bias_weights", np.array([[1.5, -0.25]], dtype=np.float32))]
            two = client.infer("ensemble", text_inputs("hi", 8, True, num_return_sequences=2) + bias, 60.0)
            one = client.infer("ensemble", text_inputs("hi", 8, True), 60.0)
        assert two.error is None and one.error is None, log.read_text()[-3000:]
        pieces: dict[int, str] = {0: "", 1: ""}
        for r in two.responses:
            if "text_output" in r:
                pieces[int(r["sequence_index"].reshape(-1)[0])] += r["text_output"].reshape(-1)[0].decode("utf-8")
        assert pieces == {0: texts[0], 1: texts[1]}
        expected = 1.5 * len(tok.encode("hello", add_special_tokens=False)) \
            - 0.25 * len(tok.encode("hello world", add_special_tokens=False))
        sent = [r["cum_log_probs"].reshape(-1).tolist() for r in two.responses if "cum_log_probs" in r]
        assert len(sent) == len(sum(sequences, [])) and all(s == [768.0, pytest.approx(expected)] for s in sent)
        assert "".join(r["text_output"].reshape(-1)[0].decode("utf-8") for r in one.responses
                       if "text_output" in r) == texts[0]
        assert {tuple(r["cum_log_probs"].reshape(-1).tolist()) for r in one.responses if "cum_log_probs" in r} == {
            (0.0, 0.0)}  # no words: the empty bias, which TensorRT-LLM's backend reads as none
    finally:
        proc.terminate()
        proc.wait(30)
