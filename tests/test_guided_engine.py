"""Guided decoding in the engine (engine/guided.py, docs/structured-outputs.md): outputs hold to their
guides, greedy tokens equal transformers' under the same grammar, jump-forward keeps the text in fewer
steps, a guided row leaves the batch's other rows alone, and bad guides are refused naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
import torch
import transformers
from engine_helpers import make_engine, run_to_completion

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.guide import MAX_GUIDE_BYTES, closed_objects, grammar_of
from trtprompt.engine.guided import apply_masks, apply_masks_reference
from trtprompt.engine.request import SamplingParams
from trtprompt.error_codes import FieldError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "kind", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["ab", "cde"]},
                         "ok": {"type": "boolean"}}}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
GBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
LARK = 'start: "x=" NUM\nNUM: /[0-9]{1,2}/'
PROMPT = [5, 17, 33, 120, 64, 9]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")


def engine_of(checkpoint: Path, **kwargs: Any) -> LLMEngine:
    eos = json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    return make_engine(checkpoint, end_ids=(eos,), tokenizer_dir=checkpoint, **kwargs)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> LLMEngine:
    return engine_of(checkpoint)


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> LLMEngine:
    """Jump-forward off: one model step per token, as transformers' generate()."""
    return engine_of(checkpoint, jump_forward=False)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def run(engine: LLMEngine, params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    return run_to_completion(engine, {"r": prompt}, params)["r"]


def guided(guide_type: str, guide: str | None, **more: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, "temperature": 0.0, "guide_type": guide_type, "guide": guide, **more})


def test_mask_fast_path_equals_the_reference_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 100, [0, 2, 3]
    masks = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    fast, slow = logits.clone(), logits.clone()
    apply_masks(fast, rows, masks)
    apply_masks_reference(slow, rows, masks)
    assert torch.equal(fast, slow)
    assert torch.equal(fast[1], logits[1]) and torch.equal(fast[4], logits[4])  # unguided rows untouched


@pytest.mark.parametrize("guide_type, guide, holds", [
    ("json_schema", json.dumps(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ("regex", REGEX, lambda text: re.fullmatch(REGEX, text) is not None),
    ("choice", json.dumps(["red", "green", "blue"]), lambda text: text in ("red", "green", "blue")),
    ("ebnf_grammar", GBNF, lambda text: re.fullmatch(r"yes|no|maybe [0-9]", text) is not None),
    ("lark_grammar", LARK, lambda text: re.fullmatch(r"x=[0-9]{1,2}", text) is not None),
])
def test_greedy_guided_tokens_equal_transformers_under_the_same_grammar(
        hf_model: Any, tokenizer: Any, engine: LLMEngine, plain: LLMEngine, guide_type: str, guide: str,
        holds: Callable[[str], bool]) -> None:
    params = guided(guide_type, guide)
    plain_steps = plain.iteration_counter
    tokens = run(plain, params)
    plain_steps = plain.iteration_counter - plain_steps
    assert tokens == hf_guided_greedy(hf_model, plain, params)
    text = tokenizer.decode(tokens)
    assert holds(text), text
    # Jump-forward: the same text, and the request asks the model for fewer tokens (forced ones are a chunk).
    steps = engine.iteration_counter
    assert tokenizer.decode(run(engine, params)) == text
    steps = engine.iteration_counter - steps
    assert steps <= plain_steps
    if guide_type == "json_schema":  # its keys and punctuation are forced
        assert steps < plain_steps


def hf_guided_greedy(model: Any, engine: LLMEngine, params: SamplingParams) -> list[int]:
    """transformers' greedy generate() with the same grammar's mask applied by a logits processor."""
    matcher = engine.guides.matcher(params)
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    class Grammar(transformers.LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] > len(PROMPT):
                assert matcher.consume_token(int(input_ids[0, -1]))
            mask = allocate_token_bitmask(1, engine.guides.tokenizer().vocab_size)
            fill_next_token_bitmask(matcher, mask)
            apply_masks_reference(scores, [0], mask)
            return scores

    eos = sorted(engine.end_ids)[0]
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=params.max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), pad_token_id=0,
                             eos_token_id=eos, logits_processor=transformers.LogitsProcessorList([Grammar()]))
    new = out[0, len(PROMPT):].tolist()
    return new[: new.index(eos)] if eos in new else new


def test_a_guided_row_leaves_the_rest_of_its_batch_alone(engine: LLMEngine, tokenizer: Any) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = run(engine, free)
    for rid, params in (("free", free), ("json", guided("json_schema", json.dumps(SCHEMA))),
                        ("re", guided("regex", REGEX))):
        engine.add_request(rid, PROMPT, params)
    outs = drain(engine)
    assert outs["free"] == alone
    jsonschema.validate(json.loads(tokenizer.decode(outs["json"])), SCHEMA)
    assert re.fullmatch(REGEX, tokenizer.decode(outs["re"]))


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            outs.setdefault(f"{out.request_id}/{out.sequence_index}", []).extend(out.new_token_ids)
    return {k.removesuffix("/0"): v for k, v in outs.items()}


