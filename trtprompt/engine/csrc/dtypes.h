// The one dtype switch of the compiled kernels: float32, bfloat16 and float16.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace trtprompt_dtypes {

// Calls fn(T{}) for the tensor's dtype T; any other dtype fails naming `op`.
template <typename Fn>
void dispatch_float_types(const at::Tensor& t, const char* op, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return fn(float{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    case at::kHalf:
      return fn(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace trtprompt_dtypes
