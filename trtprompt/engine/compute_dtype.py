"""The dtype the torch engine computes in, which may differ from the dtype its weights are stored in.

A bfloat16 engine on a CPU without bf16 instructions (neither avx512_bf16 nor amx_bf16) computes in
float32 unless told otherwise: its bf16 weights are widened once at load (exactly: every bf16 value
is a float32 value), activations and the KV cache are float32, and the step runs at float32 speed,
where bf16 arithmetic would be emulated around every product, ~7x slower on an AVX2 EPYC
(docs/quantization.md, "bf16 on a CPU without bf16 instructions"). The cost is memory: the weights
and the KV cache take twice the bytes of bf16. `compute_dtype` (a serve knob) chooses explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtprompt.engine import isa


@dataclass(frozen=True)
class ComputeDtype:
    """What the engine computes in, and why it is not the stored dtype (None when it is)."""

    dtype: str
    fallback: str | None = None


def check_compute_dtype(stored: str, requested: str | None) -> None:
    """ValueError naming the knob when the engine cannot compute in `requested` (None: unset, always fine).

    An engine computes in its own dtype or widens to float32; narrowing a float32 engine would be a
    different engine, which `trtprompt build --dtype` makes."""
    if requested is not None and requested not in (stored, "float32"):
        raise ValueError(f"compute_dtype must be float32 or the engine's own dtype ({stored}), got {requested!r}")


def resolve_compute_dtype(stored: str, requested: str | None, device: str,
                          flags: frozenset[str] | None = None) -> ComputeDtype:
    """The compute dtype of an engine stored in `stored` on `device`; flags: the CPU's (default: this one's)."""
    check_compute_dtype(stored, requested)
    if requested is not None:
        return ComputeDtype(requested)
    if stored != "bfloat16" or not device.startswith("cpu"):
        return ComputeDtype(stored)
    problem = isa.bf16_problem(isa.cpu_flags() if flags is None else flags)
    if problem is None:
        return ComputeDtype(stored)
    return ComputeDtype("float32", f"{problem}; computing in float32 instead (bf16 weights widened at load, "
                                   "twice their memory and the KV cache's; compute_dtype=bfloat16 keeps bf16)")
