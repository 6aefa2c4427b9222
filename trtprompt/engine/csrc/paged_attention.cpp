// Paged decode attention that reads K/V blocks where they are (no gather copy).
//
// One query token per sequence attends to the first seq_lens[s] tokens named by
// its block-table row. The cache is head-major, [blocks, kv_heads, tokens_per_block,
// head_size], so one (block, kv head) is a contiguous run of rows. Work is split
// over (sequence, kv head); the query heads of one kv head (a GQA group) share every
// K/V row read. Softmax runs online per block in float32, and the log-sum-exp is
// returned so callers can merge partial results (cascade attention over a shared
// prefix). Design and measurements: docs/attention.md, "Decode".
//
// Per block, for each group of up to three query heads (four with AVX-512's 32 registers):
//   scores: each K row is loaded once for all the group's heads; a head's per-row vector
//           accumulators are reduced four rows at a time (transpose-and-add), not one by one;
//   softmax: vectorised max, exp and sum per head; the rescale of the output rides on
//           its load in the next step;
//   values: each V row is loaded once for all the group's heads, their accumulators kept
//           in registers over the block.
// bfloat16 rows are widened in registers as they are read; float16 and int8 rows (with their
// row scales) are converted per block into float. bfloat16 queries over a bfloat16 cache run on the CPU's
// bf16 dot product instead where it has one (decode_item_dot, below).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_dot.h"
#include "dtypes.h"
#include "paged_checks.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace trtprompt_checks;
using namespace trtprompt_dtypes;
using namespace trtprompt_vec;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query heads sharing one pass over a K or V row: their accumulators (heads x 4 vectors)
// plus the heads' broadcast operands fill AVX2's 16 vector registers at three; AVX-512 has 32.
constexpr int kMaxGroup = kLanes == 16 ? 4 : 3;

typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

// {sum of a, sum of b, sum of c, sum of d}: pairwise adds of the four vectors' lanes, so four
// rows' dot products cost about one reduction instead of four.
inline vf4 hsum4(vf a, vf b, vf c, vf d) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
#if TRTPROMPT_LANES == 16
  auto fold = [](vf v) -> vf8 {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  };
  const vf8 a8 = fold(a), b8 = fold(b), c8 = fold(c), d8 = fold(d);
#else
  const vf8 a8 = a, b8 = b, c8 = c, d8 = d;
#endif
  // Within each 128-bit half: [a0+a1, a2+a3, b0+b1, b2+b3], then [sum a, sum b, sum c, sum d].
  const vf8 ab = __builtin_shufflevector(a8, b8, 0, 2, 8, 10, 4, 6, 12, 14) +
                 __builtin_shufflevector(a8, b8, 1, 3, 9, 11, 5, 7, 13, 15);
  const vf8 cd = __builtin_shufflevector(c8, d8, 0, 2, 8, 10, 4, 6, 12, 14) +
                 __builtin_shufflevector(c8, d8, 1, 3, 9, 11, 5, 7, 13, 15);
  const vf8 all = __builtin_shufflevector(ab, cd, 0, 2, 8, 10, 4, 6, 12, 14) +
                  __builtin_shufflevector(ab, cd, 1, 3, 9, 11, 5, 7, 13, 15);
  return __builtin_shufflevector(all, all, 0, 1, 2, 3) + __builtin_shufflevector(all, all, 4, 5, 6, 7);
#else
  return vf4{hsum(a), hsum(b), hsum(c), hsum(d)};
#endif
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, static_cast<float>(v[i]));
  return m;
}

// kLanes consecutive cache elements as floats, widened in registers.
inline vf load_row(const float* p) { return load(p); }
inline vf load_row(const c10::BFloat16* p) {  // a bfloat16 is the upper half of a float
  typedef uint16_t vu16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t vu32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  const vu32 w = __builtin_convertvector(h, vu32) << 16;
  vf f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}
// The type rows are read as: float and bfloat16 in place, widened in registers. float16 (no widening
// without F16C, as in the generic variant) is converted per block into float, and so are int8 rows
// (d values, then their float16 scale): GCC turns a vector int8 -> float conversion into scalar code,
// 2.5x slower than this auto-vectorised loop (measured: docs/attention.md, "Decode").
template <typename C>
constexpr bool kInPlace = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>;
template <typename C>
using ReadAs = std::conditional_t<kInPlace<C>, C, float>;

