"""Contract: every TensorRT-LLM name trtprompt writes exists in the release it targets.

tests/fixtures/trtllm_names.json holds the names read from TensorRT-LLM's published source and
versioned API reference (file and release per name). One test per supported version:
1.2.1 (the TensorRT engine path: the tensorrt_llm model's config.pbtxt parameters) and 1.4.0rc4
(the LLM API: TorchLlmArgs fields as model.yaml holds them, and the llmapi Triton model's tensors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trtprompt.knobs import KNOBS

FIXTURE = Path(__file__).parent / "fixtures" / "trtllm_names.json"
RELEASES = json.loads(FIXTURE.read_text(encoding="utf-8"))["releases"]
ENGINE, LLMAPI = "1.2.1", "1.4.0rc4"
# Knobs whose 1.2 name is a BuildConfig / PluginConfig field, not a config.pbtxt parameter: the engine's
# config.json fixtures (tests/fixtures/trtllm/) hold those names; they are not part of this contract.
BUILD_SECTION = "build"


def _names(release: str, key: str) -> set[str]:
    return set(RELEASES[release][key]["names"])


def _llm_args() -> dict[str, Any]:
    return RELEASES[LLMAPI]["llm_args"]


def test_every_record_says_where_and_which_release() -> None:
    for release, data in RELEASES.items():
        for key, value in data.items():
            records = value.values() if key == "llm_args" else [value.get("read", value)] if isinstance(value, dict) else []
            for record in records:
                assert record.get("file") and record.get("release"), (release, key, record)


@pytest.mark.parametrize("name", sorted(n for n, k in KNOBS.items() if k.trtllm and k.section != BUILD_SECTION))
def test_1_2_1_config_pbtxt_names(name: str) -> None:
    """Each runtime / serve knob's 1.2 name is a parameter (or a dynamic_batching field) of 1.2's config.pbtxt."""
    known = _names(ENGINE, "config_pbtxt_parameters") | _names(ENGINE, "config_pbtxt_template_fields")
    assert KNOBS[name].trtllm in known, f"{name}: {KNOBS[name].trtllm} is not in TensorRT-LLM {ENGINE}'s config.pbtxt"


def test_1_2_1_generated_tensorrt_llm_parameters_exist(tmp_path: Path) -> None:
    """Every parameter the trtllm target writes into tensorrt_llm/config.pbtxt is one 1.2 reads."""
    from trtprompt.serve.launch.trtllm_model_config import TrtllmModelParams

    params = TrtllmModelParams(engine_dir=tmp_path, dtype="bfloat16", max_attention_window_size=4096,
                               triton_max_batch_size=8, max_tokens_in_paged_kv_cache=8192).parameters()
    unknown = set(params) - _names(ENGINE, "config_pbtxt_parameters")
    assert not unknown, f"parameters TensorRT-LLM {ENGINE} does not declare: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(n for n, k in KNOBS.items() if k.llmapi))
def test_1_4_llm_api_names(name: str) -> None:
    """Each knob's LLM API name (dotted into kv_cache_config / scheduler_config) is a field of that release."""
    assert KNOBS[name].llmapi in _llm_args(), f"{name}: {KNOBS[name].llmapi} not read from TensorRT-LLM {LLMAPI}"


def test_the_issue_pairs() -> None:
    """The 1.2 <-> LLM API pairs issue 27 names, both halves."""
    pairs = {"enable_kv_cache_reuse": "kv_cache_config.enable_block_reuse",
             "enable_chunked_context": "enable_chunked_prefill",
             "kv_cache_free_gpu_mem_fraction": "kv_cache_config.free_gpu_memory_fraction",
             "max_tokens_in_paged_kv_cache": "kv_cache_config.max_tokens",
             "kv_cache_host_memory_bytes": "kv_cache_config.host_cache_size",
             "batch_scheduler_policy": "scheduler_config.capacity_scheduler_policy"}
    for name, llmapi in pairs.items():
        assert (KNOBS[name].trtllm, KNOBS[name].llmapi) == (name, llmapi)
    for bound in ("max_seq_len", "max_batch_size", "max_num_tokens", "max_input_len"):
        assert KNOBS[bound].trtllm == KNOBS[bound].llmapi == bound


def _dotted(args: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in args.items():
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= _dotted(value, prefix + key + ".")
    return out


def test_1_4_model_yaml_keys_exist(tmp_path: Path) -> None:
    """Every key of a generated model.yaml but triton_config (the Triton model's) is an LLM API field."""
    from test_llmapi_build import chat_plan

    from trtprompt.targets.llmapi_config import LlmapiPaths, llm_args

    plan, runtime = chat_plan()
    args = llm_args(plan, runtime | {"max_tokens_in_paged_kv_cache": 65536, "kv_cache_host_memory_bytes": 1 << 30},
                    LlmapiPaths(tmp_path / "c", tmp_path / "t"), 2, 1)
    keys = {k for k in _dotted(args) if not k.startswith("triton_config")}
    assert not keys - set(_llm_args()), sorted(keys - set(_llm_args()))
    assert args["scheduler_config"]["capacity_scheduler_policy"] in RELEASES[LLMAPI]["capacity_scheduler_policy_values"]["values"]


def test_1_4_llmapi_model_tensors() -> None:
    """What the prompt edge sends the llmapi Triton model, and reads back, are that model's tensor names."""
    from trtprompt.serve.launch.llmapi_repository import CORE_INPUTS, CORE_OUTPUTS
    from trtprompt.serve.triton_models.llmapi_edge import OUTPUT_NAMES, SAMPLING

    model = RELEASES[LLMAPI]["llmapi_triton_model"]
    assert {t[0] for t in CORE_INPUTS} <= set(model["inputs"])
    assert {t[0] for t in CORE_OUTPUTS} <= set(model["outputs"])
    assert {target for target, _ in SAMPLING.values()} <= set(model["inputs"])
    assert set(OUTPUT_NAMES) <= set(model["outputs"])
