"""A pure decode step's layers in one compiled call (engine/decode_layers.py, csrc/decode_layers.cpp): the
residual stream, the last MLP output and the KV caches equal bit for bit to the layer loop's for every kind of
linear routing (panels, the few-rows kernel, int8 per row and per group, int4, biases, q/k norms), and the loop
wherever the step, a linear or the cache does not fit."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest
import torch
from engine_helpers import model_config
from safetensors.torch import load_file

from trtprompt.engine import kernels
from trtprompt.engine.attention import SeqSlice, allocate_kv_cache, build_attention_metadata
from trtprompt.engine.decode_layers import DecodeLayers
from trtprompt.engine.kernel_call import FEW_ROWS, KEPT_ROUTE_ROWS, ONEDNN, PANEL, KernelCall
from trtprompt.engine.layer_ops import CompiledOps
from trtprompt.engine.linear import DenseFewRowsLinear, OneDnnLinear
from trtprompt.engine.model import DecoderModel
from trtprompt.engine.panel_linear import panel_width
from trtprompt.engine.quant_int4 import quantize_int4
from trtprompt.engine.quant_w8a8 import quantize_int8, quantize_int8_groups
from trtprompt.engine.weights import W4A16, W8A16

pytestmark = pytest.mark.skipif(not kernels.compiled_kernel_status()[0],
                                reason=f"compiled kernels unavailable: {kernels.compiled_kernel_status()[1]}")

TPB = 8
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# (quant_algo, group_size) per weight kind: float, int8 a scale per row, int8 groups of 32, int4 groups of 32
WEIGHTS = {"float": (None, None), "int8": (W8A16, None), "int8-g32": (W8A16, 32), "int4-g32": (W4A16, 32)}


def quantized(tensors: dict[str, torch.Tensor], algo: str | None, group: int | None) -> dict[str, torch.Tensor]:
    """The checkpoint's layer linears as the build stores them for `algo`."""
    out = dict(tensors)
    for name, w in tensors.items():
        if algo is None or not any(name.endswith(f"{lin}.weight") for lin in LINEARS):
            continue
        if algo == W4A16:
            assert group is not None
            out[name], out[f"{name}_scale"] = quantize_int4(w.float(), group)
        else:
            out[name], out[f"{name}_scale"] = quantize_int8(w) if group is None else quantize_int8_groups(w, group)
    return out


def load(path: Path, dtype: torch.dtype, weights: str) -> DecoderModel:
    algo, group = WEIGHTS[weights]
    model = DecoderModel(model_config(path), dtype, torch.device("cpu"), "onednn")
    model.load_weights(quantized(load_file(str(path / "model.safetensors")), algo, group), algo, group_size=group)
    return model


