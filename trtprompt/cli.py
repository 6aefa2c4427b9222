"""`trtprompt` command line: a thin click group, one function per command; logic lives in modules."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import click

from trtprompt import checkpoint_maker as demo  # standard library only at import time
from trtprompt import interface as I
from trtprompt.cli_knobs import BUILD_OPTIONS, SERVE_OPTIONS, knob_options
from trtprompt.errors import UserError
from trtprompt.knobs import KNOBS
from trtprompt.lora_build import TRTLLM_MODULES as LORA_TRTLLM_MODULES
from trtprompt.serve.openai import parser_options as PO  # standard library only at import time


@click.group()
@click.version_option(package_name="trtprompt")
def main() -> None:
    """Compile Hugging Face decoders into bounded engines and serve them behind Triton."""


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


def _refuse_key_value(_ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.UsageError("--api-key is gone: a key on the command line is readable by every local user "
                               "(/proc/PID/cmdline). Set TRTPROMPT_API_KEY or pass --api-key-file PATH.")


def _api_key_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--api-key-file (else $TRTPROMPT_API_KEY), and a removed --api-key that says what to use instead."""
    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option("--api-key", is_flag=False, flag_value="", hidden=True, expose_value=False,
                               callback=_refuse_key_value,
                               help="Removed (visible in /proc): use TRTPROMPT_API_KEY or --api-key-file.")(command)
        return click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path),
                            help=f"File holding {what} (default: $TRTPROMPT_API_KEY; never a command-line "
                                 "value). docs/security.md.")(command)
    return apply


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Engine directory to write.")
@click.option("--profile", help="Shipped profile name or path to a .toml (default: cpu-dev for torch, chat for trtllm).")
@click.option("--target", type=click.Choice(["torch", "trtllm"]), default="torch", show_default=True,
              help="torch: the embedded CPU engine; trtllm: a TensorRT-LLM engine for a GPU.")
@knob_options(BUILD_OPTIONS)
@click.option("--kv-budget-gib", type=float, help="Memory the KV fraction applies to (default: host available memory).")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--tp-size", type=int, default=1, show_default=True, help="Tensor-parallel ranks (trtllm target).")
@click.option("--pp-size", type=int, default=1, show_default=True, help="Pipeline-parallel ranks (trtllm target).")
@click.option("--print-commands", is_flag=True,
              help="trtllm: print the equivalent convert_checkpoint.py + trtllm-build commands; build nothing.")
@click.option("--trtllm-api", type=click.Choice(["engine", "llmapi"]), default=None,
              help="trtllm: engine = TensorRT-LLM 1.2 TensorRT engine; llmapi = 1.3+ LLM API (PyTorch backend, "
                   "checkpoint + model.yaml, no TensorRT-LLM needed to build). Default: llmapi where "
                   "TensorRT-LLM >= 1.3 is installed, else engine.")
@click.option("--lora-dir", "lora_dirs", multiple=True, metavar="NAME=DIR",
              help="A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) served as NAME: checked "
                   "against the checkpoint and copied into the engine's lora/NAME/ (repeatable; docs/lora.md).")
@click.option("--lora-target-modules", multiple=True, type=click.Choice(list(LORA_TRTLLM_MODULES)),
              help="Modules LoRA may apply to, TensorRT-LLM's names (repeatable; default: the adapters' own).")