template <typename C>
inline const ReadAs<C>* block_rows(const C* rows, float* buf, int64_t n, int64_t d) {
  if constexpr (std::is_same_v<C, int8_t>) {
    return dequantize_int8_rows(rows, buf, n, d);
  } else if constexpr (!kInPlace<C>) {
    for (int64_t i = 0; i < n * d; ++i) buf[i] = static_cast<float>(rows[i]);
    return buf;
  } else {
    return rows;
  }
}

// Blocks sit at scattered places, and hardware prefetchers do not follow a jump to
// the next one: ask for it, every 64-byte line into L1, while the current block is being read. With
// the cache cold (a step's linears stream between two layers' attention), a request per line took
// 0.76-0.96x the time of one per 256 bytes into L2, which left the prefetchers to fetch the lines
// between and lost to no prefetch at all (measured: docs/attention.md, "Decode").
template <typename T>
inline void prefetch_run(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 3);
}

// s[j * sp + i] = q[j] . k[i] for HB heads (q rows of d) and R rows of k (stride rs), R a multiple of 4.
// Each K vector is loaded once for the HB heads; HB x R accumulators (12 at most on AVX2).
template <int HB, int R, typename K>
inline void scores_micro(const float* q, int64_t d, const K* k, int64_t rs, float* s, int64_t sp) {
  vf acc[HB][R] = {};
  for (int64_t c = 0; c < d; c += kLanes) {
    vf qv[HB];
    for (int j = 0; j < HB; ++j) qv[j] = load(q + j * d + c);
    for (int i = 0; i < R; ++i) {
      const vf kv = load_row(k + i * rs + c);
      for (int j = 0; j < HB; ++j) acc[j][i] += qv[j] * kv;
    }
  }
  for (int j = 0; j < HB; ++j)
    for (int i = 0; i < R; i += 4) {
      const vf4 r = hsum4(acc[j][i], acc[j][i + 1], acc[j][i + 2], acc[j][i + 3]);
      std::memcpy(s + j * sp + i, &r, sizeof r);
    }
}

// Scores of rows [0, n4) (a multiple of 4: rows past the sequence lie inside the block; unused).
template <int HB, typename K>
inline void scores_rows(const float* q, int64_t d, const K* k, int64_t rs, int64_t n4, float* s, int64_t sp) {
  constexpr int kRows = HB == 1 ? 8 : 4;  // one head: eight rows for enough FMA chains
  int64_t t = 0;
  for (; t + kRows <= n4; t += kRows) scores_micro<HB, kRows>(q, d, k + t * rs, rs, s + t, sp);
  if constexpr (kRows == 8) {
    if (t < n4) scores_micro<HB, 4>(q, d, k + t * rs, rs, s + t, sp);
  }
}

// acc[j] = corr[j] * acc[j] + sum over rows t < n of p[j * sp + t] * v[t] for HB heads, over NV vectors
// of the row: HB x NV accumulators stay in registers for the block; each V vector is loaded once.
template <int HB, int NV, typename V>
inline void values_micro(const float* p, int64_t sp, const V* v, int64_t rs, int64_t n, const float* corr,
                         float* acc, int64_t d) {
  vf a[HB][NV];
  for (int j = 0; j < HB; ++j)
    for (int k = 0; k < NV; ++k) a[j][k] = load(acc + j * d + k * kLanes) * corr[j];
  for (int64_t t = 0; t < n; ++t) {
    vf w[HB];
    for (int j = 0; j < HB; ++j) w[j] = splat(p[j * sp + t]);
    const V* r = v + t * rs;
    for (int k = 0; k < NV; ++k) {
      const vf x = load_row(r + k * kLanes);
      for (int j = 0; j < HB; ++j) a[j][k] += w[j] * x;
    }
  }
  for (int j = 0; j < HB; ++j)
    for (int k = 0; k < NV; ++k) store(acc + j * d + k * kLanes, a[j][k]);
}

