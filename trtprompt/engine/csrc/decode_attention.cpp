// A pure decode step's attention for one layer in one call: (q/k norms,) rotary on q and k, the new K/V
// rows written at their cache slots, paged decode over the blocks in place. chunk_attention is its twin for a
// step of whole chunks (prefill chunks, speculative verification rows): paged_prefill over the chunks' segments.
//
// Each part is the op it would be from Python (trtprompt::rms_norm, rotary, write_kv, paged_decode), called
// through the dispatcher from here: the results are those of the op-by-op path bit for bit, and a
// step saves the ~12 Python-level calls per layer between them (split, views, two rotaries, the
// write, the metadata's dispatch, the decode wrapper, the reshape), about a millisecond a step on
// a 30-layer model at batch 1. docs/design.md, "Fused layer ops".
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "op_handle.h"

namespace {

using trtprompt_ops::op;

using Rotary = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using WriteKv = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&);
// paged_decode(q, k_cache, v_cache, tables, seq_lens, scale) and paged_prefill(..., tables, segments, scale).
using Paged = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, double);

// q or k [S, h, d] normed per head first where the model has q/k norms (Qwen3), as CompiledOps.rms_norm
// norms them (a contiguous copy of the view).
at::Tensor maybe_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  static const auto rms_norm = op<RmsNorm>("trtprompt::rms_norm");
  return weight.has_value() ? rms_norm.call(x.contiguous(), *weight, eps) : x;
}

// qkv [T, (heads + 2 kv_heads) d] in packed order; cos/sin [T, d/2] (CompiledOps.rotary_tables); caches
// [blocks, kv_heads, tokens_per_block, d]; q_norm / k_norm [d] or none. Writes the rows' rotated K and V at their
// slots and returns the rotated q [T, heads, d].
at::Tensor rotate_and_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                            int64_t heads, const std::optional<at::Tensor>& q_norm,
                            const std::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(k_cache.dim() == 4, "decode_attention: the caches must be [blocks, kv_heads, tokens_per_block, d]");
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(1), d = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "decode_attention: qkv must be [S, (heads + 2 kv_heads) head_size] with contiguous rows");
  static const auto rotary = op<Rotary>("trtprompt::rotary");
  static const auto write_kv = op<WriteKv>("trtprompt::write_kv");
  const at::Tensor q = qkv.narrow(1, 0, heads * d).view({rows, heads, d});
  const at::Tensor k = qkv.narrow(1, heads * d, kv_heads * d).view({rows, kv_heads, d});
  const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * d, kv_heads * d).view({rows, kv_heads, d});
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_attention: q_norm and k_norm go together");
  const at::Tensor q_rot = rotary.call(maybe_norm(q, q_norm, eps), cos, sin);
  write_kv.call(k_cache, v_cache, rotary.call(maybe_norm(k, k_norm, eps), cos, sin), v, slot_blocks,
                slot_offsets);
  return q_rot;
}

// The kernel over the rotated q: paged_decode (decode_attention: one new token per sequence, block_tables /
// lens its tables and seq_lens) or paged_prefill (chunk_attention: every row in a chunk, its tables and segments,
// as PagedMetadata.chunks holds them).
constexpr char kPagedDecode[] = "trtprompt::paged_decode";
constexpr char kPagedPrefill[] = "trtprompt::paged_prefill";

// Returns [T, heads d].
template <const char* Kernel>
at::Tensor attention_step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                          at::Tensor v_cache, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                          const at::Tensor& block_tables, const at::Tensor& lens, int64_t heads, double scale,
                          const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                          double eps) {
  static const auto kernel = op<Paged>(Kernel);
  const at::Tensor q = rotate_and_write(qkv, cos, sin, k_cache, v_cache, slot_blocks, slot_offsets, heads, q_norm,
                                        k_norm, eps);
  return std::get<0>(kernel.call(q, k_cache, v_cache, block_tables, lens, scale)).view({qkv.size(0), -1});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_blocks, Tensor slot_offsets, Tensor block_tables, Tensor seq_lens, int heads, "
        "float scale, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0) -> Tensor");
  m.def("chunk_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_blocks, Tensor slot_offsets, Tensor block_tables, Tensor segments, int heads, "
        "float scale, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("decode_attention", &attention_step<kPagedDecode>);
  m.impl("chunk_attention", &attention_step<kPagedPrefill>);
}