def build(checkpoint: Path, output: Path | None, profile: str | None, target: str, kv_budget_gib: float | None,
          dry_run: bool, force: bool, no_progress: bool, tp_size: int, pp_size: int, print_commands: bool,
          trtllm_api: str | None, lora_dirs: tuple[str, ...], lora_target_modules: tuple[str, ...],
          **overrides: Any) -> None:
    """Build an engine directory from a Hugging Face CHECKPOINT directory, or a .gguf file (dequantized to
    fp32 first; needs the gguf and accelerate packages, see docs/real-model.md)."""
    from trtprompt.build import BuildRequest, run_build
    from trtprompt.lora_build import LoraRequest, parse_lora_dir
    from trtprompt.report import plan_table

    if print_commands and target != "trtllm":
        raise click.UsageError("--print-commands needs --target trtllm")
    if trtllm_api is not None and target != "trtllm":
        raise click.UsageError(f"--trtllm-api {trtllm_api} applies to --target trtllm only; the {target} "
                               "target has one engine format: leave --trtllm-api out")
    if print_commands and trtllm_api == "llmapi":
        raise click.UsageError("--print-commands prints the TensorRT-LLM 1.2 engine build (convert_checkpoint.py + "
                               "trtllm-build); an llmapi build compiles nothing: run it without --print-commands")
    if output is None and not (dry_run or print_commands):
        raise click.UsageError("missing -o/--output (or pass --dry-run)")
    try:
        lora = LoraRequest(tuple(parse_lora_dir(v) for v in lora_dirs), lora_target_modules or None)
        req = BuildRequest(checkpoint, output, profile, target, overrides, kv_budget_gib, force, not no_progress,
                           tp_size=tp_size, pp_size=pp_size, trtllm_api=trtllm_api, lora=lora)
        if print_commands:
            _print_trtllm_commands(req)
            return
        path = run_build(req, dry_run, on_plan=lambda c, p, plan: _echo_plan(plan_table(c, p, plan), plan.dtype,
                                                                               target))
    except (UserError, ValueError) as exc:
        raise _fail(exc) from exc
    if path is not None:
        click.echo(f"engine written to {path}")


def _echo_plan(table: str, dtype: str, target: str) -> None:
    """The plan, then a warning where the torch target's bf16 would run emulated on this machine."""
    click.echo(table)
    if target == "torch" and dtype == "bfloat16":
        from trtprompt.engine import isa

        problem = isa.bf16_problem(isa.cpu_flags())
        if problem is not None:
            click.echo(f"warning: --dtype bfloat16: {problem}; on such a CPU the engine computes in float32 "
                       "(its weights widened at load; serve --compute-dtype bfloat16 keeps bf16)", err=True)


def _print_trtllm_commands(req: Any) -> None:
    from trtprompt.build import run_build
    from trtprompt.targets.trtllm_config import Parallelism, commands_for_plan

    out = req.output or Path("engines") / Path(req.checkpoint).name
    parallel = Parallelism(req.tp_size, req.pp_size)
    run_build(req, dry_run=True, on_plan=lambda c, p, plan: click.echo(
        commands_for_plan(c.path, c.architecture, c.tokenizer_files, plan, out, parallel), nl=False))


@main.command("demo-checkpoint")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(list(demo.ARCHITECTURES)), default="llama",
              show_default=True, help="Hugging Face architecture to write.")
@click.option("--size", type=click.Choice(list(demo.SIZES)), default="tiny", show_default=True,
              help="Model shape (checkpoint_maker.SIZES).")
@click.option("--seed", type=int, default=0, show_default=True, help="Weight seed.")
@click.option("--tie/--no-tie", default=None, help="Tie lm_head to the embeddings (default: Qwen ties).")
@click.option("--vocab-size", type=int, default=None, help="Tokenizer training target.")
@click.option("--rope", type=click.Choice(list(demo.ROPE_CHOICES)), default="default", show_default=True,
              help="RoPE scaling (llama3: Llama only).")
def demo_checkpoint(out: Path, arch: str, size: str, seed: int, tie: bool | None, vocab_size: int | None,
                    rope: str) -> None:
    """Write a Hugging Face checkpoint with random weights and an offline-trained tokenizer to OUT."""
    try:
        spec = demo.DemoSpec(arch=arch, size=size, seed=seed, tie=tie, vocab_size=vocab_size, rope=rope)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    path = demo.make_demo_checkpoint(out, spec)
    click.echo(f"wrote {spec.size} {demo.ARCHITECTURES[spec.arch]} checkpoint (seed {seed}) to {path}")


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path),
              help="Tokenizer dir (default: the engine's tokenizer/, or files beside a trtllm-build engine).")
def inspect(engine_dir: Path, as_json: bool, tokenizer_dir: Path | None) -> None:
    """Show an engine's bounds, runtime policy, memory plan and provenance."""
    from trtprompt.engine.engine_dir import read_engine_dir
    from trtprompt.report import inspect_data, inspect_text

    try:
        engine = read_engine_dir(engine_dir, tokenizer_dir)
    except UserError as exc:
        raise _fail(exc) from exc
    click.echo(json.dumps(inspect_data(engine), indent=2) if as_json else inspect_text(engine))


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True, required=True,
              help="Prompt text; repeat to run several prompts as one in-flight batch.")
@click.option("--max-tokens", default=64, show_default=True,
              help="Most tokens to generate per prompt (shortened to fit max_seq_len).")
