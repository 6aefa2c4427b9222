"""The greedy token of a row without reading the float lm_head: an int8 screen, then exact logits for the few tokens
that can still win (docs/design.md, "Greedy head").

A one-request float32 decode step of SmolLM2 reads 538 MB, 113 MB of them lm_head's (the tied embedding), yet a row
whose request reads nothing but its argmax (sampler.screen_bans: greedy, no log probabilities or logits asked for,
nothing that changes the row but min_tokens' mask of the end ids) needs the largest logit, not all 49,152. The
screen is the head's weight rounded to int8 in groups of GROUP input columns (quantize_int8_groups), 28 MB on the
panel kernel. A token's screened logit is within bound_j * |x|_1 of its float one, bound_j being its largest group
scale times one half (the rounding to int8) plus the float32 rounding of both dot products (rounding_slack). A
token whose upper bound lies below the best lower bound cannot be the argmax; the others (3 a row at the median on
SmolLM2's text) get their logit from the float weight row, the rest -inf; a token the row may not take yet
(min_tokens' end ids) is -inf before the race. The row's argmax is then the float head's, up to the float32
summation order of one dot product, as between any two float32 kernels; a row that is NaN or all -inf stays so
(such an x runs the float head).
"""

from __future__ import annotations

from typing import Sequence

import torch

from trtprompt.engine.panel_linear import pack_panels, panel_rows, panel_width, panels_fit
from trtprompt.engine.quant_w8a8 import WEIGHT_QMAX, quantize_int8_groups

GROUP = 32  # input columns per int8 scale: GGUF's Q8_0 group, the tightest bound the panel kernel runs


def rounding_slack(hidden: int) -> float:
    """The float32 rounding of the screen's and the exact dot product, per unit of a row's largest group scale and
    of |x|_1: each is within hidden * 2^-24 * sum|w x| of its real value, and sum|w x| <= WEIGHT_QMAX * scale *
    |x|_1; twice that again for the comparisons' own rounding and a margin."""
    return 4.0 * WEIGHT_QMAX * hidden * 2.0 ** -24


class GreedyHead(torch.nn.Module):
    """The int8 screen of a float32 lm_head weight [vocab, hidden] and the weight itself (kept, not copied: the
    embedding where tied)."""

    def __init__(self, weight: torch.Tensor, width: int, rows_max: int) -> None:
        super().__init__()
        self.rows_max = rows_max  # rows a step's screen runs for at most: the kernel variant's PANEL_ROWS
        q, scale = quantize_int8_groups(weight, GROUP)
        self.panels = pack_panels(q, width)
        self.panel_scale = pack_panels(scale, width)
        self.bound = (scale.amax(dim=1) * (0.5 + rounding_slack(weight.shape[1]))).contiguous()
        self.weight = weight

    @staticmethod
    def of(weight: torch.Tensor) -> GreedyHead | None:
        """The screen of this head weight, or None where it cannot run (not a float32 weight on the CPU, the panel
        kernel not compiled here, or a shape its panels do not take)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % GROUP:
            return None
        width, rows = panel_width(), panel_rows()
        if width is None or rows is None or not panels_fit(weight, width):
            return None
        return GreedyHead(weight.contiguous(), width, rows.screen_max)

    def summary(self) -> str:
        """What runs for greedy rows (the engine's log line)."""
        mib = sum(t.numel() * t.element_size() for t in (self.panels, self.panel_scale)) / (1 << 20)
        return (f"lm_head for greedy steps of up to {self.rows_max} rows: its int8 screen ({mib:.0f} MiB), "
                "then exact candidates")

    def screen(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 logits of the int8 weight."""
        out: torch.Tensor = torch.ops.trtprompt.panel_linear(x, self.panels, self.panel_scale, None)
        return out

    def logits(self, x: torch.Tensor, bans: Sequence[list[int]]) -> torch.Tensor | None:
        """[rows, vocab] float32 for x [rows, hidden]: the candidates' exact logits, -inf elsewhere, each row's bans
        (tokens it may not take: sampler.screen_bans) -inf and out of the race; None where the float head must run
        (more than rows_max rows, or an x that is not finite)."""
        if x.shape[0] > self.rows_max or not bool(torch.isfinite(x).all()):
            return None
        x = x.contiguous()
        screened = ban(self.screen(x), bans)
        out: torch.Tensor = torch.ops.trtprompt.screen_rows(screened, x, self.weight, self.bound)
        return out


def ban(screened: torch.Tensor, bans: Sequence[list[int]]) -> torch.Tensor:
    """A banned token's screened logit -inf: it neither sets a row's floor nor survives it."""
    for row, ids in zip(screened, bans):
        if ids:
            row[ids] = float("-inf")
    return screened


def reference_logits(head: GreedyHead, x: torch.Tensor, bans: Sequence[list[int]] = ()) -> torch.Tensor:
    """GreedyHead.logits in torch ops (what tests compare the compiled screen_rows with)."""
    screened = ban(head.screen(x), bans)
    margin = x.abs().sum(dim=-1, keepdim=True) * head.bound
    floor = (screened - margin).amax(dim=-1, keepdim=True)
    keep = screened + margin >= floor
    return torch.where(keep, x @ head.weight.T, torch.tensor(float("-inf")))
