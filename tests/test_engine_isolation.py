"""One bad request must not hurt another (issue 11): bounds on every float sampling value, and a
step whose sampling or forward raises fails only what it can attribute the fault to."""

from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import hf_greedy, make_engine, make_hf_model
from trtprompt.engine import sampler
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.loop import EngineLoop
from trtprompt.engine.request import FLOAT_BOUNDS, FinishReason, SamplingParams
from trtprompt.error_codes import FieldError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = {"a": [5, 9, 14, 3, 77, 12], "b": [40, 41, 42, 43], "c": [200, 3, 3, 17, 99, 100, 101]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_float_params_are_refused_naming_the_field(field, value):
    with pytest.raises(FieldError, match=rf"^{field} must be a finite number in [\[(]"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [("temperature", -0.5), ("top_p", 1.5), ("top_p", -0.1),
                                          ("repetition_penalty", 0.0), ("presence_penalty", 101.0),
                                          ("frequency_penalty", -1e9)])
def test_out_of_range_float_params_are_refused_with_the_range(field, value):
    bound = FLOAT_BOUNDS[field].describe()
    with pytest.raises(FieldError) as err:
        SamplingParams(**{field: value})
    assert str(err.value) == f"{field} must be a finite number in {bound}, got {value!r}"


def test_bounds_keep_usual_values():
    SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.3, presence_penalty=-2.0,
                   frequency_penalty=2.0, top_k=5)


def _drive(engine: LLMEngine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]
           ) -> dict[str, tuple[list[int], FinishReason | None, str | None]]:
    """Step until done; per request: (output ids, finish reason, error). Each must end exactly once."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params.get(rid, GREEDY))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    ends: dict[str, tuple[FinishReason | None, str | None]] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in ends, "a request ended twice"
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    assert set(ends) == set(prompts)
    assert engine.kv.num_used_blocks() == 0
    return {rid: (got[rid], *ends[rid]) for rid in prompts}


def test_sampling_fault_fails_only_the_culprit(llama, monkeypatch):
    """A sampled request whose sampling raises mid-generation is finished with an error; the
    greedy requests in the same steps finish with transformers' exact tokens."""
    real = sampler.sample_row
    calls = {"n": 0}

    def faulty(row: torch.Tensor, req) -> int:
        if req.request_id == "bad":
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(row, req)

    monkeypatch.setattr(sampler, "sample_row", faulty)
    engine = make_engine(llama)
    prompts = dict(PROMPTS, bad=[7, 8, 9, 10])
    results = _drive(engine, prompts, {"bad": SamplingParams(max_tokens=12, top_k=5, seed=1)})
    ids, reason, error = results["bad"]
    assert reason is FinishReason.ERROR and len(ids) == 2
    assert error.startswith("engine error: sampling failed for this request")
    assert "probability tensor" in error
    for rid, prompt in PROMPTS.items():
        ids, reason, error = results[rid]
        assert error is None and ids == hf_greedy(llama, tuple(prompt), 12)
        assert reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_nan_logits_of_one_request_fail_only_it(llama, monkeypatch):
    """Non-finite values that reach the sampler anyway (here: one row's logits made NaN) end that
    request with an error instead of a garbage argmax, on the greedy path too."""
    real = sampler._prepare_row

    def poison(row: torch.Tensor, req) -> None:
        if req.request_id == "bad":
            row.fill_(math.nan)
        real(row, req)

    monkeypatch.setattr(sampler, "_prepare_row", poison)
    results = _drive(make_engine(llama), dict(PROMPTS, bad=[7, 8]), {})
    assert results["bad"][1] is FinishReason.ERROR and results["bad"][0] == []
    assert "NaN" in results["bad"][2]
    for rid, prompt in PROMPTS.items():
        assert results[rid][0] == hf_greedy(llama, tuple(prompt), 12)
        assert results[rid][2] is None


def test_forward_fault_fails_that_step_and_the_engine_goes_on(llama, monkeypatch):
    engine = make_engine(llama)
    real = engine.runner.execute
    steps = {"n": 0}

    def flaky(sched, kv):
        steps["n"] += 1
        if steps["n"] == 2:
            raise RuntimeError("simulated kernel fault")
        return real(sched, kv)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    results = _drive(engine, {"x": [5, 6, 7]}, {})
    assert results["x"][1] is FinishReason.ERROR
    assert results["x"][2] == "engine error: the model step failed: RuntimeError: simulated kernel fault"
    after = _drive(engine, PROMPTS, {})
    for rid, prompt in PROMPTS.items():
        assert after[rid][0] == hf_greedy(llama, tuple(prompt), 12)


def test_loop_keeps_serving_others_while_one_request_faults(llama, monkeypatch):
    """Through the thread-safe loop the serving layer uses: innocents get exact greedy tokens."""
    real = sampler.sample_row

    def faulty(row: torch.Tensor, req) -> int:
        if req.request_id == "bad":
            raise RuntimeError("boom")
        return real(row, req)

    monkeypatch.setattr(sampler, "sample_row", faulty)
    loop = EngineLoop(make_engine(llama)).start()
    try:
        bad = loop.submit("bad", [7, 8, 9], SamplingParams(max_tokens=8, top_k=4))
        good = {rid: loop.submit(rid, ids, GREEDY) for rid, ids in PROMPTS.items()}
        outs = list(bad)
        assert len(outs) == 1 and outs[0].finish_reason is FinishReason.ERROR and "boom" in outs[0].error
        for rid, stream in good.items():
            outs = list(stream)
            ids = [t for o in outs for t in o.new_token_ids]
            assert outs[-1].error is None
            assert ids == hf_greedy(llama, tuple(PROMPTS[rid]), 12)
    finally:
        loop.stop()

