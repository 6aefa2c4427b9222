"""`trtprompt serve` of an llmapi engine directory: checks, the repository, one tritonserver.

One tritonserver process at any tensor/pipeline size: the LLM API starts its own
workers for tp x pp > 1 (from model.yaml's tensor_parallel_size /
pipeline_parallel_size), unlike the 1.2 engine path's one tritonserver per rank.
Everything that can be refused is refused before anything starts: TensorRT-LLM's
llmapi model.py missing (it names the container), tritonserver missing,
TensorRT-LLM missing or older than 1.3.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from trtprompt.errors import TargetUnavailableError
from trtprompt.serve.launch.launcher import Ports
from trtprompt.serve.launch.llmapi_repository import (
    LLMAPI_CONTAINER,
    PLACEHOLDER,
    find_llmapi_model,
    require_llmapi_model,
    write_llmapi_repository,
)
from trtprompt.serve.launch.options import EngineInfo, OpenAIOptions, ServeOptions
from trtprompt.serve.launch.trtllm_launch import TrtllmLaunchSpec, run_tritonserver
from trtprompt.targets.kv_offload import NEWEST_READ
from trtprompt.targets.llmapi_build import default_trtllm_api
from trtprompt.targets.trtllm_checks import installed_trtllm_version

if TYPE_CHECKING:  # options.ApiKey is new beside this module; only its type is needed here
    from trtprompt.serve.launch.options import ApiKey


def preflight_llmapi(which: Callable[[str], str | None] = shutil.which,
                     installed: Callable[[], str | None] = installed_trtllm_version) -> tuple[Path, str]:
    """(TensorRT-LLM's llmapi model folder, the tritonserver binary), or the reason it cannot run here."""
    found = require_llmapi_model(find_llmapi_model())
    server = which("tritonserver")
    if server is None:
        raise TargetUnavailableError(f"tritonserver is not on PATH: serve llmapi engines inside {LLMAPI_CONTAINER}")
    version = installed()
    if default_trtllm_api(version or "") != "llmapi":
        raise TargetUnavailableError(f"the llmapi layout needs TensorRT-LLM >= 1.3, found {version or 'none'}: "
                                     f"serve inside {LLMAPI_CONTAINER}")
    return found, server


def serve_llmapi(engine: EngineInfo, options: ServeOptions, ports: Ports, run_dir: Path | None = None,
                 ready_timeout_s: float = 900.0, echo: Callable[[str], None] = print) -> int:
    """Check, write the repository, start tritonserver, wait for SIGINT/SIGTERM."""
    found, server = preflight_llmapi()
    run = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="trtprompt-llmapi-"))
    repo = write_llmapi_repository(run / "repository", engine, options, found, installed_trtllm_version())
    spec = TrtllmLaunchSpec(repo, 1, server, host=ports.host, http_port=ports.http, grpc_port=ports.grpc,
                            metrics_port=ports.metrics)
    return run_tritonserver(spec, run / "tritonserver.log", ready_timeout_s, f"LLM API, {engine.path.name}", echo)


def run_llmapi(engine: EngineInfo, options: ServeOptions, ports: Ports, *, repo_only: Path | None,
               run_dir: Path | None, ready_timeout_s: float, echo: Callable[[str], None],
               openai: OpenAIOptions | None, api_key: "ApiKey | None" = None) -> int:
    """run_serve for an llmapi engine directory: --repo-only writes the repository (model.py or the note
    saying where it comes from); otherwise serve it, with the OpenAI front end's command printed."""
    if repo_only is not None:
        found, version = find_llmapi_model(), installed_trtllm_version()
        path = write_llmapi_repository(Path(repo_only).resolve(), engine, options, found, version)
        where = found if found is not None else f"not installed here: see tensorrt_llm/1/{PLACEHOLDER}"
        release = version or f"{NEWEST_READ} (not installed here; the newest release read)"
        echo(f"model repository written to {path} (ensemble: the prompt edge; tensorrt_llm: TensorRT-LLM's llmapi "
             f"model, model.py {where}; model.yaml for TensorRT-LLM {release}); every config.pbtxt parsed with "
             "Triton's ModelConfig schema")
        return 0
    if api_key is not None:  # fail closed: the launch command sets no restricted APIs
        raise ValueError("an API key is not applied to the llmapi layout's tritonserver yet: unset "
                         "TRTPROMPT_API_KEY / --api-key-file, or put it behind a proxy that checks one")
    if openai is not None:
        echo(f"trtprompt serve: start the OpenAI front end beside tritonserver (it calls `ensemble`): "
             f"python -m trtprompt.serve.openai {engine.path} --grpc-url {ports.local_host}:{ports.grpc} "
             f"--host {ports.host} --port {openai.port}")
    return serve_llmapi(engine, options, ports, run_dir=run_dir, ready_timeout_s=max(ready_timeout_s, 900.0),
                        echo=echo)