@click.option("--temperature", type=float,
              help="Sample at this temperature (alone: from the full distribution). Unset or 0: greedy.")
@click.option("--top-k", type=int, help="Sample from the k most likely tokens (1: greedy).")
@click.option("--top-p", type=float, help="Sample from the smallest set with this probability mass.")
@click.option("--seed", type=int, help="Per-request sampling seed (default 0, reproducible).")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object per prompt (text, output_ids, token counts, KV reuse, finish_reason).")
def generate(engine_dir: Path, prompts: tuple[str, ...], max_tokens: int, temperature: float | None,
             top_k: int | None, top_p: float | None, seed: int | None, stream: bool, as_json: bool) -> None:
    """Generate offline with the embedded engine of ENGINE_DIR (no server)."""
    from trtprompt.error_codes import RequestError
    from trtprompt.generate import generate as run
    from trtprompt.generate import load, sampling_params

    try:
        params = sampling_params(max_tokens, temperature, top_k, top_p, seed)
        engine, tokenizer = load(engine_dir)
        on_text = None
        if stream and not as_json:
            tag = len(prompts) > 1
            on_text = lambda i, piece: click.echo(f"[{i}] {piece}" if tag else piece, nl=tag)  # noqa: E731
        gens = run(engine, tokenizer, prompts, params, on_text)
    except (UserError, ValueError, RequestError) as exc:
        raise _fail(exc) from exc
    for g in gens:
        if as_json:
            click.echo(json.dumps(g.as_json(), ensure_ascii=False))
        elif stream:
            click.echo("")
        else:
            click.echo(g.text)
        if g.final is not None and g.final.warning:
            click.echo(f"warning: {g.final.warning}", err=True)



@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--host", default=I.DEFAULT_HOST, show_default=True, help="Address to bind (0.0.0.0: all).")
@click.option("--grpc-port", default=I.GRPC_PORT, show_default=True, help="Triton gRPC port.")
@click.option("--http-port", default=I.HTTP_PORT, show_default=True, help="Triton HTTP/REST port.")
@click.option("--metrics-port", default=I.METRICS_PORT, show_default=True, help="Triton Prometheus /metrics port.")
@click.option("--openai-port", default=I.OPENAI_PORT, show_default=True, help="OpenAI-compatible API (/v1/...) port.")
@click.option("--no-openai", is_flag=True, help="Do not start the OpenAI-compatible API.")
@click.option("--max-request-bytes", type=click.IntRange(min=1),
              help="Largest OpenAI request body; larger is refused (413) before it is read "
                   "(default: the engine's max_input_len x 16 + 1 MiB).")
@click.option("--tool-call-parser", type=click.Choice(PO.TOOL_CALL_PARSER_OPTIONS), default=PO.AUTO,
              show_default=True, help=f"OpenAI API: {PO.TOOL_CALL_PARSER_HELP}")
@click.option("--reasoning-parser", type=click.Choice(PO.REASONING_PARSER_OPTIONS), default=PO.AUTO,
              show_default=True, help=f"OpenAI API: {PO.REASONING_PARSER_HELP}")
@_api_key_options("the API key every Triton API but health, and the OpenAI-compatible API, then require")
@click.option("--repo-only", type=click.Path(path_type=Path), help="Write the model repository here and exit.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path),
              help="Tokenizer dir (default: the engine's tokenizer/, or files beside a trtllm-build engine).")
@click.option("--run-dir", type=click.Path(path_type=Path), help="Keep socket, repository and logs here.")
@click.option("--ready-timeout", default=120.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--no-restart", is_flag=True,
              help="Stop (instead of restarting) if the engine process or tritonserver dies (torch target).")
@click.option("--require-kv-reuse", is_flag=True,
              help="Refuse an engine that cannot reuse KV blocks (a TensorRT-LLM 1.2 engine built without "
                   "use_paged_context_fmha or a paged KV cache) instead of serving it with a warning.")
@click.option("--join-router", metavar="URL", help="Register the OpenAI API with the router at URL "
              "(`trtprompt router` on another machine) while serving; docs/multi-node.md.")
@click.option("--advertise-url", metavar="URL", help="Address the router calls this server at (default: "
              "http://HOST:OPENAI_PORT; required with --host 0.0.0.0).")
