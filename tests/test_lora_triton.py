"""tensorrtllm_backend's lora_task_id / lora_weights / lora_config on the real server (tests/serve_fixtures.py's
session server: the tiny llama engine, float32), with TensorRT-LLM's cache semantics: the first request sends
the adapter, later ones the task id alone, an unknown task id is refused naming lora_task_id. The oracle is
transformers + PEFT (unmerged). Also the trtllm and llmapi targets' LoRA settings (docs/lora.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from lora_adapters import make_peft_adapter, peft_greedy_jobs
from serve_fixtures import Oracle, Served

from trtprompt.client import LLMClient, make_input, text_inputs, token_inputs
from trtprompt.engine.lora.adapter import WEIGHTS_FILE, read_peft_dir
from trtprompt.engine.lora.trtllm_format import to_trtllm
from trtprompt.serve.wire import protocol as P

PROMPT = "The capital of France is"
MAX_TOKENS = 8
NAMES = json.loads((Path(__file__).parent / "fixtures" / "trtllm_names.json").read_text())["releases"]
TASK_IDS = (4101, 4102, 4103)  # the task ids these tests send weights for


@pytest.fixture(scope="module", autouse=True)
def forget_task_adapters(served: Served) -> Iterator[None]:
    """The session server is shared: the adapters sent here are unloaded after the module, so the next modules
    see the engine's own adapters only (/v1/models lists every adapter the engine knows)."""
    yield
    for task_id in TASK_IDS:
        try:
            P.call(served.socket_path, {"op": "lora_unload", "name": str(task_id)})
        except P.EngineError:
            pass  # never sent (a test failed first), or refused: nothing to forget


@pytest.fixture(scope="module")
def peft_dir(tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter of the served engine's checkpoint, its weights rounded to float16 (the input's type, as
    tensorrtllm_backend declares it), so the tensors sent carry exactly the adapter PEFT runs."""
    import torch
    from safetensors.torch import load_file, save_file

    out = make_peft_adapter(tiny_checkpoint_factory("llama"), tmp_path_factory.mktemp("lora") / "a", rank=4,
                            modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                            seed=11, scale=0.2)
    tensors = {k: v.to(torch.float16).to(torch.float32) for k, v in load_file(str(out / WEIGHTS_FILE)).items()}
    save_file(tensors, str(out / WEIGHTS_FILE))
    return out


@pytest.fixture(scope="module")
def tensors(served: Served, peft_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights float16, lora_config) of the adapter, as TensorRT-LLM's converter lays them out, each with
    its batch dimension (one request)."""
    from trtprompt.engine.config import ModelConfig
    from trtprompt.engine.engine_dir import read_engine_dir

    cfg = ModelConfig.from_pretrained_config(read_engine_dir(served.engine_dir, None,
                                                              verify_weights=False).pretrained_config)
    weights, config = to_trtllm(read_peft_dir("a", peft_dir, cfg, 64), np.float16)
    return weights[None], config[None]


@pytest.fixture(scope="module")
def expected(tiny_checkpoint_factory: Callable[..., Path], peft_dir: Path, oracle: Oracle) -> dict[str, list[int]]:
    ids = oracle.tokenizer.encode(PROMPT)
    base, lora = peft_greedy_jobs(tiny_checkpoint_factory("llama"), {"a": peft_dir}, [(None, ids), ("a", ids)],
                                  MAX_TOKENS)
    assert base != lora  # the adapter changes the answer: the comparison below shows it was applied
    return {"base": base, "lora": lora, "prompt": ids}


def _lora_inputs(lora: dict[str, Any]) -> list[Any]:
    return [make_input(name, value, np.uint64 if name == "lora_task_id" else None) for name, value in lora.items()]


def _text(served: Served, stream: bool, **lora: Any) -> Any:
    with LLMClient(served.url) as client:
        return client.infer("ensemble", text_inputs(PROMPT, MAX_TOKENS, stream, temperature=0.0,
                                                    exclude_input_in_output=True, speculative_decoding=False)
                            + _lora_inputs(lora), 60.0)


def _tokens(served: Served, ids: list[int], **lora: Any) -> Any:
    extra = _lora_inputs(lora)
    with LLMClient(served.url) as client:
        return client.infer("tensorrt_llm", token_inputs(ids, MAX_TOKENS, False, temperature=0.0,
                                                         speculative_decoding=False)
                            + [make_input("exclude_input_in_output", True)] + extra, 60.0)


def test_weights_once_then_task_id_alone(served: Served, tensors: tuple[np.ndarray, np.ndarray],
                                         expected: dict[str, list[int]]) -> None:
    weights, config = tensors
    first = _tokens(served, expected["prompt"], lora_task_id=4101, lora_weights=weights, lora_config=config)
    assert first.error is None, first.error
    assert first.output_ids == expected["lora"]
    again = _tokens(served, expected["prompt"], lora_task_id=4101)  # cached: the id alone
    assert again.error is None, again.error
    assert again.output_ids == expected["lora"]
    base = _tokens(served, expected["prompt"])
    assert base.output_ids == expected["base"]
    listed = {a["name"]: a for a in P.call(served.socket_path, {"op": "lora_list"})["adapters"]}
    assert listed["4101"]["source"] is None and listed["4101"]["rank"] == 4  # sent as weights


def test_ensemble_takes_the_task_id(served: Served, tensors: tuple[np.ndarray, np.ndarray],
                                    expected: dict[str, list[int]], oracle: Oracle) -> None:
    weights, config = tensors
    sent = _text(served, False, lora_task_id=4102, lora_weights=weights, lora_config=config)
    alone = _text(served, True, lora_task_id=4102)
    base = _text(served, False)
    assert sent.error is None and alone.error is None, (sent.error, alone.error)
    assert sent.text == alone.text != base.text
    assert oracle.tokenizer.decode(expected["lora"]).strip() == sent.text.strip()


