"""`trtprompt` command line: a thin click group, one function per command; logic lives in modules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from trtprompt.errors import UserError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


@click.group()
@click.version_option(package_name="trtprompt")
def main() -> None:
    """Compile Hugging Face decoders into bounded engines and serve them behind Triton."""


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Engine directory to write.")
@click.option("--profile", help="Shipped profile name or path to a .toml (default: cpu-dev for torch, chat for trtllm).")
@click.option("--target", type=click.Choice(["torch", "trtllm"]), default="torch", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), help="Engine dtype (auto: the checkpoint's).")
@click.option("--quantization", type=click.Choice(["none", "int8_wo", "fp8", "int4_awq"]))
@click.option("--max-batch-size", type=int)
@click.option("--max-input-len", type=int)
@click.option("--max-seq-len", type=int)
@click.option("--max-num-tokens", type=int)
@click.option("--opt-num-tokens", type=int)
@click.option("--max-beam-width", type=int)
@click.option("--tokens-per-block", type=int)
@click.option("--multiple-profiles/--no-multiple-profiles", default=None)
@click.option("--enable-chunked-context/--disable-chunked-context", default=None)
@click.option("--enable-kv-cache-reuse/--disable-kv-cache-reuse", default=None)
@click.option("--batch-scheduler-policy", type=click.Choice(["guaranteed_no_evict", "max_utilization"]))
@click.option("--kv-cache-free-gpu-mem-fraction", type=float)
@click.option("--max-tokens-in-paged-kv-cache", type=int)
@click.option("--max-queue-size", type=int)
@click.option("--overflow", type=click.Choice(["reject", "truncate_left", "truncate_middle"]))
@click.option("--kv-budget-gib", type=float, help="Memory the KV fraction applies to (default: host available memory).")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def build(checkpoint: Path, output: Path | None, profile: str | None, target: str, kv_budget_gib: float | None,
          dry_run: bool, force: bool, no_progress: bool, **overrides: Any) -> None:
    """Build an engine directory from a Hugging Face CHECKPOINT."""
    from trtprompt.build import BuildRequest, run_build
    from trtprompt.report import plan_table

    if output is None and not dry_run:
        raise click.UsageError("missing -o/--output (or pass --dry-run)")
    try:
        req = BuildRequest(checkpoint, output, profile, target, overrides, kv_budget_gib, force, not no_progress)
        path = run_build(req, dry_run, on_plan=lambda c, p, plan: click.echo(plan_table(c, p, plan)))
    except (UserError, ValueError) as exc:
        raise _fail(exc) from exc
    if path is not None:
        click.echo(f"engine written to {path}")


@main.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(engine_dir: Path, as_json: bool) -> None:
    """Show an engine's bounds, runtime policy, memory plan and provenance."""
    from trtprompt.engine_dir import read_engine_dir
    from trtprompt.report import inspect_data, inspect_text

    try:
        engine = read_engine_dir(engine_dir)
    except UserError as exc:
        raise _fail(exc) from exc
    click.echo(json.dumps(inspect_data(engine), indent=2) if as_json else inspect_text(engine))


if __name__ == "__main__":
    main()
