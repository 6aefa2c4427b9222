"""Time the compiled kernels in every variant this CPU runs, side by side (engine/isa.py).

    .venv/bin/python scripts/bench_kernel_variants.py [--repeats 50]

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

CHILD = r"""
import json, sys, time, torch
from trtprompt.engine import kernels
ok, why = kernels.compiled_kernel_status()
assert ok, why
torch.manual_seed(0)
S, H, KV, D, TPB, CTX = 32, 8, 4, 64, 32, 1024
blocks = S * CTX // TPB
kc, vc = torch.randn(blocks, KV, TPB, D), torch.randn(blocks, KV, TPB, D)
tables = torch.randperm(blocks, dtype=torch.int32).view(S, CTX // TPB).contiguous()
lens = torch.full((S,), CTX, dtype=torch.int32)
q = torch.randn(S, H, D)
gate_up, x, w = torch.randn(512, 2 * 1376), torch.randn(512, 512), torch.randn(512)
ops = {
    "paged_decode": lambda: torch.ops.trtprompt.paged_decode(q, kc, vc, tables, lens, D ** -0.5),
    "silu_and_mul": lambda: torch.ops.trtprompt.silu_and_mul(gate_up),
    "rms_norm": lambda: torch.ops.trtprompt.rms_norm(x, w, 1e-5),
}
out = {"variant": kernels.variant().name}
for name, fn in ops.items():
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(int(sys.argv[1])):
        fn()
    out[name] = (time.perf_counter() - t0) / int(sys.argv[1]) * 1e3
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per op and variant")
    args = ap.parse_args()
    from trtprompt.engine import isa
    flags = isa.cpu_flags()
    print("CPU flags:", " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))))
    rows = []
    for v in isa.supported(flags):
        env = {**os.environ, isa.ISA_ENV: v.name}
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.repeats)], env=env, capture_output=True,
                              text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[-1]  # generic
    print(f"{'variant':<10} {'paged_decode ms':>16} {'silu_and_mul ms':>16} {'rms_norm ms':>12}")
    for r in rows:
        cells = [f"{r[k]:.3f} ({base[k] / r[k]:.2f}x)" for k in ("paged_decode", "silu_and_mul", "rms_norm")]
        print(f"{r['variant']:<10} {cells[0]:>16} {cells[1]:>16} {cells[2]:>12}")


if __name__ == "__main__":
    main()
