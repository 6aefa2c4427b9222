// The CPU's bf16 dot product (avx512_bf16's vdpbf16ps: 16 float32 sums, each += two bf16 products) for the kernels
// that use it (bf16_panels.cpp, paged_attention.cpp, prefill_attention.cpp): whether this build holds it, the target
// their functions carry between TRTPROMPT_BF16_DOT_BEGIN and _END (the rest of the library keeps the variant's
// flags), the operand loads they share, and whether the CPU runs it.
#pragma once

// GCC's target pragma builds it into the AVX-512 variant (clang spells it otherwise: there the library builds
// without it, and the float32 paths run).
#if TRTPROMPT_LANES == 16 && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define TRTPROMPT_BF16_DOT 1
#else
#define TRTPROMPT_BF16_DOT 0
#endif

#if TRTPROMPT_BF16_DOT
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define TRTPROMPT_BF16_DOT_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma\")")
#define TRTPROMPT_BF16_DOT_END _Pragma("GCC pop_options")

TRTPROMPT_BF16_DOT_BEGIN
namespace trtprompt_bf16_dot {

// The 32 bf16 values at p (16 pairs), as the instruction's operand.
inline __m512bh pairs_at(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// The two bf16 values at p, broadcast to all 16 pairs.
inline __m512bh pair_at(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

}  // namespace trtprompt_bf16_dot
TRTPROMPT_BF16_DOT_END

namespace trtprompt_bf16_dot {

// Whether the attention kernels take their bf16 dot path: a CPU with the instruction (asked once per process) and a
// head size of whole 32-column steps.
inline bool attention_runs(int64_t head_size) {
  static const bool cpu = __builtin_cpu_supports("avx512bf16");
  return cpu && head_size % 32 == 0;
}

}  // namespace trtprompt_bf16_dot
#endif  // TRTPROMPT_BF16_DOT
