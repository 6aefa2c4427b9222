#!/usr/bin/env python3
"""Write a Hugging Face checkpoint with random weights and an offline-trained tokenizer.

    python scripts/make_demo_checkpoint.py OUT [--arch llama|mistral|qwen2|qwen3]
        [--size tiny|small|peer] [--seed N] [--tie/--no-tie] [--vocab-size N] [--rope default|llama3]
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtprompt.checkpoint_maker import ARCHITECTURES, ROPE_CHOICES, SIZES, DemoSpec, make_demo_checkpoint  # noqa: E402


@click.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(list(ARCHITECTURES)), default="llama", show_default=True)
@click.option("--size", type=click.Choice(list(SIZES)), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tie/--no-tie", default=None, help="Tie lm_head to the embeddings (default: Qwen ties).")
@click.option("--vocab-size", type=int, default=None, help="Tokenizer training target.")
@click.option("--rope", type=click.Choice(list(ROPE_CHOICES)), default="default", show_default=True)
def main(out: Path, arch: str, size: str, seed: int, tie: bool | None, vocab_size: int | None,
         rope: str) -> None:
    try:
        spec = DemoSpec(arch=arch, size=size, seed=seed, tie=tie, vocab_size=vocab_size, rope=rope)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    path = make_demo_checkpoint(out, spec)
    click.echo(f"wrote {spec.size} {ARCHITECTURES[spec.arch]} checkpoint (seed {seed}) to {path}")


if __name__ == "__main__":
    main()
