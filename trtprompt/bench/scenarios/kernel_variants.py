"""Time the compiled kernels in every variant this CPU runs, side by side (engine/isa.py).

    .venv/bin/python -m trtprompt.bench.scenarios.kernel_variants [--repeats 50]

Each variant runs in its own child process (a process loads one variant). Shapes: paged decode of
32 sequences x 1,024 context tokens (8 query / 4 kv heads, head size 64, 32 tokens per block), SiLU-mul
of 512 x 1,376 and RMSNorm of 512 x 512 (the peer checkpoint's sizes), fp32, every core torch uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from trtprompt.bench import machine

MODULE = "trtprompt.bench.scenarios.kernel_variants"  # each child runs `python -m MODULE --child`
OPS = ("paged_decode", "silu_and_mul", "rms_norm")


def child_ops() -> dict[str, Callable[[], Any]]:
    """The three ops on their inputs, in the variant this process loaded."""
    import torch

    from trtprompt.engine import kernels

    ok, why = kernels.compiled_kernel_status()
    if not ok:
        raise SystemExit(why)
    torch.manual_seed(0)
    s, h, kv, d, tpb, ctx = 32, 8, 4, 64, 32, 1024
    blocks = s * ctx // tpb
    kc, vc = torch.randn(blocks, kv, tpb, d), torch.randn(blocks, kv, tpb, d)
    tables = torch.randperm(blocks, dtype=torch.int32).view(s, ctx // tpb).contiguous()
    lens = torch.full((s,), ctx, dtype=torch.int32)
    q = torch.randn(s, h, d)
    gate_up, x, w = torch.randn(512, 2 * 1376), torch.randn(512, 512), torch.randn(512)
    return {
        "paged_decode": lambda: torch.ops.trtprompt.paged_decode(q, kc, vc, tables, lens, d ** -0.5),
        "silu_and_mul": lambda: torch.ops.trtprompt.silu_and_mul(gate_up),
        "rms_norm": lambda: torch.ops.trtprompt.rms_norm(x, w, 1e-5),
    }


def child(repeats: int) -> dict[str, Any]:
    """ms per call of each op in this process's variant, after 5 untimed calls."""
    from trtprompt.engine import kernels

    out: dict[str, Any] = {"variant": kernels.variant().name}
    for name, fn in child_ops().items():
        for _ in range(5):
            fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t0) / repeats * 1e3
    return out


def run_variants(repeats: int) -> list[dict[str, Any]]:
    """One child process per variant this CPU runs (the last is generic)."""
    from trtprompt.engine import isa

    rows = []
    for v in isa.supported(isa.cpu_flags()):
        env = {**os.environ, isa.ISA_ENV: v.name}
        done = subprocess.run([sys.executable, "-m", MODULE, "--repeats", str(repeats), "--child"], env=env,
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per op and variant")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.repeats)))
        return
    print(f"machine: {machine.one_line()}")
    rows = run_variants(args.repeats)
    base = rows[-1]  # generic
    print(f"{'variant':<10} {'paged_decode ms':>16} {'silu_and_mul ms':>16} {'rms_norm ms':>12}")
    for r in rows:
        cells = [f"{r[k]:.3f} ({base[k] / r[k]:.2f}x)" for k in OPS]
        print(f"{r['variant']:<10} {cells[0]:>16} {cells[1]:>16} {cells[2]:>12}")


if __name__ == "__main__":
    main()
