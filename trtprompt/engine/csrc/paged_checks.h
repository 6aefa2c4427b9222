// The checks every paged attention kernel makes of its query and KV caches (paged_decode, paged_prefill);
// each kernel adds its own of its index tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include "vec.h"

namespace trtprompt_checks {

// q [rows, heads, D] against caches [blocks, kv_heads, tokens_per_block, D]; `op` and `q_shape` name them.
inline void check_query_and_caches(const char* op, const char* q_shape, const at::Tensor& q, const at::Tensor& kc,
                                   const at::Tensor& vc) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && vc.sizes() == kc.sizes(), op, ": q must be ", q_shape,
              " and the caches [blocks, kv_heads, tokens_per_block, D]");
  TORCH_CHECK(q.size(2) == kc.size(3) && q.size(1) % kc.size(1) == 0, op,
              ": head sizes differ or heads are not a multiple of kv_heads");
  TORCH_CHECK(q.size(2) % trtprompt_vec::kLanes == 0 && kc.size(2) % 4 == 0, op, ": head_size must be a multiple of ",
              trtprompt_vec::kLanes, " (this kernel variant's vector width) and tokens_per_block of 4");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type(), op,
              ": q and the caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), op, ": inputs must be contiguous");
}

}  // namespace trtprompt_checks
