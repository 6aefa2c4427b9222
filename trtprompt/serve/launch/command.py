"""What `trtprompt serve` and `trtprompt infer` do; cli.py only parses options."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from trtprompt.engine.engine_dir import LLMAPI_TARGET
from trtprompt.serve.launch import kv_reuse
from trtprompt.serve.launch.launcher import Ports, Server, serve_forever
from trtprompt.serve.launch.lora_modules import check_lora_modules
from trtprompt.serve.launch.options import ApiKey, EngineInfo, OpenAIOptions, resolve_options
from trtprompt.serve.launch.repository import RepoContext, write_repository

if TYPE_CHECKING:
    from trtprompt.serve.launch.join import JoinOptions


def run_serve(engine_dir: Path, overrides: Mapping[str, Any], ports: Ports, *,
              repo_only: Path | None = None, tokenizer: Path | None = None, run_dir: Path | None = None,
              ready_timeout_s: float = 120.0, restart: bool = True,
              echo: Callable[[str], None] = print, openai: OpenAIOptions | None = None,
              api_key: ApiKey | None = None, require_kv_reuse: bool = False,
              join: "JoinOptions | None" = None) -> int:
    """Serve ENGINE_DIR until SIGINT/SIGTERM; or, with repo_only, write the repository and return.

    require_kv_reuse: refuse an engine that cannot reuse KV blocks instead of warning (kv_reuse.py).

    openai: also run the OpenAI-compatible front end (trtprompt.serve.openai) on its port.
    api_key: required by every Triton API but health and by the front end (docs/security.md).
    tokenizer: where the tokenizer is (default: the engine's own; see read_engine_dir).
    join: register the OpenAI front end with a router elsewhere while serving (docs/multi-node.md).

    Raises ValueError for an engine or options that cannot be served.
    """
    engine = EngineInfo.read(engine_dir, tokenizer)
    kv_reuse.warn_or_refuse(engine, require_kv_reuse, echo)
    options = resolve_options(engine, overrides)
    check_lora_modules(engine, options.lora_modules)  # a bad adapter fails here, with its own message
    if require_kv_reuse:
        kv_reuse.require_reuse_on(engine, options)
    if join is not None:
        check_join(engine.target, options.replicas, openai, repo_only)
    if openai is not None:
        openai.check_ports({"gRPC": ports.grpc, "HTTP": ports.http, "metrics": ports.metrics})
    if engine.target == LLMAPI_TARGET:  # TensorRT-LLM 1.3+ LLM API model behind the prompt edge
        from trtprompt.serve.launch.llmapi_launch import run_llmapi

        return run_llmapi(engine, options, ports, repo_only=repo_only, run_dir=run_dir,
                          ready_timeout_s=ready_timeout_s, echo=echo, openai=openai, api_key=api_key)
    if repo_only is not None:
        root = Path(repo_only).resolve()
        path = write_repository(root, RepoContext(engine, options, str(root / "engine.sock")))
        models = sorted(p.parent.name for p in path.glob("*/config.pbtxt"))
        echo(f"model repository written to {path} ({', '.join(models)}); every config.pbtxt "
             "parsed with Triton's ModelConfig schema")
        return 0
    if engine.target == "trtllm":  # Triton's tensorrtllm backend, in the NGC container
        from trtprompt.serve.launch.trtllm_launch import serve_trtllm

        if api_key is not None:  # fail closed: its launch command sets no restricted APIs
            raise ValueError("an API key is not applied to the trtllm target's tritonserver yet: unset "
                             "TRTPROMPT_API_KEY / --api-key-file, or put it behind a proxy that checks one "
                             "(docs/security.md)")

        if openai is not None:
            echo(f"trtprompt serve: the OpenAI front end is not started for the trtllm target; run it beside "
                 f"tritonserver: python -m trtprompt.serve.openai {engine.path} --grpc-url "
                 f"{ports.local_host}:{ports.grpc} --host {ports.host} --port {openai.port}")
        return serve_trtllm(engine, options, ports, run_dir=run_dir, ready_timeout_s=ready_timeout_s, echo=echo)
    if options.replicas > 1:  # N servers on disjoint cores behind sglang-router (docs/replicas.md)
        from trtprompt.serve.launch.replicas import serve_replicas

        return serve_replicas(engine, options, ports, openai, run_dir, ready_timeout_s, restart, echo, api_key)
    server = Server(engine, options, ports, run_dir=run_dir, ready_timeout_s=ready_timeout_s,
                    restart_engine=restart, log=echo, openai=openai, api_key=api_key)
    if join is not None and openai is not None:
        from trtprompt.serve.launch.join import serve_joined

        return serve_joined(server, join, f"http://{ports.local_host}:{openai.port}/health")
    return serve_forever(server)


def check_join(target: str, replicas: int, openai: OpenAIOptions | None, repo_only: Path | None) -> None:
    """--join-router registers one torch server's OpenAI front end (docs/multi-node.md)."""
    if target != "torch":
        raise ValueError(f"--join-router registers a torch server's OpenAI front end; this engine is for the "
                         f"{target} target")
    if openai is None or repo_only is not None:
        raise ValueError("--join-router registers the OpenAI front end: drop --no-openai / --repo-only")
    if replicas != 1:
        raise ValueError("--join-router with --replicas: run one server per machine (or per NUMA node) and "
                         "join each, or serve --replicas without --join-router")


def run_infer(prompt: str, url: str, model: str, max_tokens: int, stream: bool,
              temperature: float | None, as_json: bool, api_key: ApiKey | None = None) -> int:
    """Send one prompt; print text as it streams (or a JSON record). Returns the exit code.

    api_key: the server's key (None: none sent).
    """
    from trtprompt.client import PERF_OUTPUTS, LLMClient, text_inputs

    def show(out: Mapping[str, Any]) -> None:
        if not as_json:
            value = out["text_output"].reshape(-1)[0]
            sys.stdout.write(value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value))
            sys.stdout.flush()

    optional = dict(temperature=temperature, exclude_input_in_output=True, return_perf_metrics=as_json,
                    return_num_input_tokens=as_json, return_num_output_tokens=as_json)
    from tritonclient.utils import InferenceServerException

    try:
        with LLMClient(url, api_key.value if api_key is not None else "") as client:
            declared = client.input_names(model)
            inputs = text_inputs(prompt, max_tokens, stream,
                                 **{k: v for k, v in optional.items() if k in declared})
            result = client.infer(model, inputs, on_response=show, request_id=uuid.uuid4().hex)
    except InferenceServerException as exc:  # the server unreachable, or refusing us
        print(f"error: {exc}{_key_hint(str(exc), api_key)}", file=sys.stderr)
        return 1
    if result.error:
        print(f"\nerror: {result.error}{_key_hint(result.error, api_key)}", file=sys.stderr)
        return 1
    if as_json:
        record = {"text": result.text, "model": model, "responses": len(result.responses),
                  "ttft_s": result.ttft_s, "total_s": result.times[-1] if result.times else None}
        for name in (*PERF_OUTPUTS, "num_input_tokens", "num_output_tokens"):
            record[name] = result.last(name)
        print(json.dumps(record, ensure_ascii=False, indent=2))
    else:
        print()
    return 0


def _key_hint(error: str, api_key: ApiKey | None) -> str:
    """What to do when Triton refused the call for want of the right key."""
    if "is restricted" not in error:  # Triton 2.51's words: "This protocol is restricted, expecting header"
        return ""
    if api_key is None:
        return "\n(the server requires an API key: set TRTPROMPT_API_KEY or pass --api-key-file)"
    return "\n(the server refused this API key)"
