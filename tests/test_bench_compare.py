"""`trtprompt bench --compare reuse=on,off` end to end on the tiny engine (a short-lived real
server per variant), and the in-process transformers baselines on the same workload."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from trtprompt.bench.baselines import run_baselines
from trtprompt.bench.report import summarize
from trtprompt.bench.workloads import WorkloadSpec, make_workload
from trtprompt.cli import main
from trtprompt.tokenizer import Tokenizer


def test_compare_reuse_on_off(tiny_engine_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # One system prompt of 64 tokens (2 full blocks) + 8 unique tokens; the warm-up request caches it.
    args = ["bench", str(tiny_engine_dir), "--workload", "shared-prefix", "--num-prefixes", "1",
            "--prefix-len", "64", "--suffix-len", "8", "--num-requests", "3", "--warmup", "1",
            "--output-len", "3", "--concurrency", "2", "--compare", "reuse=on,off",
            "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    summaries = results["summaries"]["concurrency=2"]
    scraped = results["metrics"]["concurrency=2"]["reuse=on"]
    reused = [k for k in scraped["after"] if k.startswith("nv_trt_llm_kv_cache_block_metrics")
              and 'kv_cache_block_type="reused"' in k]
    assert len(reused) == 1 and scraped["after"][reused[0]] - scraped["before"][reused[0]] >= 6
    assert list(summaries) == ["reuse=on", "reuse=off"]
    for name, s in summaries.items():
        assert (s["requests"], s["ok"], s["output_tokens"]) == (3, 3, 9), name
        assert s["ttft_s"]["p50"] > 0 and s["itl_s"]["p50"] is not None, name
    on, off = summaries["reuse=on"]["kv"], summaries["reuse=off"]["kv"]
    assert (on["reused_blocks"], on["hit_rate"], on["prefill_tokens_computed"]) == (6, 1.0, 3 * 8)
    assert (off["reused_blocks"], off["hit_rate"], off["prefill_tokens_computed"]) == (0, 0.0, 3 * 72)
    report = (out / "report.md").read_text()
    assert "| metric | reuse=on | reuse=off | reuse=off / reuse=on |" in report
    assert "| KV hit rate | 100.0% | 0.0% |  |" in report
    assert "| prefill tokens computed | 24 | 216 | 9.00× |" in report
    assert "| KV hit rate | 100.0% | 0.0%" in result.output  # the table is printed too
    for png in ("shared-prefix_concurrency=2_cdf.png", "shared-prefix_concurrency=2_ttft_vs_len.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    records = json.loads((out / "records" / "reuse=on__concurrency=2.json").read_text())
    assert [r["index"] for r in records] == [1, 2, 3]
    assert all(r["perf"]["kv_cache_reused_blocks"] == 2 for r in records)


def test_transformers_baselines_time_every_token(tiny_engine_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_engine_dir / "tokenizer")
    wl = make_workload(WorkloadSpec("random", num_requests=2, input_len=24, output_len=4), tok)
    source = Path(json.loads((tiny_engine_dir / "trtprompt.json").read_text())["source"]["path"])
    runs = run_baselines(source, tok, wl, wl.requests, warm=False)
    assert list(runs) == ["transformers-sequential", "transformers-generate_batch"]
    for name, run in runs.items():
        assert [r.index for r in run.records] == [0, 1], name
        for r in run.records:
            assert (r.num_input_tokens, r.num_output_tokens) == (24, 4), name
            assert r.ttft_s > 0 and len(r.itl_s) == 3 and r.e2e_s >= r.ttft_s, name
        s = summarize(run)
        assert s["output_tokens"] == 8 and s["kv"]["reused_blocks"] is None
    seq = runs["transformers-sequential"].records
    assert seq[1].start_s >= seq[0].start_s + seq[0].e2e_s  # one after the other


def test_compare_refuses_prompts_a_variant_cannot_take_before_starting_servers(tiny_engine_dir: Path,
                                                                              tmp_path: Path) -> None:
    cfg = json.loads((tiny_engine_dir / "config.json").read_text())["build_config"]
    too_long = cfg["max_num_tokens"] + 1  # fine with chunked context, too long without
    args = ["bench", str(tiny_engine_dir), "--workload", "random", "--input-len", str(too_long),
            "--num-requests", "1", "--compare", "chunked=on,off", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert (f"prompt 0 has {too_long} tokens, over the engine's maximum input length ({too_long - 1}), for the "
            "variant with the tightest bound") in result.output
    assert not (tmp_path / "results.json").exists()
