// 8-float vectors shared by the compiled kernels.
//
// GCC/Clang vector extensions, not intrinsics, so the same source builds for any
// x86-64 or ARM CPU (AVX2/FMA code where kernels.py passes -mavx2 -mfma).
#pragma once

#include <cstdint>
#include <cstring>

namespace trtprompt_vec {

constexpr int64_t kLanes = 8;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(vf v) {
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// e^x for x <= 0 (scores minus their running max, -|g| in SiLU), 8 lanes at once: range reduction
// to 2^n * e^r with |r| <= ln2 / 2 and a degree-6 polynomial (about 1 ulp).
inline vf exp_nonpositive(vf x) {
  typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;  // e^-87 is below float32's normal range: as good as 0 next to the max term
  const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);  // round to nearest, x <= 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace trtprompt_vec
