#!/usr/bin/env python3
"""W8A8 (quantization int8_w8a8) against fp32, side by side in one run: GEMMs, throughput, quality.

    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.int8 gemm [--rounds 7]
    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.int8 throughput [--reps 3]
    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.int8 quality [--checkpoint build/smollm2]

gemm:       every int8 GEMM torch offers on this CPU against fp32 F.linear and the engine's
            prepacked oneDNN fp32 linear, on the peer checkpoint's and SmolLM2-135M's linear
            shapes, tokens 1..512; rounds interleave the variants; best-of-rounds GFLOP/s
            (int8: GOP/s) and each int8 kernel's error against the exact integer product.
throughput: the peer workload, 32 x (128 in, 64 out), greedy, offline, in process, on a
            peer-checkpoint engine built fp32 and int8_w8a8, reps alternating.
quality:    SmolLM2-135M-Instruct (`make real-model`), fp32 against int8_w8a8 variants
            (--variants: bit split and SmoothQuant alpha, e.g. w8a7@none,w8a7@0.5,w7a8@auto
            (alpha searched per linear), +skip1 (calibration maxima without each sequence's
            first token), and wo for int8_wo): perplexity on a held-out text (/usr/share/common-licenses/GPL-3,
            Debian's base-files), teacher-forced top-1 and free-running greedy agreement over
            32 prompts x 64 tokens. Every variant runs the engine's default W8A8 path (fbgemm, or oneDNN with AMX).

Writes JSON under build/bench-int8/ and prints Markdown. Not part of `make test`.
docs/quantization.md explains the kernels and the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from trtprompt.bench import machine
from trtprompt.bench.machine import ROOT
from trtprompt.bench.scenarios._quality import (
    CHAT,
    HELD_OUT,
    OUT,
    PPL_TOKENS,
    TOPICS,
    agreement,
    built,
    cpu_line,
    perplexity,
    run_greedy,
    teacher_forced,
)
from trtprompt.engine.quant_w8a8 import LEGACY_BITS, FbgemmW8A8Linear, W8A8Bits, quantize_per_token

# (name, K, N) per model: fused qkv, o_proj, fused gate_up, down_proj, lm_head.
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "peer": [("qkv", 512, 1024), ("o", 512, 512), ("gate_up", 512, 2752), ("down", 1376, 512),
             ("lm_head", 512, 4000)],
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                ("lm_head", 576, 49152)],
}
TOKENS = (1, 8, 32, 128, 512)
# The bounds of the vLLM side-by-side's engine, so throughput figures compare with BENCHMARKS.md's.
ENGINE_OVERRIDES = {"max_batch_size": 64, "max_num_tokens": 2048, "max_seq_len": 2048, "tokens_per_block": 32,
                    "enable_chunked_context": True}
# -- gemm ------------------------------------------------------------------------------------------

def _best_ms(fn: Callable[[], Any], min_s: float = 0.05) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s or n < 3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def _onednn_int8(qw: torch.Tensor, sw: torch.Tensor, m: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """oneDNN's int8 linear, per-token scales the same way as fbgemm's (x / s_x, scale 1, zero point 64)."""
    packed = torch.ops.onednn.qlinear_prepack(qw, [m, qw.shape[1]])
    zps = torch.zeros(qw.shape[0], dtype=torch.long)

    def run(x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_per_token(x)
        qu = (q + LEGACY_BITS.act_zero_point).to(torch.uint8)
        y: torch.Tensor = torch.ops.onednn.qlinear_pointwise(qu, 1.0, LEGACY_BITS.act_zero_point, packed, sw, zps,
                                                             None, 1.0, 0, torch.float32, "none", [], "")
        return y * s
    return run


def _variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    from trtprompt.targets.torch_build import quantize_int8

    qw, sw = quantize_int8(w)
    packed_fp32 = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    fb = FbgemmW8A8Linear(qw, sw, None)
    od = _onednn_int8(qw, sw, x.shape[0])
    q, _ = quantize_per_token(x)
    qi, qwt = q.to(torch.int8), qw.t()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        qt = torch._make_per_channel_quantized_tensor(qw, sw.double(), torch.zeros(w.shape[0], dtype=torch.long), 0)
        dyn = torch.ops.quantized.linear_prepack(qt, None)
    out = {
        "fp32 F.linear (MKL)": lambda: F.linear(x, w),
        "fp32 oneDNN prepacked (engine)": lambda: torch.ops.mkldnn._linear_pointwise(x, packed_fp32, None, "none",
                                                                                     [], ""),
        "W8A8 fbgemm per-token (engine)": lambda: fb(x),
        "W8A8 oneDNN qlinear per-token": lambda: od(x),
        "fbgemm linear_dynamic per-tensor": lambda: torch.ops.quantized.linear_dynamic(x, dyn, True),
        "per-token quantize only": lambda: quantize_per_token(x)[0],
    }
    if 16 < x.shape[0] <= 32 and w.shape[0] <= 4096:  # wants M > 16; ~2 GOP/s here, so the small shapes only
        out["torch._int_mm (int32 out)"] = lambda: torch._int_mm(qi, qwt)
    return out


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from trtprompt.targets.torch_build import quantize_int8

    qw, sw = quantize_int8(w)
    q, s = quantize_per_token(x)
    return ((q.double() @ qw.double().t()) * sw.double() * s.double()).float()


def gemm_row(model: str, name: str, x: torch.Tensor, w: torch.Tensor, rounds: int) -> dict[str, Any]:
    """One linear at one token count: best ms, GFLOP/s (int8: GOP/s) and error of each variant."""
    variants = _variants(x, w)
    exact = _exact(x, w)
    errs = {v: ((variants[v]() - exact).abs().max() / exact.abs().max()).item()
            for v in ("W8A8 fbgemm per-token (engine)", "W8A8 oneDNN qlinear per-token")}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v, fn in variants.items():
            times[v].append(_best_ms(fn))
    best = {v: min(t) for v, t in times.items()}
    m, k, n = x.shape[0], x.shape[1], w.shape[0]
    ops = 2 * m * k * n / 1e9
    fp = best["fp32 oneDNN prepacked (engine)"]
    print(f"{model} {name} M={m}: " + ", ".join(f"{v} {fp / t:.2f}x" for v, t in best.items()), flush=True)
    return {"model": model, "linear": name, "M": m, "K": k, "N": n, "ms": best,
            "gops": {v: ops / (t / 1e3) for v, t in best.items()}, "rel_err": errs}


def gemm(args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for model, shapes in SHAPES.items():
        for name, k, n in shapes:
            w = torch.randn(n, k, generator=gen) * 0.05
            for m in args.gemm_tokens:
                rows.append(gemm_row(model, name, torch.randn(m, k, generator=gen), w, args.rounds))
    return {"rows": rows}


def gemm_markdown(res: dict[str, Any]) -> str:
    variants = list(res["rows"][0]["gops"])
    head = "| model | linear | M x K x N | " + " | ".join(variants) + " |"
    lines = [head, "|" + " --- |" * (3 + len(variants))]
    for r in res["rows"]:
        cells = [f"{r['gops'][v]:.1f}" if v in r["gops"] else "—" for v in variants]
        lines.append(f"| {r['model']} | {r['linear']} | {r['M']} x {r['K']} x {r['N']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- engines ---------------------------------------------------------------------------------------

def alternating_reps(engines: dict[str, Any], prompts: list[list[int]], output: int,
                     reps: int) -> dict[str, list[float]]:
    """Output tok/s per engine and rep, the order reversed every other rep."""
    out: dict[str, list[float]] = {q: [] for q in engines}
    for i in range(reps):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for q in order:
            toks, wall = run_greedy(engines[q], prompts, output)
            out[q].append(sum(map(len, toks)) / wall)
            print(f"rep {i} {q}: {out[q][-1]:.1f} output tok/s (load {os.getloadavg()[0]:.2f})", flush=True)
    return out


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from trtprompt.checkpoint_maker import DemoSpec, make_demo_checkpoint
    from trtprompt.engine.engine import LLMEngine

    ckpt = args.peer_checkpoint
    if not (ckpt / "config.json").exists():
        make_demo_checkpoint(ckpt, DemoSpec(size="peer"))
    engines = {q: LLMEngine.from_engine_dir(built(ckpt, OUT / f"peer-{q}", q, ENGINE_OVERRIDES))
               for q in ("none", "int8_w8a8")}
    gen = torch.Generator().manual_seed(0)
    vocab = engines["none"].runner.model.cfg.vocab_size
    prompts = [torch.randint(10, vocab, (args.input,), generator=gen).tolist() for _ in range(args.requests)]
    for e in engines.values():
        run_greedy(e, prompts, args.output)  # warm-up at full size
    reps = alternating_reps(engines, prompts, args.output, args.reps)
    med = {q: statistics.median(v) for q, v in reps.items()}
    return {"workload": f"{args.requests} x ({args.input} in, {args.output} out), greedy, offline",
            "output_tok_s": reps, "median": med, "ratio_int8_over_fp32": med["int8_w8a8"] / med["none"]}


# -- quality ---------------------------------------------------------------------------------------

SPLITS = {"w8a7": W8A8Bits(weight_bits=8, activation_bits=7), "w7a8": W8A8Bits(weight_bits=7, activation_bits=8)}


@dataclass(frozen=True)
class Variant:
    """fp32, int8_wo, int4_wo in groups, or int8_w8a8 at a bit split with SmoothQuant alpha (None: unsmoothed);
    "+bf16" on any of them builds a bfloat16 engine."""

    spec: str  # "fp32", "wo", "wohead", "wog32head", "int4g32", "w8a7@none", "w7a8@0.5", "w7a8@0.5+skip1", "auto+bf16"
    quantization: str
    bits: W8A8Bits | None = None
    alpha: float | None = None
    skip_first: int | None = None  # calibration tokens left out per sequence (None: the build's choice)
    search: bool = False  # alpha "auto": searched per linear (smoothquant.ALPHA_GRID)
    group: int | None = None  # int4_wo's int4_group_size, or int8_wo's int8_group_size ("wogN")
    dtype: str = "float32"
    quantize_lm_head: bool = False  # "wohead": int8_wo with lm_head int8 too


def parse_variant(spec: str) -> Variant:
    base, bf16, _ = spec.partition("+bf16")
    if bf16:
        return dataclasses.replace(parse_variant(base), spec=spec, dtype="bfloat16")
    wo = re.fullmatch(r"wo(?:g(\d+))?(head)?", spec)
    if wo is not None and (wo.group(1) or wo.group(2)):  # "wohead", "wog32", "wog32head"
        return Variant(spec, "int8_wo", group=int(wo.group(1)) if wo.group(1) else None,
                       quantize_lm_head=bool(wo.group(2)))
    if spec in ("fp32", "wo", "bf16"):
        return Variant(spec, "int8_wo" if spec == "wo" else "none", dtype="bfloat16" if spec == "bf16" else "float32")
    if spec.startswith("int4g") and spec[5:].isdigit():
        return Variant(spec, "int4_wo", group=int(spec[5:]))
    split, _, rest = spec.partition("@")
    alpha, _, skip = rest.partition("+skip")
    if split not in SPLITS or not alpha:
        raise SystemExit(f"variant {spec!r}: fp32, bf16, wo[gGROUP][head], int4gGROUP, or SPLIT@ALPHA[+skipN] with "
                         f"SPLIT in {', '.join(SPLITS)}, ALPHA a number, none or auto, N the calibration tokens left "
                         "out at each sequence's start; +bf16 after any builds a bfloat16 engine")
    value = None if alpha in ("none", "auto") else float(alpha)
    return Variant(spec, "int8_w8a8", SPLITS[split], value, int(skip) if skip else None, alpha == "auto")


@contextlib.contextmanager
def build_as(v: Variant) -> Iterator[None]:
    """The build writes quant_w8a8.BUILD_BITS; this benchmark builds other splits (and unsmoothed) to compare them."""
    from trtprompt.targets import smoothquant, torch_build

    saved_bits, saved_smooth, saved_skip = torch_build.BUILD_BITS, torch_build.smooth, smoothquant.SKIP_FIRST
    torch_build.BUILD_BITS = v.bits or saved_bits
    smoothquant.SKIP_FIRST = saved_skip if v.skip_first is None else v.skip_first
    if v.quantization == "int8_w8a8" and v.alpha is None and not v.search:
        torch_build.smooth = lambda tensors, *_a, **_k: (dict(tensors), None)  # type: ignore[assignment]
    if v.search:
        torch_build.smooth = lambda t, pc, _alpha, *a, **k: saved_smooth(t, pc, None, *a, **k)
    try:
        yield
    finally:
        torch_build.BUILD_BITS, torch_build.smooth, smoothquant.SKIP_FIRST = saved_bits, saved_smooth, saved_skip


def variant_engine(v: Variant, checkpoint: Path, overrides: dict[str, Any]) -> Path:
    extra: dict[str, Any] = {"smoothquant_alpha": v.alpha} if v.alpha is not None else {}
    group_knob = "int8_group_size" if v.quantization == "int8_wo" else "int4_group_size"
    extra.update({group_knob: v.group} if v.group is not None else {}, dtype=v.dtype)
    extra.update({"quantize_lm_head": True} if v.quantize_lm_head else {})
    with build_as(v):
        return built(checkpoint, OUT / f"smollm2-{v.spec}", v.quantization, {**overrides, **extra})


def quality_row(v: Variant, args: argparse.Namespace, overrides: dict[str, Any], text: list[int],
                prompts: list[list[int]], ref: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    """One variant's perplexity, greedy run and (against ref, when there is one) agreement; its tokens."""
    from trtprompt.engine.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_dir(variant_engine(v, args.checkpoint, overrides))
    row: dict[str, Any] = {"ppl": perplexity(engine, text)}
    toks, row["generate_s"] = run_greedy(engine, prompts, args.tokens)
    if ref:
        row.update(agreement(ref, toks))
        row["teacher_forced_top1"] = teacher_forced(engine, prompts, ref)
    row["wall_s"], row["utc"] = time.perf_counter() - t0, time.strftime("%H:%M:%S", time.gmtime())
    row["loadavg"] = os.getloadavg()[0]
    return row, toks


