"""The compiled kernels (csrc/), built on first use: paged attention, fused layer ops, the KV write, the
few-rows linear, the LoRA products, W8A8's per-token quantize and rescale, the greedy argmax, the bf16
linear on AMX tiles, and a probe of the FMA units' rate for benchmark reports (bench/host_speed.py).

One build per instruction set (isa.py chooses the variant from the CPU's flags).

torch's C++ extension loader compiles it once per machine with the system's
C++ compiler and caches it under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions). Where no compiler, ninja or Python headers exist,
or the build fails, the engine runs the pure-torch attention instead and says
so once in the log. Design: docs/design.md, "Attention".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from trtprompt.engine import isa
from trtprompt.engine.isa import KernelVariant

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "prefill_attention.cpp", CSRC / "fused_ops.cpp",
           CSRC / "few_rows_linear.cpp", CSRC / "kv_write.cpp", CSRC / "lora_runs.cpp", CSRC / "quantize_rows.cpp",
           CSRC / "greedy_rows.cpp", CSRC / "amx_linear.cpp", CSRC / "panel_linear.cpp",
           CSRC / "decode_attention.cpp", CSRC / "decode_layers.cpp", CSRC / "host_probe.cpp", CSRC / "bf16_panels.cpp")
HEADERS = (CSRC / "vec.h", CSRC / "bf16_vec.h", CSRC / "typed_vec.h", CSRC / "dtypes.h", CSRC / "paged_checks.h",
           CSRC / "widen.h", CSRC / "op_handle.h", CSRC / "bf16_panels.h", CSRC / "bf16_dot.h")
# The kernel tiles rows by four; head sizes must be a multiple of the variant's vector width.
TOKENS_PER_BLOCK_MULTIPLE = 4
_BASE_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi")
# torch's loader serializes builds with a `lock` file in the build directory and waits for it forever; a
# build killed midway (Ctrl-C, OOM) leaves it behind and every later process hangs on its first request.
# A build takes 1-3 minutes on 2 cores, so a lock this old belongs to no live build.
STALE_LOCK_SECONDS = 900


@functools.lru_cache(maxsize=None)
def variant() -> KernelVariant:
    """The variant this process builds and runs (isa.py); ValueError for a bad TRTPROMPT_KERNEL_ISA."""
    return isa.choose(isa.cpu_flags(), isa.requested_variant())


def head_size_multiple() -> int:
    """Head sizes the compiled kernel takes are multiples of this (8, or 16 for the AVX-512 variant)."""
    try:
        return variant().lanes
    except ValueError:
        return 8


def _build_flags(v: KernelVariant) -> tuple[str, list[str]]:
    """(extension name, compiler flags) of a variant.

    The name carries the variant so a cache shared by machines of different
    CPUs never hands one a binary it cannot run, and a digest of where the
    sources lie: torch's cache is per user, and two checkouts building one name
    each found the other's build stale (its sources' paths differ) and rebuilt it.
    """
    return (f"trtprompt_kernels_{v.name}_{_checkout_digest()}",
            [*_BASE_FLAGS, *v.cflags, f"-DTRTPROMPT_HEADERS={_headers_digest()}"])


def _checkout_digest() -> str:
    """8 hex digits naming this copy of the sources (docs/design.md, "Kernel variants")."""
    return hashlib.blake2b(str(CSRC.resolve()).encode("utf-8"), digest_size=4).hexdigest()


def _headers_digest() -> str:
    """A digest of the headers, passed as a define: torch's loader rebuilds when sources or flags change, and
    it hashes the .cpp files only, so an edited header would otherwise keep the old binary."""
    h = hashlib.blake2b(digest_size=8)
    for path in HEADERS:
        h.update(path.read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def _interpreter_tools_first() -> Iterator[None]:
    """PATH with this interpreter's bin directory first while torch builds.

    torch runs the `ninja` it finds on PATH, and ninja releases record a build command differently (the
    venv's pip ninja 1.13 against Debian's 1.11 here): serve's engine processes (PATH starts with the venv,
    serve/launch/launcher.py child_env) and a plain `.venv/bin/python` each found the other's build stale
    and rebuilt the kernel, about 20 s, every time the other had run. One ninja for every process."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


