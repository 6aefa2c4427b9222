"""vLLM's and SGLang's extension fields on the OpenAI front end (docs/openai.md, "Extension fields").

Honoured fields change the output as transformers' equivalent does (greedy is the oracle; min_p's
filter is compared with transformers' MinPLogitsWarper); noted fields are accepted and log one
line; refused fields get a 400 naming them; the exact bodies sglang-router 0.3.2 sends (captured
from it) are accepted as they are; /v1/models and SGLang's /server_info name the real model.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers
from engine_helpers import EOS, make_engine, make_hf_model, run_to_completion
from serve_fixtures import Oracle, Served

from trtprompt.engine.request import SamplingParams
from trtprompt.engine.sampler import sampling_probs
from trtprompt.serve.openai import extensions
from trtprompt.serve.openai.config import FrontendConfig
from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.params import HONOURED_EXTENSIONS, ModelLimits, parse_request

ROOT = Path(__file__).resolve().parent.parent
LIMITS = ModelLimits("tiny", 2048, vocab_size=256)
# What sglang-router 0.3.2 (smg launch --policy cache_aware) sent a worker for a plain request.
ROUTER_CHAT = {"messages": [{"role": "user", "content": "hi"}], "model": "tiny", "logprobs": False,
               "max_completion_tokens": 4, "stream": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False}
ROUTER_COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": False, "echo": False,
                     "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}


def body(kind: str, **extra: Any) -> dict[str, Any]:
    base = {"model": "tiny", "max_tokens": 4}
    main = {"prompt": "Hello"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    return base | main | extra


# ---------------------------------------------------------------- the table, without a server


@pytest.mark.parametrize("kind, sent", [("chat", ROUTER_CHAT), ("completion", ROUTER_COMPLETION)])
def test_the_routers_bodies_are_accepted_silently(kind: str, sent: dict[str, Any]) -> None:
    gen = parse_request(kind, sent, LIMITS)
    assert gen.notes == () and gen.max_tokens == 4 and gen.skip_special_tokens
    assert not gen.sampling.ignore_eos


def _other_value(ext: extensions.Extension) -> Any:
    """A value that asks for something else than this server's behaviour."""
    same = ext.same[0] if ext.same else None
    if isinstance(same, bool):
        return not same
    if isinstance(same, (int, float)):
        return same + 3
    return {"x": 1} if ext.name.endswith(("kwargs", "params", "config", "xargs")) else "something"


REFUSED = [(kind, e) for e in extensions.EXTENSIONS if e.action == extensions.REFUSE for kind in e.kinds]
NOTED = [(kind, e) for e in extensions.EXTENSIONS if e.action == extensions.NOTE for kind in e.kinds]


@pytest.mark.parametrize("kind, ext", REFUSED, ids=[f"{k}-{e.name}" for k, e in REFUSED])
def test_refused_fields_are_400_naming_the_field(kind: str, ext: extensions.Extension) -> None:
    with pytest.raises(APIError) as info:
        parse_request(kind, body(kind, **{ext.name: _other_value(ext)}), LIMITS)
    assert (info.value.status, info.value.param, info.value.code) == (400, ext.name, "unsupported_parameter")
    assert ext.why in info.value.message
    for same in (None, *ext.same):  # the value meaning this server's behaviour is accepted, silently
        assert parse_request(kind, body(kind, **{ext.name: same}), LIMITS).notes == ()


@pytest.mark.parametrize("kind, ext", NOTED, ids=[f"{k}-{e.name}" for k, e in NOTED])
def test_noted_fields_are_accepted_with_a_note(kind: str, ext: extensions.Extension) -> None:
    value = _other_value(ext)
    gen = parse_request(kind, body(kind, **{ext.name: value}), LIMITS)
    assert gen.notes == (f"{ext.name}={json.dumps(value)} ({ext.why})",)
    assert gen.sampling == parse_request(kind, body(kind), LIMITS).sampling  # changes nothing


def test_a_field_of_the_other_endpoint_is_still_unknown() -> None:
    with pytest.raises(APIError, match="unrecognized request argument"):
        parse_request("completion", body("completion", continue_final_message=False), LIMITS)


def test_honoured_fields_reach_the_sampling_parameters() -> None:
    gen = parse_request("completion", body("completion", min_p=0.2, top_k=7, ignore_eos=True,
                                           stop_token_ids=[5, 9], skip_special_tokens=False), LIMITS)
    s = gen.sampling
    assert (s.min_p, s.top_k, s.ignore_eos, s.extra_end_ids, s.min_tokens) == (0.2, 7, True, (5, 9), 0)
    assert not gen.skip_special_tokens


