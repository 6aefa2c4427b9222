"""`trtprompt generate` and LLMEngine.from_engine_dir on a built engine, against transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from trtprompt.cli import main
from trtprompt.engine.engine import LLMEngine
from trtprompt.tokenizer import Tokenizer

PROMPTS = ["Hello world, this is a test", "The quick brown fox jumps over", "Olá, café"]


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoint_factory):
    ckpt = tiny_checkpoint_factory("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(ckpt, local_files_only=True)

    def greedy(prompt: str, n: int) -> list[int]:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        eos = model.config.eos_token_id
        return out[: out.index(eos)] if eos in out else out

    return greedy, tok


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_generate_json_matches_transformers_greedy(tiny_engine_dir, hf_reference):
    greedy, tok = hf_reference
    args = ["generate", str(tiny_engine_dir), "--max-tokens", "16", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    res = run_cli(*args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.strip().splitlines()]
    assert len(rows) == len(PROMPTS)
    for prompt, row in zip(PROMPTS, rows):
        expected = greedy(prompt, 16)
        assert row["output_ids"] == expected
        assert row["text"] == tok.decode(expected, skip_special_tokens=True)
        assert row["num_input_tokens"] == len(tok(prompt)["input_ids"])
        assert row["num_output_tokens"] == len(expected)
        assert set(row) >= {"kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "finish_reason"}


def test_generate_stream_prints_the_same_text(tiny_engine_dir, hf_reference):
    greedy, tok = hf_reference
    res = run_cli("generate", str(tiny_engine_dir), "--prompt", PROMPTS[0], "--max-tokens", "16", "--stream")
    assert res.exit_code == 0
    assert res.output == tok.decode(greedy(PROMPTS[0], 16), skip_special_tokens=True) + "\n"


def test_generate_reports_reuse_for_a_repeated_long_prompt(tiny_engine_dir):
    long = " ".join(f"word{i}" for i in range(60))
    res = run_cli("generate", str(tiny_engine_dir), "--prompt", long, "--max-tokens", "4", "--json")
    assert res.exit_code == 0
    # Within one process a second engine starts cold, so reuse is shown with the engine API.
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    ids = Tokenizer.from_dir(tiny_engine_dir / "tokenizer").encode(long)
    from trtprompt.engine.request import SamplingParams
    for rid in ("a", "b"):
        engine.add_request(rid, ids, SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            outs = engine.step()
    assert outs[-1].stats.kv_cache_reused_blocks == (len(ids) - 1) // engine.kv.tokens_per_block > 0


def test_generate_too_long_prompt_names_both_numbers(tiny_engine_dir):
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    res = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "x " * 5000])
    assert res.exit_code != 0
    assert f"exceeds maximum input length ({engine.max_input_len})" in res.output
    assert "Prompt length (" in res.output


def test_runtime_overrides_may_lower_but_not_raise_bounds(tiny_engine_dir):
    build = json.loads((tiny_engine_dir / "config.json").read_text())["build_config"]
    lowered = LLMEngine.from_engine_dir(tiny_engine_dir, max_num_tokens=64, enable_chunked_context=False)
    assert lowered.max_input_len == 64
    with pytest.raises(ValueError, match="max_batch_size=.* exceeds the engine's build-time max_batch_size"):
        LLMEngine.from_engine_dir(tiny_engine_dir, max_batch_size=build["max_batch_size"] + 1)
    with pytest.raises(ValueError, match="unknown runtime option"):
        LLMEngine.from_engine_dir(tiny_engine_dir, max_beam_width=2)
