"""The OpenAI front end's engine path keeps errors typed to its edge (issue 37, item 1): the code
goes through the one status table, the param comes from the field the error names, and no text is
tagged and parsed back on the way (serve/openai/errors.py `from_error`)."""

from __future__ import annotations

from trtprompt.engine.errors import InputTooLongError
from trtprompt.error_codes import CapacityError, ErrorCode, FieldError
from trtprompt.serve.openai.errors import from_error
from trtprompt.serve.wire import protocol as P


def test_a_field_error_names_its_openai_parameter() -> None:
    err = from_error(FieldError("extra_end_ids", "must be token ids >= 0, got [-1]"))
    assert (err.status, err.param, err.message) == (400, "stop_token_ids", "extra_end_ids must be token ids >= 0, got [-1]")
    assert from_error(FieldError("logit_bias", "biases must be finite numbers")).param == "logit_bias"


def test_an_engine_error_entry_keeps_its_code_and_field() -> None:
    entry = {"id": "1", "finished": True, "error": "n (9) exceeds the engine's max_batch_size (8)",
             "code": "invalid_argument", "field": "n"}
    error = P.entry_error(entry)
    assert error is not None and error.field == "n"
    api = from_error(error)
    assert (api.status, api.param, api.type) == (400, "n", "invalid_request_error")


def test_codes_map_through_the_one_table() -> None:
    assert from_error(InputTooLongError(9000, 2048)).param == "prompt"
    full = from_error(CapacityError("queue full: 8 requests wait"))
    assert (full.status, full.code, full.headers.get("Retry-After")) == (429, "queue_full", "1")
    internal = from_error(KeyError("boom"))
    assert (internal.status, internal.message) == (500, "internal error: KeyError: 'boom'")
    assert P.entry_error({"error": "x", "code": "nonsense"}).code is ErrorCode.INTERNAL
