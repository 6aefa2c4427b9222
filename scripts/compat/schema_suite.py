#!/usr/bin/env python3
"""Issue 38's schema suite against a served model, through the official openai client.

    .venv/bin/python scripts/compat/schema_suite.py --base-url http://127.0.0.1:8003/v1
        [--model ID] [--temperature 0 | --temperature 0.8 --seeds 3] [--max-tokens 512] [--concurrency 4]
        [--only name,name] [--out bench-results/schema-suite.json]

Every case of trtprompt/bench/schemas.py (SUITE and FIXED_KEYS) goes as `chat.completions.create` with
`response_format={"type": "json_schema", "json_schema": {"name", "schema", "strict": true}}` and is checked
with jsonschema (formats too, as far as the installed jsonschema checks them); each case with a pydantic model
in scripts/compat/schema_models.py ALSO goes through `chat.completions.parse(response_format=Model)`, checked
by pydantic and against the schema the client sent. Works against any OpenAI-compatible server: `trtprompt
serve` (`make serve`: the OpenAI port is 8003) and vLLM's (`python -m vllm.entrypoints.openai.api_server`).

An output that finished ("stop") must parse and validate; one cut by max_tokens ("length") is OpenAI's
truncated output and is counted apart, not checked. Exit 0 when every request was answered and every
finished output validated; 1 otherwise (a refused request, an unparsable or invalid finished output).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jsonschema  # noqa: E402
import openai  # noqa: E402
from openai.lib._parsing._completions import type_to_response_format_param  # noqa: E402
from schema_models import MODELS  # noqa: E402

from trtprompt.bench.guided_served import api_key  # noqa: E402
from trtprompt.bench.schemas import ALL, SchemaCase  # noqa: E402


@dataclass(frozen=True)
class Job:
    case: SchemaCase
    via: str  # "create" (the schema dict) or "parse" (the case's pydantic model)
    seed: int


@dataclass
class Outcome:
    name: str
    via: str
    seed: int
    finish_reason: str | None = None
    parsed: bool = False  # the content is JSON (create) / the client parsed it into the model (parse)
    valid: bool = False  # ... and it validates against the schema sent
    error: str | None = None  # the request failed (a refusal, a transport error)
    problem: str | None = None  # why a finished output failed
    completion_tokens: int | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is None and self.finish_reason == "stop"


def sent_schema(job: Job) -> dict[str, Any]:
    if job.via == "create":
        return job.case.schema
    return type_to_response_format_param(MODELS[job.case.name])["json_schema"]["schema"]  # type: ignore[index]


def check(schema: dict[str, Any], value: Any) -> str | None:
    """The first schema violation of `value`, or None."""
    validator = jsonschema.Draft202012Validator(schema,
                                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"{'/'.join(map(str, error.absolute_path))}: {error.message}"[:300]


def run_create(client: openai.OpenAI, model: str, job: Job, args: argparse.Namespace) -> Outcome:
    out = Outcome(job.case.name, job.via, job.seed)
    response_format = {"type": "json_schema",
                       "json_schema": {"name": job.case.name, "schema": job.case.schema, "strict": True}}
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": job.case.prompt}],
                                           response_format=response_format,  # type: ignore[arg-type]
                                           **sampling(args, job.seed))
    choice = reply.choices[0]
    out.finish_reason, out.content = choice.finish_reason, choice.message.content
    out.completion_tokens = reply.usage.completion_tokens if reply.usage else None
    if out.finish_reason != "stop":
        return out
    try:
        value = json.loads(out.content or "")
    except json.JSONDecodeError as exc:
        out.problem = f"not JSON: {exc}"
        return out
    out.parsed = True
    out.problem = check(job.case.schema, value)
    out.valid = out.problem is None
    return out


def run_parse(client: openai.OpenAI, model: str, job: Job, args: argparse.Namespace) -> Outcome:
    import pydantic

    out = Outcome(job.case.name, job.via, job.seed)
    try:
        reply = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": job.case.prompt}],
                                              response_format=MODELS[job.case.name], **sampling(args, job.seed))
    except openai.LengthFinishReasonError as exc:
        out.finish_reason = "length"
        out.completion_tokens = exc.completion.usage.completion_tokens if exc.completion.usage else None
        return out
    except pydantic.ValidationError as exc:  # the client's own parse of a finished output failed
        out.finish_reason, out.problem = "stop", f"pydantic: {str(exc).splitlines()[0]}"[:300]
        return out
    choice = reply.choices[0]
    out.finish_reason, out.content = choice.finish_reason, choice.message.content
    out.completion_tokens = reply.usage.completion_tokens if reply.usage else None
    if out.finish_reason != "stop":
        return out
    out.parsed = choice.message.parsed is not None
    out.problem = check(sent_schema(job), json.loads(out.content or "null")) if out.parsed else "not parsed"
    out.valid = out.problem is None
    return out


def sampling(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return {"temperature": args.temperature, "seed": seed, "max_tokens": args.max_tokens}


def run_job(client: openai.OpenAI, model: str, job: Job, args: argparse.Namespace) -> Outcome:
    try:
        return (run_create if job.via == "create" else run_parse)(client, model, job, args)
    except openai.APIError as exc:
        return Outcome(job.case.name, job.via, job.seed, error=f"{type(exc).__name__}: {exc}"[:300])


def jobs_of(args: argparse.Namespace) -> list[Job]:
    only = set(args.only.split(",")) if args.only else None
    cases = [c for c in ALL if only is None or c.name in only]
    if only is not None and len(cases) != len(only):
        raise SystemExit(f"--only names no case: {sorted(only - {c.name for c in cases})}")
    seeds = range(args.seeds)
    return ([Job(c, "create", s) for s in seeds for c in cases]
            + [Job(c, "parse", s) for s in seeds for c in cases if c.name in MODELS])


def report(outcomes: list[Outcome]) -> dict[str, Any]:
    for o in outcomes:
        verdict = ("ERROR" if o.error else "pass" if o.valid else "truncated" if o.finish_reason == "length"
                   else "FAIL")
        detail = o.error or o.problem or ""
        print(f"{verdict:9} {o.name:28} {o.via:6} seed={o.seed} finish={o.finish_reason} "
              f"tokens={o.completion_tokens} {detail}")
    finished = [o for o in outcomes if o.finished]
    totals = {
        "requests": len(outcomes), "errors": sum(o.error is not None for o in outcomes),
        "finish_reasons": dict(Counter(o.finish_reason or "none" for o in outcomes)),
        "finished": len(finished),
        "parse_rate": sum(o.parsed for o in finished) / len(finished) if finished else None,
        "validate_rate": sum(o.valid for o in finished) / len(finished) if finished else None,
    }
    print(json.dumps(totals, indent=2))
    return totals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8003/v1")
    ap.add_argument("--model", help="default: the first model GET /v1/models lists")
    ap.add_argument("--api-key", help="default: $TRTPROMPT_API_KEY or $OPENAI_API_KEY when set, else 'unused'")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seeds", type=int, default=1, help="each case sent once per seed 0..N-1")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--out", type=Path, help="write every outcome and the totals here (JSON)")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or api_key(), max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    jobs = jobs_of(args)
    print(f"{len(jobs)} requests to {args.base_url} (model {model}), temperature {args.temperature}, "
          f"{args.seeds} seed(s), max_tokens {args.max_tokens}")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        outcomes = list(pool.map(lambda job: run_job(client, model, job, args), jobs))
    totals = report(outcomes) | {"wall_s": time.perf_counter() - t0, "model": model, "base_url": args.base_url,
                                 "temperature": args.temperature, "seeds": args.seeds, "max_tokens": args.max_tokens}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"totals": totals, "outcomes": [asdict(o) for o in outcomes]}, indent=2))
    ok = totals["errors"] == 0 and all(o.valid for o in outcomes if o.finished)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
