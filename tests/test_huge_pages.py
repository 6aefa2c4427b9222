"""The model's large tensors on transparent huge pages (engine/huge_pages.py): what moves, that the values and the
sharing stay, and that the kernel really backs them with huge pages where the host allows it."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from trtprompt.engine import huge_pages
from trtprompt.engine.huge_pages import HUGE_PAGE_BYTES, MIN_TENSOR_BYTES, Slabs, move_weights, thp_mode

THP = thp_mode()
needs_thp = pytest.mark.skipif(THP not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason=f"transparent huge pages are {THP} here")


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding address, from /proc/self/smaps (kB -> bytes)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        big = torch.randn(1 << 20)  # 4 MiB
        self.weight = torch.nn.Parameter(big.clone(), requires_grad=False)
        self.trained = torch.nn.Parameter(torch.randn(1 << 18))  # 1 MiB, requires_grad as torch defaults it
        self.register_buffer("table", torch.arange(3 << 18, dtype=torch.int32))  # 3 MiB
        self.panels = big  # a plain attribute, as the packed linears keep theirs
        self.shared = big  # the same tensor under a second name: moved once
        self.small = torch.ones(16)


@pytest.mark.parametrize("setting,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                          ("always madvise [never]", "never"), ("", None)])
def test_thp_mode_reads_the_bracketed_choice(tmp_path: Path, setting: str, mode: str | None) -> None:
    path = tmp_path / "enabled"
    path.write_text(setting)
    assert thp_mode(path) == mode
    assert thp_mode(tmp_path / "absent") is None


@needs_thp
def test_large_tensors_move_once_keep_their_values_and_kinds_and_sit_on_huge_pages() -> None:
    m = _Holder()
    before = {name: t.clone() for name, t in (("weight", m.weight), ("table", m.table), ("panels", m.panels))}
    small = m.small
    line = move_weights(m)
    assert line.startswith("weights on huge pages: 12 MiB in 4 tensors"), line
    assert isinstance(m.weight, torch.nn.Parameter) and not m.weight.requires_grad  # as they were
    assert isinstance(m.trained, torch.nn.Parameter) and m.trained.requires_grad
    assert "table" in dict(m.named_buffers()) and m.small is small
    assert m.shared is m.panels
    for name, want in before.items():
        got = getattr(m, name)
        assert torch.equal(got, want) and got.is_contiguous(), name
        assert _huge_bytes_at(got.data_ptr()) >= HUGE_PAGE_BYTES, name
    m.panels.add_(1.0)  # still writable memory of its own
    assert torch.equal(m.shared, before["panels"] + 1.0)


@needs_thp
def test_slabs_start_on_a_huge_page_and_hand_out_disjoint_aligned_memory() -> None:
    slabs = Slabs()
    a, b = slabs.take(MIN_TENSOR_BYTES + 1), slabs.take(MIN_TENSOR_BYTES)
    assert a.data_ptr() % HUGE_PAGE_BYTES == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel() and b.data_ptr() % huge_pages.ALIGN_BYTES == 0
    big = slabs.take(huge_pages.SLAB_BYTES + 1)  # past the slab: a mapping of its own
    assert big.numel() == huge_pages.SLAB_BYTES + 1 and big.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(big.sum()) == 0  # anonymous memory starts zeroed


def test_nothing_moves_where_the_host_has_no_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    m = _Holder()
    weight = m.weight
    assert move_weights(m) == "weights on the default pages (transparent huge pages: never)"
    assert m.weight is weight


@needs_thp
def test_an_engine_on_huge_pages_answers_as_one_on_the_default_pages(tiny_engine_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny engine's tensors are all small: with the size bound lowered, every weight the linears read moves,
    and the greedy tokens (one request, then three at once) equal those of the same engine left where it loaded."""
    from engine_helpers import run_to_completion

    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.request import SamplingParams

    def tokens(engine: LLMEngine) -> list[dict[str, list[int]]]:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        prompts = {f"r{i}": [5 + i, 17, 3 * i + 1, 9, 40] for i in range(3)}
        return [run_to_completion(engine, {"one": [7, 8, 9, 10]}, params), run_to_completion(engine, prompts, params)]

    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    plain = LLMEngine.from_engine_dir(tiny_engine_dir, speculative_decoding="none")
    monkeypatch.undo()
    monkeypatch.setattr(huge_pages, "MIN_TENSOR_BYTES", 1)
    moved = LLMEngine.from_engine_dir(tiny_engine_dir, speculative_decoding="none")
    assert (moved.runner.model.weight_pages or "").startswith("weights on huge pages")
    layer = moved.runner.model.layers[0]
    assert isinstance(layer, torch.nn.Module)
    qkv = layer.attn.qkv
    weights = [t for t in vars(qkv).values() if isinstance(t, torch.Tensor)] + list(qkv.parameters())
    assert weights and all(_huge_bytes_at(t.data_ptr()) >= HUGE_PAGE_BYTES for t in weights)
    assert tokens(moved) == tokens(plain)