@pytest.mark.parametrize("extra, param, text", [
    ({"stop_token_ids": [5, 256]}, "stop_token_ids",
     "stop_token_ids[1]: token id 256 is outside the vocabulary [0, 256)"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "token id -1 is outside the vocabulary"),
    ({"stop_token_ids": 5}, "stop_token_ids", "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "stop_token_ids[0] must be a token id (an integer)"),
    ({"min_p": 1.5}, "min_p", "min_p must be a finite number in [0, 1], got 1.5"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "skip_special_tokens must be true or false"),
    ({"seed": 2**64}, "seed", "seed must be in [0, 2**64)"),
])
def test_honoured_fields_are_bounded(extra: dict[str, Any], param: str, text: str) -> None:
    with pytest.raises(APIError) as info:
        parse_request("completion", body("completion", **extra), LIMITS)
    assert (info.value.status, info.value.param) == (400, param) and text in info.value.message


def test_the_docs_table_lists_every_field() -> None:
    doc = (ROOT / "docs" / "openai.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Extension fields"):]
    for name in {e.name for e in extensions.EXTENSIONS} | set(HONOURED_EXTENSIONS):
        assert f"`{name}`" in section, name


@pytest.mark.parametrize("extra, prompt, param", [
    ({"min_p": 0.1, "temperature": 0.5}, "hi", "min_p"),
    ({"stop_token_ids": [5]}, "hi", "stop_token_ids"),
    ({"skip_special_tokens": False}, "hi", "skip_special_tokens"),
    ({}, [5, 6], "prompt"),
])
def test_through_triton_what_the_ensemble_lacks_is_refused(extra: dict[str, Any], prompt: Any, param: str) -> None:
    from trtprompt.serve.openai.to_triton import _refuse_undeclared, ensemble_sampling

    declared = frozenset({"text_input", "max_tokens", "temperature", "top_p", "top_k", "min_tokens"})
    gen = parse_request("completion", body("completion", prompt=prompt, **extra), LIMITS)
    with pytest.raises(APIError) as info:
        _refuse_undeclared(gen, gen.prompts[0], ensemble_sampling(gen.sampling), declared, "ensemble")
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "unsupported_parameter")
    plain = parse_request("completion", body("completion", ignore_eos=True, top_k=3), LIMITS)  # min_tokens instead
    _refuse_undeclared(plain, plain.prompts[0], ensemble_sampling(plain.sampling), declared, "ensemble")


@pytest.mark.parametrize("temperature, top_k, min_p", [(1.0, None, 0.1), (0.7, 20, 0.05), (1.3, None, 0.3)])
def test_min_p_filters_as_transformers_warpers_do(temperature: float, top_k: int | None, min_p: float) -> None:
    torch.manual_seed(0)
    row = torch.randn(256) * 1.5
    params = SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, top_p=1.0)
    ours = sampling_probs(row.clone(), params)
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    warpers.append(transformers.MinPLogitsWarper(min_p))
    scores = row.clone()[None]
    for w in warpers:
        scores = w(torch.zeros(1, 1, dtype=torch.long), scores)
    theirs = torch.softmax(scores[0], dim=-1)
    assert torch.equal(ours > 0, theirs > 0)
    assert 1 < int((ours > 0).sum()) < 256  # the filter did something, and kept more than the top token
    torch.testing.assert_close(ours / ours.sum(), theirs)


# ---------------------------------------------------------------- the engine, against transformers


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def _hf(path: Path, prompt: list[int], n: int, **kwargs: Any) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs)
    return out[0, len(prompt):].tolist()


def _hf_no_end(path: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with no end token at all (its model, argmax step by step)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _cut(tokens: list[int], ends: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in ends), tokens)


def test_ignore_eos_keeps_generating_through_the_end_token(llama: Path) -> None:
    prompt = list(range(10, 30))
    plain = _hf_no_end(llama, prompt, 12)
    end = plain[3]  # a token greedy decoding reaches: as the end token it would stop there
    stopped = run_to_completion(make_engine(llama), {"r": prompt}, SamplingParams(max_tokens=12, end_id=end))["r"]
    assert stopped == plain[:plain.index(end)]
    kept = run_to_completion(make_engine(llama), {"r": prompt},
                             SamplingParams(max_tokens=12, end_id=end, ignore_eos=True))["r"]
    assert kept == plain  # generated and kept, not masked: the tokens are greedy's own


