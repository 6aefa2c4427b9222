"""Which build of the compiled kernels (csrc/) this CPU runs: one variant per instruction set.

The kernels are written once with GCC/Clang vector extensions (csrc/vec.h);
a variant is the compiler flags and the vector width they are built with.
The best variant whose CPU flags the machine reports is chosen; the
environment variable TRTPROMPT_KERNEL_ISA names another one (for example
`avx2` on an AVX-512 machine, to compare the two side by side). Design and
figures: docs/design.md, "Kernel variants".

Only variants whose code differs are listed. bf16 / VNNI / AMX variants would
compile to the same fp32 code as `avx512`: the kernels compute in fp32 (bf16
caches are converted on load). The exceptions carry their instructions'
target on their own functions inside the `avx512` build and run only where
the CPU reports the flag: bf16 panels (csrc/bf16_panels.cpp, avx512_bf16) and
the AMX linear (csrc/amx_linear.cpp); VNNI reaches the linears through oneDNN
(engine/linear.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "TRTPROMPT_KERNEL_ISA"


@dataclass(frozen=True)
class KernelVariant:
    name: str
    needs: frozenset[str]  # CPU flags as /proc/cpuinfo names them
    cflags: tuple[str, ...]
    lanes: int  # floats per vector (csrc/vec.h's TRTPROMPT_LANES)

    def __post_init__(self) -> None:
        if self.lanes not in (8, 16):
            raise ValueError(f"KernelVariant.lanes must be 8 or 16, got {self.lanes}")

    def missing(self, flags: frozenset[str]) -> list[str]:
        return sorted(self.needs - flags)


_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"})
# Best first. `generic` is the compiler's baseline for the machine (SSE2 on x86-64, NEON on
# aarch64): it runs everywhere a compiler does.
VARIANTS: tuple[KernelVariant, ...] = (
    KernelVariant("avx512", _AVX512, ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                                      "-DTRTPROMPT_LANES=16"), 16),
    KernelVariant("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c", "-DTRTPROMPT_LANES=8"),
                  8),
    KernelVariant("generic", frozenset(), ("-DTRTPROMPT_LANES=8",), 8),
)
BY_NAME: dict[str, KernelVariant] = {v.name: v for v in VARIANTS}

# What torch's own dispatch reports, for machines without /proc/cpuinfo (it knows no more than these).
_TORCH_CAPABILITY_FLAGS: dict[str, frozenset[str]] = {
    "AVX512": _AVX512,
    "AVX2": frozenset({"avx2", "fma", "f16c"}),
}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags: /proc/cpuinfo's first `flags` line, else what torch's dispatch saw."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    # Imported here only: `trtprompt serve` checks its options through this module, and importing torch took ~4 s
    # of its start on a loaded 2-core host (the engine process imports torch meanwhile).
    import torch

    return _TORCH_CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), frozenset())


def supported(flags: frozenset[str]) -> tuple[KernelVariant, ...]:
    """The variants this CPU can run, best first (always at least `generic`)."""
    return tuple(v for v in VARIANTS if not v.missing(flags))


def choose(flags: frozenset[str], requested: str | None) -> KernelVariant:
    """The variant to run: the requested one (TRTPROMPT_KERNEL_ISA), else the best supported.

    ValueError names the variable, the choices, and the flags a requested variant needs and the CPU lacks.
    """
    if not requested:
        return supported(flags)[0]
    variant = BY_NAME.get(requested)
    if variant is None:
        raise ValueError(f"{ISA_ENV}={requested!r}: not a kernel variant (choices: {', '.join(BY_NAME)})")
    missing = variant.missing(flags)
    if missing:
        raise ValueError(f"{ISA_ENV}={requested!r}: this CPU lacks {', '.join(missing)} "
                         f"(it runs: {', '.join(v.name for v in supported(flags))})")
    return variant


# Either gives bf16 dot products in hardware (VDPBF16PS, AMX tiles), which oneDNN's bf16 matmuls need to
# run faster than fp32; without them it converts to fp32 and back around every product.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_problem(flags: frozenset[str]) -> str | None:
    """Why bfloat16 weights run slowly on this CPU, or None where it has a bf16 instruction set.

    Measured (docs/quantization.md, "bf16 on a CPU without bf16 instructions"): a 256 x 576 x 1536 linear
    in bf16 ran at 19 GFLOP/s against fp32's 159 on a 2-core AVX2 EPYC, 8x slower."""
    if any(f in flags for f in BF16_FLAGS):
        return None
    return (f"this CPU has none of {', '.join(BF16_FLAGS)}: bfloat16 matmuls run emulated, several times "
            "slower than float32 (8x on an AVX2 EPYC)")


def requested_variant() -> str | None:
    return os.environ.get(ISA_ENV) or None
