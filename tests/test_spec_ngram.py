"""The n-gram drafters (engine/speculation/ngram.py, drafting.py): TensorRT-LLM's NGram knobs mean what they say,
the public pool stays within its tokens and never crosses a cache_salt, draft lengths adapt."""

from __future__ import annotations

from trtprompt.engine.request import FinishReason, Request, SamplingParams
from trtprompt.engine.speculation.config import SpeculationConfig
from trtprompt.engine.speculation.drafting import Drafter, next_draft_len
from trtprompt.engine.speculation.ngram import Match, NgramIndex


def request(rid: str, tokens: list[int], salt: str | None = None, max_tokens: int = 100) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset(), salt, 0)


def test_the_longest_run_wins_and_oldest_or_newest_follows_the_knob() -> None:
    tokens = [1, 2, 3, 10, 11, 2, 3, 20, 21, 9, 2, 3]
    oldest = NgramIndex(3, keep_all=True, use_oldest=True)
    oldest.add(tokens)
    assert oldest.propose(tokens, 2) == Match(2, [10, 11])  # run (2, 3): first seen before 10, 11
    newest = NgramIndex(3, keep_all=True, use_oldest=False)
    newest.add(tokens)
    assert newest.propose(tokens, 2) == Match(2, [20, 21])
    only_newest = NgramIndex(3, keep_all=False, use_oldest=True)  # keep_all off: only the newest is kept
    only_newest.add(tokens)
    assert only_newest.propose(tokens, 2) == Match(2, [20, 21])
    # (9, 2, 3) ends the sequence, nothing followed it yet: the run of two decides
    assert oldest.propose([7, 9, 2, 3], 3) == Match(2, [10, 11, 2])
    assert oldest.propose([99], 3) is None


def test_a_live_sequence_is_indexed_as_it_grows() -> None:
    tokens = [5, 6, 7]
    index = NgramIndex(2, keep_all=True, use_oldest=True)
    sid = index.add(tokens)
    assert index.propose([5], 2) == Match(1, [6, 7])
    tokens.extend([5, 6])
    index.extend(sid)
    assert index.propose(tokens, 3) == Match(2, [7, 5, 6])
    assert index.num_tokens == 5


def test_the_pool_keeps_its_capacity_and_forgets_the_oldest() -> None:
    pool = NgramIndex(2, keep_all=True, use_oldest=True, capacity=10)
    pool.add([1, 2, 3, 4, 5, 6])
    pool.add([7, 8, 9, 1, 2, 30])
    assert pool.propose([0, 1, 2], 3) == Match(2, [30])  # the first sequence left: 6 + 6 tokens > 10
    assert pool.num_tokens == 6
    assert pool.propose([4], 2) is None
    pool.add(list(range(100, 130)))  # longer than the pool: its last 10 tokens only
    assert pool.num_tokens == 10 and pool.propose([121], 2) == Match(1, [122, 123])
    assert pool.propose([101], 2) is None and pool.propose([1, 2], 2) is None
    assert not any(pool._runs[key] == [] for key in pool._runs)  # evicted runs leave no empty entries


def test_public_pool_drafts_only_for_the_same_salt() -> None:
    drafter = Drafter(SpeculationConfig(max_draft_len=4))
    source = request("src", [40 + i for i in range(30)], salt="tenant-a")
    drafter.admitted(source)  # its prompt drafts for requests running beside it
    later = [200, 201, 202, 40, 41, 42]
    for salt, expect in (("tenant-a", [43, 44, 45, 46]), ("tenant-b", []), (None, [])):
        req = request(f"later-{salt}", later, salt)
        drafter.propose([req])
        assert req.drafts == expect
    for token in (90, 91, 92, 93):
        source.append_token(token)
    source.finish_reason = FinishReason.STOP
    drafter.finished(source)  # then its answer, after the prompt's last tokens
    req = request("after", [7, 68, 69, 90], "tenant-a")
    drafter.propose([req])
    assert req.drafts == [91, 92, 93]
    private = Drafter(SpeculationConfig(max_draft_len=4, is_public_pool=False))
    private.admitted(source)
    private.finished(source)
    req = request("p", later, "tenant-a")
    private.propose([req])
    assert req.drafts == []


def test_drafts_stop_at_max_tokens_and_go_stale_once_tokens_follow() -> None:
    drafter = Drafter(SpeculationConfig(max_draft_len=6))
    req = request("r", [1, 2, 3, 4, 5, 6, 7, 1, 2], max_tokens=4)
    req.append_token(3)  # one output so far: at most 4 - 1 - 1 = 2 drafts (the token after them is an output too)
    drafter.propose([req])
    assert req.drafts == [4, 5]
    req.append_token(4)
    assert req.drafts == []  # proposed for a shorter sequence


def test_draft_length_adapts_to_acceptance() -> None:
    assert next_draft_len(4, drafted=4, accepted=4, max_draft_len=16) == 8
    assert next_draft_len(12, drafted=12, accepted=12, max_draft_len=16) == 16
    assert next_draft_len(2, drafted=1, accepted=1, max_draft_len=16) == 4  # a short match, all accepted
    assert next_draft_len(8, drafted=8, accepted=2, max_draft_len=16) == 4  # halved
    assert next_draft_len(8, drafted=8, accepted=6, max_draft_len=16) == 7  # the accepted run + 1
    assert next_draft_len(1, drafted=1, accepted=0, max_draft_len=16) == 1
    drafter = Drafter(SpeculationConfig(max_draft_len=6))
    req = request("r", [1, 2])
    drafter.propose([req])
    drafter.verified(req, drafted=5, accepted=2)
    assert req.draft_len == 3 and req.stats.num_draft_tokens == 5 and req.stats.num_accepted_draft_tokens == 2
    assert drafter.counters.accepted_per_pos[:3] == [1, 1, 0]


def test_speculation_pauses_above_max_concurrency() -> None:
    drafter = Drafter(SpeculationConfig(max_concurrency=8))
    assert not drafter.paused(8) and drafter.paused(9)
    assert not Drafter(SpeculationConfig(max_concurrency=None)).paused(10_000)
