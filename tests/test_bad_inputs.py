"""Every row of docs/bad-inputs.md against the real server: the answer it documents, and the
server serving normally afterwards (issue 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_fixtures import Served
from trtprompt.serve.bad_inputs import CASES, Limits, ask, limits_of, render_table
from trtprompt.tokenizer import Tokenizer

pytestmark = pytest.mark.server
DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"


@pytest.fixture(scope="module")
def limits(served: Served) -> Limits:
    tok = Tokenizer.from_dir(served.engine_dir / "tokenizer")
    return limits_of(served.engine_info(), tok.max_token_bytes)


def test_the_doc_carries_the_table_of_cases():
    assert len(CASES) >= 40
    assert {c.endpoint for c in CASES} == {"ensemble", "tensorrt_llm", "HTTP generate"}
    assert render_table() in DOC.read_text(encoding="utf-8")


@pytest.mark.parametrize("n", range(len(CASES)), ids=[f"{i + 1}-{c.endpoint}-{c.what}" for i, c in enumerate(CASES)])
def test_bad_input_gets_what_the_doc_says(served: Served, limits: Limits, n: int):
    case = CASES[n]
    answer = ask(case, limits, served.url, f"http://127.0.0.1:{served.http}")
    assert (answer.status, case.expected(limits) in answer.message) == (case.status, True), answer


def test_server_serves_after_all_bad_inputs(served: Served):
    served.assert_healthy()
    stats = served.engine_stats()
    assert stats["in_flight"] == 0 and stats["used_num_blocks"] == 0