@click.option("--router-admin-key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="File holding the router's admin key for its /workers API (default: "
                   "$TRTPROMPT_ROUTER_ADMIN_KEY; else the API key is sent).")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=DIR",
              help="A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) the engine loads at "
                   "start, served as `model` NAME (repeatable; vLLM's flag; also as JSON {\"name\", \"path\"}); "
                   "docs/lora.md.")
@knob_options(SERVE_OPTIONS, serve=True)
def serve(engine_dir: Path, host: str, grpc_port: int, http_port: int, metrics_port: int, openai_port: int,
          no_openai: bool, max_request_bytes: int | None, tool_call_parser: str, reasoning_parser: str,
          api_key_file: Path | None, repo_only: Path | None, tokenizer_dir: Path | None,
          run_dir: Path | None,
          ready_timeout: float, no_restart: bool, require_kv_reuse: bool, join_router: str | None,
          advertise_url: str | None, router_admin_key_file: Path | None, **overrides: Any) -> None:
    """Serve ENGINE_DIR behind a real tritonserver (TensorRT-LLM ensemble interface) and an OpenAI-compatible API."""
    from trtprompt.serve.launch.command import run_serve
    from trtprompt.serve.launch.launcher import Ports
    from trtprompt.serve.launch.lora_modules import parse_lora_modules
    from trtprompt.serve.launch.options import ApiKey, OpenAIOptions

    try:
        api_key = ApiKey.read(api_key_file, os.environ)
        overrides["lora_modules"] = parse_lora_modules(overrides.pop("lora_modules", ()))
        openai = None if no_openai else OpenAIOptions(openai_port, api_key.value if api_key else None,
                                                        max_request_bytes, tool_call_parser, reasoning_parser)
        code = run_serve(engine_dir, overrides, Ports(host, grpc_port, http_port, metrics_port),
                         repo_only=repo_only, tokenizer=tokenizer_dir, run_dir=run_dir,
                         ready_timeout_s=ready_timeout,
                         restart=not no_restart, echo=lambda m: click.echo(m, err=True), openai=openai,
                         api_key=api_key, require_kv_reuse=require_kv_reuse,
                         join=_join(join_router, advertise_url, router_admin_key_file, host, openai_port, api_key))
    except (UserError, ValueError) as exc:
        raise _fail(exc) from exc
    raise SystemExit(code)


def _join(router_url: str | None, advertise_url: str | None, admin_key_file: Path | None, host: str,
          openai_port: int, api_key: Any) -> Any:
    """serve --join-router's options (None without it); the admin key from a file or the environment."""
    if router_url is None:
        if advertise_url is not None or admin_key_file is not None:
            raise ValueError("--advertise-url and --router-admin-key-file go with --join-router")
        return None
    from trtprompt.secret_source import read_secret
    from trtprompt.serve.launch.join import join_options
    from trtprompt.serve.launch.router import ADMIN_KEY_ENV

    admin = read_secret(admin_key_file, os.environ, ADMIN_KEY_ENV, "router admin key")
    return join_options(router_url, advertise_url, host, openai_port, admin, api_key.value if api_key else None)


@main.command()
@click.option("--host", default=I.DEFAULT_HOST, show_default=True,
              help="Address to bind (0.0.0.0: all; needs an admin or API key).")
@click.option("--port", default=30000, show_default=True, help="The router's OpenAI port, and its /workers API.")
@click.option("--metrics-port", default=29000, show_default=True, help="The router's Prometheus /metrics port.")
@click.option("--policy", type=click.Choice(["cache_aware", "round_robin"]), default="cache_aware",
              show_default=True, help="sglang-router's routing policy.")
@click.option("--worker-url", "worker_urls", multiple=True, metavar="URL",
              help="A server to route to from the start (repeatable); servers can also join later.")
@click.option("--selector", "selectors", multiple=True, metavar="KEY=VALUE",
              help="Kubernetes discovery: route to pods with these labels (repeatable); docs/multi-node.md.")