// The whole row in chunks of kMax vectors (HB x kMax accumulators), the rest in fours, twos, ones.
template <int HB, typename V>
inline void values_rows(const float* p, int64_t sp, const V* v, int64_t rs, int64_t n, const float* corr,
                        float* acc, int64_t d) {
  constexpr int kMax = HB == 1 ? 8 : 4;
  const int64_t nv = d / kLanes;
  int64_t c = 0;
  for (; c + kMax <= nv; c += kMax) values_micro<HB, kMax>(p, sp, v + c * kLanes, rs, n, corr, acc + c * kLanes, d);
  if (kMax == 8 && c + 4 <= nv) values_micro<HB, 4>(p, sp, v + c * kLanes, rs, n, corr, acc + c * kLanes, d), c += 4;
  if (c + 2 <= nv) values_micro<HB, 2>(p, sp, v + c * kLanes, rs, n, corr, acc + c * kLanes, d), c += 2;
  if (c < nv) values_micro<HB, 1>(p, sp, v + c * kLanes, rs, n, corr, acc + c * kLanes, d);
}

// The compile-time group size of a run-time one.
template <typename Fn>
inline void with_group(int64_t hb, Fn&& fn) {
  switch (hb) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 3:
      return fn(std::integral_constant<int, 3>{});
    default:
      if constexpr (kMaxGroup >= 4) return fn(std::integral_constant<int, 4>{});
  }
}

struct Shape {
  int64_t heads, kv_heads, head_size, tokens_per_block, max_blocks;
};

// fn(base, n) for each block b in [b0, b1) holding some of the first len tokens of kv head kh (base: the block's
// first element in the caches, rows of rs elements; n: its tokens), the next block's K and V asked for first.
template <typename E, typename Fn>
inline void each_block(const E* k_cache, const E* v_cache, const int32_t* table, int64_t len, int64_t b0, int64_t b1,
                       const Shape& sh, int64_t kh, int64_t rs, Fn&& fn) {
  const int64_t tpb = sh.tokens_per_block;
  for (int64_t b = b0; b < b1 && b * tpb < len; ++b) {
    if (b + 1 < b1 && (b + 1) * tpb < len) {
      const int64_t next = (static_cast<int64_t>(table[b + 1]) * sh.kv_heads + kh) * tpb * rs;
      prefetch_run(k_cache + next, tpb * rs);
      prefetch_run(v_cache + next, tpb * rs);
    }
    fn((static_cast<int64_t>(table[b]) * sh.kv_heads + kh) * tpb * rs, std::min(tpb, len - b * tpb));
  }
}

// Running softmax state of the g query heads of one kv head, and a block's scratch.
struct Online {
  int64_t sp;  // scores per head: tokens_per_block rounded up to whole vectors
  std::vector<float> q, acc, scores, m, l, corr, kbuf, vbuf;
  std::vector<uint16_t> qb, pb;  // bf16 dot path: the query rows as they came, a block's weights rounded to bf16
  std::vector<std::pair<int64_t, int64_t>> groups;  // (first head, heads) sharing a pass over a row
  Online(int64_t g, const Shape& sh)
      : sp((sh.tokens_per_block + kLanes - 1) / kLanes * kLanes), q(g * sh.head_size), acc(g * sh.head_size),
        scores(g * sp), m(g), l(g), corr(g), kbuf(sh.tokens_per_block * sh.head_size),
        vbuf(sh.tokens_per_block * sh.head_size), qb(g * sh.head_size), pb(g * (sp + kLanes)) {
    const int64_t ng = (g + kMaxGroup - 1) / kMaxGroup;  // balanced: g = 4 is 2 + 2, not 3 + 1
    for (int64_t i = 0, j0 = 0; i < ng; ++i) {
      const int64_t hb = g / ng + (i < g % ng ? 1 : 0);
      groups.emplace_back(j0, hb);
      j0 += hb;
    }
  }

  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.f);
  }

  // Head j's scores of rows [0, n) turned into weights under the new running max; corr[j] rescales
  // its output accumulator.
  void softmax_head(int64_t j, int64_t n) {
    float* s = scores.data() + j * sp;
    const int64_t np = (n + kLanes - 1) / kLanes * kLanes;
    for (int64_t t = n; t < np; ++t) s[t] = kNegInf;  // rows past the sequence
    vf mx = splat(kNegInf);
    for (int64_t t = 0; t < np; t += kLanes) mx = vmax(mx, load(s + t));
    const float nm = std::max(m[j], hmax(mx));
    corr[j] = std::exp(m[j] - nm);  // 0 on the first block (m = -inf)
    vf sum = {};
    for (int64_t t = 0; t < np; t += kLanes) {
      const vf e = exp_nonpositive(load(s + t) - nm);  // e^-87 for -inf: nothing next to the max term's 1
      sum += e;
      store(s + t, e);
    }
    l[j] = l[j] * corr[j] + hsum(sum);
    m[j] = nm;
  }

  static vf vmax(vf a, vf b) { return a > b ? a : b; }
};

