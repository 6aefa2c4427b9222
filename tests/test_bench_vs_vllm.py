"""scripts/bench_vs_vllm.py: options, the shared prompts and the ratio table (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("bench_vs_vllm", ROOT / "scripts/bench_vs_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_issue_workloads() -> None:
    script = _script()
    args = script.parse_args([])
    assert (args.throughput_requests, args.throughput_input, args.throughput_output) == (32, 128, 64)
    assert (args.prefix_requests, args.prefix_len, args.prefix_unique, args.prefix_output) == (64, 1024, 32, 16)
    assert (args.served_concurrency, args.served_input, args.served_output) == (32, 128, 64)
    assert args.only == ["throughput", "prefix", "served"] and args.sides == ["vllm", "trtprompt"]
    assert (args.model, args.dtype, args.engine) == ("peer", "fp32", ROOT / "build/peer-engine")
    assert args.out_dir == ROOT / "build/bench-vs-vllm" and args.vllm_venv == ROOT.parent / "peers/vllm-venv"
    # 64 sequences of 1,072 tokens, each rounded up to whole 32-token blocks (34 blocks).
    assert script.kv_pool_tokens(args) == 64 * 34 * 32


@pytest.mark.parametrize("argv, message", [
    (["--only", "throughput,decode"], "--only"),
    (["--sides", ""], "--sides"),
    (["--reps", "0"], "--reps"),
    (["--prefix-len", "2040"], "max_seq_len"),
])
def test_bad_options_are_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _script().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_runs_as_a_script() -> None:
    import subprocess

    res = subprocess.run([sys.executable, str(ROOT / "scripts/bench_vs_vllm.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--install-vllm" in res.stdout


def test_offline_prompts_share_the_prefix_and_change_every_rep(tmp_path: Path) -> None:
    script = _script()
    args = script.parse_args(["--reps", "2", "--prefix-requests", "3", "--prefix-len", "40",
                              "--prefix-unique", "5", "--throughput-requests", "2", "--throughput-input", "7"])
    spec = script.offline_spec(args, (7, 4000))
    prefix = spec["workloads"]["prefix"]
    reps = prefix["reps"]
    assert len(reps) == 2 and all(len(p) == 45 for rep in reps for p in rep)
    assert all(p[:40] == reps[0][0][:40] for p in reps[0])  # one prefix within a rep
    assert reps[0][0][:40] != reps[1][0][:40] != prefix["warmup"][0][:40]  # new to the cache each rep
    assert prefix["max_tokens"] == 16
    ids = [t for rep in spec["workloads"]["throughput"]["reps"] for p in rep for t in p]
    assert len(ids) == 2 * 2 * 7 and min(ids) >= 7 and max(ids) < 4000
    # Deterministic: the same options give the same prompts (both sides read one file anyway).
    assert json.dumps(spec) == json.dumps(script.offline_spec(args, (7, 4000)))


def test_token_range_skips_special_tokens(tiny_checkpoint_factory) -> None:
    path = tiny_checkpoint_factory("llama")
    low, high = _script().token_range(path)
    config = json.loads((path / "config.json").read_text())
    assert (low, high) == (7, config["vocab_size"])


def test_table_ratios_are_trtprompt_over_vllm() -> None:
    script = _script()
    args = script.parse_args(["--only", "throughput,prefix"])
    results = {
        "vllm": {"throughput": [{"output_tok_s": 800.0}, {"output_tok_s": 900.0}, {"output_tok_s": 700.0}],
                 "prefix": [{"wall_s": 1.5, "mean_ttft_s": 0.8}]},
        "trtprompt": {"throughput": [{"output_tok_s": 1000.0}],
                      "prefix": [{"wall_s": 1.2, "mean_ttft_s": None}]},
    }
    table = script.rows(args, results)
    assert [(r["metric"], r["vllm"], r["trtprompt"]) for r in table] == [
        ("output tok/s", 800.0, 1000.0), ("wall s", 1.5, 1.2), ("mean TTFT s", 0.8, None)]
    assert table[0]["ratios"]["vllm"] == pytest.approx(1.25) and table[1]["ratios"]["vllm"] == pytest.approx(0.8)
    assert table[2]["ratios"]["vllm"] is None
    text = script.markdown(table, args.sides)
    assert "| 1000 | 1.25× (higher is better) |" in text and "| 0.8 | — | — |" in text


def test_greedy_agreement_counts_matching_tokens() -> None:
    results = {"vllm": {"throughput": [{"tokens": [[1, 2, 3], [4, 5, 6]]}]},
               "trtprompt": {"throughput": [{"tokens": [[1, 2, 3], [4, 9, 6]]}]}}
    assert _script().greedy_agreement(results, "vllm") == {"sequences": 2, "identical": 1, "tokens_equal": 5,
                                                           "tokens": 6}
    assert _script().greedy_agreement({"vllm": {}, "trtprompt": {}}, "vllm") is None
