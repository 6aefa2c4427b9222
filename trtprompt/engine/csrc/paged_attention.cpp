// Paged decode attention that reads K/V blocks where they are (no gather copy).
//
// One query token per sequence attends to the first seq_lens[s] tokens named by
// its block-table row. The cache is head-major, [blocks, kv_heads, tokens_per_block,
// head_size], so one (block, kv head) is a contiguous run of rows. Work is split
// over (sequence, kv head); the query heads of one kv head (a GQA group) share every
// K/V row read. Softmax runs online per block in float32, and the log-sum-exp is
// returned so callers can merge partial results (cascade attention over a shared
// prefix). Design and measurements: docs/design.md, "Attention".
//
// Vectors (vec.h) are GCC/Clang vector extensions; scores of four rows are computed
// together so their FMA chains overlap.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

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

// out[r] = q . rows[r] for four consecutive rows of length d (a multiple of kLanes).
inline void dot4(const float* q, const float* rows, int64_t d, float* out) {
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t i = 0; i < d; i += kLanes) {
    const vf qv = load(q + i);
    a0 += qv * load(rows + i);
    a1 += qv * load(rows + d + i);
    a2 += qv * load(rows + 2 * d + i);
    a3 += qv * load(rows + 3 * d + i);
  }
  out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
}

// Blocks sit at scattered places, and hardware prefetchers do not follow a jump to
// the next one: ask for it while the current block is being read.
template <typename T>
inline void prefetch_run(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 1);
}

// acc[0, NV vectors) += sum over rows t < n of p[t] * rows[t]: the accumulators stay in
// registers for the whole block, one load and one store per block instead of per row.
template <int NV>
inline void weighted_rows(const float* p, const float* rows, int64_t n, int64_t d, float* acc) {
  vf a[NV];
  for (int k = 0; k < NV; ++k) a[k] = load(acc + k * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    const float w = p[t];
    const float* r = rows + t * d;
    for (int k = 0; k < NV; ++k) a[k] += w * load(r + k * kLanes);
  }
  for (int k = 0; k < NV; ++k) store(acc + k * kLanes, a[k]);
}

// acc[0, d) += sum over rows t < n of p[t] * rows[t], in chunks of at most four vectors
// (more would not stay in the 16 vector registers of AVX2; AVX-512 has 32).
inline void accumulate_rows(const float* p, const float* rows, int64_t n, int64_t d, float* acc) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= d; c += 4 * kLanes) weighted_rows<4>(p, rows + c, n, d, acc + c);
  switch ((d - c) / kLanes) {
    case 3:
      return weighted_rows<3>(p, rows + c, n, d, acc + c);
    case 2:
      return weighted_rows<2>(p, rows + c, n, d, acc + c);
    case 1:
      return weighted_rows<1>(p, rows + c, n, d, acc + c);
    default:
      return;
  }
}

// One (block, kv head) run of rows as float: float caches are read in place,
// others converted into buf.
template <typename T>
inline const float* rows_as_float(const T* rows, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(rows[i]);
  return buf;
}
template <>
inline const float* rows_as_float<float>(const float* rows, float*, int64_t) {
  return rows;
}

// n rows of head_size d as float. int8 rows (kv_cache_dtype int8, engine/attention_int8.py) hold
// d values, then the row's float16 scale in their last two bytes: dequantized into buf.
inline const float* rows_as(const int8_t* rows, float* buf, int64_t n, int64_t d) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* r = rows + t * (d + 2);
    c10::Half s;
    std::memcpy(&s, r + d, sizeof(s));
    const float sc = static_cast<float>(s);
    for (int64_t i = 0; i < d; ++i) buf[t * d + i] = sc * static_cast<float>(r[i]);
  }
  return buf;
}
template <typename T>
inline const float* rows_as(const T* rows, float* buf, int64_t n, int64_t d) {
  return rows_as_float(rows, buf, n * d);
}

struct Shape {
  int64_t heads, kv_heads, head_size, tokens_per_block, max_blocks;
};