@click.option("--discovery-port", default=8003, show_default=True, help="Kubernetes discovery: the pods' OpenAI port.")
@click.option("--discovery-namespace", help="Kubernetes discovery: the namespace to watch (default: all).")
@click.option("--run-dir", type=click.Path(path_type=Path), help="Keep the router's log here.")
@_api_key_options("the API key clients must send (the router passes it on to its workers)")
@click.option("--admin-key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="File holding the key the /workers API then requires (default: $TRTPROMPT_ROUTER_ADMIN_KEY).")
def router(host: str, port: int, metrics_port: int, policy: str, worker_urls: tuple[str, ...],
           selectors: tuple[str, ...], discovery_port: int, discovery_namespace: str | None, run_dir: Path | None,
           api_key_file: Path | None, admin_key_file: Path | None) -> None:
    """Run sglang-router alone, for `trtprompt serve --join-router` servers on other machines."""
    from trtprompt.secret_source import read_secret
    from trtprompt.serve.launch import router as R
    from trtprompt.serve.launch.options import ApiKey
    from trtprompt.serve.launch.router_node import Discovery, NodeOptions, run_router_node

    try:
        api_key = ApiKey.read(api_key_file, os.environ)
        admin = read_secret(admin_key_file, os.environ, R.ADMIN_KEY_ENV, "router admin key")
        opts = NodeOptions(R.RouterOptions(host, port, metrics_port, policy, api_key=api_key.value if api_key else None,
                                           admin_key=admin), worker_urls,
                           Discovery(selectors, discovery_port, discovery_namespace) if selectors else None, run_dir)
    except ValueError as exc:
        raise _fail(exc) from exc
    raise SystemExit(run_router_node(opts, lambda m: click.echo(m, err=True)))


@main.command()
@click.argument("prompt")
@click.option("--url", default=I.DEFAULT_GRPC_URL, show_default=True, help="Triton gRPC address.")
@click.option("--model", default="ensemble", show_default=True, help="Triton model to call.")
@click.option("--max-tokens", default=64, show_default=True, help="Most tokens to generate.")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Print tokens as they arrive (decoupled streaming) or the whole answer at the end.")
@click.option("--temperature", type=float, help="0 (or unset top-k/top-p) is greedy.")
@click.option("--json", "as_json", is_flag=True, help="Print the text and the perf-metric outputs as JSON.")
@_api_key_options("the server's API key, sent as gRPC metadata")
def infer(prompt: str, url: str, model: str, max_tokens: int, stream: bool, temperature: float | None,
          as_json: bool, api_key_file: Path | None) -> None:
    """Send PROMPT to a running server over gRPC and print the answer as it streams."""
    from trtprompt.serve.launch.command import run_infer
    from trtprompt.serve.launch.options import ApiKey

    try:
        api_key = ApiKey.read(api_key_file, os.environ)
    except ValueError as exc:
        raise _fail(exc) from exc
    raise SystemExit(run_infer(prompt, url, model, max_tokens, stream, temperature, as_json, api_key))


# The serve tier knobs `lint` takes to say which prefixes a restart keeps (trtprompt/prompt/restart.py).
LINT_TIER_OPTIONS = ("disk_cache_path", "disk_cache_size", "kv_remote_url", "kv_tier_write_policy")


@main.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path),
              help="Engine dir: its tokenizer and tokens_per_block.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path), help="Tokenizer dir (without --engine).")
@click.option("--tokens-per-block", type=int,
              help=f"KV block size with --tokenizer (default {KNOBS['tokens_per_block'].default}).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option("--fail-under", type=click.FloatRange(0.0, 1.0),
              help="Exit 1 when the reusable fraction is below this (for CI).")
@click.option("--samples", default=8, show_default=True, help="Instances made of a template file.")
@click.option("--write-reordered", type=click.Path(path_type=Path),
              help="Write the suggested (reordered) prompts here as JSONL.")
@knob_options(LINT_TIER_OPTIONS, serve=True)  # as serve takes them: what survives a restart
def lint(file: Path, engine_dir: Path | None, tokenizer_dir: Path | None, tokens_per_block: int | None,
         as_json: bool, fail_under: float | None, samples: int, write_reordered: Path | None,
         **tiers: Any) -> None:
    """Report how much of FILE's prefill KV-block reuse can skip (JSONL prompts or a {template}), and
    which shared prefixes the serve tiers given would keep across a restart."""
    from trtprompt.prompt.lint_report import run_lint
    from trtprompt.prompt.restart import TierSetup

    try:
        setup = TierSetup(**{k: v for k, v in tiers.items() if v is not None})
        code = run_lint(file, engine_dir, tokenizer_dir, tokens_per_block, as_json, fail_under, samples,
                        write_reordered, click.echo, lambda m: click.echo(m, err=True), setup)
    except (UserError, ValueError) as exc:
        raise _fail(exc) from exc
    raise SystemExit(code)


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--workload", type=click.Choice(["random", "shared-prefix", "multi-turn", "long-context", "template",
                                               "file"]), default="random", show_default=True,
              help="Prompt shapes to send; the other options tune the one chosen.")