// One block of n rows (K rows scored up to n4) for every head of the kv head.
template <typename R>
inline void attend_block(const R* k, const R* v, int64_t rs, int64_t n, int64_t n4, int64_t d, Online& st) {
  for (const auto& [j0, hb] : st.groups)
    with_group(hb, [&](auto h) {
      scores_rows<decltype(h)::value>(st.q.data() + j0 * d, d, k, rs, n4, st.scores.data() + j0 * st.sp, st.sp);
    });
  for (int64_t j = 0; j < static_cast<int64_t>(st.m.size()); ++j) st.softmax_head(j, n);
  for (const auto& [j0, hb] : st.groups)
    with_group(hb, [&](auto h) {
      values_rows<decltype(h)::value>(st.scores.data() + j0 * st.sp, st.sp, v, rs, n, st.corr.data() + j0,
                                      st.acc.data() + j0 * d, d);
    });
}

#if TRTPROMPT_BF16_DOT
// bfloat16 queries over bfloat16 caches on avx512_bf16's dot product (vdpbf16ps: 16 float32 sums, each += two bf16
// products), where the CPU has it: the K and V rows are read as they are stored, with no widening, and each
// instruction does two rows' or two columns' work. q . k takes the query's bf16 values as they came (the scale is
// applied to the float32 score); the softmax stays float32 and its weights are rounded to bf16 for the values, as
// torch's CPU flash attention does for bf16. Measured: docs/attention.md, "Decode on bf16 dot products".
TRTPROMPT_BF16_DOT_BEGIN
using trtprompt_bf16_dot::pairs_at;

// s[j * sp + i] = scale * q[j] . k[i] for HB heads and R rows (R a multiple of 4), 32 columns a step.
template <int HB, int R>
inline void scores_dot(const uint16_t* q, int64_t d, const uint16_t* k, int64_t rs, float* s, int64_t sp,
                       float scale) {
  __m512 acc[HB][R];
  for (int j = 0; j < HB; ++j)
    for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    __m512bh qv[HB];
    for (int j = 0; j < HB; ++j) qv[j] = pairs_at(q + j * d + c);
    for (int i = 0; i < R; ++i) {
      const __m512bh kv = pairs_at(k + i * rs + c);
      for (int j = 0; j < HB; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], qv[j], kv);
    }
  }
  for (int j = 0; j < HB; ++j)
    for (int i = 0; i < R; i += 4) {
      const vf4 r = hsum4((vf)acc[j][i], (vf)acc[j][i + 1], (vf)acc[j][i + 2], (vf)acc[j][i + 3]) * scale;
      std::memcpy(s + j * sp + i, &r, sizeof r);
    }
}

template <int HB>
inline void scores_rows_dot(const uint16_t* q, int64_t d, const uint16_t* k, int64_t rs, int64_t n4, float* s,
                            int64_t sp, float scale) {
  int64_t t = 0;
  for (; t + 8 <= n4; t += 8) scores_dot<HB, 8>(q, d, k + t * rs, rs, s + t, sp, scale);
  if (t < n4) scores_dot<HB, 4>(q, d, k + t * rs, rs, s + t, sp, scale);
}

