// kLanes elements of a tensor's dtype read as a float vector (vec.h's vf) and written back from one: a vector
// operation each for float32 and bfloat16 (bf16_vec.h: widening is a shift, narrowing rounds to nearest even
// as c10::BFloat16 does), float16 lane by lane. For kernels that take any of the three float dtypes.
#pragma once

#include <c10/util/BFloat16.h>

#include "bf16_vec.h"
#include "vec.h"

#include <cstdint>

namespace trtprompt_vec {

template <typename T>
inline vf load_as_float(const T* p) {
  vf v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
template <>
inline vf load_as_float<float>(const float* p) {
  return load(p);
}
template <>
inline vf load_as_float<c10::BFloat16>(const c10::BFloat16* p) {
  return load_bf16(reinterpret_cast<const uint16_t*>(p));
}

template <typename T>
inline void store_as(T* p, vf v) {
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(v[i]);
}
template <>
inline void store_as<float>(float* p, vf v) {
  store(p, v);
}
template <>
inline void store_as<c10::BFloat16>(c10::BFloat16* p, vf v) {
  store_bf16(reinterpret_cast<uint16_t*>(p), v);
}

// m rows of k values of x (rows `stride` elements apart) as float32, row after row, into dst [m, k].
template <typename T>
inline void rows_as_float(const T* x, int64_t stride, int64_t m, int64_t k, float* dst) {
  for (int64_t r = 0; r < m; ++r) {
    const T* row = x + r * stride;
    float* out = dst + r * k;
    int64_t c = 0;
    for (; c + kLanes <= k; c += kLanes) store(out + c, load_as_float(row + c));
    for (; c < k; ++c) out[c] = static_cast<float>(row[c]);
  }
}

}  // namespace trtprompt_vec
