"""bench/speculative.py end to end on the tiny engine (a few tokens), its timing arithmetic, and the pure parts of
bench/peers/spec_peers.py (command lines, run order; no peer started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtprompt.bench import spec_workloads, speculative
from trtprompt.bench.peers import spec_peers


def test_bench_speculative_writes_its_json(tiny_engine_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spec.json"
    speculative.main([str(tiny_engine_dir), "--out", str(out), "--rounds", "1", "--max-tokens", "6",
                      "--concurrency", "2", "--throughput-input", "8", "--throughput-output", "3"])
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["side"] == "trtprompt"
    assert result["tokens_identical"] is True
    assert {"cpu", "flags", "cores"} <= set(result["machine"])
    assert set(result["latency"]) == set(spec_workloads.WORKLOAD_NAMES)
    for workload in result["latency"].values():
        assert workload["tokens_identical"] is True
        assert set(workload["variants"]) == {"none", "ngram"}
        assert set(workload["ratios"]["ngram"]) == {"ms_per_token", "median_itl_ms"}
        none, ngram = workload["variants"]["none"], workload["variants"]["ngram"]
        assert none["acceptance"] is None  # no speculation, no counts
        assert ngram["acceptance"]["draft_tokens"] >= ngram["acceptance"]["accepted_tokens"] >= 0
        assert none["output_tokens"] == ngram["output_tokens"] <= 6
        assert workload["prompt_tokens"] > 0 and len(workload["prompt_digest"]) == 16
    tp = result["throughput"]
    assert tp["requests"] == 2 and tp["speculating_variant"] == "ngram"
    assert tp["none"]["median_output_tok_s"] > 0 and tp["ngram"]["median_output_tok_s"] > 0
    assert tp["tokens_identical"] is True
    assert "| code_rewrite | ngram |" in capsys.readouterr().out


def test_timing_spreads_a_delivery_over_its_tokens() -> None:
    # start 0; first token at 1.0 s; one token at 1.1; four at once at 1.3 (drafts accepted); two events
    # 0.1 ms apart at 1.5 (a streaming peer's one step) count as one delivery of two tokens.
    arrivals = [(1.0, 1), (1.1, 1), (1.3, 4), (1.5, 1), (1.5001, 1)]
    t = speculative.timing(0.0, arrivals)
    assert t["output_tokens"] == 8
    assert t["ttft_ms"] == pytest.approx(1000.0)
    assert t["ms_per_token"] == pytest.approx(500.0 / 7, rel=1e-3)  # (last - first) / tokens after the first
    assert t["median_itl_ms"] == pytest.approx(50.0, rel=1e-3)  # 100, 50 x 4, 100 x 2 -> 50
    assert t["median_chunk_ms"] == pytest.approx(200.0, rel=1e-3)
    assert t["tokens_per_chunk"] == pytest.approx(7 / 3)


def test_workloads_are_deterministic_and_end_with_a_user_turn() -> None:
    first, second = spec_workloads.workloads(), spec_workloads.workloads()
    assert first == second
    assert [w.name for w in first] == list(spec_workloads.WORKLOAD_NAMES)
    assert first[0].messages[0][1].startswith("Rewrite this code with `req` renamed to `request`.")
    assert "if req.num_output >= req.max_output_tokens:" in first[0].messages[0][1]  # the engine's own source
    with pytest.raises(ValueError, match="must end with a user turn"):
        spec_workloads.Workload("x", (("assistant", "hi"),))


def test_peer_command_lines_carry_the_same_draft_settings(tmp_path: Path) -> None:
    args = spec_peers.parse_args(["--peer", "vllm", "--draft-len", "5", "--max-ngram", "2",
                                  "--out", str(tmp_path / "v.json")])
    spec = json.loads(spec_peers.vllm_cmd(args, 8000, "ngram")[-1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    assert "--speculative-config" not in spec_peers.vllm_cmd(args, 8000, "none")
    args = spec_peers.parse_args(["--peer", "llamacpp", "--draft-len", "5", "--max-ngram", "2", "--dtype", "bf16"])
    assert args.gguf.name == "smollm2-bf16.gguf"
    tail = [str(x) for x in spec_peers.llama_cmd(args, 8000, "ngram")[-6:]]
    assert tail == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "5"]
    # Every workload runs on both variants each round; the first variant alternates.
    order = spec_peers.order(["a", "b"], 2)
    assert order == [("a", "none"), ("a", "ngram"), ("b", "ngram"), ("b", "none"),
                     ("a", "ngram"), ("a", "none"), ("b", "none"), ("b", "ngram")]
