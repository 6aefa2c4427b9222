"""The decoder layer's row-wise ops: plain torch, or one compiled op each.

`TorchOps` is the reference: transformers' expressions, op by op. `CompiledOps`
runs each as one pass (csrc/fused_ops.cpp), rounding where the torch
expression rounds. The engine uses the compiled ops exactly when it runs the
compiled attention kernel (attention_backend "compiled": same build, same
fallback); "torch" and "reference" run these torch ops. Why and how much:
docs/design.md, "Fused layer ops".
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    # True where cos/sin are rotary_tables' [T, head_size/2] and a pure decode step's attention may run
    # as one compiled call a layer (attention.decode_attention).
    fuses_decode: bool

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """transformers' expressions; cos/sin are [T, 1, head_size/2]."""

    fuses_decode = False

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, head_size/2] as rotary takes them; once per step, shared by every layer."""
        return cos, sin

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in float32, round to dtype, then scale (transformers' LlamaRMSNorm).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)): the residual stream and the next sublayer's input (delta None:
        the first layer's, nothing to add)."""
        total = x if delta is None else x + delta
        return total, self.rms_norm(total, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_size] by half-split pairs (transformers' rotate_half convention)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CompiledOps:
    """One compiled op each (shapes as the model passes them; the kernels name any other)."""

    fuses_decode = True

    def __init__(self) -> None:
        from trtprompt.engine import kernels

        available, why = kernels.compiled_kernel_status()  # loads the library that defines the ops
        if not available:
            raise RuntimeError(f"compiled layer ops are unavailable: {why}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out: torch.Tensor = torch.ops.trtprompt.rms_norm(x.contiguous(), weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return x, self.rms_norm(x, weight, eps)
        total, normed = torch.ops.trtprompt.add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps)
        return total, normed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.trtprompt.silu_and_mul(gate_up.contiguous())
        return out

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_size/2] once per step, not two squeezes per rotary call (4 ops a layer)."""
        return cos.squeeze(1), sin.squeeze(1)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x may be a view of the fused qkv output (strided rows): the kernel reads it in place.
        cos/sin come from rotary_tables."""
        out: torch.Tensor = torch.ops.trtprompt.rotary(x, cos, sin)
        return out


def layer_ops(attention_backend: str) -> LayerOps:
    """The ops that go with a resolved attention backend ("compiled", "torch" or "reference")."""
    return CompiledOps() if attention_backend == "compiled" else TorchOps()
