"""Issue 38's schema suite (trtprompt/bench/schemas.py) in the engine: every schema is a valid Draft 2020-12
schema and compiles, and the whole suite, run as one greedy batch on the tiny random checkpoint, gives
outputs that hold: a request that finished ("stop") parses and validates (the jsonschema package, formats
checked); one that ran out of tokens ("length", OpenAI's truncated) is a prefix the schema's grammar
accepts. The pydantic models the compat script sends through `chat.completions.parse` compile too."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
import transformers
from engine_helpers import make_engine

from trtprompt.bench.schemas import ALL, FIXED_KEYS, SUITE, SchemaCase
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import FinishReason, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> LLMEngine:
    eos = json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    # Room for the whole suite in one batch: byte-level prompts of ~250 tokens each, 96 out.
    return make_engine(checkpoint, end_ids=(eos,), tokenizer_dir=checkpoint, max_batch_size=len(ALL),
                       max_num_tokens=4096, max_seq_len=512, kv_tokens=len(ALL) * 512)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def params_of(case: SchemaCase) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, guide_type="json_schema", guide=case.schema_text)


def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_the_suite_is_what_the_targets_ask_for() -> None:
    assert len(SUITE) >= 50 and len(FIXED_KEYS) >= 3
    assert len({c.name for c in ALL}) == len(ALL)
    text = json.dumps([c.schema for c in SUITE])
    for keyword in ("minItems", "maxItems", "enum", "minimum", "pattern", '"format"', "$defs", "$ref", "anyOf",
                    '"null"', "boolean", '"additionalProperties": false', "const"):
        assert keyword in text, keyword
    for case in FIXED_KEYS:
        assert 12 <= len(case.schema["required"]) <= 20, case.name


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_every_schema_is_valid_draft_2020_12(case: SchemaCase) -> None:
    jsonschema.Draft202012Validator.check_schema(case.schema)


def test_every_schema_compiles_in_the_engine(engine: LLMEngine) -> None:
    failed = {}
    for case in ALL:
        try:
            engine.guides.matcher(params_of(case))
        except Exception as exc:  # noqa: BLE001 - every failure is listed, not just the first
            failed[case.name] = str(exc)
    assert not failed


def test_the_suite_as_one_batch_holds_to_its_schemas(engine: LLMEngine, tokenizer: Any) -> None:
    prompts = {c.name: tokenizer.encode(c.prompt) for c in ALL}
    for case in ALL:
        engine.add_request(case.name, prompts[case.name], params_of(case))
    tokens, reasons = drain(engine)
    assert set(reasons) == {c.name for c in ALL}
    finished = Counter(reasons.values())
    print(f"\n{len(ALL)} schemas, greedy, max_tokens {MAX_TOKENS}: {dict(finished)}")
    problems = {}
    for case in ALL:
        text = tokenizer.decode(tokens[case.name])
        if reasons[case.name] == FinishReason.STOP:
            errors = sorted(e.message for e in validator(case.schema).iter_errors(json.loads(text)))
        else:
            assert reasons[case.name] == FinishReason.LENGTH and len(tokens[case.name]) == MAX_TOKENS
            errors = [] if grammar_accepts_prefix(engine, case, tokens[case.name]) else ["prefix refused"]
        if errors:
            problems[case.name] = (text, errors)
    assert not problems
    # Not a vacuous pass: enough outputs finished to have been parsed and validated.
    assert finished[FinishReason.STOP] >= len(ALL) // 4, dict(finished)


def drain(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, (out.request_id, out.error)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None
                reasons[out.request_id] = out.finish_reason
    return tokens, reasons


def grammar_accepts_prefix(engine: LLMEngine, case: SchemaCase, tokens: list[int]) -> bool:
    """A fresh matcher of the case's grammar takes every token and is left in no error."""
    matcher = engine.guides.matcher(params_of(case))
    return bool(matcher.consume_tokens(tokens)) and not matcher.is_error()


def test_the_check_has_teeth(engine: LLMEngine, tokenizer: Any) -> None:
    """The same validation fails on what the same model writes unguided: a broken check would pass both."""
    case = SUITE[0]
    engine.add_request("free", tokenizer.encode(case.prompt), SamplingParams(max_tokens=16, temperature=0.0))
    tokens, _ = drain(engine)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        validator(case.schema).validate(json.loads(tokenizer.decode(tokens["free"])))
    assert not grammar_accepts_prefix(engine, case, tokens["free"])


def test_the_pydantic_models_compile(engine: LLMEngine) -> None:
    """What `chat.completions.parse(response_format=Model)` sends (the client's strict conversion)."""
    from openai.lib._parsing._completions import type_to_response_format_param

    models = load_compat_models()
    assert len(models) >= 10 and set(models) <= {c.name for c in ALL}
    for model in models.values():
        schema = type_to_response_format_param(model)["json_schema"]["schema"]  # type: ignore[index]
        jsonschema.Draft202012Validator.check_schema(schema)
        engine.guides.matcher(SamplingParams(max_tokens=4, guide_type="json_schema", guide=json.dumps(schema)))


def load_compat_models() -> dict[str, Any]:
    path = ROOT / "scripts/compat/schema_models.py"
    spec = importlib.util.spec_from_file_location("schema_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["schema_models"] = module  # pydantic resolves the models' forward references through it
    spec.loader.exec_module(module)
    return dict(module.MODELS)
