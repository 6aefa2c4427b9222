"""bench/host_speed.py: the probes of the host's FMA and memory rates that side-by-side reports print per round."""

from __future__ import annotations

import math

import pytest
import torch

from trtprompt.bench import host_speed
from trtprompt.bench.peers import sidebyside
from trtprompt.engine import kernels


def test_the_probe_measures_both_rates() -> None:
    p = host_speed.probe()
    assert p["read_gbs"] > 0 and math.isfinite(p["read_gbs"])
    if kernels.compiled_kernel_status()[0]:
        assert p["fma_gflops"] is not None and p["fma_gflops"] > 0 and math.isfinite(p["fma_gflops"])
    else:
        assert p["fma_gflops"] is None


@pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="needs the compiled kernels")
def test_the_fma_probe_refuses_a_count_that_is_not_positive() -> None:
    with pytest.raises(RuntimeError, match="fma_rate: iterations must be positive"):
        torch.ops.trtprompt.fma_rate(0)


def test_a_probe_reads_as_one_line() -> None:
    assert host_speed.one_line({"fma_gflops": 145.4, "read_gbs": 23.14, "time_utc": "10:13:37"}) == \
        "FMA 145 GFLOP/s, read 23.1 GB/s at 10:13:37"
    assert host_speed.one_line({"fma_gflops": None, "read_gbs": 9.0, "time_utc": "01:02:03"}) == \
        "FMA n/a GFLOP/s, read 9.0 GB/s at 01:02:03"


def test_the_side_by_side_prints_the_host_before_each_round() -> None:
    rounds = [{"fma_gflops": 199.0, "read_gbs": 24.0, "time_utc": "11:00:00"},
              {"fma_gflops": 125.0, "read_gbs": 18.5, "time_utc": "11:04:10"}]
    assert sidebyside.host_lines(rounds) == [
        "host before round 0: FMA 199 GFLOP/s, read 24.0 GB/s at 11:00:00",
        "host before round 1: FMA 125 GFLOP/s, read 18.5 GB/s at 11:04:10"]
