#!/usr/bin/env python3
"""How int8 weight schemes cost quality on SmolLM2, OpenVINO's among them, in one transformers model.

    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.int8_schemes [--prompt-set chat|peers]
        [--schemes sym,sym+head,asym,asym+head,asym+head+a32] [--prompts 32] [--tokens 64]

Each scheme rounds the weights of a float32 transformers model and restores them (fake quantization), so
every scheme runs the same float kernels and only the rounding differs:
- sym: int8_wo's build, symmetric per row in [-127, 127] (quant_w8a8.quantize_int8, the engine's own);
- asym: OpenVINO's int8 export (nncf `int8_asym, per-channel`: a scale and a zero point per row, [0, 255]);
- +head: lm_head too, as an untied copy of the embedding (trtprompt's `quantize_lm_head`; OpenVINO's export
  compresses it as well);
- +aN: every rounded linear's input rounded too, symmetric int8 per run of N input columns of each token (what
  OpenVINO's CPU plugin does at run time to an int8 export: DYNAMIC_QUANTIZATION_GROUP_SIZE, 32 by default;
  docs/peer-openvino.md), so its matmuls can multiply int8 by int8.
Measured against the float32 model's greedy tokens: teacher-forced top-1 (each scheme fed float32's own
sequence) and free-running position match. sym and sym+head reproduce the int8_wo engines' figures token for
token (docs/quantization.md). --prompt-set chat: the int8 scenario's chat prompts; peers: the side-by-side's
throughput prompts (random ids, 32 x 128, seed 101: bench.peers' first rep). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from trtprompt.bench.machine import ROOT
from trtprompt.bench.scenarios._quality import CHAT, OUT, TOPICS, agreement, cpu_line
from trtprompt.engine.quant_w8a8 import quantize_int8

Rounding = Callable[[torch.Tensor], torch.Tensor]
PEERS_SEED = 101  # bench.peers: the throughput workload's seed 100, rep 0 -> 101


def symmetric(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8(w)
    return q.float() * scale[:, None]


def asymmetric(w: torch.Tensor) -> torch.Tensor:
    """Per row: scale (max - min) / 255, an integer zero point, codes in [0, 255]."""
    lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    scale = ((hi - lo) / 255.0).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    return (torch.round(w / scale) + zero).clamp(0, 255).sub(zero) * scale


ROUNDINGS: dict[str, Rounding] = {"sym": symmetric, "asym": asymmetric}


def in_groups(rounding: Rounding, group: int) -> Rounding:
    """rounding applied to each run of `group` input columns of a row (a scale per group, as GGUF's Q8_0 with 32)."""
    def grouped(w: torch.Tensor) -> torch.Tensor:
        if w.shape[1] % group:  # else a group would straddle two rows
            raise ValueError(f"--schemes: groups of {group} do not divide a weight's {w.shape[1]} input columns")
        return rounding(w.reshape(-1, group)).reshape(w.shape)
    return grouped


@dataclass(frozen=True)
class Scheme:
    rounding: Rounding
    head: bool  # lm_head rounded too
    act_group: int | None  # input columns per activation scale (+aN), None: float activations

    def __post_init__(self) -> None:
        if self.act_group is not None and self.act_group < 1:
            raise ValueError(f"Scheme.act_group must be None or >= 1, got {self.act_group}")


def _positive(digits: str) -> bool:
    return digits.isdigit() and int(digits) > 0


def parse_scheme(scheme: str) -> Scheme:
    """'sym' or 'asym', '-gN' for a scale per N input columns (else per row), '+head' to round lm_head too, '+aN'
    to round the activations per N columns."""
    body, *extras = scheme.split("+")
    name, _, group = body.partition("-g")
    acts = [e for e in extras if e.startswith("a")]
    if (name not in ROUNDINGS or (group and not _positive(group)) or extras.count("head") > 1 or len(acts) > 1
            or any(e != "head" and not (e.startswith("a") and _positive(e[1:])) for e in extras)):
        raise ValueError(f"--schemes: {scheme!r} is not sym or asym, optionally -gN (N > 0), with or without +head "
                         "and +aN")
    rounding = ROUNDINGS[name]
    return Scheme(in_groups(rounding, int(group)) if group else rounding, "head" in extras,
                  int(acts[0][1:]) if acts else None)


def activations_in_groups(group: int) -> Callable[[torch.nn.Module, tuple[Any, ...]], tuple[torch.Tensor]]:
    """A forward pre-hook rounding a linear's input to symmetric int8 per run of `group` columns of each token."""
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        if x.shape[-1] % group:
            raise ValueError(f"--schemes: +a{group} does not divide an input of {x.shape[-1]} columns")
        runs = x.reshape(*x.shape[:-1], -1, group)
        scale = runs.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
        return ((torch.round(runs / scale).clamp(-127, 127) * scale).reshape(x.shape),)
    return hook


def rounded_model(base: Any, scheme: str) -> Any:
    """A copy of base with every layer linear (and lm_head for '+head') rounded by scheme."""
    plan = parse_scheme(scheme)
    model = copy.deepcopy(base)
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for module in linears:
            module.weight.copy_(plan.rounding(module.weight))
        if plan.head:  # untied: the embedding lookup keeps float weights, as the engine's does
            model.lm_head.weight = torch.nn.Parameter(plan.rounding(model.lm_head.weight.detach().clone()))
            linears.append(model.lm_head)
    if plan.act_group is not None:
        for module in linears:
            module.register_forward_pre_hook(activations_in_groups(plan.act_group))
    return model


def prompt_set(name: str, checkpoint: Path, count: int) -> list[list[int]]:
    if name == "peers":
        from trtprompt.bench.peers.workloads import random_prompts, token_range

        return random_prompts(PEERS_SEED, count, 128, token_range(checkpoint))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return [tok.encode(CHAT.format(topic=t), add_special_tokens=False).ids for t in TOPICS[:count]]


def greedy(model: Any, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def top1(model: Any, prompts: list[list[int]], ref: list[list[int]]) -> float:
    hits = total = 0
    for p, r in zip(prompts, ref):
        with torch.no_grad():
            logits = model(torch.tensor([p + r[:-1]])).logits[0, len(p) - 1:]
        hits += int((logits.argmax(-1) == torch.tensor(r)).sum())
        total += len(r)
    return hits / total


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(args.checkpoint), dtype=torch.float32).eval()
    prompts = prompt_set(args.prompt_set, args.checkpoint, args.prompts)
    ref = [greedy(base, p, args.tokens) for p in prompts]
    res: dict[str, Any] = {"cpu": cpu_line(), "prompt_set": args.prompt_set,
                           "prompts": f"{len(prompts)} x {args.tokens} greedy tokens"}
    for scheme in args.schemes.split(","):
        model = rounded_model(base, scheme)
        row = {"teacher_forced_top1": top1(model, prompts, ref),
               **agreement(ref, [greedy(model, p, args.tokens) for p in prompts])}
        res[scheme] = row
        print(scheme, json.dumps(row), flush=True)
    return res


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "build/smollm2", help="the float32 checkpoint")
    ap.add_argument("--prompt-set", choices=("chat", "peers"), default="chat", help="which prompts (above)")
    ap.add_argument("--schemes", default="sym,sym+head,asym,asym+head", help="comma list: sym or asym, -gN for "
                    "a scale per N input columns, +head to round lm_head too, +aN to round activations per N columns")
    ap.add_argument("--prompts", type=int, default=32, help="how many prompts")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        for scheme in args.schemes.split(","):
            parse_scheme(scheme)  # every scheme checked before the model loads
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    torch.set_num_threads(args.threads)
    res = run(args)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"int8-schemes-{args.prompt_set}.json"
    path.write_text(json.dumps(res, indent=2), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