// acc[j] = corr[j] * acc[j] + sum over rows t < n of p[j][t] v[t], two rows a step: rows t and t + 1 interleaved
// per column (vpunpck{l,h}wd within 128-bit lanes), so the sums of a 32-column chunk lie in lane order
// [0-3, 8-11, 16-19, 24-27] (lo) and [4-7, 12-15, 20-23, 28-31] (hi), put back in order by the item's end.
template <int HB>
inline void values_dot(const uint16_t* p, int64_t sp, const uint16_t* v, int64_t rs, int64_t n, const float* corr,
                       float* acc, int64_t d) {
  for (int64_t c = 0; c < d; c += 32) {
    __m512 lo[HB], hi[HB];
    for (int j = 0; j < HB; ++j) {
      lo[j] = _mm512_loadu_ps(acc + j * d + c) * corr[j];
      hi[j] = _mm512_loadu_ps(acc + j * d + c + 16) * corr[j];
    }
    for (int64_t t = 0; t < n; t += 2) {
      const __m512i a = _mm512_loadu_si512(v + t * rs + c);
      const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * rs + c) : _mm512_setzero_si512();
      const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int j = 0; j < HB; ++j) {
        int32_t pair;
        std::memcpy(&pair, p + j * sp + t, sizeof pair);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        lo[j] = _mm512_dpbf16_ps(lo[j], w, vlo);
        hi[j] = _mm512_dpbf16_ps(hi[j], w, vhi);
      }
    }
    for (int j = 0; j < HB; ++j) {
      _mm512_storeu_ps(acc + j * d + c, lo[j]);
      _mm512_storeu_ps(acc + j * d + c + 16, hi[j]);
    }
  }
}

// The softmax's float32 weights of rows [0, n) as bf16 (rounded to nearest even), a zero past an odd n.
inline void weights_bf16(const float* s, int64_t n, uint16_t* out) {
  int64_t t = 0;
  for (; t + 32 <= n; t += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(s + t));
    std::memcpy(out + t, &h, sizeof h);
  }
  for (; t < n; ++t) {
    const c10::BFloat16 b(s[t]);
    std::memcpy(out + t, &b, sizeof b);
  }
  out[n] = 0;
}

inline void attend_block_dot(const uint16_t* k, const uint16_t* v, int64_t rs, int64_t n, int64_t n4, int64_t d,
                             float scale, Online& st) {
  for (const auto& [j0, hb] : st.groups)
    with_group(hb, [&](auto h) {
      scores_rows_dot<decltype(h)::value>(st.qb.data() + j0 * d, d, k, rs, n4, st.scores.data() + j0 * st.sp,
                                          st.sp, scale);
    });
  const int64_t g = static_cast<int64_t>(st.m.size()), pp = st.sp + kLanes;
  for (int64_t j = 0; j < g; ++j) {
    st.softmax_head(j, n);
    weights_bf16(st.scores.data() + j * st.sp, n, st.pb.data() + j * pp);
  }
  for (const auto& [j0, hb] : st.groups)
    with_group(hb, [&](auto h) {
      values_dot<decltype(h)::value>(st.pb.data() + j0 * pp, pp, v, rs, n, st.corr.data() + j0,
                                     st.acc.data() + j0 * d, d);
    });
}

// acc's 32-column chunks from values_dot's lane order back to column order.
inline void unpermute_acc(float* acc, int64_t rows, int64_t d) {
  float tmp[32];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; c += 32) {
      float* a = acc + r * d + c;
      for (int i = 0; i < 16; ++i) {
        tmp[8 * (i / 4) + i % 4] = a[i];
        tmp[8 * (i / 4) + 4 + i % 4] = a[16 + i];
      }
      std::memcpy(a, tmp, sizeof tmp);
    }
}

void decode_item_dot(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* table, int64_t len,
                     int64_t b0, int64_t b1, const Shape& sh, int64_t kh, float scale, Online& st) {
  const int64_t d = sh.head_size;
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
  st.reset();
  each_block(kc, vc, table, len, b0, b1, sh, kh, d, [&](int64_t base, int64_t n) {
    attend_block_dot(kc + base, vc + base, d, n, (n + 3) / 4 * 4, d, scale, st);
  });
  unpermute_acc(st.acc.data(), static_cast<int64_t>(st.m.size()), d);
}

TRTPROMPT_BF16_DOT_END
#endif  // TRTPROMPT_BF16_DOT