@functools.lru_cache(maxsize=None)
def compiled_kernel_status() -> tuple[bool, str]:
    """(available, why); builds or loads the kernel once per process."""
    try:
        v = variant()
    except ValueError as exc:
        return False, str(exc)
    name, flags = _build_flags(v)
    try:
        from torch.utils import cpp_extension

        clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
        with _interpreter_tools_first():
            cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags,
                               extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use pure torch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return False, f"{type(exc).__name__}: {first}"[:300]
    return True, f"compiled kernel {name} ({v.name}: {v.lanes}-float vectors)"


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove a build lock older than STALE_LOCK_SECONDS (a killed build's); True when one was removed."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False  # another process may be building right now: torch's loader waits for it
    log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


# Variants whose LoRA kernel (csrc/lora_runs.cpp) beats torch's paths. The generic one (SSE2 on x86-64: no FMA,
# two instructions per 8-float vector) ran a SmolLM2 layer's products at 2.0 ms against 0.25 ms for avx2 and
# ~0.8 ms masked (8 adapters x 4 rows, docs/design.md "Kernel variants").
LORA_KERNEL_VARIANTS = frozenset({"avx512", "avx2"})


def lora_kernel_lanes() -> int | None:
    """The vector width LoraStep's kernel path runs at here, or None where torch's paths are the faster."""
    v = variant()
    return v.lanes if v.name in LORA_KERNEL_VARIANTS and compiled_kernel_status()[0] else None


def kernel_fits(head_size: int, tokens_per_block: int, device: torch.device) -> str | None:
    """Why the compiled kernel cannot serve this model, or None when it can."""
    if device.type != "cpu":
        return f"device {device} (the kernel is CPU-only)"
    multiple = head_size_multiple()
    if head_size % multiple:
        return (f"head_size {head_size} is not a multiple of {multiple} (kernel variant {variant().name}; "
                f"{isa.ISA_ENV}=avx2 builds 8-float vectors)")
    if tokens_per_block % TOKENS_PER_BLOCK_MULTIPLE:
        return f"tokens_per_block {tokens_per_block} is not a multiple of {TOKENS_PER_BLOCK_MULTIPLE}"
    return None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [S, H, D], lse [S, H] float32) of one query token per sequence, read in place."""
    out, lse = torch.ops.trtprompt.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return out, lse


def paged_decode_int8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_decode over int8 caches [blocks, kv_heads, tpb, D + 2] (values, then a float16 scale per row),
    read in place (kv_cache_dtype int8; engine/attention_int8.py)."""
    out, lse = torch.ops.trtprompt.paged_decode_int8(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return out, lse


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  segments: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D], lse [T, H] float32) of query rows attending to K/V blocks in place, as blocked GEMMs.

    segments [S, 4] int64, one per block-table row (int32): row_start, num_rows, num_keys, first_limit;
    row i of a segment sees keys [0, min(num_keys, first_limit + i)). Rows no segment names are left
    unset. csrc/prefill_attention.cpp; docs/attention.md.
    """
    out, lse = torch.ops.trtprompt.paged_prefill(q, k_cache, v_cache, block_tables, segments, scale)
    return out, lse


def paged_prefill_int8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       segments: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_prefill over int8 caches [blocks, kv_heads, tpb, D + 2] (values, then a float16 scale per row),
    read in place: each run is dequantized into the thread's tile buffer as it is read (kv_cache_dtype int8)."""
    out, lse = torch.ops.trtprompt.paged_prefill_int8(q, k_cache, v_cache, block_tables, segments, scale)
    return out, lse


def _build_in_child(v: KernelVariant) -> str:
    """Build one variant in a child process (a process can load one variant only: they define the same ops)."""
    env = {**os.environ, isa.ISA_ENV: v.name}
    done = subprocess.run([sys.executable, "-m", "trtprompt.engine.kernels"], env=env, capture_output=True, text=True)
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> None:
    """`python -m trtprompt.engine.kernels [--all]`: build now (make install does) and say which path runs.

    --all also builds every other variant this CPU supports (tests/test_kernel_variants.py runs each).
    """
    args = sys.argv[1:] if argv is None else argv
    if args and args != ["--all"]:
        raise SystemExit("usage: python -m trtprompt.engine.kernels [--all]  (build every variant this CPU runs)")
    ok, why = compiled_kernel_status()
    print(f"paged attention and layer ops: {'compiled kernels' if ok else 'pure-torch fallback'} ({why})")
    if args == ["--all"] and ok:
        for v in isa.supported(isa.cpu_flags()):
            if v != variant():
                print(f"  also built for tests: {_build_in_child(v)}")


if __name__ == "__main__":
    main()
