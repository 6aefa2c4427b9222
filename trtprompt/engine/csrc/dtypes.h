// The one dtype switch of the compiled kernels: float32, bfloat16 and float16.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace trtprompt_dtypes {

// int8 KV rows (kv_cache_dtype int8, engine/attention_int8.py): d int8 values, then the row's float16
// scale in its last kInt8ScaleBytes bytes.
constexpr int64_t kInt8ScaleBytes = 2;

// n such rows dequantized into buf (n * d floats, row after row); returns buf.
inline const float* dequantize_int8_rows(const int8_t* rows, float* buf, int64_t n, int64_t d) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* r = rows + t * (d + kInt8ScaleBytes);
    c10::Half s;
    std::memcpy(&s, r + d, sizeof(s));
    const float sc = static_cast<float>(s);
    float* dst = buf + t * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = sc * static_cast<float>(r[i]);
  }
  return buf;
}

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
