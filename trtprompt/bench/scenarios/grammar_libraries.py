"""Measure the two maintained grammar libraries the engine could use, on this CPU and tokenizer: how long
a typical JSON schema takes to compile (first time, then again), and what one token costs (fill the
mask, advance the matcher). docs/structured-outputs.md, "Why llguidance", has the figures and the choice.

The project's venv has llguidance only; measure xgrammar from a venv that also has it
(`pip install xgrammar` pulls torch, transformers and a 1 GB `triton`):

    .venv/bin/python -m trtprompt.bench.scenarios.grammar_libraries --library llguidance
    OTHER_VENV/bin/python -m trtprompt.bench.scenarios.grammar_libraries --library xgrammar   # from the repo root
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city"]},
    "kind": {"enum": ["a", "b", "c"]}}}
VALUE = {"name": "Bob", "age": 42, "tags": ["x", "y"], "address": {"city": "Paris", "zip": "75001"}, "kind": "b"}


def ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of fn in milliseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def llguidance_case(tok: Any) -> dict[str, float]:
    """llguidance: compile first and again, and the mask-and-advance cost per token of VALUE."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tok)
    defaults: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile_nth(i: int) -> Any:  # a distinct text each time: llguidance keeps no cache of its own
        return llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA) + " " * i, defaults=defaults))

    first = ms(lambda: compile_nth(0), 1)
    again = ms(lambda: compile_nth(1), 5)
    ids = tok.encode(json.dumps(VALUE), add_special_tokens=False)
    mask = lt.allocate_token_bitmask(1, lltok.vocab_size)

    def walk() -> float:
        matcher = compile_nth(2)
        start = time.perf_counter()
        for t in ids:
            lt.fill_next_token_bitmask(matcher, mask, 0)
            if not matcher.consume_token(t):
                raise RuntimeError(f"llguidance refused token {t}: {matcher.get_error()}")
        return (time.perf_counter() - start) * 1e3 / len(ids)

    return {"compile_first_ms": first, "compile_again_ms": again,
            "mask_and_advance_ms_per_token": statistics.median(walk() for _ in range(5))}


def xgrammar_case(tok: Any) -> dict[str, float]:
    """xgrammar: the same three figures, its compiler's cache off."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    first = ms(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False), 1)
    again = ms(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False), 5)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    ids = tok.encode(json.dumps(VALUE), add_special_tokens=False)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def walk() -> float:
        matcher = xgr.GrammarMatcher(compiled)
        start = time.perf_counter()
        for t in ids:
            matcher.fill_next_token_bitmask(mask, 0)
            if not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")
        return (time.perf_counter() - start) * 1e3 / len(ids)

    return {"compile_first_ms": first, "compile_again_ms": again,
            "mask_and_advance_ms_per_token": statistics.median(walk() for _ in range(5))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", choices=("llguidance", "xgrammar"), required=True)
    parser.add_argument("--tokenizer", default="build/smollm2", help="a checkpoint directory with tokenizer.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    case = llguidance_case if args.library == "llguidance" else xgrammar_case
    print(json.dumps({"library": args.library, **case(tok)}, indent=1))


if __name__ == "__main__":
    main()
