"""oneDNN's primitive cache (and ideep's LRU, LRU_CACHE_CAPACITY) are bounded in every process
that runs the engine's linears (issue 11).

oneDNN's is observed through its own verbose log (cache_hit / cache_miss per primitive
created), in a fresh process each because the capacity is read once. ideep's LRU shows no
per-call trace; its effect on RSS is in docs/benchmarks-history.md "Soak (issue 11)"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trtprompt.engine.linear import (IDEEP_CACHE_CAPACITY, IDEEP_CACHE_ENV, ONEDNN_CACHE_CAPACITY,
                                     ONEDNN_CACHE_ENV, cap_primitive_cache, onednn_available)

pytestmark = pytest.mark.skipif(not onednn_available(torch.float32, torch.device("cpu")),
                                reason="no oneDNN on this CPU")

# Through the engine's own entry (resolve_backend), run CAP + 1 distinct token counts, then the
# first again; print what became of that last call. few_rows=False: every count goes to oneDNN (a dense
# layer linear runs its fewest rows on the few-rows kernel, which has no primitive cache).
CHILD = """
import sys, torch
from trtprompt.engine.linear import make_linear, resolve_backend
backend = resolve_backend("onednn", torch.float32, torch.device("cpu"))
lin = make_linear(torch.randn(8, 16), None, backend, torch.float32, few_rows=False)
print("BACKEND", backend, flush=True)
for m in list(range(1, int(sys.argv[1]) + 2)) + [1]:
    print("CALL", m, flush=True)
    lin(torch.randn(m, 16))
"""


def _last_call_outcome(distinct: int, env_caps: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in (ONEDNN_CACHE_ENV, IDEEP_CACHE_ENV)}
    env.update(ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1", **(env_caps or {}))
    out = subprocess.run([sys.executable, "-c", CHILD, str(distinct)], env=env, capture_output=True,
                         text=True, check=True, timeout=300).stdout.splitlines()
    assert "BACKEND onednn" in out
    last = max(i for i, line in enumerate(out) if line.startswith("CALL "))
    created = [line for line in out[last:] if ",inner_product," in line and "create:cache_" in line]
    return "miss" if any("create:cache_miss" in line for line in created) else "hit"


def test_engine_caps_the_primitive_cache():
    # Each token count takes about two entries (measured), and the probe and weight reorders a
    # few more: as many shapes as the cap evict the first, a quarter as many keep it.
    assert _last_call_outcome(ONEDNN_CACHE_CAPACITY) == "miss"
    assert _last_call_outcome(ONEDNN_CACHE_CAPACITY // 4) == "hit"


def test_operator_capacity_wins():
    assert _last_call_outcome(ONEDNN_CACHE_CAPACITY, {ONEDNN_CACHE_ENV: str(4 * ONEDNN_CACHE_CAPACITY)}) == "hit"


def test_both_capacities_are_set_unless_the_operator_did(monkeypatch):
    monkeypatch.delenv(ONEDNN_CACHE_ENV, raising=False)
    monkeypatch.setenv(IDEEP_CACHE_ENV, "5")
    cap_primitive_cache()
    assert os.environ[ONEDNN_CACHE_ENV] == str(ONEDNN_CACHE_CAPACITY)
    assert os.environ[IDEEP_CACHE_ENV] == "5"
    monkeypatch.delenv(IDEEP_CACHE_ENV)
    cap_primitive_cache()
    assert os.environ[IDEEP_CACHE_ENV] == str(IDEEP_CACHE_CAPACITY)
