"""The compiled kernels (csrc/): paged attention and fused layer ops, built on first use.

torch's C++ extension loader compiles it once per machine with the system's
C++ compiler and caches it under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions). Where no compiler, ninja or Python headers exist,
or the build fails, the engine runs the pure-torch attention instead and says
so once in the log. Design: docs/design.md, "Attention".
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "fused_ops.cpp")
# The kernel reads 8-float vectors and tiles rows by four.
HEAD_SIZE_MULTIPLE = 8
TOKENS_PER_BLOCK_MULTIPLE = 4


def _build_flags() -> tuple[str, list[str]]:
    """(extension name, compiler flags) for this CPU.

    The name carries the instruction set so a cache shared by machines of
    different CPUs never hands one a binary it cannot run.
    """
    cap = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]
    if cap in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return f"trtprompt_paged_attention_{cap.lower()}", flags


@functools.lru_cache(maxsize=None)
def compiled_kernel_status() -> tuple[bool, str]:
    """(available, why); builds or loads the kernel once per process."""
    name, flags = _build_flags()
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use pure torch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return False, f"{type(exc).__name__}: {first}"[:300]
    return True, f"compiled kernel {name}"


def kernel_fits(head_size: int, tokens_per_block: int, device: torch.device) -> str | None:
    """Why the compiled kernel cannot serve this model, or None when it can."""
    if device.type != "cpu":
        return f"device {device} (the kernel is CPU-only)"
    if head_size % HEAD_SIZE_MULTIPLE:
        return f"head_size {head_size} is not a multiple of {HEAD_SIZE_MULTIPLE}"
    if tokens_per_block % TOKENS_PER_BLOCK_MULTIPLE:
        return f"tokens_per_block {tokens_per_block} is not a multiple of {TOKENS_PER_BLOCK_MULTIPLE}"
    return None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [S, H, D], lse [S, H] float32) of one query token per sequence, read in place."""
    out, lse = torch.ops.trtprompt.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return out, lse


def main() -> None:
    """`python -m trtprompt.engine.kernels`: build now (make install does) and say which path runs."""
    ok, why = compiled_kernel_status()
    print(f"paged attention and layer ops: {'compiled kernels' if ok else 'pure-torch fallback'} ({why})")


if __name__ == "__main__":
    main()