// C: the cache's element type, T's for float caches, int8_t for int8 rows of d + 2 bytes.
// st.q holds the item's g query rows, scaled; st.acc, st.m, st.l its result over blocks [b0, b1)
// of the first len tokens.
template <typename C>
void decode_item(const C* k_cache, const C* v_cache, const int32_t* table, int64_t len, int64_t b0, int64_t b1,
                 const Shape& sh, int64_t kh, Online& st) {
  const int64_t d = sh.head_size;
  const int64_t rs = std::is_same_v<C, int8_t> ? d + kInt8ScaleBytes : d;  // elements per cached row
  st.reset();
  each_block(k_cache, v_cache, table, len, b0, b1, sh, kh, rs, [&](int64_t base, int64_t n) {
    const int64_t n4 = (n + 3) / 4 * 4;  // rows past n lie inside the block; their scores are unused
    const auto* k = block_rows(k_cache + base, st.kbuf.data(), n4, d);
    const auto* v = block_rows(v_cache + base, st.vbuf.data(), n, d);
    attend_block(k, v, kInPlace<C> ? rs : d, n, n4, d, st);  // converted rows lie d apart
  });
}

// With fewer (sequence, kv head) items than this, a thread of two would idle for part of the call:
// each sequence is then cut into parts of whole blocks, one item each, merged by log-sum-exp.
constexpr int64_t kMinItems = 8;
// Blocks a part covers at least, so its fixed costs (loading q, the merge) stay small.
constexpr int64_t kMinPartBlocks = 8;

// Parts per sequence (at most kMinItems): 1 unless there are few items and long sequences; never a
// thread count, so a result does not depend on the machine.
inline int64_t parts_per_sequence(int64_t items, int64_t max_len, int64_t tpb) {
  if (items >= kMinItems || items == 0) return 1;
  const int64_t blocks = (max_len + tpb - 1) / tpb;
  return std::max<int64_t>(1, std::min((kMinItems + items - 1) / items, blocks / kMinPartBlocks));
}

// out and lse of the g heads of one item from its parts' (acc, m, l); acc unnormalised. An empty part
// (l = 0) weighs nothing.
template <typename T>
void write_heads(int64_t g, int64_t d, int64_t parts, const float* acc, const float* m, const float* l, T* out,
                 float* lse) {
  for (int64_t j = 0; j < g; ++j) {
    float mx = kNegInf, sum = 0.f, weight[kMinItems];
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, m[p * g + j]);
    for (int64_t p = 0; p < parts; ++p) {
      weight[p] = l[p * g + j] > 0.f ? std::exp(m[p * g + j] - mx) : 0.f;
      sum += weight[p] * l[p * g + j];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t p = 0; p < parts; ++p) weight[p] *= inv;
    for (int64_t i = 0; i < d; ++i) {
      float o = 0.f;
      for (int64_t p = 0; p < parts; ++p) o += weight[p] * acc[(p * g + j) * d + i];
      out[j * d + i] = static_cast<T>(o);
    }
    lse[j] = sum > 0.f ? mx + std::log(sum) : kNegInf;
  }
}

