"""scripts/bench_vs_vllm.py with --model / --dtype / llama.cpp: options, each peer's command line, the
three-side table and the CPU check (no peer started; scripts/peer_llamacpp.py's pure parts too)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(*argv: str):
    return _load("bench_vs_vllm").parse_args(list(argv))


def test_model_and_dtype_pick_checkpoint_engine_and_peers_dir(tmp_path: Path) -> None:
    args = _args("--model", "smollm2", "--dtype", "bf16", "--peers-dir", str(tmp_path))
    assert args.checkpoint == ROOT / "build/smollm2" and args.engine == ROOT / "build/smollm2-engine-bf16"
    assert args.vllm_venv == tmp_path / "vllm-venv"
    assert _args("--dtype", "int8", "--sides", "trtprompt").engine == ROOT / "build/peer-engine-int8"


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int8"], "vllm has no such precision"),
    (["--sides", "vllm,llamacpp"], "trtprompt is what the others"),
    (["--model", "gpt2"], "--model"),
    (["--dtype", "fp16"], "--dtype"),
    (["--sides", "trtprompt,sglang"], "--sides"),
])
def test_bad_model_dtype_or_sides_are_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _args(*argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("dtype, trt_flags, vllm_dtype, gguf", [
    ("fp32", ["--dtype", "float32"], "float32", "f32"),
    ("bf16", ["--dtype", "bfloat16"], "bfloat16", "bf16"),
    ("int8", ["--dtype", "float32", "--quantization", "int8_w8a8"], None, "q8_0"),
])
def test_each_side_runs_the_precision_asked(dtype: str, trt_flags: list[str], vllm_dtype: str | None,
                                            gguf: str, tmp_path: Path) -> None:
    script = _load("bench_vs_vllm")
    sides = "trtprompt,llamacpp" + (",vllm" if vllm_dtype else "")
    args = script.parse_args(["--model", "smollm2", "--dtype", dtype, "--sides", sides,
                              "--peers-dir", str(tmp_path)])
    build = [str(c) for c in script.build_cmd(args)]
    i = build.index("--dtype")
    assert build[i:i + len(trt_flags)] == trt_flags and str(args.checkpoint) in build
    llama = script.llama_server_cmd(args, 8080)
    assert llama[llama.index("-m") + 1] == str(tmp_path / f"llamacpp/gguf/smollm2-{gguf}.gguf")
    if vllm_dtype:
        vllm = [str(c) for c in script.vllm_server_cmd(args, 8000)]
        assert vllm[vllm.index("--dtype") + 1] == vllm_dtype


def test_llama_server_uses_every_core_32_slots_and_room_for_the_prefix_workload(tmp_path: Path) -> None:
    script = _load("bench_vs_vllm")
    args = script.parse_args(["--sides", "trtprompt,llamacpp", "--threads", "2", "--peers-dir", str(tmp_path)])
    cmd = script.llama_server_cmd(args, 8080)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("-t"), flag("-tb"), flag("-np"), flag("--cache-reuse"), flag("--port")) == ("2", "2", "32",
                                                                                              "256", "8080")
    assert "-cb" in cmd and cmd[0] == str(tmp_path / "llamacpp/build/bin/llama-server")
    # -c is split over the 32 slots: each holds 1,024 + 32 + 16 = 1,072 tokens, rounded up to 1,280.
    assert int(flag("-c")) == 32 * 1280 and int(flag("-c")) // 32 >= 1072


def test_vllm_binds_every_core_and_sizes_its_kv_cache_from_the_checkpoint(tmp_path: Path) -> None:
    script = _load("bench_vs_vllm")
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}))
    args = script.parse_args(["--checkpoint", str(tmp_path), "--threads", "2"])
    env = script.vllm_env(args)
    # 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes x 64 x 1,088 tokens = 2.99 GiB -> 3.
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    bf16 = script.parse_args(["--checkpoint", str(tmp_path), "--dtype", "bf16"])
    assert script.vllm_env(bf16)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_table_has_a_ratio_per_peer_and_flags_a_side_under_its_cores() -> None:
    script = _load("bench_vs_vllm")
    args = script.parse_args(["--only", "throughput", "--sides", "vllm,trtprompt,llamacpp"])
    results = {"vllm": {"throughput": [{"output_tok_s": 200.0, "cores_busy": 1.9}]},
               "trtprompt": {"throughput": [{"output_tok_s": 300.0, "cores_busy": 1.95}]},
               "llamacpp": {"throughput": [{"output_tok_s": 100.0, "cores_busy": 1.0}]}}
    table = script.rows(args, results)
    assert table[0]["ratios"] == {"vllm": pytest.approx(1.5), "llamacpp": pytest.approx(3.0)}
    text = script.markdown(table, args.sides)
    assert "| vLLM CPU | trtprompt | llama.cpp | trtprompt / vLLM CPU | trtprompt / llama.cpp |" in text
    assert "| 200 | 300 | 100 | 1.50× (higher is better) | 3.00× (higher is better) |" in text
    line = script.cores_line(table, args.sides, 2)
    assert "vllm 1.90, trtprompt 1.95, llamacpp 1.00 (UNDER 2 CORES: llamacpp)" in line


def test_cpu_flags_keep_the_isa_order() -> None:
    flags = _load("bench_vs_vllm").cpu_flags("model name : X\nflags : fpu amx_bf16 avx2 avx sse4_2 avx512f fma\n")
    assert flags == ["sse4_2", "avx", "avx2", "fma", "avx512f", "amx_bf16"]


def test_tree_cpu_seconds_counts_a_busy_child() -> None:
    worker = _load("bench_vs_vllm_worker")
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.6: pass"])
    try:
        t0, before = time.perf_counter(), worker.tree_cpu_seconds(os.getpid())
        deadline = time.monotonic() + 30
        while worker.tree_cpu_seconds(os.getpid()) - before < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.tree_cpu_seconds(os.getpid()) - before >= 0.2, time.perf_counter() - t0
    finally:
        child.wait(timeout=30)


def test_llamacpp_completion_body_is_greedy_fixed_length_and_cached() -> None:
    body = _load("peer_llamacpp").completion_body([5, 6, 7], 16)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 16 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["cache_prompt"] is True and body["stream"] is True


def test_llamacpp_convert_and_build_command_lines(tmp_path: Path) -> None:
    llama = _load("peer_llamacpp")
    paths = llama.LlamaPaths(tmp_path)
    cmd = llama.convert_cmd(paths, Path("/venv/bin/python"), Path("/ckpt/smollm2"), "int8")
    assert cmd[1].endswith("vendor/llama.cpp/convert_hf_to_gguf.py") and cmd[cmd.index("--outtype") + 1] == "q8_0"
    assert cmd[cmd.index("--outfile") + 1] == str(tmp_path / "llamacpp/gguf/smollm2-q8_0.gguf")
    configure = llama.cmake_configure_cmd(paths)
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"} <= set(configure)


def test_llamacpp_stream_tokens_are_counted_once() -> None:
    merge = _load("peer_llamacpp").merge_tokens
    got = merge(merge([], {"tokens": [4], "stop": False}), {"tokens": [5], "stop": False})
    assert got == [4, 5]
    assert merge(got, {"tokens": [4, 5, 6], "stop": True, "tokens_predicted": 3}) == [4, 5, 6]  # all again
    assert merge(got, {"tokens": [6], "stop": True, "tokens_predicted": 3}) == [4, 5, 6]  # only the last
