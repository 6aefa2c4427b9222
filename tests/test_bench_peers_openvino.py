"""OpenVINO GenAI as a side of the peer side-by-side (trtprompt/bench/peers/openvino_side.py, openvino_worker.py):
its options, command line, KV cache size, result parsing, the OVMS finding, and that every side reads the same
token ids. One smoke run of the worker in the OpenVINO venv, where that venv and the SmolLM2 export exist."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trtprompt.bench.peers import openvino_side, openvino_worker, report, sidebyside, workloads

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "peers"
SMOLLM2_SHAPE = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}


def _args(*argv: str) -> argparse.Namespace:
    return sidebyside.parse_args(["--sides", "trtprompt,openvino", *argv])


def _flag(cmd: list, name: str) -> str:
    text = [str(c) for c in cmd]
    return text[text.index(name) + 1]


@pytest.mark.parametrize("dtype, flags, hint", [
    ("fp32", {"avx512_bf16"}, "f32"),
    ("bf16", set(), "bf16"),
    ("int8", {"avx512f", "amx_bf16"}, "bf16"),  # int8 weights, the rest of the step in bf16 where the CPU has it
    ("int8", {"avx2", "avx512f"}, "f32"),
])
def test_precision_hint_follows_the_dtype_and_the_cpu(dtype: str, flags: set[str], hint: str) -> None:
    assert openvino_side.precision_hint(dtype, flags) == hint


def test_paths_default_under_the_peers_dir_and_int8_has_its_own_export(tmp_path: Path) -> None:
    args = _args("--model", "smollm2", "--peers-dir", str(tmp_path))
    assert (args.ov_venv, args.ov_model_dir) == (tmp_path / "ov-venv", tmp_path / "openvino")
    paths = openvino_side.paths(args)
    assert paths.model_dir(args.checkpoint, "fp32") == paths.model_dir(args.checkpoint, "bf16") \
        == tmp_path / "openvino/smollm2-fp32"  # bf16 is the fp32 IR with a bf16 hint
    cmd = openvino_side.export_cmd(paths, args.checkpoint, "int8")
    assert cmd[:3] == [str(tmp_path / "ov-venv/bin/optimum-cli"), "export", "openvino"]
    assert _flag(cmd, "--weight-format") == "int8" and cmd[-1] == str(tmp_path / "openvino/smollm2-int8")
    assert _flag(cmd, "--task") == "text-generation-with-past" and _flag(cmd, "--model") == str(args.checkpoint)


def test_an_existing_export_is_never_redone(tmp_path: Path) -> None:
    paths = openvino_side.OvPaths(tmp_path / "no-venv", tmp_path)
    done = tmp_path / "smollm2-int8"
    done.mkdir()
    (done / "openvino_model.xml").write_text("<net/>")
    # The venv does not exist: any export attempt would fail.
    assert openvino_side.ensure_export(paths, Path("/ckpt/smollm2"), "int8") == done


def test_every_dtype_is_accepted_with_openvino_alone() -> None:
    for dtype in sidebyside.DTYPES:
        assert _args("--dtype", dtype).sides == ["trtprompt", "openvino"]


def test_the_worker_command_carries_threads_precision_and_cache(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    args = _args("--checkpoint", str(tmp_path), "--dtype", "bf16", "--threads", "2", "--ov-kv-precision", "u8",
                 "--peers-dir", str(tmp_path))
    cmd = openvino_side.offline_cmd(args, Path("/p.json"), Path("/r.json"))
    assert cmd[:2] == [tmp_path / "ov-venv/bin/python", openvino_side.WORKER]
    assert openvino_side.WORKER.parent == ROOT / "trtprompt/bench/peers" and openvino_side.WORKER.exists()
    assert (_flag(cmd, "--prompts"), _flag(cmd, "--threads"), _flag(cmd, "--precision-hint"),
            _flag(cmd, "--kv-precision")) == ("/p.json", "2", "bf16", "u8")
    assert _flag(cmd, "--model") == str(tmp_path / f"openvino/{tmp_path.name}-fp32")


def test_cache_size_holds_the_prefix_workload_within_half_the_memory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    args = _args("--checkpoint", str(tmp_path))
    # 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes x 64 x 1,088 tokens = 2.99 GiB -> 3; in bf16 1.5 -> 2.
    assert openvino_side.cache_gb(args, machine_gib=64) == 3
    assert openvino_side.cache_gb(_args("--checkpoint", str(tmp_path), "--dtype", "bf16"), machine_gib=64) == 2
    assert openvino_side.cache_gb(args, machine_gib=4) == 2  # half of a small machine
    assert openvino_side.cache_gb(_args("--checkpoint", str(tmp_path), "--ov-cache-gb", "7"), machine_gib=4) == 7


def test_worker_options_and_scheduler_settings() -> None:
    args = openvino_worker.parse_args(["--prompts", "p", "--out", "r", "--model", "m", "--precision-hint", "bf16"])
    assert args.kv_precision == "bf16"  # the KV follows the hint unless told
    assert openvino_worker.properties(args) == {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "bf16",
                                                "KV_CACHE_PRECISION": "bf16"}
    spec = {"max_num_tokens": workloads.MAX_NUM_TOKENS, "max_batch_size": workloads.MAX_BATCH}
    assert openvino_worker.scheduler_settings(spec, 3) == {
        "max_num_batched_tokens": 2048, "max_num_seqs": 64, "enable_prefix_caching": True,
        "dynamic_split_fuse": True, "cache_size": 3}


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--cache-gb", "0"], ["--precision-hint", "f16"]])
def test_worker_refuses_bad_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        openvino_worker.parse_args(["--prompts", "p", "--out", "r", "--model", "m", *argv])
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_worker_tracks_each_requests_first_and_last_token() -> None:
    first, second = openvino_worker.Track(), openvino_worker.Track()
    first.add([5], 0.1)
    first.add([], 0.15)  # a step that gave it nothing
    first.add([6, 7], 0.3)
    second.add([9], 0.2)
    out = openvino_worker.summarise([first, second], 0.5)
    assert out["tokens"] == [[5, 6, 7], [9]] and out["output_tokens"] == 4 and out["wall_s"] == 0.5
    assert out["mean_ttft_s"] == pytest.approx(0.15)
    assert out["ms_per_token"][0] == pytest.approx(100.0) and out["ms_per_token"][1] is None


def test_result_parsing_takes_only_an_openvino_result() -> None:
    good = {"side": "openvino", "versions": {"openvino_genai": "2026.4.1"}, "throughput": [{"output_tokens": 8}]}
    assert openvino_side.parse_result(json.dumps(good))["throughput"] == [{"output_tokens": 8}]
    with pytest.raises(ValueError, match="not an OpenVINO worker result"):
        openvino_side.parse_result(json.dumps({**good, "side": "vllm"}))
    with pytest.raises(ValueError, match="prefix must be a list of reps"):
        openvino_side.parse_result(json.dumps({**good, "prefix": {"wall_s": 1.0}}))


def test_every_side_reads_the_same_token_ids(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    args = _args("--sides", "vllm,trtprompt,openvino", "--peers-dir", str(tmp_path), "--checkpoint", str(tmp_path))
    prompts = tmp_path / "offline-prompts.json"
    for side, (make_cmd, _env) in sidebyside.OFFLINE_WORKERS.items():
        assert _flag(make_cmd(args, prompts, tmp_path / f"{side}.json"), "--prompts") == str(prompts), side
    # llama.cpp's offline run reads the file itself: run_offline(args, prompts).
    assert list(sidebyside.OFFLINE_WORKERS) == ["trtprompt", "vllm", "openvino"]


def test_ovms_is_reported_as_not_installable_and_leaves_its_served_cell_empty() -> None:
    args = _args("--only", "throughput,served")
    results = {"trtprompt": {"throughput": [{"output_tok_s": 10.0, "output_tokens": 8, "tokens": [[1] * 8]}],
                             "served": [{"output_tok_s": 9.0, "mean_ttft_s": 0.2}]},
               "openvino": {"throughput": [{"output_tok_s": 12.0, "output_tokens": 8, "tokens": [[1] * 8]}]}}
    assert openvino_side.OVMS_NOTE.startswith("OVMS: not installable from the package registries here")
    spec = {"workloads": {"throughput": {"max_tokens": 8, "reps": [[[3, 4]]]}}}
    assert openvino_side.OVMS_NOTE in sidebyside.notes(args, results, spec)
    served_row = report.rows(args, results)[1]
    assert served_row["metric"] == "output tok/s" and served_row["openvino"] is None
    assert served_row["ratios"]["openvino"] is None
    assert openvino_side.OVMS_NOTE not in sidebyside.notes(_args("--only", "throughput"), results, spec)


def test_wrong_output_lengths_are_named() -> None:
    spec = {"workloads": {"throughput": {"max_tokens": 4, "reps": [[[1], [2]], [[3], [4]]]}}}
    results = {"openvino": {"throughput": [{"output_tokens": 8}, {"output_tokens": 7}]}}
    assert report.length_problems(results, spec) == ["openvino throughput rep 1: 7 output tokens, expected 8"]


@pytest.mark.parametrize("worker, argv", [("openvino_worker.py", ["--help"]),
                                          ("vllm_worker.py", ["offline", "--help"])])
def test_a_peer_worker_runs_by_path_without_site_packages(worker: str, argv: list[str]) -> None:
    # -S: no site-packages, so no trtprompt, torch or numpy: what the peer's own venv lacks.
    res = subprocess.run([sys.executable, "-S", "-E", "-s", str(ROOT / "trtprompt/bench/peers" / worker), *argv],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert res.returncode == 0, res.stderr
    assert "--prompts" in res.stdout


OV_PYTHON = PEERS / "ov-venv/bin/python"
OV_MODEL = PEERS / "openvino/smollm2-fp32"
SMOLLM2 = ROOT / "build/smollm2"


@pytest.mark.skipif(not (OV_PYTHON.exists() and (OV_MODEL / "openvino_model.xml").exists()
                         and (SMOLLM2 / "tokenizer.json").exists()),
                    reason="needs ../peers/ov-venv, its SmolLM2 export and build/smollm2 (docs/peer-openvino.md)")
def test_the_worker_runs_in_the_openvino_venv(tmp_path: Path) -> None:
    args = argparse.Namespace(only=["throughput"], reps=1, throughput_requests=2, throughput_input=16,
                              throughput_output=4)
    spec = workloads.offline_spec(args, workloads.token_range(SMOLLM2))
    prompts, out = tmp_path / "prompts.json", tmp_path / "result.json"
    prompts.write_text(json.dumps(spec), encoding="utf-8")
    subprocess.run([str(OV_PYTHON), str(openvino_side.WORKER), "--prompts", str(prompts), "--out", str(out),
                    "--model", str(OV_MODEL), "--cache-gb", "1"], check=True, capture_output=True, timeout=300)
    result = openvino_side.parse_result(out.read_text(encoding="utf-8"))
    rep = result["throughput"][0]
    assert rep["output_tokens"] == 8 and [len(t) for t in rep["tokens"]] == [4, 4]  # exactly the asked lengths
    assert len(rep["ms_per_token"]) == 2 and rep["mean_ttft_s"] > 0
    assert report.length_problems({"openvino": result}, spec) == []
