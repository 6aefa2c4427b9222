// The new tokens' K and V stored at their cache slots: one call per layer instead of two
// advanced-indexing assignments, each about ten torch ops of dispatch (index tensors, broadcast,
// index_put) for a decode step's few rows. k and v may be views of the fused qkv output (rows
// strided by its width); the caches are [blocks, kv_heads, tokens_per_block, head_size].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

namespace {

void check(const at::Tensor& cache, const at::Tensor& x, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "write_kv: ", name, " cache must be contiguous 4-D");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "write_kv: ", name, " rows must be [T, kv_heads, d], d contiguous");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), "write_kv: ", name, " dtype differs from its cache's");
  TORCH_CHECK(x.size(1) == cache.size(1) && x.size(2) == cache.size(3), "write_kv: ", name,
              " rows do not match the cache's kv_heads and head_size");
}

void copy_rows(at::Tensor& cache, const at::Tensor& x, const int64_t* blocks, const int64_t* offsets) {
  const int64_t heads = x.size(1), d = x.size(2), tpb = cache.size(2), bytes = d * x.element_size();
  char* base = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  for (int64_t t = 0; t < x.size(0); ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst_row = (blocks[t] * heads + h) * tpb + offsets[t];
      std::memcpy(base + dst_row * bytes, src + (t * x.stride(0) + h * x.stride(1)) * x.element_size(), bytes);
    }
  }
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  check(k_cache, k, "k");
  check(v_cache, v, "v");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous() &&
                  slot_blocks.numel() == k.size(0) && slot_offsets.numel() == k.size(0) && v.size(0) == k.size(0),
              "write_kv: slot_blocks and slot_offsets must be contiguous int64, one per row of k and v");
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)  // all checked before any row is written
    TORCH_CHECK(blocks[t] >= 0 && blocks[t] < k_cache.size(0) && offsets[t] >= 0 && offsets[t] < k_cache.size(2),
                "write_kv: slot (", blocks[t], ", ", offsets[t], ") outside the cache");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "write_kv: the k and v caches differ in shape");
  copy_rows(k_cache, k, blocks, offsets);
  copy_rows(v_cache, v, blocks, offsets);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_blocks, "
        "Tensor slot_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("write_kv", &write_kv);
}