def test_every_sampled_sequence_holds_to_the_guide(engine: LLMEngine, tokenizer: Any) -> None:
    params = SamplingParams(max_tokens=48, temperature=1.0, top_k=50, seed=7, n=3, guide_type="json_schema",
                            guide=json.dumps(SCHEMA))
    engine.add_request("n3", PROMPT, params)
    outs = drain(engine)
    texts = [tokenizer.decode(outs[k]) for k in ("n3", "n3/1", "n3/2")]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_preempted_guided_requests_resume_their_grammar(checkpoint: Path, engine: LLMEngine) -> None:
    """Recompute-style preemption drops the KV, not the output: each matcher goes on where it was."""
    prompts = {f"p{i}": PROMPT + [40 + i] * 20 for i in range(4)}
    params = guided("json_schema", json.dumps(SCHEMA))
    roomy = run_to_completion(engine, prompts, params)
    tight = engine_of(checkpoint, policy="max_utilization", kv_tokens=96)
    assert run_to_completion(tight, prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_log_probabilities_of_a_guided_request_are_raw_and_one_per_token(engine: LLMEngine) -> None:
    params = guided("regex", REGEX, logprobs=2)
    engine.add_request("lp", PROMPT, params)
    tokens, entries = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            entries += out.logprobs or []
    assert [e.token_id for e in entries] == tokens  # no forced token goes without its own row
    free = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
    engine.add_request("first", PROMPT, free)
    first = [e for out in iter_outputs(engine) for e in out.logprobs or []][0]
    assert first.top == entries[0].top  # raw: the grammar's mask is applied after they are taken


def iter_outputs(engine: LLMEngine) -> list[Any]:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_a_guide_compiles_once_and_is_served_from_the_cache(engine: LLMEngine) -> None:
    params = guided("regex", "(cached|hit)[0-9]")
    before = engine.guides.compiles
    engine.guides.matcher(params)
    engine.guides.matcher(params)
    assert engine.guides.compiles == before + 1


@pytest.mark.parametrize("params, field, words", [
    (dict(guide_type="regex", guide="["), "guide", "not a valid regex"),
    (dict(guide_type="json_schema", guide='{"type": "foo"}'), "guide", "not a valid json_schema"),
    (dict(guide_type="json_schema", guide="[1]"), "guide", "JSON schema"),
    (dict(guide_type="choice", guide="[]"), "guide", "non-empty JSON array"),
    (dict(guide_type="ebnf_grammar", guide="root ::= (\"a\" | "), "guide", "GBNF"),
    (dict(guide_type="regex", guide="a" * (MAX_GUIDE_BYTES + 1)), "guide", "MAX_GUIDE_BYTES"),
    (dict(guide_type="xml", guide="<a/>"), "guide_type", "must be one of"),
    (dict(guide_type="regex", guide=None), "guide", "non-empty string"),
    (dict(guide=".*"), "guide_type", "must be set"),
    (dict(guide_type="regex", guide="a", beam_width=2), "guide_type", "beam search"),
])
def test_bad_guides_are_refused_naming_the_field(engine: LLMEngine, params: dict[str, Any], field: str,
                                                 words: str) -> None:
    with pytest.raises(FieldError) as info:
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=4, **params))
    assert info.value.field == field and words in str(info.value)
    assert "bad" not in engine.groups