def test_unknown_task_id_without_weights(served: Served, expected: dict[str, list[int]]) -> None:
    result = _tokens(served, expected["prompt"], lora_task_id=999001)
    assert result.error is not None
    assert ("input 'lora_task_id': LoRA task 999001 not found in cache. Please send LoRA weights with request"
            in result.error), result.error
    assert "[invalid_argument]" in result.error
    served.assert_healthy()


def test_malformed_inputs_are_refused_by_name(served: Served, tensors: tuple[np.ndarray, np.ndarray],
                                              expected: dict[str, list[int]]) -> None:
    weights, config = tensors
    ids = expected["prompt"]
    bad_module = config.copy()
    bad_module[0, 0, 0] = 13  # moe_h_to_4h: not a module of this engine
    cases = [
        (dict(lora_task_id=4103, lora_weights=weights), "input 'lora_config' is required with 'lora_weights'"),
        (dict(lora_weights=weights, lora_config=config), "input 'lora_task_id' must be set for LoRA inference"),
        (dict(lora_task_id=4103, lora_weights=weights[:, :-1], lora_config=config),
         f"inputs 'lora_weights' ({config.shape[1] - 1} rows) and 'lora_config' ({config.shape[1]} rows)"),
        (dict(lora_task_id=4103, lora_weights=weights[:, :, :10], lora_config=config),
         "input 'lora_weights' row 0 has 10 values"),
        (dict(lora_task_id=4103, lora_weights=weights, lora_config=bad_module),
         "input 'lora_config' row 0 has module_id 13"),
        (dict(lora_task_id=4103, lora_weights=weights, lora_config=np.zeros((1, config.shape[1], 4), np.int32)),
         "lora_config"),  # Triton's own shape check names the input ([-1, 3] declared)
    ]
    for given, needle in cases:
        result = _tokens(served, ids, **given)
        assert result.error is not None and needle in result.error, (needle, result.error)
    refused = _tokens(served, ids, lora_task_id=4103)  # nothing refused reached the engine's cache
    assert refused.error is not None and "LoRA task 4103 not found in cache" in refused.error


def test_trtllm_target_lora_cache_parameters(tmp_path: Path) -> None:
    """An engine built with the lora plugin gets the backend's LoRA cache parameters (names 1.2 reads), sized
    from its max_lora_rank and target modules and max_cpu_loras; one without gets none."""
    from trtprompt.serve.launch.trtllm_model_config import LORA_CACHE_FIELDS, TrtllmModelParams

    fixture = json.loads((Path(__file__).parent / "fixtures" / "trtllm" / "good" / "config.json").read_text())
    pretrained, build = fixture["pretrained_config"], fixture["build_config"]
    plain = TrtllmModelParams.from_engine(tmp_path, pretrained, build, {}).parameters()
    assert not set(LORA_CACHE_FIELDS) & set(plain)
    build = build | {"plugin_config": {**build["plugin_config"], "lora_plugin": "auto"},
                     "lora_config": {"max_lora_rank": 16, "lora_target_modules": ["attn_q", "attn_v"]}}
    params = TrtllmModelParams.from_engine(tmp_path, pretrained, build, {"max_cpu_loras": 4}).parameters()
    assert params["lora_cache_max_adapter_size"] == "16" and params["lora_cache_optimal_adapter_size"] == "8"
    h = int(pretrained["hidden_size"])
    heads = int(pretrained["num_attention_heads"])
    d = int(pretrained.get("head_size") or h // heads)
    kv = int(pretrained.get("num_key_value_heads") or heads) * d
    width = {"float16": 2, "bfloat16": 2, "float32": 4}[pretrained["dtype"]]
    per = int(pretrained["num_hidden_layers"]) * 16 * ((h + heads * d) + (h + kv)) * width
    assert params["lora_cache_host_memory_bytes"] == str(4 * per)
    assert set(LORA_CACHE_FIELDS) <= set(NAMES["1.2.1"]["config_pbtxt_parameters"]["names"])


def test_llmapi_lora_config(llmapi_engine: Path, peft_dir: Path, tmp_path: Path) -> None:
    """The llmapi target's model.yaml carries lora_config for an engine directory with adapters: lora_dir,
    its modules under TensorRT-LLM's names, max_lora_rank and the serve options, every name recorded."""
    from trtprompt.engine.engine_dir import read_engine_dir
    from trtprompt.serve.launch.llmapi_repository import serve_model_yaml
    from trtprompt.serve.launch.options import resolve_options

    engine = read_engine_dir(llmapi_engine, None, verify_weights=False)
    assert "lora_config" not in serve_model_yaml(engine, resolve_options(engine, {}))
    copy = tmp_path / "engine"
    shutil.copytree(llmapi_engine, copy)
    shutil.copytree(peft_dir, copy / "lora" / "fr")
    engine = read_engine_dir(copy, None, verify_weights=False)
    lora = serve_model_yaml(engine, resolve_options(engine, {"max_loras": 3, "max_cpu_loras": 5}))["lora_config"]
    assert lora == {"lora_dir": [str(copy / "lora" / "fr")], "max_lora_rank": 64, "max_loras": 3, "max_cpu_loras": 5,
                    "lora_target_modules": sorted(["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h",
                                                   "mlp_gate", "mlp_4h_to_h"])}
    assert {f"lora_config.{k}" for k in lora} | {"lora_config"} <= set(NAMES["1.4.0rc4"]["llm_args"])
