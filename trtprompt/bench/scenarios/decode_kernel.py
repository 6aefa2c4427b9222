#!/usr/bin/env python3
"""The paged decode kernel against an earlier version of itself, side by side in one process.

    .venv/bin/python -m trtprompt.bench.scenarios.decode_kernel [--old main] [--threads 2,1] [--rounds 5] [--int8]

Builds csrc/paged_attention.cpp as it is in the working tree and as it is at git ref --old (with the
headers of each) as two small extensions under their own op namespaces, with the flags of the kernel
variant this CPU runs (engine/isa.py), then times both on the same inputs, rounds interleaved, at
SmolLM2-135M's shape (9 query / 3 kv heads x 64) and the peer checkpoint's (8 / 4 x 64), 32 tokens
per block, scattered blocks: 32 sequences x 161 and x 1,024 cached tokens (K/V in cache) and 16 x
8,192 (K/V from memory). Reports microseconds per call (best round's mean), old / new and GFLOP/s
counting 4 * d per (query head, cached token). --int8 times paged_decode_int8 as well.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trtprompt.bench import machine
from trtprompt.bench.machine import ROOT as REPO
from trtprompt.engine import kernels
from trtprompt.engine.attention_int8 import quantize_rows

SOURCE = "trtprompt/engine/csrc/paged_attention.cpp"
HEADERS = ("vec.h", "dtypes.h", "paged_checks.h")
TPB = 32
CASES = [(32, 161, 9, 3), (32, 1024, 9, 3), (32, 161, 8, 4), (32, 1024, 8, 4), (16, 8192, 8, 4), (16, 8192, 9, 3)]


def _texts(ref: str | None) -> dict[str, str]:
    """The kernel source and its headers at a git ref, or in the working tree (ref None)."""
    names = [SOURCE, *(f"trtprompt/engine/csrc/{h}" for h in HEADERS)]
    if ref is None:
        return {Path(n).name: (REPO / n).read_text() for n in names}
    return {Path(n).name: subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:{n}"], check=True,
                                         capture_output=True, text=True).stdout for n in names}


def build(ref: str | None, namespace: str, flags: list[str]) -> None:
    """Compile one copy of the kernel whose ops are torch.ops.<namespace>.*."""
    texts = _texts(ref)
    src = texts["paged_attention.cpp"].replace("TORCH_LIBRARY(trtprompt,", f"TORCH_LIBRARY({namespace},")
    src = src.replace("TORCH_LIBRARY_IMPL(trtprompt,", f"TORCH_LIBRARY_IMPL({namespace},")
    texts["paged_attention.cpp"] = src
    digest = hashlib.blake2b("".join(texts.values()).encode() + " ".join(flags).encode(), digest_size=6).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"trtprompt-decode-bench-{digest}"
    folder.mkdir(exist_ok=True)
    for name, text in texts.items():
        if not (folder / name).exists() or (folder / name).read_text() != text:
            (folder / name).write_text(text)
    from torch.utils import cpp_extension

    cpp_extension.load(name=f"decode_bench_{namespace}_{digest}", sources=[str(folder / "paged_attention.cpp")],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)


def make_case(seqs: int, ctx: int, heads: int, kv_heads: int, d: int = 64) -> dict[str, Any]:
    blocks = -(-ctx // TPB)
    kc, vc = torch.randn(seqs * blocks, kv_heads, TPB, d), torch.randn(seqs * blocks, kv_heads, TPB, d)
    tables = torch.randperm(seqs * blocks, dtype=torch.int32).view(seqs, blocks).contiguous()
    return {"q": torch.randn(seqs, heads, d), "kc": kc, "vc": vc, "tables": tables,
            "lens": torch.full((seqs,), ctx, dtype=torch.int32), "flops": 4 * d * heads * ctx * seqs}


def call(namespace: str, op: str, c: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc = (c["kc8"], c["vc8"]) if op.endswith("int8") else (c["kc"], c["vc"])
    out, lse = getattr(getattr(torch.ops, namespace), op)(c["q"], kc, vc, c["tables"], c["lens"],
                                                           c["q"].shape[-1] ** -0.5)
    return out, lse


def mean_call_s(fn: Callable[[], object], budget_s: float = 0.15) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < budget_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


Case = tuple[int, int, int, int]  # sequences, cached tokens, query heads, kv heads


def prepared_cases(with_int8: bool) -> dict[Case, dict[str, Any]]:
    """Every case's inputs (int8 copies of K/V too with with_int8)."""
    torch.manual_seed(0)
    cases: dict[Case, dict[str, Any]] = {c: make_case(*c) for c in CASES}
    if with_int8:
        for c in cases.values():
            c["kc8"], c["vc8"] = quantize_rows(c["kc"]).contiguous(), quantize_rows(c["vc"]).contiguous()
    return cases


def check_agree(cases: dict[Case, dict[str, Any]], ops: list[str]) -> None:
    """The two builds agree on every case before they are timed."""
    for c in cases.values():
        for op in ops:
            (o1, l1), (o2, l2) = call("decode_old", op, c), call("decode_new", op, c)
            if (o1 - o2).abs().max().item() >= 1e-4 or (l1 - l2).abs().max().item() >= 1e-4:
                raise SystemExit(f"{op}: the old and new kernels disagree")


def best_of_rounds(cases: dict[Case, dict[str, Any]], ops: list[str], rounds: int) -> dict[tuple[Any, ...], float]:
    """Best mean seconds per call of (case, op, build) over interleaved rounds."""
    best: dict[tuple[Any, ...], float] = {}
    for _ in range(rounds):
        for key, c in cases.items():
            for op in ops:
                for ns in ("decode_old", "decode_new"):
                    t = mean_call_s(functools.partial(call, ns, op, c))
                    best[(key, op, ns)] = min(best.get((key, op, ns), t), t)
    return best


def print_rows(cases: dict[Case, dict[str, Any]], ops: list[str], threads: int,
               best: dict[tuple[Any, ...], float]) -> None:
    for key, c in cases.items():
        seqs, ctx, heads, kvh = key
        for op in ops:
            old, new = (best[(key, op, ns)] for ns in ("decode_old", "decode_new"))
            print(f"| {op} | {threads} | {seqs} x {ctx} | {heads} / {kvh} | {old * 1e6:.0f} | {new * 1e6:.0f} | "
                  f"{old / new:.2f}x | {c['flops'] / new / 1e9:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="main", help="git ref of the version to compare with (default main)")
    ap.add_argument("--threads", default="2,1", help="comma-separated torch thread counts")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (best kept)")
    ap.add_argument("--int8", action="store_true", help="also time paged_decode_int8")
    args = ap.parse_args()
    variant = kernels.variant()
    flags = [*kernels._BASE_FLAGS, *variant.cflags]
    build(args.old, "decode_old", flags)
    build(None, "decode_new", flags)
    ops = ["paged_decode"] + (["paged_decode_int8"] if args.int8 else [])
    cases = prepared_cases(args.int8)
    check_agree(cases, ops)
    info = machine.describe()
    print(f"# {info['time_utc']} UTC; {machine.one_line(info)} ({platform.machine()}); "
          f"variant {variant.name} {' '.join(variant.cflags)}; load {os.getloadavg()}")
    print(f"# {' '.join(sys.argv)}; old = {args.old}, new = working tree")
    print("| op | threads | seqs x tokens | heads / kv | old us | new us | old / new | new GFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print_rows(cases, ops, threads, best_of_rounds(cases, ops, args.rounds))
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