def test_stop_token_ids_end_as_transformers_extra_eos_ids_do(llama: Path) -> None:
    prompt = list(range(40, 60))
    plain = _hf_no_end(llama, prompt, 16)
    stops = (plain[5], plain[9])
    ref = _cut(_hf(llama, prompt, 16, eos_token_id=[EOS, *stops]), {EOS, *stops})
    out = run_to_completion(make_engine(llama), {"r": prompt},
                            SamplingParams(max_tokens=16, extra_end_ids=stops))["r"]
    assert out == ref and len(ref) <= 5
    # with min_tokens, they are masked until then, as transformers' min_new_tokens does
    ref = _cut(_hf(llama, prompt, 16, eos_token_id=[EOS, *stops], min_new_tokens=8), {EOS, *stops})
    out = run_to_completion(make_engine(llama), {"r": prompt},
                            SamplingParams(max_tokens=16, extra_end_ids=stops, min_tokens=8))["r"]
    assert out == ref and len(ref) >= 8


# ---------------------------------------------------------------- through the real server


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0)


def _model(served: Served) -> str:
    return FrontendConfig.for_engine(served.engine_dir, "127.0.0.1:1").limits.name


def _log_lines(served: Served, needle: str) -> list[str]:
    text = (served.run_dir / "openai.log").read_text(encoding="utf-8", errors="replace")
    return [line for line in text.splitlines() if needle in line]


def test_models_and_server_info_name_the_real_model(served: Served) -> None:
    import urllib.request

    model = _model(served)
    meta = json.loads((served.engine_dir / "trtprompt.json").read_text())
    assert model == meta["source"]["model"] != served.engine_dir.name
    assert [m.id for m in _client(served).models.list().data] == [model]
    for path in ("/server_info", "/get_model_info"):
        with urllib.request.urlopen(f"http://127.0.0.1:{served.openai}{path}", timeout=10) as resp:
            info = json.loads(resp.read())
        assert (info["model_path"], info["served_model_name"], info["is_generation"]) == (model, model, True)
    done = _client(served).completions.create(model=served.engine_dir.name, prompt="alias", max_tokens=2)
    assert done.model == model  # the engine directory's name stays accepted; answers name the model


@pytest.mark.parametrize("path, sent", [("/v1/chat/completions", ROUTER_CHAT),
                                        ("/v1/completions", ROUTER_COMPLETION)])
def test_the_routers_bodies_are_answered(served: Served, path: str, sent: dict[str, Any]) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", served.openai, timeout=60)
    conn.request("POST", path, json.dumps(sent | {"model": _model(served)}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, answer
    assert answer["usage"]["completion_tokens"] <= 4


def test_skip_special_tokens_false_keeps_them(served: Served, oracle: Oracle) -> None:
    prompt, n = "The quick brown fox", 64  # its 64 greedy tokens hold special tokens (<pad>, ...)
    ids = oracle.tokenizer.encode(prompt)
    oracle.engine.add_request(uuid.uuid4().hex, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while oracle.engine.has_unfinished_requests():
        for o in oracle.engine.step():
            out += o.new_token_ids
    kept, skipped = oracle.tokenizer.decode(out, False), oracle.tokenizer.decode(out, True)
    assert kept != skipped
    c = _client(served)
    for skip, want in ((False, kept), (True, skipped)):
        done = c.completions.create(model=_model(served), prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        assert done.choices[0].text == want
        chunks = c.completions.create(model=_model(served), prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want


def test_stop_token_ids_and_min_p_through_the_server(served: Served, oracle: Oracle) -> None:
    prompt = "The quick brown fox"  # no end token in its first 64 greedy tokens
    greedy = oracle.token_ids(prompt, 12)
    stop = greedy[4]
    want = oracle.tokenizer.decode(greedy[:greedy.index(stop)])
    c = _client(served)
    done = c.completions.create(model=_model(served), prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"stop_token_ids": [stop]})
    assert done.choices[0].text == want and done.choices[0].finish_reason == "stop"
    # min_p=1 keeps only the most likely token: sampling at any temperature is then greedy
    sampled = c.completions.create(model=_model(served), prompt=prompt, max_tokens=12, temperature=1.5, seed=7,
                                   extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == oracle.text(prompt, 12)


def test_a_refused_field_is_400_and_a_noted_one_logs_a_line(served: Served) -> None:
    c = _client(served)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=_model(served), messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"
    marker = f"rid-{uuid.uuid4().hex}"
    c.completions.create(model=_model(served), prompt="x", max_tokens=2, extra_body={"rid": marker})
    deadline = time.monotonic() + 30
    while not _log_lines(served, marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = _log_lines(served, marker)
    assert len(lines) == 1 and "accepted, changing nothing here: rid=" in lines[0], lines
