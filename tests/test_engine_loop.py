"""The thread-safe front: concurrent submitters, aborts, errors, stop."""

from __future__ import annotations

import threading

import pytest

from engine_helpers import hf_greedy, make_engine, make_hf_model
from trtprompt.engine.errors import InputTooLongError, QueueFullError
from trtprompt.engine.loop import EngineLoop
from trtprompt.engine.request import FinishReason, SamplingParams
from trtprompt.error_codes import ErrorCode


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def test_concurrent_submitters_get_exact_greedy_outputs(llama):
    loop = EngineLoop(make_engine(llama, max_batch_size=4)).start()
    prompts = {f"t{i}": list(range(3 + i, 20 + 2 * i)) for i in range(8)}
    results: dict[str, list[int]] = {}
    finals: dict[str, int] = {}

    def client(rid: str) -> None:
        stream = loop.submit(rid, prompts[rid], SamplingParams(max_tokens=8))
        toks: list[int] = []
        for out in stream:
            toks.extend(out.new_token_ids)
            finals[rid] = finals.get(rid, 0) + int(out.finished)
        results[rid] = toks

    threads = [threading.Thread(target=client, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    loop.stop()
    assert finals == {rid: 1 for rid in prompts}
    assert results == {rid: hf_greedy(llama, tuple(p), 8) for rid, p in prompts.items()}


def test_abort_through_loop_and_errors_at_submit(llama):
    loop = EngineLoop(make_engine(llama, chunked=False, max_num_tokens=32)).start()
    with pytest.raises(InputTooLongError):
        loop.submit("long", [5] * 33, SamplingParams())
    stream = loop.submit("a", [5, 6, 7], SamplingParams(max_tokens=200))
    first = stream.get(timeout=30)
    assert not first.finished
    stream.abort()
    last = first
    while not last.finished:
        last = stream.get(timeout=30)
    assert last.finish_reason is FinishReason.ABORTED
    loop.stop()
    assert loop.engine.stats().used_num_blocks == 0


def test_queue_full_at_submit(llama):
    engine = make_engine(llama, max_queue_size=1)
    loop = EngineLoop(engine)  # not started: nothing leaves the queue
    loop.submit("a", [5, 6], SamplingParams())
    with pytest.raises(QueueFullError):
        loop.submit("b", [5, 6], SamplingParams())
    loop.start()
    loop.stop()


def test_stop_ends_in_flight_requests_with_an_error(llama):
    loop = EngineLoop(make_engine(llama))
    stream = loop.submit("a", [5, 6], SamplingParams(max_tokens=5))
    loop.stop()
    out = stream.get(timeout=60)
    assert out.finished and out.finish_reason is FinishReason.ERROR and "stopped" in out.error
    assert out.error_code is ErrorCode.UNAVAILABLE


def test_step_failure_fails_requests_but_loop_survives(llama):
    engine = make_engine(llama)
    loop = EngineLoop(engine).start()
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(*args, **kwargs)

    engine.runner.execute = flaky
    out = list(loop.submit("a", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert out[-1].finish_reason is FinishReason.ERROR and "simulated kernel failure" in out[-1].error
    assert out[-1].error_code is ErrorCode.INTERNAL
    ok = list(loop.submit("b", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert ok[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in ok) == 4
    loop.stop()
    assert engine.stats().used_num_blocks == 0


def test_arrival_is_stamped_at_submit_and_idle_stats_are_zero(llama):
    import time
    engine = make_engine(llama)
    loop = EngineLoop(engine)
    before = time.time_ns()
    stream = loop.submit("a", [5, 6, 7], SamplingParams(max_tokens=3))
    submitted = time.time_ns()
    # The loop is not running yet: the request waits in the inbox until start().
    started = time.time_ns()
    loop.start()
    final = list(stream)[-1]
    # Stamped inside submit(), not when the loop drained the inbox after start().
    assert before <= final.stats.arrival_time_ns <= submitted <= started
    assert final.stats.first_scheduled_time_ns >= started
    loop.stop()
    stats = engine.stats()
    assert (stats.scheduled_requests, stats.generation_requests, stats.context_requests) == (0, 0, 0)
    assert stats.iteration_counter >= 3


def test_a_submitted_request_is_validated_once_and_runs_as_checked(llama, monkeypatch):
    from trtprompt.engine import engine as engine_module

    calls: list[int] = []
    real = engine_module.validate_request

    def counting(prompt, params, limits):
        calls.append(len(prompt))
        return real(prompt, params, limits)

    monkeypatch.setattr(engine_module, "validate_request", counting)
    engine = make_engine(llama, max_seq_len=16)
    loop = EngineLoop(engine)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    stream = loop.submit("a", prompt, SamplingParams(max_tokens=10))
    prompt[0] = 300  # out of the vocabulary: had it been read again, the request would be refused
    loop.start()
    outs = list(stream)
    loop.stop()
    assert calls == [10]  # at submit, not again when the loop admitted it
    final = outs[-1]
    assert final.error is None and final.num_input_tokens == 10
    # What validation granted (and said) is what ran: the output shortened to fit max_seq_len.
    assert final.num_output_tokens <= 6 and final.warning is not None and "shortened to 6" in final.warning
