"""The peer side-by-side with --model / --dtype / llama.cpp: options, each peer's command line, the three-side
table and the machine line (no peer started; llamacpp_side.py's pure parts too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trtprompt.bench import machine
from trtprompt.bench.peers import (
    llamacpp_side,
    offline_loop,
    report,
    sidebyside,
    trtprompt_side,
    vllm_side,
)
from trtprompt.engine import isa

ROOT = Path(__file__).resolve().parent.parent


def _args(*argv: str):
    return sidebyside.parse_args(list(argv))


def test_model_and_dtype_pick_checkpoint_engine_and_peers_dir(tmp_path: Path) -> None:
    args = _args("--model", "smollm2", "--dtype", "bf16", "--peers-dir", str(tmp_path))
    assert args.checkpoint == ROOT / "build/smollm2" and args.engine == ROOT / "build/smollm2-engine-bf16"
    assert args.vllm_venv == tmp_path / "vllm-venv"
    assert _args("--dtype", "int8", "--sides", "trtprompt").engine == ROOT / "build/peer-engine-int8_w8a8"
    assert _args("--dtype", "int8", "--sides", "trtprompt", "--int8-quantization", "int4_wo").engine == \
        ROOT / "build/peer-engine-int4_wo"


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
    ("int8", ["--dtype", trtprompt_side.int8_dtype(), "--quantization", "int8_w8a8"], None, "q8_0"),
])
def test_each_side_runs_the_precision_asked(dtype: str, trt_flags: list[str], vllm_dtype: str | None,
                                            gguf: str, tmp_path: Path) -> None:
    sides = "trtprompt,llamacpp" + (",vllm" if vllm_dtype else "")
    args = _args("--model", "smollm2", "--dtype", dtype, "--sides", sides, "--peers-dir", str(tmp_path))
    build = [str(c) for c in trtprompt_side.build_cmd(args)]
    i = build.index("--dtype")
    assert build[i:i + len(trt_flags)] == trt_flags and str(args.checkpoint) in build
    llama = llamacpp_side.side_server_cmd(args, 8080)
    assert llama[llama.index("-m") + 1] == str(tmp_path / f"llamacpp/gguf/smollm2-{gguf}.gguf")
    if vllm_dtype:
        vllm = [str(c) for c in vllm_side.server_cmd(args, 8000)]
        assert vllm[vllm.index("--dtype") + 1] == vllm_dtype


def test_int8_engines_keep_bf16_around_int8_where_the_cpu_has_it() -> None:
    args = _args("--dtype", "int8", "--sides", "trtprompt", "--int8-quantization", "int8_wo")
    assert trtprompt_side.precision_flags(args) == ["--dtype", trtprompt_side.int8_dtype(), "--quantization", "int8_wo"]
    assert trtprompt_side.int8_dtype() == ("float32" if isa.bf16_problem(isa.cpu_flags()) else "bfloat16")


def test_trtprompt_decodes_plainly_unless_asked() -> None:
    args = _args("--compute-dtype", "bfloat16")
    for cmd in (trtprompt_side.offline_cmd(args, Path("p.json"), Path("r.json")), trtprompt_side.server_cmd(args, 1)):
        text = [str(c) for c in cmd]
        assert text[text.index("--speculative-decoding") + 1] == "none"
        assert text[text.index("--compute-dtype") + 1] == "bfloat16"
    ngram = [str(c) for c in trtprompt_side.server_cmd(_args("--speculative-decoding", "ngram"), 1)]
    assert ngram[ngram.index("--speculative-decoding") + 1] == "ngram" and "--compute-dtype" not in ngram


def test_llama_server_uses_every_core_32_slots_and_room_for_the_prefix_workload(tmp_path: Path) -> None:
    args = _args("--sides", "trtprompt,llamacpp", "--threads", "2", "--peers-dir", str(tmp_path))
    cmd = llamacpp_side.side_server_cmd(args, 8080)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("-t"), flag("-tb"), flag("-np"), flag("--cache-reuse"), flag("--port")) == ("2", "2", "32",
                                                                                              "256", "8080")
    assert "-cb" in cmd and cmd[0] == str(tmp_path / "llamacpp/build/bin/llama-server")
    # -c is split over the 32 slots: each holds 1,024 + 32 + 16 = 1,072 tokens, rounded up to 1,280.
    assert int(flag("-c")) == 32 * 1280 and int(flag("-c")) // 32 >= 1072


def test_vllm_binds_every_core_and_sizes_its_kv_cache_from_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}))
    args = _args("--checkpoint", str(tmp_path), "--threads", "2")
    env = vllm_side.env(args)
    # 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes x 64 x 1,088 tokens = 2.99 GiB -> 3.
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert vllm_side.env(_args("--checkpoint", str(tmp_path), "--dtype", "bf16"))["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_table_has_a_ratio_per_peer_and_flags_a_side_under_its_cores() -> None:
    args = _args("--only", "throughput", "--sides", "vllm,trtprompt,llamacpp")
    results = {"vllm": {"throughput": [{"output_tok_s": 200.0, "cores_busy": 1.9}]},
               "trtprompt": {"throughput": [{"output_tok_s": 300.0, "cores_busy": 1.95}]},
               "llamacpp": {"throughput": [{"output_tok_s": 100.0, "cores_busy": 1.0}]}}
    table = report.rows(args, results)
    assert table[0]["ratios"] == {"vllm": pytest.approx(1.5), "llamacpp": pytest.approx(3.0)}
    text = report.markdown(table, args.sides)
    assert "| vLLM CPU | trtprompt | llama.cpp | trtprompt / vLLM CPU | trtprompt / llama.cpp |" in text
    assert "| 200 | 300 | 100 | 1.50× (higher is better) | 3.00× (higher is better) |" in text
    line = report.cores_line(table, args.sides, 2)
    assert "vllm 1.90, trtprompt 1.95, llamacpp 1.00 (UNDER 2 CORES: llamacpp)" in line


def test_the_report_opens_with_the_machine_line() -> None:
    args = _args("--only", "throughput", "--sides", "trtprompt")
    info = machine.describe()
    text = sidebyside.report_text(args, info, report.rows(args, {"trtprompt": {}}), ["a note"])
    assert text.splitlines()[0] == f"machine: {machine.one_line(info)}"
    assert text.splitlines()[-1] == "a note" and "trtprompt build: " in text


def test_tree_cpu_seconds_counts_a_busy_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.6: pass"])
    try:
        t0, before = time.perf_counter(), offline_loop.tree_cpu_seconds(os.getpid())
        deadline = time.monotonic() + 30
        while offline_loop.tree_cpu_seconds(os.getpid()) - before < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert offline_loop.tree_cpu_seconds(os.getpid()) - before >= 0.2, time.perf_counter() - t0
    finally:
        child.wait(timeout=30)


def test_one_at_a_time_sends_each_prompt_alone_and_keeps_each_ones_pace() -> None:
    seen = []

    def run(prompts, max_tokens):
        seen.append(len(prompts))
        return {"wall_s": 0.1, "output_tokens": max_tokens, "mean_ttft_s": 0.01 * len(seen),
                "tokens": [[1] * max_tokens], "ms_per_token": [10.0 * len(seen)]}

    out = offline_loop.one_at_a_time(run, [[5], [6], [7]], 4)
    assert seen == [1, 1, 1] and out["output_tokens"] == 12 and out["ms_per_token"] == [10.0, 20.0, 30.0]
    assert out["mean_ttft_s"] == pytest.approx(0.02) and len(out["tokens"]) == 3
    assert offline_loop.ms_per_token(1.0, 1.3, 4) == pytest.approx(100.0)
    assert offline_loop.ms_per_token(1.0, 1.0, 1) is None and offline_loop.ms_per_token(None, 2.0, 5) is None


def test_llamacpp_completion_body_is_greedy_fixed_length_and_cached() -> None:
    body = llamacpp_side.completion_body([5, 6, 7], 16)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 16 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["cache_prompt"] is True and body["stream"] is True


def test_llamacpp_convert_and_build_command_lines(tmp_path: Path) -> None:
    paths = llamacpp_side.LlamaPaths(tmp_path)
    cmd = llamacpp_side.convert_cmd(paths, Path("/venv/bin/python"), Path("/ckpt/smollm2"), "int8")
    assert cmd[1].endswith("vendor/llama.cpp/convert_hf_to_gguf.py") and cmd[cmd.index("--outtype") + 1] == "q8_0"
    assert cmd[cmd.index("--outfile") + 1] == str(tmp_path / "llamacpp/gguf/smollm2-q8_0.gguf")
    configure = llamacpp_side.cmake_configure_cmd(paths)
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"} <= set(configure)


def test_llamacpp_stream_tokens_are_counted_once() -> None:
    merge = llamacpp_side.merge_tokens
    got = merge(merge([], {"tokens": [4], "stop": False}), {"tokens": [5], "stop": False})
    assert got == [4, 5]
    assert merge(got, {"tokens": [4, 5, 6], "stop": True, "tokens_predicted": 3}) == [4, 5, 6]  # all again
    assert merge(got, {"tokens": [6], "stop": True, "tokens_predicted": 3}) == [4, 5, 6]  # only the last


def test_a_scenario_result_is_printed_and_written_with_the_machine(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    machine.print_and_write({"tok_s": 1.5, "args": {"reps": "2"}}, out)
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text(encoding="utf-8"))
    assert printed["tok_s"] == 1.5 and printed["machine"]["cores"] == machine.describe()["cores"]
    machine.print_and_write({"tok_s": 2.0}, None)  # no --out: printed only
    assert json.loads(capsys.readouterr().out)["tok_s"] == 2.0