@click.option("--num-requests", type=int, help="Measured requests per run (default 64).")
@click.option("--warmup", default=2, show_default=True, help="Requests sent first and left out of the results.")
@click.option("--duration", type=float, help="Stop sending new requests after this many seconds.")
@click.option("--concurrency", help="Requests in flight; a list (1,4,8) runs each level. Default 4.")
@click.option("--rate", type=float, help="Poisson arrivals at this many requests/s (instead of fixed concurrency).")
@click.option("--seed", type=int, help="Workload seed (default 0).")
@click.option("--output-len", type=int, help="Tokens generated per request (default 32).")
@click.option("--allow-eos", is_flag=True, help="Let requests end at EOS (default: exactly --output-len tokens).")
@click.option("--input-len", type=int, help="random/long-context: prompt tokens, BOS included (default 128).")
@click.option("--input-spread", type=float, help="random: lengths uniform in input-len * [1-s, 1+s].")
@click.option("--num-prefixes", type=int, help="shared-prefix: distinct system prompts (default 4).")
@click.option("--prefix-len", type=int, help="shared-prefix / template: shared tokens, BOS included (default 512).")
@click.option("--suffix-len", type=int, help="shared-prefix: unique tokens per request (default 64).")
@click.option("--turns", type=int, help="multi-turn: turns per conversation (default 4).")
@click.option("--user-len", type=int, help="multi-turn: tokens per user message (default 64).")
@click.option("--answer-len", type=int, help="multi-turn: tokens per assistant answer (default: output-len).")
@click.option("--long-len", type=int, help="long-context: tokens of the long prompts (default 1536).")
@click.option("--long-fraction", type=float, help="long-context: share of long prompts (default 0.125).")
@click.option("--num-fields", type=int, help="template: variable fields (default 3).")
@click.option("--field-len", type=int, help="template: tokens per field (default 16).")
@click.option("--file", type=click.Path(path_type=Path), help='file: JSONL of {"prompt"} or {"messages"}.')
@click.option("--compare", help="A/B variants, e.g. reuse=on,off  chunked=on,off  policy=guaranteed_no_evict,"
                                "max_utilization  profile=cpu-dev,chat  start=cold,warm,restart (restart: primed "
                                "through a disk KV tier, then a new server) (';' combines axes).")
@click.option("--url", help="Bench a running server instead of starting one: a Triton gRPC host:port, or an "
                            "OpenAI-compatible http(s)://host:port/v1 (trtprompt's or any other, e.g. vLLM).")
@click.option("--api", type=click.Choice(["triton", "openai"]),
              help="Client: Triton gRPC streaming or OpenAI /v1/completions streaming (default: from --url, else triton).")
@click.option("--metrics-url", help=f"Its /metrics (default: the --url host, port {I.METRICS_PORT}).")
@click.option("--replicas-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A serve --replicas group's RUN_DIR/replicas.json: bench through its router (--url defaults to it) "
                   "and report per-replica requests and hit rate, and the router's added TTFT (docs/bench/README.md).")
@click.option("--overhead-requests", type=click.IntRange(min=1),
              help="With --replicas-file: short prompts sent each way (direct, through the router). Default 20.")
@click.option("--baseline", type=click.Choice(["none", "transformers"]), default="none", show_default=True,
              help="Also run the workload in-process with transformers generate and generate_batch.")
@click.option("--hf-checkpoint", type=click.Path(path_type=Path),
              help="Checkpoint for the baseline (default: the engine's recorded source).")
@click.option("--out", type=click.Path(path_type=Path), help="Output directory (default bench-results/WORKLOAD).")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds one request may take.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--no-plots", is_flag=True, help="Write no PNG plots.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
def bench(engine_dir: Path, workload: str, as_json: bool, **options: Any) -> None:
    """Benchmark ENGINE_DIR behind Triton: TTFT, ITL, throughput and KV reuse (A/B with --compare)."""
    from trtprompt.bench.command import run_bench_command

    try:
        run_bench_command(engine_dir, workload, options, lambda m: click.echo(m, err=True), as_json)
    except (UserError, ValueError) as exc:
        raise _fail(exc) from exc


if __name__ == "__main__":
    main()