def quality(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    overrides = {"max_seq_len": 2048, "max_num_tokens": 2048, "max_batch_size": 32}
    prompts = [tok.encode(CHAT.format(topic=t), add_special_tokens=False).ids for t in TOPICS[:args.prompts]]
    text = tok.encode(HELD_OUT.read_text(encoding="utf-8"), add_special_tokens=False).ids[:args.ppl_tokens]
    results: dict[str, Any] = {"held_out": f"{HELD_OUT} (first {len(text)} tokens)",
                               "prompts": f"{len(prompts)} x {args.tokens} greedy tokens"}
    ref: list[list[int]] = []
    for v in [parse_variant("fp32"), *(parse_variant(s) for s in args.variants.split(",") if s)]:
        row, toks = quality_row(v, args, overrides, text, prompts, ref)
        ref = ref or toks
        results[v.spec] = row
        print(v.spec, json.dumps(row), flush=True)
    base = results["fp32"]["ppl"]
    for r in results.values():
        if isinstance(r, dict) and "ppl" in r:
            r["ppl_increase"] = r["ppl"] / base - 1
    results["sample"] = {"prompt": tok.decode(prompts[0]), "fp32": tok.decode(ref[0])}
    return results


def quality_markdown(res: dict[str, Any]) -> str:
    lines = ["| variant | perplexity | increase | teacher-forced top-1 | position match | identical seqs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in res.items():
        if not isinstance(r, dict) or "ppl" not in r:
            continue
        tf = f"{r['teacher_forced_top1']:.1%}" if "teacher_forced_top1" in r else "—"
        pm = f"{r['position_match']:.1%}" if "position_match" in r else "—"
        ident = f"{r['identical_sequences']:.0%}" if "identical_sequences" in r else "—"
        lines.append(f"| {name} | {r['ppl']:.3f} | {r['ppl_increase']:+.2%} | {tf} | {pm} | {ident} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("gemm", "throughput", "quality"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gemm-tokens", type=lambda t: [int(v) for v in t.split(",")], default=list(TOKENS),
                    help="gemm: comma list of token counts M")
    ap.add_argument("--rounds", type=int, default=5, help="gemm: interleaved rounds (best kept)")
    ap.add_argument("--reps", type=int, default=3, help="throughput: timed reps per side (median)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--peer-checkpoint", type=Path, default=ROOT / "build/peer-checkpoint")
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "build/smollm2", help="quality: SmolLM2 checkpoint")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--variants", default="w8a7@none,w8a7@0.5,w7a8@0.5,wo",
                    help="quality: comma list of variants besides fp32: bf16, wo (int8_wo), wohead (int8_wo with "
                    "quantize_lm_head), wogGROUP[head] (int8_wo with int8_group_size GROUP), int4gGROUP (int4_wo in "
                    "groups of GROUP), or SPLIT@ALPHA (SPLIT w8a7 or w7a8: weight / activation bits; ALPHA: "
                    "SmoothQuant alpha, none, or auto: searched); +bf16 after any builds a bfloat16 engine")
    ap.add_argument("--ppl-tokens", type=int, default=PPL_TOKENS, help="quality: held-out tokens scored")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_line()}", flush=True)
    res = {"gemm": gemm, "throughput": throughput, "quality": quality}[args.what](args)
    res["cpu"] = cpu_line()
    res["machine"] = machine.describe()
    res["loadavg_end"] = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.what}.json").write_text(json.dumps(res, indent=2), encoding="utf-8")
    if args.what == "gemm":
        print(gemm_markdown(res))
    elif args.what == "quality":
        print(quality_markdown(res))
    else:
        print(json.dumps({k: res[k] for k in ("workload", "median", "ratio_int8_over_fp32")}, indent=2))


if __name__ == "__main__":
    main()
