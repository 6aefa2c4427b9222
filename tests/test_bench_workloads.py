"""Benchmark workloads: exact token lengths with the engine's tokenizer, shared prefixes that
encode to identical ids, and identical prompts for a seed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trtprompt.bench.workloads import KINDS, WordPool, WorkloadSpec, make_workload
from trtprompt.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_engine_dir / "tokenizer")


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "file"])
def test_every_prompt_encodes_to_its_stated_length(tok: Tokenizer, kind: str) -> None:
    wl = make_workload(WorkloadSpec(kind, num_requests=24, seed=3, input_len=40, prefix_len=64, suffix_len=9,
                                    user_len=7, turns=3, long_len=200, long_fraction=0.25, field_len=5), tok)
    assert len(wl.requests) == 24
    assert [r.index for r in wl.requests] == list(range(24))
    for r in wl.requests:
        assert len(_ids(tok, r.prompt)) == r.prompt_len, (kind, r.index)
        assert r.max_tokens == 32


def test_lengths_follow_the_spec(tok: Tokenizer) -> None:
    spec = dict(num_requests=16, seed=1)
    assert {r.prompt_len for r in make_workload(WorkloadSpec("random", input_len=50, **spec), tok).requests} == {50}
    spread = make_workload(WorkloadSpec("random", input_len=50, input_spread=0.2, **spec), tok).requests
    assert all(40 <= r.prompt_len <= 60 for r in spread) and len({r.prompt_len for r in spread}) > 1
    sp = make_workload(WorkloadSpec("shared-prefix", prefix_len=64, suffix_len=10, **spec), tok).requests
    assert {r.prompt_len for r in sp} == {74}
    lc = make_workload(WorkloadSpec("long-context", input_len=20, long_len=300, long_fraction=0.25, **spec),
                       tok).requests
    assert sorted(r.prompt_len for r in lc) == [20] * 12 + [300] * 4
    assert all((r.tag == "long") == (r.prompt_len == 300) for r in lc)
    tp = make_workload(WorkloadSpec("template", prefix_len=48, num_fields=2, field_len=6, **spec), tok).requests
    assert {r.prompt_len for r in tp} == {48 + 2 * (2 + 6)}


def test_shared_prefix_ids_are_identical_within_a_group_and_differ_between_groups(tok: Tokenizer) -> None:
    wl = make_workload(WorkloadSpec("shared-prefix", num_requests=20, num_prefixes=3, prefix_len=64,
                                    suffix_len=16), tok)
    prefixes: dict[str, set[tuple[int, ...]]] = {}
    for r in wl.requests:
        prefixes.setdefault(r.group, set()).add(tuple(_ids(tok, r.prompt)[:64]))
    assert sorted(prefixes) == ["prefix0", "prefix1", "prefix2"]
    assert all(len(p) == 1 for p in prefixes.values())
    assert len(set().union(*prefixes.values())) == 3
    suffixes = {tuple(_ids(tok, r.prompt)[64:]) for r in wl.requests}
    assert len(suffixes) == 20


def test_template_header_ids_are_shared(tok: Tokenizer) -> None:
    wl = make_workload(WorkloadSpec("template", num_requests=6, prefix_len=40, num_fields=2, field_len=4), tok)
    ids = [_ids(tok, r.prompt) for r in wl.requests]
    assert len({tuple(i[:42]) for i in ids}) == 1  # header and the first field's label
    assert len({tuple(i) for i in ids}) == 6


def test_multi_turn_history_grows_and_each_turn_extends_the_previous_prompt(tok: Tokenizer) -> None:
    wl = make_workload(WorkloadSpec("multi-turn", num_requests=9, turns=3, user_len=8, answer_len=5), tok)
    by_index = {r.index: r for r in wl.requests}
    # Turn-major: 3 conversations' first turns, then their second turns, ...
    assert [r.group for r in wl.requests] == ["conv0", "conv1", "conv2"] * 3
    for r in wl.requests:
        turn = r.index // 3
        assert r.prompt_len == 1 + turn * (8 + 5) + 8
        if turn == 0:
            assert r.after is None
        else:
            prev = by_index[r.after]
            assert prev.group == r.group and prev.index == r.index - 3
            assert _ids(tok, r.prompt)[:prev.prompt_len] == _ids(tok, prev.prompt)


def test_same_seed_same_prompts_other_seed_other_prompts(tok: Tokenizer) -> None:
    for kind in ("random", "shared-prefix", "multi-turn", "long-context", "template"):
        spec = WorkloadSpec(kind, num_requests=8, seed=11, prefix_len=48, long_len=120, input_len=30)
        a, b = make_workload(spec, tok), make_workload(spec, tok)
        assert a.requests == b.requests
        other = make_workload(WorkloadSpec(kind, num_requests=8, seed=12, prefix_len=48, long_len=120,
                                           input_len=30), tok)
        assert [r.prompt for r in other.requests] != [r.prompt for r in a.requests]


def test_exact_adjusts_text_that_does_not_compose(tok: Tokenizer) -> None:
    pool = WordPool(tok)
    multi = [w for w in (" internationalization", " zyxwvut", " qqqqjjj") if len(tok.encode(w, False)) > 1]
    assert multi
    pool.words = pool.words[:20] + multi * 10  # most sampled words now cost several tokens
    rng = random.Random(0)
    head = "Hello, world!! 1234 x-y_z:"
    base = len(tok.encode(head))
    misses = 0
    for target in range(base + 3, base + 40, 4):
        first = pool.text(random.Random(target), target - base)
        misses += len(tok.encode(head + first)) != target
        text = pool.exact([head, first], target, rng)
        assert text.startswith(head)
        assert len(tok.encode(text)) == target
    assert misses > 0  # the adjustment did work


def test_file_workload_prompts_and_messages(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [{"prompt": "plain prompt here", "max_tokens": 5},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    wl = make_workload(WorkloadSpec("file", num_requests=5, path=path, output_len=7), tok)
    assert [r.max_tokens for r in wl.requests] == [5, 7, 5, 7, 5]
    assert wl.requests[2].prompt == "plain prompt here"
    chat = wl.requests[1]
    ids = tok.encode(chat.prompt)
    assert chat.prompt_len == len(ids)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the server adds the only BOS
    assert chat.prompt.startswith("<|system|>")
    path.write_text('{"text": "no"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"w.jsonl:1: each line must be an object with either 'prompt'"):
        make_workload(WorkloadSpec("file", path=path), tok)


def test_bounds_are_named(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="prompt 0 has 300 tokens, over the engine's maximum input length "
                                         r"\(255\)"):
        make_workload(WorkloadSpec("random", num_requests=2, input_len=300), tok, max_input_len=255)
    with pytest.raises(ValueError, match="suffix_len must be >= 1, got 0"):
        WorkloadSpec("shared-prefix", suffix_len=0)
    with pytest.raises(ValueError, match="kind must be one of"):
        WorkloadSpec("chat")
    with pytest.raises(ValueError, match="path is required"):
        WorkloadSpec("file")
    with pytest.raises(ValueError, match=r"prefix_len \(1\) must exceed the tokenizer's 1 special token"):
        make_workload(WorkloadSpec("shared-prefix", prefix_len=1), tok)