template <typename T, typename C = T>
void decode_all(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                const at::Tensor& lens, double scale, at::Tensor& out, at::Tensor& lse) {
  const Shape sh{q.size(1), kc.size(1), q.size(2), kc.size(2), tables.size(1)};
  const int64_t g = sh.heads / sh.kv_heads, d = sh.head_size, stride = sh.heads * d, seqs = q.size(0);
  const T* qp = q.data_ptr<T>();
  const C* kp = kc.data_ptr<C>();
  const C* vp = vc.data_ptr<C>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t max_len = seqs ? *std::max_element(lp, lp + seqs) : 0;
  const int64_t parts = parts_per_sequence(seqs * sh.kv_heads, max_len, sh.tokens_per_block);
  bool dot = false;  // bf16 queries over a bf16 cache on the CPU's bf16 dot product
#if TRTPROMPT_BF16_DOT
  dot = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> &&
        trtprompt_bf16_dot::attention_runs(d);
#endif
  // Parts' results, (acc [g, d], m [g], l [g]) each, merged once every part is done.
  std::vector<float> part_acc(parts > 1 ? seqs * sh.kv_heads * parts * g * d : 0);
  std::vector<float> part_ml(parts > 1 ? 2 * seqs * sh.kv_heads * parts * g : 0);
  at::parallel_for(0, seqs * sh.kv_heads * parts, 1, [&](int64_t begin, int64_t end) {
    Online st(g, sh);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t item = w / parts, p = w % parts, s = item / sh.kv_heads, kh = item % sh.kv_heads;
      const int64_t blocks = (lp[s] + sh.tokens_per_block - 1) / sh.tokens_per_block;
      const int64_t per = (blocks + parts - 1) / parts;  // blocks per part
      const T* qs = qp + s * stride + kh * g * d;
#if TRTPROMPT_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
        if (dot) {
          std::memcpy(st.qb.data(), qs, g * d * sizeof(T));
          decode_item_dot(kp, vp, tp + s * sh.max_blocks, lp[s], p * per, (p + 1) * per, sh, kh, sc, st);
        }
      }
#endif
      if (!dot) {
        for (int64_t i = 0; i < g * d; ++i) st.q[i] = static_cast<float>(qs[i]) * sc;
        decode_item<C>(kp, vp, tp + s * sh.max_blocks, lp[s], p * per, (p + 1) * per, sh, kh, st);
      }
      if (parts == 1) {
        write_heads(g, d, 1, st.acc.data(), st.m.data(), st.l.data(), op + s * stride + kh * g * d,
                    lsep + s * sh.heads + kh * g);
        continue;
      }
      std::copy(st.acc.begin(), st.acc.end(), part_acc.begin() + w * g * d);
      std::copy(st.m.begin(), st.m.end(), part_ml.begin() + (2 * item * parts + p) * g);
      std::copy(st.l.begin(), st.l.end(), part_ml.begin() + (2 * item + 1) * parts * g + p * g);
    }
  });
  if (parts == 1) return;
  at::parallel_for(0, seqs * sh.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / sh.kv_heads, kh = item % sh.kv_heads;
      write_heads(g, d, parts, part_acc.data() + item * parts * g * d, part_ml.data() + 2 * item * parts * g,
                  part_ml.data() + (2 * item + 1) * parts * g, op + s * stride + kh * g * d,
                  lsep + s * sh.heads + kh * g);
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                  const at::Tensor& lens) {
  check_query_and_caches("paged_decode", "[S, H, D]", q, kc, vc);
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lens.numel() == q.size(0),
              "paged_decode: one block-table row and one length per sequence");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "paged_decode: inputs must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens, double scale) {
  check_inputs(q, k_cache, v_cache, block_tables, seq_lens);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  dispatch_float_types(q, "paged_decode", [&](auto tag) {
    decode_all<decltype(tag)>(q, k_cache, v_cache, block_tables, seq_lens, scale, out, lse);
  });
  return {out, lse};
}

// The same over int8 caches [blocks, kv_heads, tokens_per_block, D + 2] (values, then a float16
// scale per row), read in place: a quarter of fp32's bytes per decode step, no dequantized copy.
std::tuple<at::Tensor, at::Tensor> paged_decode_int8(const at::Tensor& q, const at::Tensor& k_cache,
                                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                     const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_int8: q must be [S, H, D] and the caches [blocks, kv_heads, tokens_per_block, D + 2]");
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar,
              "paged_decode_int8: the caches must be int8");
  TORCH_CHECK(k_cache.size(3) == q.size(2) + 2 && q.size(1) % k_cache.size(1) == 0,
              "paged_decode_int8: cache rows must be D + 2 bytes and heads a multiple of kv_heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && k_cache.size(2) % 4 == 0, "paged_decode_int8: head_size must be a ",
              "multiple of ", kLanes, " (this kernel variant's vector width) and tokens_per_block of 4");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_int8: inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0) &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_int8: one contiguous int32 block-table row and length per sequence");
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  dispatch_float_types(q, "paged_decode_int8", [&](auto tag) {
    decode_all<decltype(tag), int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out, lse);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(trtprompt, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> (Tensor, Tensor)");
  m.def("paged_decode_int8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_int8", &paged_decode_int8);
}
