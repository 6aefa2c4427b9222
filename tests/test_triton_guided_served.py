"""tensorrtllm_backend's guided decoding inputs against the real server (tests/serve_fixtures.py's session
server, fused layout; the upstream layout's server runs the same checks from tests/test_serve_upstream.py):
a JSON schema's output parses and validates, a regex's output fullmatches, and a bad regex is refused
naming `guided_decoding_guide`, on `ensemble`, on `tensorrt_llm` and on Triton's HTTP generate endpoint.
The grammars end early (an enum, a two-word choice), so each request is a handful of tokens."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import jsonschema
from serve_fixtures import Oracle, Served

from trtprompt.client import LLMClient, make_input, token_inputs

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
REGEX = "(yes|no)"
PROMPT = "Is the sky blue? Answer:"
MAX_TOKENS = 24  # far more than either grammar needs: the grammar ends the request
BAD_REGEX = "(unclosed"


def _guided(guide_type: str, guide: str | None) -> dict[str, str]:
    given = {"guided_decoding_guide_type": guide_type}
    return given if guide is None else given | {"guided_decoding_guide": guide}


def check_ensemble(server: Served, stream: bool) -> None:
    """`ensemble`: a schema's output validates, a regex's fullmatches, a bad regex is refused by name."""
    schema = server.text(PROMPT, MAX_TOKENS, stream, temperature=0.0, exclude_input_in_output=True,
                         **_guided("json_schema", json.dumps(SCHEMA)))
    assert schema.error is None, schema.error
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    regex = server.text(PROMPT, MAX_TOKENS, stream, temperature=0.0, exclude_input_in_output=True,
                        **_guided("regex", REGEX))
    assert regex.error is None, regex.error
    assert re.fullmatch(REGEX, regex.text), regex.text
    bad = server.text(PROMPT, MAX_TOKENS, stream, **_guided("regex", BAD_REGEX))
    assert bad.error is not None and "input 'guided_decoding_guide'" in bad.error, bad.error
    assert "[invalid_argument]" in bad.error


def test_ensemble_streamed(served: Served) -> None:
    check_ensemble(served, stream=True)


def test_ensemble_json_with_a_schema_is_the_schema(served: Served) -> None:
    """`json` with a guide holds to the guide as a schema (TensorRT-LLM's executor would ignore it); without
    one, any JSON object. Not streamed: the whole text in one response."""
    with_schema = served.text(PROMPT, MAX_TOKENS, False, temperature=0.0, exclude_input_in_output=True,
                              **_guided("json", json.dumps(SCHEMA)))
    assert with_schema.error is None, with_schema.error
    jsonschema.validate(json.loads(with_schema.text), SCHEMA)
    unknown = served.text(PROMPT, MAX_TOKENS, False, **_guided("yaml", "x"))
    assert unknown.error is not None and "input 'guided_decoding_guide_type' must be one of" in unknown.error


def test_token_model(served: Served, oracle: Oracle) -> None:
    """`tensorrt_llm`: the output ids decode to text the regex fullmatches; a bad regex is refused by name."""
    prompt_ids = oracle.tokenizer.encode(PROMPT)
    with LLMClient(served.url) as client:
        result = client.infer("tensorrt_llm", token_inputs(prompt_ids, MAX_TOKENS, False, temperature=0.0)
                              + [make_input("exclude_input_in_output", True),
                                 make_input("guided_decoding_guide_type", "regex"),
                                 make_input("guided_decoding_guide", REGEX)], 60.0)
        bad = client.infer("tensorrt_llm", token_inputs(prompt_ids, MAX_TOKENS, False)
                           + [make_input("guided_decoding_guide_type", "regex"),
                              make_input("guided_decoding_guide", BAD_REGEX)], 60.0)
    assert result.error is None, result.error
    assert re.fullmatch(REGEX, oracle.tokenizer.decode(result.output_ids)), result.output_ids
    assert bad.error is not None and "input 'guided_decoding_guide'" in bad.error, bad.error


def _generate(server: Served, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http}/v2/models/ensemble/generate",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def check_http_generate(server: Served) -> None:
    """Triton's generate endpoint maps JSON fields to inputs by name, so the two inputs are JSON strings."""
    body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "exclude_input_in_output": True}
    status, answer = _generate(server, body | _guided("json_schema", json.dumps(SCHEMA)))
    assert status == 200, answer
    jsonschema.validate(json.loads(answer["text_output"]), SCHEMA)
    status, answer = _generate(server, body | _guided("regex", BAD_REGEX))
    assert status == 400 and "input 'guided_decoding_guide'" in answer["error"], (status, answer)


def test_http_generate(served: Served) -> None:
    check_http_generate(served)
