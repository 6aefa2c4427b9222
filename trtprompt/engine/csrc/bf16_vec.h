// bfloat16 <-> float32 vectors (vec.h's vf), for kernels that read or write bfloat16 a vector at a time.
//
// A bfloat16 is float32's top 16 bits. Widening is a shift; compilers widen vector-extension types lane by
// lane, so the variant's ISA widens in one instruction where it has one. Narrowing rounds to nearest even
// as torch does (c10::BFloat16), NaN kept a NaN.
#pragma once

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace trtprompt_vec {

typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// kLanes uint16 values widened to int32 lanes.
inline vi widen_u16(const uint16_t* p) {
#if TRTPROMPT_LANES == 16 && defined(__AVX512F__)
  return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif TRTPROMPT_LANES == 8 && defined(__AVX2__)
  return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vi);
#endif
}

inline vf as_float(vi bits) {
  vf f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline vf load_bf16(const uint16_t* p) { return as_float(widen_u16(p) << 16); }

// v rounded to bfloat16, to nearest even (a NaN stays a quiet NaN), as the low 16 bits of each lane.
inline vu bf16_bits(vf v) {
  vu bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vu rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  const vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);  // all ones where v is a NaN
  return (rounded & ~nan) | ((bits >> 16) & nan) | (nan & 0x40u);
}

// v rounded to bfloat16 into p[0, kLanes).
inline void store_bf16(uint16_t* p, vf v) {
  const vh h = __builtin_convertvector(bf16_bits(v), vh);
  std::memcpy(p, &h, sizeof h);
}

// v as it reads after a round trip through bfloat16 (torch rounds every bfloat16 op's float result).
inline vf round_bf16(vf v) { return as_float((vi)(bf16_bits(v) << 16)); }

}  // namespace trtprompt_vec