// Running softmax state of the g query heads of one kv head.
struct Online {
  std::vector<float> q, acc, scores, kbuf, vbuf, m, l;
  Online(int64_t g, const Shape& sh)
      : q(g * sh.head_size), acc(g * sh.head_size), scores(g * sh.tokens_per_block),
        kbuf(sh.tokens_per_block * sh.head_size), vbuf(sh.tokens_per_block * sh.head_size), m(g), l(g) {}

  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.f);
  }

  // Scores of rows [0, n) of one block turned into probabilities under the new running max.
  void softmax_block(int64_t g, int64_t n, int64_t tpb, int64_t d) {
    for (int64_t j = 0; j < g; ++j) {
      float* s = scores.data() + j * tpb;
      const float nm = std::max(m[j], *std::max_element(s, s + n));
      const float corr = std::exp(m[j] - nm);  // 0 on the first block (m = -inf)
      l[j] *= corr;
      for (int64_t i = 0; i < d; ++i) acc[j * d + i] *= corr;
      int64_t t = 0;
      for (; t + kLanes <= n; t += kLanes) {
        const vf e = exp_nonpositive(load(s + t) - nm);
        store(s + t, e);
        l[j] += hsum(e);
      }
      for (; t < n; ++t) {
        s[t] = std::exp(s[t] - nm);
        l[j] += s[t];
      }
      m[j] = nm;
    }
  }
};

// C: the cache's element type, T's for float caches, int8_t for int8 rows of d + 2 bytes.
template <typename T, typename C = T>
void decode_one(const T* q, const C* k_cache, const C* v_cache, const int32_t* table, int64_t len,
                const Shape& sh, float scale, int64_t kh, T* out, float* lse, Online& st) {
  const int64_t g = sh.heads / sh.kv_heads, d = sh.head_size, tpb = sh.tokens_per_block;
  const int64_t rs = std::is_same_v<C, int8_t> ? d + 2 : d;  // elements per cached row
  st.reset();
  for (int64_t j = 0; j < g; ++j)
    for (int64_t i = 0; i < d; ++i) st.q[j * d + i] = static_cast<float>(q[(kh * g + j) * d + i]) * scale;
  for (int64_t b = 0; b * tpb < len; ++b) {
    const int64_t n = std::min(tpb, len - b * tpb);
    const int64_t base = (static_cast<int64_t>(table[b]) * sh.kv_heads + kh) * tpb * rs;
    if ((b + 1) * tpb < len) {
      const int64_t next = (static_cast<int64_t>(table[b + 1]) * sh.kv_heads + kh) * tpb * rs;
      prefetch_run(k_cache + next, tpb * rs);
      prefetch_run(v_cache + next, tpb * rs);
    }
    const int64_t n4 = (n + 3) / 4 * 4;  // rows past n lie inside the block; their scores are unused
    const float* k = rows_as(k_cache + base, st.kbuf.data(), n4, d);
    for (int64_t j = 0; j < g; ++j)
      for (int64_t t = 0; t < n; t += 4) dot4(st.q.data() + j * d, k + t * d, d, st.scores.data() + j * tpb + t);
    st.softmax_block(g, n, tpb, d);
    const float* v = rows_as(v_cache + base, st.vbuf.data(), n, d);
    for (int64_t j = 0; j < g; ++j) accumulate_rows(st.scores.data() + j * tpb, v, n, d, st.acc.data() + j * d);
  }
  for (int64_t j = 0; j < g; ++j) {
    const int64_t h = kh * g + j;
    const float inv = st.l[j] > 0.f ? 1.f / st.l[j] : 0.f;
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = static_cast<T>(st.acc[j * d + i] * inv);
    lse[h] = st.l[j] > 0.f ? st.m[j] + std::log(st.l[j]) : -std::numeric_limits<float>::infinity();
  }
}

template <typename T, typename C = T>
void decode_all(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                const at::Tensor& lens, double scale, at::Tensor& out, at::Tensor& lse) {
  const Shape sh{q.size(1), kc.size(1), q.size(2), kc.size(2), tables.size(1)};
  const int64_t g = sh.heads / sh.kv_heads, stride = sh.heads * sh.head_size;
  const T* qp = q.data_ptr<T>();
  const C* kp = kc.data_ptr<C>();
  const C* vp = vc.data_ptr<C>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  float* lsep = lse.data_ptr<float>();
  at::parallel_for(0, q.size(0) * sh.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Online st(g, sh);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / sh.kv_heads, kh = w % sh.kv_heads;
      decode_one<T, C>(qp + s * stride, kp, vp, tp + s * sh.max_blocks, lp[s], sh, static_cast<float>(scale), kh,
                    op + s * stride, lsep + s * sh.heads, st);
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