def decode_step(model: DecoderModel, rows: int, seed: int, kv_cache_dtype: str = "auto"):
    """(x, cos, sin, metadata, caches) of one decode step of `rows` sequences with random cached rows and
    contexts of 0-20 tokens on shuffled blocks."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg, dtype = model.cfg, model.dtype
    lens = [rng.randrange(21) for _ in range(rows)]
    free = list(range(sum(n // TPB + 1 for n in lens) + 3))
    rng.shuffle(free)
    seqs = [SeqSlice(n, 1, [free.pop() for _ in range(n // TPB + 1)]) for n in lens]
    caches = allocate_kv_cache(cfg, len(free) + sum(len(s.block_table) for s in seqs), TPB, dtype,
                               torch.device("cpu"), kv_cache_dtype)
    if kv_cache_dtype == "auto":
        for k, v in caches:
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))
    x = (torch.randn(rows, cfg.hidden_size, generator=gen) * 0.5).to(dtype)
    cos, sin = CompiledOps().rotary_tables(*model.rotary.cos_sin(torch.tensor(lens), dtype))
    meta = build_attention_metadata(seqs, TPB, torch.device("cpu"), "compiled", dtype)
    return x, cos, sin, meta, caches


def chunk_step(model: DecoderModel, chunks: list[tuple[int, int]], seed: int):
    """(x, cos, sin, metadata, caches) of a step of whole chunks: (cached tokens, new tokens) per sequence on
    shuffled blocks, the cached rows random (a verification step's rows are such chunks too)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg, dtype = model.cfg, model.dtype
    need = [(c + n + TPB - 1) // TPB for c, n in chunks]
    free = list(range(sum(need) + 3))
    rng.shuffle(free)
    seqs = [SeqSlice(c, n, [free.pop() for _ in range(b)]) for (c, n), b in zip(chunks, need)]
    caches = allocate_kv_cache(cfg, len(free) + sum(need), TPB, dtype, torch.device("cpu"))
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    positions = torch.tensor([p for c, n in chunks for p in range(c, c + n)])
    x = (torch.randn(len(positions), cfg.hidden_size, generator=gen) * 0.5).to(dtype)
    cos, sin = CompiledOps().rotary_tables(*model.rotary.cos_sin(positions, dtype))
    return x, cos, sin, build_attention_metadata(seqs, TPB, torch.device("cpu"), "compiled", dtype), caches


def layer_loop(model: DecoderModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, caches):
    ops, delta = CompiledOps(), None
    for layer, kv in zip(model.layers, caches):
        x, delta = layer.forward(x, delta, cos, sin, meta, kv, ops)
    return x, delta


def copies(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: biases; qwen3: q/k norms
def test_the_one_call_equals_the_layer_loop_bit_for_bit(tiny_checkpoint_factory: Callable[..., Path], arch: str,
                                                        weights: str) -> None:
    """1, 3 and 13 rows: the few-rows kernel, panels, and panels past the grouped int8 widening bound (AVX2; other
    variants fuse the rows their linears route to a kernel, one row everywhere, and run the loop for the rest)."""
    model = load(tiny_checkpoint_factory(arch), torch.float32, weights)
    assert model.decode_layers is not None and model.decode_layers.linears(1) is not None
    for rows in (1, 3, 13):
        x, cos, sin, meta, caches = decode_step(model, rows, seed=rows)
        loop_caches = copies(caches)
        got = model.decode_layers.run(x, cos, sin, meta, caches)
        want = layer_loop(model, x, cos, sin, meta, loop_caches)
        if model.decode_layers.linears(rows) is None:
            assert got is None and kernels.variant().name != "avx2"
            continue
        assert got is not None, f"{rows} rows took the loop"
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{rows} rows"
        for (k, v), (lk, lv) in zip(caches, loop_caches):
            assert torch.equal(k, lk) and torch.equal(v, lv), f"{rows} rows"


def on_onednn(model: DecoderModel, few_rows_max: int) -> None:
    """The model's float32 layer linears as oneDNN ones (the few-rows kernel to few_rows_max rows), as other kernel
    variants than AVX2's build them; the step's one call rebuilt over them."""
    for layer in model.layers:
        for owner, name in ((layer.attn, "qkv"), (layer.attn, "o_proj"), (layer.mlp, "gate_up"), (layer.mlp, "down")):
            lin = getattr(owner, name)
            weight = lin.panels.transpose(1, 2).reshape(-1, lin.panels.shape[1])  # unpacked: [out, in]
            bias = None if lin.bias_f32 is None else lin.bias_f32.to(model.dtype)
            setattr(owner, name, DenseFewRowsLinear(weight, bias, few_rows_max) if few_rows_max else
                    OneDnnLinear(weight, bias))
    model.decode_layers = model._decode_layers()


@pytest.mark.skipif(kernels.variant().name != "avx2", reason="unpacks the panel linears' weights (AVX2 only)")
@pytest.mark.parametrize("few_rows_max", [0, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_onednn_linears_fuse_as_their_forward_runs_them(tiny_checkpoint_factory: Callable[..., Path], arch: str,
                                                        few_rows_max: int) -> None:
    """oneDNN's prepacked GEMM (a boxed call from C++), alone or above the few-rows kernel's rows: bit for bit."""
    model = load(tiny_checkpoint_factory(arch), torch.float32, "float")
    on_onednn(model, few_rows_max)
    assert model.decode_layers is not None
    for rows in (1, 3, 13):
        lin = model.decode_layers.linears(rows)
        assert lin is not None and set(lin.kinds) == {FEW_ROWS if rows <= few_rows_max else ONEDNN}
        x, cos, sin, meta, caches = decode_step(model, rows, seed=rows + 20)
        loop_caches = copies(caches)
        got = model.decode_layers.run(x, cos, sin, meta, caches)
        want = layer_loop(model, x, cos, sin, meta, loop_caches)
        assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{rows} rows"
        for (k, v), (lk, lv) in zip(caches, loop_caches):
            assert torch.equal(k, lk) and torch.equal(v, lv), f"{rows} rows"


def test_the_step_hands_each_linear_its_own_kernel_call(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """One grouped-int8 row on the few-rows kernel with its group, several on the panels (AVX2's panel variant);
    the same KernelCall objects the linears' forward runs."""
    model = load(tiny_checkpoint_factory("llama"), torch.float32, "int8-g32")
    assert model.decode_layers is not None
    one = model.decode_layers.linears(1)
    assert one is not None and set(one.kinds) == {FEW_ROWS} and set(one.groups) == {32}
    qkv = model.layers[0].attn.qkv
    assert one.weights[0] is qkv.qweight and one.scales[0] is qkv.scale
    if kernels.variant().name == "avx2":
        three = model.decode_layers.linears(3)
        assert three is not None and set(three.kinds) == {PANEL} and three.weights[0] is qkv.panels
    assert model.decode_layers.linears(1) is one  # kept per row count


@pytest.mark.parametrize("weights", ["float", "int8-g32", "int4-g32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_step_of_whole_chunks_takes_the_one_call_bit_for_bit(tiny_checkpoint_factory: Callable[..., Path],
                                                                arch: str, weights: str) -> None:
    """Speculative verification rows (1 + 4 drafts behind a context) and prefill chunks, with and without cached
    context: paged_prefill over the chunks' segments in place of the decode attention."""
    model = load(tiny_checkpoint_factory(arch), torch.float32, weights)
    assert model.decode_layers is not None
    for chunks in ([(21, 5)], [(9, 5), (0, 7), (30, 2)], [(0, 12)]):
        x, cos, sin, meta, caches = chunk_step(model, chunks, seed=len(chunks))
        assert meta.decode_tables is None and meta.chunk_tables is not None
        loop_caches = copies(caches)
        got = model.decode_layers.run(x, cos, sin, meta, caches)
        want = layer_loop(model, x, cos, sin, meta, loop_caches)
        if model.decode_layers.linears(x.shape[0]) is None:
            assert got is None and kernels.variant().name != "avx2"
            continue
        assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), chunks
        for (k, v), (lk, lv) in zip(caches, loop_caches):
            assert torch.equal(k, lk) and torch.equal(v, lv), chunks


def test_a_step_with_a_decode_row_or_a_shared_prefix_keeps_the_loop(
        tiny_checkpoint_factory: Callable[..., Path]) -> None:
    model = load(tiny_checkpoint_factory("llama"), torch.float32, "float")
    cpu = torch.device("cpu")
    mixed = build_attention_metadata([SeqSlice(9, 1, [0, 1]), SeqSlice(0, 5, [2])], TPB, cpu, "compiled")
    prefix = list(range(64))  # 512 tokens shared by both chunks: a cascade group (cascade.MIN_SAVED_TOKENS)
    shared = build_attention_metadata([SeqSlice(512, 3, [*prefix, 64]), SeqSlice(512, 3, [*prefix, 65])], TPB, cpu,
                                      "compiled")
    assert shared.groups and mixed.chunk_tables is None and shared.chunk_tables is None
    assert build_attention_metadata([SeqSlice(0, 5, [2])], TPB, cpu, "torch").chunk_tables is None
    assert model.decode_layers is not None
    caches = allocate_kv_cache(model.cfg, 66, TPB, torch.float32, cpu)
    for meta in (mixed, shared):
        x = torch.zeros(meta.num_tokens, model.cfg.hidden_size)
        cos = sin = torch.zeros(meta.num_tokens, model.cfg.head_size // 2)
        assert model.decode_layers.run(x, cos, sin, meta, caches) is None


def test_a_linear_keeps_the_routes_of_decode_sizes_only(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """A prefill chunk's row count is worked out again each call, so chunks of every size leave nothing behind."""
    model = load(tiny_checkpoint_factory("llama"), torch.float32, "float")
    qkv = model.layers[0].attn.qkv
    first = qkv.kernel_call(1)
    assert first is not None and qkv.kernel_call(1) is first
    qkv.kernel_call(KEPT_ROUTE_ROWS)
    qkv.kernel_call(KEPT_ROUTE_ROWS + 1)
    assert sorted(qkv._calls) == [1, KEPT_ROUTE_ROWS]
    assert model.decode_layers is not None  # the step's lists too
    model.decode_layers.linears(1)
    model.decode_layers.linears(KEPT_ROUTE_ROWS + 1)
    assert sorted(model.decode_layers._linears) == [1]


def test_a_kernel_call_names_a_bad_field() -> None:
    w = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="KernelCall.kind must be one of"):
        KernelCall(7, w, None, None)
    with pytest.raises(ValueError, match="KernelCall.group must be >= 0"):
        KernelCall(FEW_ROWS, w, None, None, -1)
    with pytest.raises(ValueError, match="KernelCall.scale must be None for kind ONEDNN"):
        KernelCall(ONEDNN, w, torch.ones(16), None)


def test_the_loop_runs_where_the_step_or_a_part_does_not_fit(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """A prefill chunk, int8 KV caches, and int8 weights past the kernels' rows (dense GEMM): None, the loop."""
    model = load(tiny_checkpoint_factory("llama"), torch.float32, "int8")
    assert model.decode_layers is not None
    x, cos, sin, _, caches = decode_step(model, 2, seed=5)
    prefill = build_attention_metadata([SeqSlice(3, 1, [0]), SeqSlice(0, 4, [1])], TPB, torch.device("cpu"),
                                       "compiled")
    assert model.decode_layers.run(x[:1].expand(5, -1), cos[:1].expand(5, -1), sin[:1].expand(5, -1), prefill,
                                   caches) is None
    x, cos, sin, meta, int8_caches = decode_step(model, 2, seed=5, kv_cache_dtype="int8")
    assert model.decode_layers.run(x, cos, sin, meta, int8_caches) is None
    assert model.decode_layers.linears(300) is None


def test_a_bfloat16_model_fuses_the_rows_its_linears_route_to_a_kernel(
        tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """bf16 dense linears: few rows on the few-rows kernel (or AMX tiles, or bf16 panels) fuse, bit for bit, and
    larger calls fuse on oneDNN's prepacked GEMM or bf16 panels; where this CPU's oneDNN has no bf16 the reference
    linears (F.linear) run and every step takes the loop."""
    model = load(tiny_checkpoint_factory("qwen2"), torch.bfloat16, "float")
    assert model.decode_layers is not None
    x, cos, sin, meta, caches = decode_step(model, 1, seed=9)
    loop_caches = copies(caches)
    got, want = model.decode_layers.run(x, cos, sin, meta, caches), layer_loop(model, x, cos, sin, meta, loop_caches)
    if model.linear_backend == "reference":
        assert got is None
        return
    assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(caches, loop_caches))
    large = model.decode_layers.linears(200)
    routes = {getattr(owner, name).kernel_call(200).kind for layer in model.layers
              for owner, name in ((layer.attn, "qkv"), (layer.attn, "o_proj"), (layer.mlp, "gate_up"),
                                  (layer.mlp, "down"))}
    # oneDNN's prepacked GEMM, or bf16 panels where the CPU has avx512_bf16 (test_bf16_panels.py)
    assert large is not None and set(large.kinds) == routes and routes <= {ONEDNN, PANEL}


def test_the_op_names_lists_that_disagree(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    model = load(tiny_checkpoint_factory("llama"), torch.float32, "float")
    assert model.decode_layers is not None
    x, cos, sin, meta, caches = decode_step(model, 2, seed=3)
    short = DecodeLayers(model.decode_layers.parts[:1], model.decode_layers.heads, model.decode_layers.scale,
                         model.decode_layers.eps)
    with pytest.raises(RuntimeError, match="decode_layers: k_caches, v_caches"):
        short.run(x, cos, sin, meta, caches)  # one layer's norms against every layer's caches
    with pytest.raises(ValueError, match="at least one layer"):
        DecodeLayers([], 4, 1.0, 1e-6)


@pytest.mark.parametrize("ab_name, attr, on, off", [
    ("layers_ab", "decode_layers", "one_call", "loop"),
    pytest.param("head_ab", "greedy_head", "screened", "float_head",
                 marks=pytest.mark.skipif(panel_width() is None, reason="the panel kernel does not run here"))])
def test_step_overhead_compares_both_ways_and_puts_the_part_back(tiny_engine_dir: Path, ab_name: str, attr: str,
                                                                 on: str, off: str) -> None:
    """`step_overhead --compare-layers` / `--compare-head`: decode steps both ways in one process (the layers in one
    call or the loop; lm_head's int8 screen or the float head); the model's part as before, and each way's tokens are
    the other's (the engine's greedy requests go on as one)."""
    from trtprompt.bench.scenarios import step_overhead
    from trtprompt.engine.engine import LLMEngine

    engine = LLMEngine.from_engine_dir(tiny_engine_dir, enable_kv_cache_reuse=False, speculative_decoding="none")
    try:
        before = getattr(engine.runner.model, attr)
        step_overhead.start_batch(engine, 2, 16, "t")
        got = getattr(step_overhead, ab_name)(engine, rounds=2, block=2)
        assert getattr(engine.runner.model, attr) is before is not None
        assert got["ratio_median"] == got[f"{on}_ms_median"] / got[f"{off}_ms_median"] > 0
        assert all(r.num_output == 9 for r in engine.requests.values())  # the first token, then 2 rounds x 2 x 2
    finally:
        engine.close()
