// kLanes int8 / uint8 values widened to int32 lanes, one instruction each with the variant's ISA (compilers
// widen vector-extension types lane by lane, which left the linear kernels compute-bound).
#pragma once

#include "bf16_vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace trtprompt_vec {

typedef uint8_t vu8 __attribute__((vector_size(kLanes)));

inline vi widen_s8(const int8_t* p) {
#if TRTPROMPT_LANES == 16 && defined(__AVX512F__)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif TRTPROMPT_LANES == 8 && defined(__AVX2__)
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b ^ 0x80, vi) - 128;
#endif
}

inline vi widen_u8(const uint8_t* p) {
#if TRTPROMPT_LANES == 16 && defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif TRTPROMPT_LANES == 8 && defined(__AVX2__)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
#endif
}

}  // namespace trtprompt_vec
