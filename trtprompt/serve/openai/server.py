"""Run the OpenAI front end: `python -m trtprompt.serve.openai ENGINE_DIR --grpc-url ... --port ...`.

`trtprompt serve` starts it as its own process next to tritonserver (its
event loop then shares no GIL with the launcher), on the fused layout with
--engine-socket (requests go straight to the engine process,
serve/openai/to_engine.py); it can also be run by hand in front of any
tritonserver serving the engine's `ensemble`. The
API key comes from a file (`--api-key-file`, written 0600 by serve) or
TRTPROMPT_API_KEY, never from the command line, which other users can read.
It speaks plain HTTP: put a TLS-terminating reverse proxy in front of it to
serve beyond localhost (docs/security.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trtprompt.interface import DEFAULT_GRPC_URL, DEFAULT_HOST, OPENAI_PORT
from trtprompt.serve.openai import http_limits as H
from trtprompt.serve.openai import parser_options as PO
from trtprompt.serve.openai.config import API_KEY_ENV, FrontendConfig
from trtprompt.serve.wire.process import prefer_quick_thread_switches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m trtprompt.serve.openai", description=__doc__.split("\n")[0])
    ap.add_argument("engine_dir", type=Path, help="engine directory (model name, max_model_len, block size)")
    ap.add_argument("--grpc-url", default=DEFAULT_GRPC_URL, help="tritonserver gRPC address")
    ap.add_argument("--host", default=DEFAULT_HOST, help="address to bind")
    ap.add_argument("--port", type=int, default=OPENAI_PORT)
    ap.add_argument("--api-key-file", type=Path, help=f"file holding the API key (else ${API_KEY_ENV})")
    ap.add_argument("--model-name", help="name to serve the model as (default: the engine directory's name)")
    ap.add_argument("--engine-socket", help="the torch target's engine process socket: send requests there "
                    "directly instead of through tritonserver (fused layout; `trtprompt serve` sets it)")
    ap.add_argument("--tokenizer-dir", help="tokenizer for --engine-socket (default: the engine directory's)")
    _parser_args(ap)
    _limit_args(ap)
    return ap.parse_args(argv)


def _parser_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tool-call-parser", choices=PO.TOOL_CALL_PARSER_OPTIONS, default=PO.AUTO,
                    help=PO.TOOL_CALL_PARSER_HELP + " (default: %(default)s)")
    ap.add_argument("--reasoning-parser", choices=PO.REASONING_PARSER_OPTIONS, default=PO.AUTO,
                    help=PO.REASONING_PARSER_HELP + " (default: %(default)s)")


def _limit_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-request-bytes", type=int,
                    help=f"largest request body; larger is 413 before it is read (default: the engine's "
                    f"max_input_len x {H.BYTES_PER_INPUT_TOKEN} + {H.BODY_HEADROOM_BYTES >> 20} MiB)")
    ap.add_argument("--max-header-bytes", type=int, default=H.MAX_HEADER_BYTES,
                    help="largest request line + headers; larger is 431 (default: %(default)s)")
    ap.add_argument("--read-timeout", type=float, default=H.READ_TIMEOUT_S,
                    help="seconds a request's headers and body may take to arrive (default: %(default)s)")
    ap.add_argument("--keep-alive-timeout", type=int, default=H.KEEP_ALIVE_TIMEOUT_S,
                    help="seconds an idle keep-alive connection is kept (default: %(default)s)")
    ap.add_argument("--max-connections", type=int, default=H.MAX_CONNECTIONS,
                    help="open connections past which requests get 503 (default: %(default)s)")


def http_limits(args: argparse.Namespace) -> H.HttpLimits:
    body = args.max_request_bytes
    if body is None:
        body = H.engine_max_request_bytes(args.engine_dir)
    return H.HttpLimits(body, args.max_header_bytes, args.read_timeout, args.keep_alive_timeout,
                        args.max_connections)


def read_api_key(path: Path | None) -> str | None:
    key = path.read_text(encoding="utf-8").strip() if path is not None else os.environ.get(API_KEY_ENV)
    return key or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # gRPC's aio poller is a thread of its own: with Python's default 5 ms switch interval every
    # streamed token could wait that long for the GIL (as in the python-backend stub; measured in
    # docs/benchmarks-history.md, "OpenAI-compatible front end vs Triton gRPC").
    prefer_quick_thread_switches()
    import uvicorn

    from trtprompt.serve.openai.app import create_app
    from trtprompt.serve.openai.http_protocol import guarded_protocol

    try:
        cfg = FrontendConfig.for_engine(args.engine_dir, args.grpc_url, read_api_key(args.api_key_file),
                                        args.model_name, args.engine_socket, args.tokenizer_dir,
                                        args.tool_call_parser, args.reasoning_parser)
        limits = http_limits(args)
    except (OSError, ValueError) as exc:
        print(f"openai front end: {exc}", file=sys.stderr)
        return 2
    print(f"openai front end: limits {limits}", file=sys.stderr, flush=True)
    # The stdlib event loop: grpc.aio's poller is known to work with it (uvloop is not needed here).
    # http: uvicorn's httptools protocol with a header limit and read deadline (http_protocol.py);
    # no websockets (nothing here speaks them).
    uvicorn.run(create_app(cfg, limits), host=args.host, port=args.port, log_level="warning", access_log=False,
                loop="asyncio", http=guarded_protocol(limits), ws="none",  # type: ignore[arg-type]
                limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_timeout_s,
                timeout_graceful_shutdown=5)
    return 0
