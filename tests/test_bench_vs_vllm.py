"""The peer side-by-side (trtprompt/bench/peers, scripts/bench_vs_vllm.py): options, the shared prompts and the
ratio table (no peer started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trtprompt.bench.peers import report, sidebyside, workloads

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_the_issue_workloads() -> None:
    args = sidebyside.parse_args([])
    assert (args.throughput_requests, args.throughput_input, args.throughput_output) == (32, 128, 64)
    assert (args.prefix_requests, args.prefix_len, args.prefix_unique, args.prefix_output) == (64, 1024, 32, 16)
    assert (args.latency_requests, args.latency_input, args.latency_output) == (4, 128, 128)
    assert (args.served_concurrency, args.served_input, args.served_output) == (32, 128, 64)
    assert args.only == ["throughput", "prefix", "served"] and args.sides == ["vllm", "trtprompt"]
    assert (args.model, args.dtype, args.engine) == ("peer", "fp32", ROOT / "build/peer-engine")
    assert args.out_dir == ROOT / "build/bench-vs-vllm" and args.vllm_venv == ROOT.parent / "peers/vllm-venv"
    assert args.speculative_decoding == "none"  # the peers do not speculate
    # 64 sequences of 1,072 tokens, each rounded up to whole 32-token blocks (34 blocks).
    assert workloads.kv_pool_tokens(args) == 64 * 34 * 32


def test_a_smoke_sized_prefix_workload_still_gets_one_full_sequence_of_pool() -> None:
    args = sidebyside.parse_args(["--prefix-requests", "2", "--prefix-len", "64"])
    assert workloads.kv_pool_tokens(args) == workloads.MAX_SEQ_LEN


@pytest.mark.parametrize("argv, message", [
    (["--only", "throughput,decode"], "--only"),
    (["--sides", ""], "--sides"),
    (["--reps", "0"], "--reps"),
    (["--prefix-len", "2040"], "max_seq_len"),
    (["--latency-input", "2000"], "latency workload exceeds"),
])
def test_bad_options_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sidebyside.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_runs_as_a_script() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "scripts/bench_vs_vllm.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--install-vllm" in res.stdout and "openvino" in res.stdout


def test_offline_prompts_share_the_prefix_and_change_every_rep() -> None:
    args = sidebyside.parse_args(["--reps", "2", "--prefix-requests", "3", "--prefix-len", "40",
                                  "--prefix-unique", "5", "--throughput-requests", "2", "--throughput-input", "7",
                                  "--only", "throughput,prefix,latency", "--latency-requests", "3",
                                  "--latency-input", "6"])
    spec = workloads.offline_spec(args, (7, 4000))
    assert list(spec["workloads"]) == ["throughput", "prefix", "latency"]  # the run order
    prefix = spec["workloads"]["prefix"]
    reps = prefix["reps"]
    assert len(reps) == 2 and all(len(p) == 45 for rep in reps for p in rep)
    assert all(p[:40] == reps[0][0][:40] for p in reps[0])  # one prefix within a rep
    assert reps[0][0][:40] != reps[1][0][:40] != prefix["warmup"][0][:40]  # new to the cache each rep
    assert prefix["max_tokens"] == 16 and not prefix["one_at_a_time"]
    ids = [t for rep in spec["workloads"]["throughput"]["reps"] for p in rep for t in p]
    assert len(ids) == 2 * 2 * 7 and min(ids) >= 7 and max(ids) < 4000
    latency = spec["workloads"]["latency"]
    assert latency["one_at_a_time"] and latency["max_tokens"] == 128 and len(latency["warmup"]) == 1
    assert [len(rep) for rep in latency["reps"]] == [3, 3] and all(len(p) == 6 for p in latency["reps"][0])
    # Deterministic: the same options give the same prompts (every side reads one file anyway).
    assert json.dumps(spec) == json.dumps(workloads.offline_spec(args, (7, 4000)))


def test_token_range_skips_special_tokens(tiny_checkpoint_factory) -> None:
    path = tiny_checkpoint_factory("llama")
    low, high = workloads.token_range(path)
    config = json.loads((path / "config.json").read_text())
    assert (low, high) == (7, config["vocab_size"])


def test_table_ratios_are_trtprompt_over_vllm() -> None:
    args = sidebyside.parse_args(["--only", "throughput,prefix,latency"])
    results = {
        "vllm": {"throughput": [{"output_tok_s": 800.0}, {"output_tok_s": 900.0}, {"output_tok_s": 700.0}],
                 "prefix": [{"wall_s": 1.5, "mean_ttft_s": 0.8}], "latency": [{"median_ms_per_token": 40.0}]},
        "trtprompt": {"throughput": [{"output_tok_s": 1000.0}],
                      "prefix": [{"wall_s": 1.2, "mean_ttft_s": None}], "latency": [{"median_ms_per_token": 30.0}]},
    }
    table = report.rows(args, results)
    assert [(r["metric"], r["vllm"], r["trtprompt"]) for r in table] == [
        ("output tok/s", 800.0, 1000.0), ("wall s", 1.5, 1.2), ("mean TTFT s", 0.8, None),
        ("ms per token after the first", 40.0, 30.0)]
    assert table[0]["ratios"]["vllm"] == pytest.approx(1.25) and table[1]["ratios"]["vllm"] == pytest.approx(0.8)
    assert table[2]["ratios"]["vllm"] is None and table[3]["ratios"]["vllm"] == pytest.approx(0.75)
    text = report.markdown(table, args.sides)
    assert "| 1000 | 1.25× (higher is better) |" in text and "| 0.8 | — | — |" in text


def test_greedy_agreement_counts_matching_tokens() -> None:
    results = {"vllm": {"throughput": [{"tokens": [[1, 2, 3], [4, 5, 6]]}]},
               "trtprompt": {"throughput": [{"tokens": [[1, 2, 3], [4, 9, 6]]}]}}
    assert report.greedy_agreement(results, "vllm") == {"sequences": 2, "identical": 1, "tokens_equal": 5,
                                                        "tokens": 6}
    assert report.greedy_agreement({"vllm": {}, "trtprompt": {}}, "vllm") is None


def test_reps_run_in_rounds_with_the_sides_order_alternating() -> None:
    """Each round carries one rep's prompts; a side's rounds append in rep order; the order flips every round."""
    spec = {"max_num_tokens": 64, "workloads": {"throughput": {"max_tokens": 4, "reps": [[[1]], [[2]], [[3]]]},
                                                "latency": {"max_tokens": 4, "reps": [[[4]], [[5]], [[6]]]}}}
    assert sidebyside.round_spec(spec, 1)["workloads"]["latency"]["reps"] == [[[5]]]
    assert sidebyside.round_spec(spec, 1)["max_num_tokens"] == 64 and spec["workloads"]["latency"]["reps"][0] == [[4]]
    merged: dict[str, object] = {}
    for rep in range(3):
        sidebyside.merge_round(merged, {"side": "trtprompt", "init_s": float(rep), "throughput": [{"rep": rep}],
                                        "latency": [{"rep": rep}]}, ["throughput", "latency"])
    assert merged == {"side": "trtprompt", "init_s": 0.0, "throughput": [{"rep": 0}, {"rep": 1}, {"rep": 2}],
                      "latency": [{"rep": 0}, {"rep": 1}, {"rep": 2}]}
    sides = ["trtprompt", "openvino", "vllm"]
    assert [sidebyside.round_order(sides, r) for r in range(3)] == [sides, sides[::-1], sides]


def test_each_round_gives_a_ratio_and_the_table_shows_their_spread() -> None:
    args = sidebyside.parse_args(["--only", "throughput", "--sides", "trtprompt,openvino"])
    results = {"trtprompt": {"throughput": [{"output_tok_s": 500.0}, {"output_tok_s": 400.0}, {"output_tok_s": 420.0}]},
               "openvino": {"throughput": [{"output_tok_s": 400.0}, {"output_tok_s": 400.0}, {"output_tok_s": 600.0}]}}
    row = report.rows(args, results)[0]
    assert row["round_ratios"]["openvino"] == pytest.approx([1.25, 1.0, 0.7])
    assert row["ratios"]["openvino"] == pytest.approx(420.0 / 400.0)
    assert "1.05× (higher is better; rounds 0.70-1.25, median 1.00)" in report.markdown([row], args.sides)
