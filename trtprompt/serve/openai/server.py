"""Run the OpenAI front end: `python -m trtprompt.serve.openai ENGINE_DIR --grpc-url ... --port ...`.

`trtprompt serve` starts it as its own process next to tritonserver (its
event loop then shares no GIL with the launcher), on the fused layout with
--engine-socket (requests go straight to the engine process,
serve/openai/to_engine.py); it can also be run by hand in front of any
tritonserver serving the engine's `ensemble`. The
API key comes from a file (`--api-key-file`, written 0600 by serve) or
TRTPROMPT_API_KEY, never from the command line, which other users can read.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trtprompt.interface import DEFAULT_GRPC_URL
from trtprompt.serve.openai.config import API_KEY_ENV, FrontendConfig
from trtprompt.serve.wire.process import prefer_quick_thread_switches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m trtprompt.serve.openai", description=__doc__.split("\n")[0])
    ap.add_argument("engine_dir", type=Path, help="engine directory (model name, max_model_len, block size)")
    ap.add_argument("--grpc-url", default=DEFAULT_GRPC_URL, help="tritonserver gRPC address")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8003)
    ap.add_argument("--api-key-file", type=Path, help=f"file holding the API key (else ${API_KEY_ENV})")
    ap.add_argument("--model-name", help="name to serve the model as (default: the engine directory's name)")
    ap.add_argument("--engine-socket", help="the torch target's engine process socket: send requests there "
                    "directly instead of through tritonserver (fused layout; `trtprompt serve` sets it)")
    ap.add_argument("--tokenizer-dir", help="tokenizer for --engine-socket (default: the engine directory's)")
    return ap.parse_args(argv)


def read_api_key(path: Path | None) -> str | None:
    key = path.read_text(encoding="utf-8").strip() if path is not None else os.environ.get(API_KEY_ENV)
    return key or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # gRPC's aio poller is a thread of its own: with Python's default 5 ms switch interval every
    # streamed token could wait that long for the GIL (as in the python-backend stub; measured in
    # BENCHMARKS.md, "OpenAI front end").
    prefer_quick_thread_switches()
    import uvicorn

    from trtprompt.serve.openai.app import create_app

    try:
        cfg = FrontendConfig.for_engine(args.engine_dir, args.grpc_url, read_api_key(args.api_key_file),
                                        args.model_name, args.engine_socket, args.tokenizer_dir)
    except (OSError, ValueError) as exc:
        print(f"openai front end: {exc}", file=sys.stderr)
        return 2
    # The stdlib event loop: grpc.aio's poller is known to work with it (uvloop is not needed here).
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning", access_log=False,
                loop="asyncio", timeout_graceful_shutdown=5)
    return 0
