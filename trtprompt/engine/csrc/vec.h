// Float vectors shared by the compiled kernels: 8 lanes, or 16 where kernels.py builds
// the AVX-512 variant (-DTRTPROMPT_LANES=16; engine/isa.py lists the variants).
//
// GCC/Clang vector extensions, not intrinsics, so the same source builds for any
// x86-64 or ARM CPU: the compiler maps a vector onto the registers of the ISA the
// variant's flags name (AVX2 ymm, AVX-512 zmm, NEON q pairs), or splits it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifndef TRTPROMPT_LANES
#define TRTPROMPT_LANES 8
#endif
static_assert(TRTPROMPT_LANES == 8 || TRTPROMPT_LANES == 16, "TRTPROMPT_LANES must be 8 or 16");

namespace trtprompt_vec {

constexpr int64_t kLanes = TRTPROMPT_LANES;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// x in every lane (x - 0 is x for every float, so this folds to a broadcast; 0 + x would not, for -0).
inline vf splat(float x) { return x - vf{}; }

// Sum of the lanes as a tree of shuffles (3 or 4 dependent adds instead of 8 or 16);
// compilers without __builtin_shufflevector (GCC before 12) add lane by lane.
inline float hsum(vf v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
#if TRTPROMPT_LANES == 16
  typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
  const vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 s = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#else
  vf4 s = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#endif
  s += __builtin_shufflevector(s, s, 2, 3, 0, 1);
  s += __builtin_shufflevector(s, s, 1, 0, 3, 2);
  return s[0];
#else
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
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

// Rows a thread takes at once in a row-wise op (at::parallel_for's grain): threads split rows only when a share
// holds enough elements to pay for waking them.
constexpr int64_t kGrainElements = 1 << 14;
inline int64_t grain_rows(int64_t row_elements) {
  return row_elements >= kGrainElements ? 1 : kGrainElements / (row_elements > 0 ? row_elements : 1);
}

// Calls body(std::integral_constant<int, M>) for M = m in 1..8 (8 for more): kernels that read each weight
// vector once for up to 8 rows of x unroll their rows at compile time.
constexpr int64_t kMaxUnrolledRows = 8;
template <typename Body>
void with_rows(int64_t m, Body&& body) {
  switch (m) {
    case 1: return body(std::integral_constant<int, 1>{});
    case 2: return body(std::integral_constant<int, 2>{});
    case 3: return body(std::integral_constant<int, 3>{});
    case 4: return body(std::integral_constant<int, 4>{});
    case 5: return body(std::integral_constant<int, 5>{});
    case 6: return body(std::integral_constant<int, 6>{});
    case 7: return body(std::integral_constant<int, 7>{});
    default: return body(std::integral_constant<int, kMaxUnrolledRows>{});
  }
}

}  // namespace trtprompt_vec