def test_objects_that_list_their_properties_take_no_others() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "free": {"type": "object"},
                                               "open": {"type": "object", "properties": {"b": {}},
                                                        "additionalProperties": True}},
              "$defs": {"item": {"properties": {"c": {"type": "integer"}}}},
              "anyOf": [{"properties": {"d": {}}}], "items": {"properties": {"e": {}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert set(props) == {"properties", "free", "open"}  # a property named "properties" is a name, not a keyword
    assert props["properties"]["additionalProperties"] is False and props["free"] == {"type": "object"}
    assert props["open"]["additionalProperties"] is True
    assert closed["$defs"]["item"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False and closed["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy: the client's schema is not changed


def test_a_schema_that_lists_its_properties_gets_no_other_keys(engine: LLMEngine, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    text = tokenizer.decode(run(engine, guided("json_schema", json.dumps(schema), max_tokens=64)))
    assert set(json.loads(text)) == {"n"}, text


def test_guide_after_holds_the_grammar_only_after_the_marker(engine: LLMEngine, tokenizer: Any) -> None:
    from llguidance import LLMatcher

    grammar = grammar_of("json_schema", json.dumps(SCHEMA), "</think>")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731

    def accepts(text: str) -> bool:
        matcher = LLMatcher(engine.guides.tokenizer(), grammar, log_level=0)
        return matcher.consume_tokens(encode(text)) and matcher.is_accepting()

    assert accepts('Any {thinking} at all, "quoted".</think>{"n": 5, "kind": "ab", "ok": true}')
    assert not accepts('thinking</think>{"n": 500, "kind": "ab", "ok": true}')
    assert not accepts('{"n": 5, "kind": "ab", "ok": true}')  # the answer only follows the marker


def test_an_engine_without_a_tokenizer_refuses_guided_requests(checkpoint: Path) -> None:
    bare = make_engine(checkpoint)
    with pytest.raises(FieldError, match="needs the engine's tokenizer"):
        bare.add_request("g", PROMPT, guided("regex", "a+"))


@pytest.mark.parametrize("guide_type, guide", [
    ("json", None), ("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("choice", '["red", "blue"]'),
    ("ebnf_grammar", GBNF), ("lark_grammar", LARK),
    ("structural_tag", json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                                   "triggers": ["<f"]})),
])
def test_every_guide_type_can_be_held_until_reasoning_ends(engine: LLMEngine, guide_type: str,
                                                          guide: str | None) -> None:
    engine.guides.matcher(SamplingParams(guide_type=guide_type, guide=guide, guide_after="</think>"))


def test_a_marker_that_is_a_vocabulary_token_is_matched_as_that_token(engine: LLMEngine, tokenizer: Any) -> None:
    """llguidance never matches an added token by its text: "<|end|>" (id 3 of the demo vocabulary) as a
    reasoning end, and "<|user|>" (id 5) as a Lark literal, must take the token the model writes."""
    from llguidance import LLMatcher

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    end, user = tokenizer.convert_tokens_to_ids(["<|end|>", "<|user|>"])
    after = engine.guides.matcher(SamplingParams(guide_type="regex", guide="[0-9]{2}", guide_after="<|end|>"))
    assert after.consume_tokens(encode("some thought") + [end] + encode("42")) and after.is_accepting()
    lark = engine.guides.matcher(SamplingParams(guide_type="lark_grammar", guide='start: "<|user|>" /[a-z]+/'))
    assert lark.consume_tokens([user] + encode("abc")) and lark.is_accepting()
    assert isinstance(lark, LLMatcher)


def test_a_forced_run_longer_than_the_step_budget_is_chunked(checkpoint: Path, tokenizer: Any) -> None:
    """Jump-forward appends the whole forced text; with chunked context off it still computes in chunks."""
    literal = "hello world " * 20
    small = engine_of(checkpoint, chunked=False, max_num_tokens=64)
    tokens = run(small, guided("regex", re.escape(literal), max_tokens=200))
    assert tokenizer.decode(tokens) == literal and len(tokens) > 64


def test_a_bad_guide_sent_again_is_refused_afresh(engine: LLMEngine) -> None:
    """The cached failure is raised as a new error each time: re-raising one object grows its traceback."""
    import traceback

    depths = []
    for _ in range(3):
        with pytest.raises(FieldError) as info:
            engine.guides.matcher(SamplingParams(guide_type="regex", guide="(unclosed"))
        depths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert depths[0] == depths[1] == depths[2]


def test_a_guide_nested_too_deeply_is_refused(engine: LLMEngine) -> None:
    deep = '{"items": ' * 5000 + "{}" + "}" * 5000
    with pytest.raises(FieldError, match="nested too deeply|not a valid"):
        engine.guides.matcher(SamplingParams(guide_type="json_schema", guide=deep))


def test_ignore_eos_keeps_a_guided_request_going(engine: LLMEngine, tokenizer: Any) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, guide_type="regex", guide="(ab)+")
    engine.add_request("ieos", PROMPT, params)
    outs = iter_outputs(engine)
    tokens = [t for out in outs for t in out.new_token_ids]
    assert len(tokens) == 8 and sorted(engine.end_ids)[0] not in tokens
    assert re.fullmatch("(ab)+", tokenizer.decode(tokens)) and outs[-1].finish_reason.value == "length"


def test_all_of_parts_stay_open_so_their_union_validates(engine: LLMEngine, tokenizer: Any) -> None:
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
              "allOf": [{"$ref": "#/$defs/Base"},
                        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}]}
    matcher = engine.guides.matcher(SamplingParams(guide_type="json_schema", guide=json.dumps(schema)))
    assert matcher.consume_tokens(tokenizer.encode('{"id": 1, "name": "x"}', add_special_tokens=False))
    assert matcher.is_accepting()
