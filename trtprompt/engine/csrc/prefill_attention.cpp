// Paged prefill attention as register-blocked GEMMs over K/V blocks read in place.
//
// A segment is a run of query rows of q that attend to the first num_keys tokens named
// by its block-table row; row i sees keys [0, min(num_keys, first_limit + i)) (causal
// for a chunk whose own tokens are already in the cache; first_limit = num_keys for
// none). A work item is (segment, kv head, tile of query tokens): the tile's query
// heads of that kv head (a GQA group) become the columns of one matrix, packed once,
// transposed and pre-scaled; each K/V block the tile can see is read where it is, once
// per item, and
//   S[key, col] = K[key, :] . Qt[:, col]          (6 keys x 2 vectors of columns per step)
//   online softmax down each column (running max and sum; vectorised across columns)
//   O[col, :]  = alpha[col] O[col, :] + sum_key S[key, col] V[key, :]   (6 columns x 2 vectors)
// Blocks past the tile's last visible key are skipped; only blocks that cross the
// diagonal are masked. Items go to threads dynamically, most work first, as causal
// tiles differ in cost. The log-sum-exp is returned so callers merge partial results
// (cascade attention over a shared prefix). Design and figures: docs/attention.md.
//
// paged_prefill_int8 is the same kernel over int8 caches (kv_cache_dtype int8, engine/attention_int8.py):
// rows of D int8 values then their float16 scale, each run dequantized into the thread's tile buffer as
// the tile reads it, so no float copy of the cache exists anywhere.
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
#include <atomic>
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

// Columns (query tokens x GQA heads) per item: Qt, S and O of an item then take
// 24-48 KB each at head size 64 and stay in L2 with the K/V tile; more columns would
// read each K/V block fewer times but leave fewer items to balance two threads.
constexpr int64_t kColsTarget = 96;
// Keys per K/V tile: whole blocks, at least one; a tile's O update loads and stores
// O once per column, so longer tiles amortise it.
constexpr int64_t kTileKeys = 128;
constexpr int64_t kColBlock = 2 * kLanes;  // columns of one scores micro tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The head size: a compile-time constant for the common sizes (the micro kernels then
// address six key rows by immediate offsets instead of running out of integer registers).
template <int D>
inline int64_t dim(int64_t d) {
  return D > 0 ? D : d;
}

// e^x for x <= 0, exactly 0 below -87 (masked scores are -inf).
inline vf exp_or_zero(vf x) {
  const vf e = exp_nonpositive(x);
  return x < vf{} - 87.0f ? vf{} : e;
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// A run of consecutive key rows of one (block, kv head), as float.
struct Run {
  const float* k;
  const float* v;
  int64_t n;
};

// s[i, :2 vectors] = sum_e k[i, e] * qt[e, :2 vectors] for R key rows read in place; mx (the columns'
// maximum over the tile) takes in the first `valid` rows (the others lie past the tile's keys).
// Masked (a tile crossing the diagonal): key `key0 + i` at or past a column's limit scores -inf.
template <int D, int R, bool Masked>
inline void qk_micro(const float* k, int64_t d_, const float* qt, int64_t ncp, float* s, float* mx,
                     const float* limit, float key0, int64_t valid) {
  const int64_t d = dim<D>(d_);
  vf acc[R][2] = {};
#pragma GCC unroll 4
  for (int64_t e = 0; e < d; ++e) {
    const vf b0 = load(qt + e * ncp), b1 = load(qt + e * ncp + kLanes);
    for (int i = 0; i < R; ++i) {
      const float a = k[i * d + e];
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
    }
  }
  // Without this barrier the compiler keeps the maxima in registers from call to call, and
  // with them live an accumulator spills in the loop above (a store-forward chain per step).
  asm volatile("" ::: "memory");
  vf m0 = load(mx), m1 = load(mx + kLanes);
  const vf inf = vf{} + kNegInf;
  for (int i = 0; i < R; ++i) {  // a constant trip count: acc stays in registers
    if (Masked) {
      const vf key = vf{} + (key0 + static_cast<float>(i));
      acc[i][0] = key >= load(limit) ? inf : acc[i][0];
      acc[i][1] = key >= load(limit + kLanes) ? inf : acc[i][1];
    }
    if (i < valid) m0 = vmax(m0, acc[i][0]), m1 = vmax(m1, acc[i][1]);
    store(s + i * ncp, acc[i][0]);
    store(s + i * ncp + kLanes, acc[i][1]);
  }
  store(mx, m0), store(mx + kLanes, m1);
}

// Scores of one run's n rows (rounded up to 4: rows past n lie inside the block) in one column block,
// six rows at a time and the rest in fours (two-row steps would halve the FMA rate: too few chains).
template <int D, bool Masked>
inline void qk_run(const Run& run, int64_t d, const float* qt, int64_t ncp, float* s, float* mx,
                   const float* limit, int64_t key0) {
  const int64_t n4 = (run.n + 3) / 4 * 4;
  const int64_t fours = n4 % 6 == 2 ? 2 : n4 % 6 == 4 ? 1 : 0;
  const int64_t stride = dim<D>(d);
  int64_t r = 0;
  auto at = [&](int64_t row) { return static_cast<float>(key0 + row); };
  for (; r + 4 * fours < n4; r += 6)
    qk_micro<D, 6, Masked>(run.k + r * stride, d, qt, ncp, s + r * ncp, mx, limit, at(r), run.n - r);
  for (; r < n4; r += 4)
    qk_micro<D, 4, Masked>(run.k + r * stride, d, qt, ncp, s + r * ncp, mx, limit, at(r), run.n - r);
}

// Scores of a tile's runs (keys key0 ..) against every column, and the columns' maximum over them.
template <int D>
inline void qk_tile(const Run* runs, int64_t num_runs, int64_t d, const float* qt, int64_t ncp, float* s,
                    float* mx, const float* limit, int64_t key0, bool masked) {
  std::fill(mx, mx + ncp, kNegInf);
  for (int64_t c = 0; c < ncp; c += kColBlock) {
    int64_t off = 0;
    for (int64_t j = 0; j < num_runs; off += runs[j].n, ++j) {
      if (masked)
        qk_run<D, true>(runs[j], d, qt + c, ncp, s + off * ncp + c, mx + c, limit + c, key0 + off);
      else
        qk_run<D, false>(runs[j], d, qt + c, ncp, s + off * ncp + c, mx + c, limit + c, key0 + off);
    }
  }
}

// o[i, e0 + :NV vectors] = alpha[i] * o[i, ...] + sum over the tile's keys t of p[t, i] * v_t[e0 + ...]
// for R columns; the accumulators stay in registers across the tile's runs.
template <int D, int R, int NV>
inline void pv_micro(const float* p, int64_t ncp, const Run* runs, int64_t num_runs, int64_t d_, int64_t e0,
                     const float* alpha, float* o) {
  const int64_t d = dim<D>(d_);
  vf acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < NV; ++w) acc[i][w] = load(o + i * d + e0 + w * kLanes) * alpha[i];
  for (int64_t j = 0; j < num_runs; ++j) {
    const float* v = runs[j].v + e0;
    for (int64_t t = 0; t < runs[j].n; ++t, p += ncp) {
      vf b[NV];
      for (int w = 0; w < NV; ++w) b[w] = load(v + t * d + w * kLanes);
      for (int i = 0; i < R; ++i) {
        const float a = p[i];
        for (int w = 0; w < NV; ++w) acc[i][w] += a * b[w];
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < NV; ++w) store(o + i * d + e0 + w * kLanes, acc[i][w]);
}

template <int D, int R>
inline void pv_cols(const float* p, int64_t ncp, const Run* runs, int64_t num_runs, int64_t d,
                    const float* alpha, float* o) {
  int64_t e = 0;
  for (; e + 2 * kLanes <= d; e += 2 * kLanes) pv_micro<D, R, 2>(p, ncp, runs, num_runs, d, e, alpha, o);
  if (e < d) pv_micro<D, R, 1>(p, ncp, runs, num_runs, d, e, alpha, o);
}

// O[c, :] = alpha[c] O[c, :] + P[:, c]^T V for every column c < ncp (p: the tile's probabilities).
template <int D>
inline void pv_tile(const float* p, int64_t ncp, const Run* runs, int64_t num_runs, int64_t d,
                    const float* alpha, float* o) {
  int64_t c = 0;
  for (; c + 6 <= ncp; c += 6) pv_cols<D, 6>(p + c, ncp, runs, num_runs, d, alpha + c, o + c * d);
  for (; c + 4 <= ncp; c += 4) pv_cols<D, 4>(p + c, ncp, runs, num_runs, d, alpha + c, o + c * d);
  for (; c < ncp; c += 2) pv_cols<D, 2>(p + c, ncp, runs, num_runs, d, alpha + c, o + c * d);
}

template <typename T>
inline void prefetch_run(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 1);
}

// n rows of one (block, kv head) as float: float caches in place, others converted into buf.
template <typename T>
inline const float* rows_as_float(const T* rows, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(rows[i]);
  return buf;
}
template <>
inline const float* rows_as_float<float>(const float* rows, float*, int64_t) {
  return rows;
}

// Elements per cached row of head size d: int8 rows carry their float16 scale after the values.
template <typename C>
inline int64_t row_elems(int64_t d) {
  return std::is_same_v<C, int8_t> ? d + kInt8ScaleBytes : d;
}

// n cached rows of head size d as float (d values each): int8 rows times their scale, into buf.
inline const float* rows_as(const int8_t* rows, float* buf, int64_t n, int64_t d) {
  return dequantize_int8_rows(rows, buf, n, d);
}
template <typename C>
inline const float* rows_as(const C* rows, float* buf, int64_t n, int64_t d) {
  return rows_as_float(rows, buf, n * d);
}

struct Segment {
  int64_t row_start, num_rows, num_keys, first_limit;
};

struct Item {
  int64_t seg, kv_head, t0, nt, cost;
};

struct Shape {
  int64_t heads, kv_heads, d, tpb, max_blocks, group, tile_tokens, ncp, tile_blocks;
};

// Per-thread scratch: the packed queries, scores, output accumulators and softmax state of one item.
struct Scratch {
  std::vector<float> qt, s, o, m, l, mx, alpha, limit, kbuf, vbuf;
  std::vector<Run> runs;
  // The bf16 dot path's queries, probabilities and values, each in pairs, and the tile's K / V runs read in place
  // with their lengths (run_item_dot); empty elsewhere.
  std::vector<uint16_t> qtp, pp, vp;
  std::vector<const uint16_t*> kr, vr;
  std::vector<int64_t> nr;
  Scratch(const Shape& sh, bool dot)
      : qt(sh.d * sh.ncp), s(sh.tile_blocks * sh.tpb * sh.ncp), o(sh.ncp * sh.d), m(sh.ncp), l(sh.ncp),
        mx(sh.ncp), alpha(sh.ncp), limit(sh.ncp), kbuf(sh.tile_blocks * sh.tpb * sh.d),
        vbuf(sh.tile_blocks * sh.tpb * sh.d), runs(sh.tile_blocks), qtp(dot ? sh.d * sh.ncp : 0),
        pp(dot ? (sh.tile_blocks * sh.tpb + 2) * sh.ncp : 0), vp(dot ? (sh.tile_blocks * sh.tpb + 2) * sh.d : 0),
        kr(dot ? sh.tile_blocks : 0), vr(dot ? sh.tile_blocks : 0), nr(dot ? sh.tile_blocks : 0) {}
};

// Online softmax over the tile's nk score rows, given the columns' maximum over them (st.mx): scores
// become probabilities under the new running max; st.alpha gets each column's rescale factor.
inline void softmax_tile(Scratch& st, int64_t nk, int64_t ncp) {
  for (int64_t c = 0; c < ncp; c += kLanes) {
    float* s = st.s.data() + c;
    const vf m_old = load(st.m.data() + c);
    const vf m_new = vmax(m_old, load(st.mx.data() + c));
    const vf base = m_new == vf{} + kNegInf ? vf{} : m_new;  // a column with nothing visible yet stays empty
    vf sum = {};
    for (int64_t r = 0; r < nk; ++r) {
      const vf p = exp_or_zero(load(s + r * ncp) - base);
      store(s + r * ncp, p);
      sum += p;
    }
    const vf alpha = exp_or_zero(m_old - base);
    store(st.alpha.data() + c, alpha);
    store(st.l.data() + c, load(st.l.data() + c) * alpha + sum);
    store(st.m.data() + c, m_new);
  }
}

// T: the queries' and output's dtype; C: the cache's element type (T, or int8_t for int8 rows).
template <typename T, typename C = T>
struct Inputs {
  const T* q;
  const C* k;
  const C* v;
  const int32_t* tables;
  const Segment* segs;
  T* out;
  float* lse;
  float scale;
};

template <typename T, typename C>
void pack_queries(const Inputs<T, C>& in, const Shape& sh, const Segment& sg, const Item& it, Scratch& st) {
  const int64_t d = sh.d, g = sh.group, ncp = sh.ncp, cols = it.nt * g;
  std::fill(st.qt.begin(), st.qt.end(), 0.f);
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t t = c / g, h = it.kv_head * g + c % g;
    const T* src = in.q + ((sg.row_start + it.t0 + t) * sh.heads + h) * d;
    for (int64_t e = 0; e < d; ++e) st.qt[e * ncp + c] = static_cast<float>(src[e]) * in.scale;
    st.limit[c] = static_cast<float>(std::min(sg.num_keys, sg.first_limit + it.t0 + t));
  }
  for (int64_t c = cols; c < ncp; ++c) st.limit[c] = static_cast<float>(sg.num_keys);  // padding: never masked
  std::fill(st.o.begin(), st.o.end(), 0.f);
  std::fill(st.m.begin(), st.m.end(), kNegInf);
  std::fill(st.l.begin(), st.l.end(), 0.f);
}

template <typename T, typename C>
void write_item(const Inputs<T, C>& in, const Shape& sh, const Segment& sg, const Item& it, const Scratch& st) {
  const int64_t d = sh.d, g = sh.group;
  for (int64_t c = 0; c < it.nt * g; ++c) {
    const int64_t row = sg.row_start + it.t0 + c / g, h = it.kv_head * g + c % g;
    const float l = st.l[c], inv = l > 0.f ? 1.f / l : 0.f;
    T* dst = in.out + (row * sh.heads + h) * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(st.o[c * d + e] * inv);
    in.lse[row * sh.heads + h] = l > 0.f ? st.m[c] + std::log(l) : kNegInf;
  }
}

// The tile's runs: blocks b0 .. of the segment's table holding keys [b0 * tpb, b0 * tpb + nk).
template <typename T, typename C>
int64_t tile_runs(const Inputs<T, C>& in, const Shape& sh, const int32_t* table, int64_t kv_head, int64_t b0,
                  int64_t nk, Scratch& st) {
  const int64_t d = sh.d, tpb = sh.tpb, num_runs = (nk + tpb - 1) / tpb, rs = row_elems<C>(d);
  for (int64_t j = 0; j < num_runs; ++j) {
    const int64_t base = (static_cast<int64_t>(table[b0 + j]) * sh.kv_heads + kv_head) * tpb * rs;
    const int64_t n = std::min(tpb, nk - j * tpb), n4 = (n + 3) / 4 * 4;
    st.runs[j] = {rows_as(in.k + base, st.kbuf.data() + j * tpb * d, n4, d),
                  rows_as(in.v + base, st.vbuf.data() + j * tpb * d, n, d), n};
  }
  return num_runs;
}

template <int D, typename T, typename C>
void run_item(const Inputs<T, C>& in, const Shape& sh, const Item& it, Scratch& st) {
  const Segment& sg = in.segs[it.seg];
  const int64_t d = sh.d, tpb = sh.tpb, ncp = sh.ncp, tile = sh.tile_blocks * tpb, rs = row_elems<C>(d);
  pack_queries(in, sh, sg, it, st);
  const int64_t last = std::min(sg.num_keys, sg.first_limit + it.t0 + it.nt - 1);  // keys the last row sees
  const int64_t first = std::min(sg.num_keys, sg.first_limit + it.t0);             // keys the first row sees
  const int32_t* table = in.tables + it.seg * sh.max_blocks;
  for (int64_t k0 = 0; k0 < last; k0 += tile) {
    const int64_t nk = std::min(tile, last - k0);
    for (int64_t b = (k0 + tile) / tpb; b < (k0 + 2 * tile) / tpb && b * tpb < last; ++b) {
      const int64_t base = (static_cast<int64_t>(table[b]) * sh.kv_heads + it.kv_head) * tpb * rs;
      prefetch_run(in.k + base, tpb * rs);
      prefetch_run(in.v + base, tpb * rs);
    }
    const int64_t num_runs = tile_runs(in, sh, table, it.kv_head, k0 / tpb, nk, st);
    qk_tile<D>(st.runs.data(), num_runs, d, st.qt.data(), ncp, st.s.data(), st.mx.data(), st.limit.data(), k0,
               k0 + nk > first);
    softmax_tile(st, nk, ncp);
    pv_tile<D>(st.s.data(), ncp, st.runs.data(), num_runs, d, st.alpha.data(), st.o.data());
  }
  write_item(in, sh, sg, it, st);
}

#if TRTPROMPT_BF16_DOT
// bfloat16 queries over bfloat16 caches on avx512_bf16's dot product (vdpbf16ps: 16 float32 sums, each += two bf16
// products), where the CPU has it. S = K Qt takes pairs of input columns: a key row's (e, e + 1) broadcast against
// the queries packed as [d / 2][columns][2] (their bf16 values as they came; the scale multiplies the float32
// score), the K rows read in place. The softmax stays float32; P is rounded to bf16 (as torch's CPU flash attention
// does for bf16) and packed as [keys / 2][columns][2], V as [keys / 2][d][2] (a tile's odd last key pairs with a zero
// row), so O += P^T V takes pairs of keys. Measured: docs/attention.md, "Prefill on bf16 dot products".
TRTPROMPT_BF16_DOT_BEGIN
using trtprompt_bf16_dot::pair_at;
using trtprompt_bf16_dot::pairs_at;

template <typename T, typename C>
void pack_queries_dot(const Inputs<T, C>& in, const Shape& sh, const Segment& sg, const Item& it, Scratch& st) {
  const int64_t d = sh.d, g = sh.group, ncp = sh.ncp, cols = it.nt * g;
  std::fill(st.qtp.begin(), st.qtp.end(), uint16_t{0});
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t t = c / g, h = it.kv_head * g + c % g;
    const auto* src = reinterpret_cast<const uint16_t*>(in.q + ((sg.row_start + it.t0 + t) * sh.heads + h) * d);
    for (int64_t e = 0; e < d; ++e) st.qtp[((e / 2) * ncp + c) * 2 + e % 2] = src[e];
    st.limit[c] = static_cast<float>(std::min(sg.num_keys, sg.first_limit + it.t0 + t));
  }
  for (int64_t c = cols; c < ncp; ++c) st.limit[c] = static_cast<float>(sg.num_keys);  // padding: never masked
  std::fill(st.o.begin(), st.o.end(), 0.f);
  std::fill(st.m.begin(), st.m.end(), kNegInf);
  std::fill(st.l.begin(), st.l.end(), 0.f);
}

// qk_micro on pairs: R key rows (bf16, in place) against one column block of 32 (qtp at the block's first column).
template <int D, int R, bool Masked>
inline void qk_micro_dot(const uint16_t* k, int64_t d_, const uint16_t* qtp, int64_t ncp, float* s, float* mx,
                         const float* limit, float key0, int64_t valid, float scale) {
  const int64_t d = dim<D>(d_);
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = _mm512_setzero_ps(), acc[i][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t e = 0; e < d; e += 2) {
    const __m512bh b0 = pairs_at(qtp + e * ncp), b1 = pairs_at(qtp + e * ncp + 2 * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512bh a = pair_at(k + i * d + e);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
  asm volatile("" ::: "memory");  // as qk_micro: keeps the maxima out of the loop's registers
  vf m0 = load(mx), m1 = load(mx + kLanes);
  const vf inf = vf{} + kNegInf;
  for (int i = 0; i < R; ++i) {
    vf a0 = (vf)acc[i][0] * scale, a1 = (vf)acc[i][1] * scale;
    if (Masked) {
      const vf key = vf{} + (key0 + static_cast<float>(i));
      a0 = key >= load(limit) ? inf : a0;
      a1 = key >= load(limit + kLanes) ? inf : a1;
    }
    if (i < valid) m0 = vmax(m0, a0), m1 = vmax(m1, a1);
    store(s + i * ncp, a0);
    store(s + i * ncp + kLanes, a1);
  }
  store(mx, m0), store(mx + kLanes, m1);
}

template <int D, bool Masked>
inline void qk_run_dot(const uint16_t* k, int64_t n, int64_t d, const uint16_t* qtp, int64_t ncp, float* s,
                       float* mx, const float* limit, int64_t key0, float scale) {
  const int64_t n4 = (n + 3) / 4 * 4;
  const int64_t fours = n4 % 6 == 2 ? 2 : n4 % 6 == 4 ? 1 : 0;
  const int64_t stride = dim<D>(d);
  int64_t r = 0;
  auto at = [&](int64_t row) { return static_cast<float>(key0 + row); };
  for (; r + 4 * fours < n4; r += 6)
    qk_micro_dot<D, 6, Masked>(k + r * stride, d, qtp, ncp, s + r * ncp, mx, limit, at(r), n - r, scale);
  for (; r < n4; r += 4)
    qk_micro_dot<D, 4, Masked>(k + r * stride, d, qtp, ncp, s + r * ncp, mx, limit, at(r), n - r, scale);
}

// P (float32 [nk][ncp], the softmax's output) as bf16 pairs of keys [nk / 2][ncp][2], a zero key past an odd nk.
inline void p_pairs(const float* s, int64_t nk, int64_t ncp, uint16_t* pp) {
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t = 0; t < nk; t += 2)
    for (int64_t c = 0; c < ncp; c += kLanes) {
      const __m512 lo = _mm512_loadu_ps(s + t * ncp + c);
      const __m512 hi = t + 1 < nk ? _mm512_loadu_ps(s + (t + 1) * ncp + c) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // [key t's 16 | key t + 1's 16]
      _mm512_storeu_si512(pp + ((t / 2) * ncp + c) * 2, _mm512_permutexvar_epi16(inter, both));
    }
}

// The tile's V rows (bf16, in place, runs of whole blocks but the last) as pairs of keys [keys / 2][d][2].
inline void v_pairs(const uint16_t* const* v, const int64_t* n, int64_t num_runs, int64_t d, uint16_t* vp) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                          6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  int64_t off = 0;  // keys before this run: even (whole blocks of a multiple of 4 tokens)
  for (int64_t j = 0; j < num_runs; off += n[j], ++j)
    for (int64_t t = 0; t < n[j]; t += 2)
      for (int64_t c = 0; c < d; c += 32) {
        const __m512i a = _mm512_loadu_si512(v[j] + t * d + c);
        const __m512i b = t + 1 < n[j] ? _mm512_loadu_si512(v[j] + (t + 1) * d + c) : _mm512_setzero_si512();
        uint16_t* dst = vp + (((off + t) / 2) * d + c) * 2;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
}

// O[c, e0 + :NV vectors] = alpha[c] O[c, ...] + sum over key pairs of P[.., c] V[.., e0 + ...] for R columns.
template <int D, int R, int NV>
inline void pv_micro_dot(const uint16_t* pp, int64_t ncp, const uint16_t* vp, int64_t pairs, int64_t d_, int64_t e0,
                         const float* alpha, float* o) {
  const int64_t d = dim<D>(d_);
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < NV; ++w) acc[i][w] = (__m512)(load(o + i * d + e0 + w * kLanes) * alpha[i]);
  for (int64_t t = 0; t < pairs; ++t) {
    __m512bh b[NV];
    for (int w = 0; w < NV; ++w) b[w] = pairs_at(vp + (t * d + e0 + w * kLanes) * 2);
    for (int i = 0; i < R; ++i) {
      const __m512bh a = pair_at(pp + (t * ncp + i) * 2);
      for (int w = 0; w < NV; ++w) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], a, b[w]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < NV; ++w) store(o + i * d + e0 + w * kLanes, (vf)acc[i][w]);
}

template <int D, int R>
inline void pv_cols_dot(const uint16_t* pp, int64_t ncp, const uint16_t* vp, int64_t pairs, int64_t d,
                        const float* alpha, float* o) {
  int64_t e = 0;
  for (; e + 4 * kLanes <= d; e += 4 * kLanes) pv_micro_dot<D, R, 4>(pp, ncp, vp, pairs, d, e, alpha, o);
  for (; e < d; e += kLanes) pv_micro_dot<D, R, 1>(pp, ncp, vp, pairs, d, e, alpha, o);
}

template <int D>
inline void pv_tile_dot(const uint16_t* pp, int64_t ncp, const uint16_t* vp, int64_t pairs, int64_t d,
                        const float* alpha, float* o) {
  int64_t c = 0;
  for (; c + 6 <= ncp; c += 6) pv_cols_dot<D, 6>(pp + c * 2, ncp, vp, pairs, d, alpha + c, o + c * d);
  for (; c + 4 <= ncp; c += 4) pv_cols_dot<D, 4>(pp + c * 2, ncp, vp, pairs, d, alpha + c, o + c * d);
  for (; c < ncp; c += 2) pv_cols_dot<D, 2>(pp + c * 2, ncp, vp, pairs, d, alpha + c, o + c * d);
}

template <int D, typename T, typename C>
void run_item_dot(const Inputs<T, C>& in, const Shape& sh, const Item& it, Scratch& st) {
  const Segment& sg = in.segs[it.seg];
  const int64_t d = sh.d, tpb = sh.tpb, ncp = sh.ncp, tile = sh.tile_blocks * tpb;
  pack_queries_dot(in, sh, sg, it, st);
  const int64_t last = std::min(sg.num_keys, sg.first_limit + it.t0 + it.nt - 1);  // keys the last row sees
  const int64_t first = std::min(sg.num_keys, sg.first_limit + it.t0);             // keys the first row sees
  const int32_t* table = in.tables + it.seg * sh.max_blocks;
  const auto* kc = reinterpret_cast<const uint16_t*>(in.k);
  const auto* vc = reinterpret_cast<const uint16_t*>(in.v);
  for (int64_t k0 = 0; k0 < last; k0 += tile) {
    const int64_t nk = std::min(tile, last - k0);
    for (int64_t b = (k0 + tile) / tpb; b < (k0 + 2 * tile) / tpb && b * tpb < last; ++b) {
      const int64_t base = (static_cast<int64_t>(table[b]) * sh.kv_heads + it.kv_head) * tpb * d;
      prefetch_run(kc + base, tpb * d);
      prefetch_run(vc + base, tpb * d);
    }
    const int64_t num_runs = (nk + tpb - 1) / tpb;
    for (int64_t j = 0; j < num_runs; ++j) {
      const int64_t base = (static_cast<int64_t>(table[k0 / tpb + j]) * sh.kv_heads + it.kv_head) * tpb * d;
      st.kr[j] = kc + base, st.vr[j] = vc + base, st.nr[j] = std::min(tpb, nk - j * tpb);
    }
    std::fill(st.mx.begin(), st.mx.end(), kNegInf);
    for (int64_t c = 0; c < ncp; c += kColBlock)
      for (int64_t j = 0, off = 0; j < num_runs; off += st.nr[j], ++j) {
        if (k0 + nk > first)
          qk_run_dot<D, true>(st.kr[j], st.nr[j], d, st.qtp.data() + c * 2, ncp, st.s.data() + off * ncp + c,
                              st.mx.data() + c, st.limit.data() + c, k0 + off, in.scale);
        else
          qk_run_dot<D, false>(st.kr[j], st.nr[j], d, st.qtp.data() + c * 2, ncp, st.s.data() + off * ncp + c,
                               st.mx.data() + c, st.limit.data() + c, k0 + off, in.scale);
      }
    softmax_tile(st, nk, ncp);
    p_pairs(st.s.data(), nk, ncp, st.pp.data());
    v_pairs(st.vr.data(), st.nr.data(), num_runs, d, st.vp.data());
    pv_tile_dot<D>(st.pp.data(), ncp, st.vp.data(), (nk + 1) / 2, d, st.alpha.data(), st.o.data());
  }
  write_item(in, sh, sg, it, st);
}

TRTPROMPT_BF16_DOT_END
#endif  // TRTPROMPT_BF16_DOT

std::vector<Item> make_items(const std::vector<Segment>& segs, const Shape& sh) {
  std::vector<Item> items;
  for (int64_t s = 0; s < static_cast<int64_t>(segs.size()); ++s) {
    const Segment& sg = segs[s];
    for (int64_t t0 = 0; t0 < sg.num_rows; t0 += sh.tile_tokens) {
      const int64_t nt = std::min(sh.tile_tokens, sg.num_rows - t0);
      const int64_t keys = std::min(sg.num_keys, sg.first_limit + t0 + nt / 2);
      for (int64_t kh = 0; kh < sh.kv_heads; ++kh) items.push_back({s, kh, t0, nt, nt * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename T, typename C>
void prefill_all(const Inputs<T, C>& in, const Shape& sh, const std::vector<Item>& items) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  bool dot = false;  // bf16 queries over a bf16 cache on the CPU's bf16 dot product
#if TRTPROMPT_BF16_DOT
  dot = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> &&
        trtprompt_bf16_dot::attention_runs(sh.d);
#endif
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch st(sh, dot);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
#if TRTPROMPT_BF16_DOT
        if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
          if (dot) {
            if (sh.d == 64)
              run_item_dot<64, T, C>(in, sh, items[i], st);
            else if (sh.d == 128)
              run_item_dot<128, T, C>(in, sh, items[i], st);
            else
              run_item_dot<0, T, C>(in, sh, items[i], st);
            continue;
          }
        }
#endif
        if (sh.d == 64)
          run_item<64, T, C>(in, sh, items[i], st);
        else if (sh.d == 128)
          run_item<128, T, C>(in, sh, items[i], st);
        else
          run_item<0, T, C>(in, sh, items[i], st);
      }
    }
  });
}

void check_indices(const char* op, const at::Tensor& tables, const at::Tensor& segments) {
  TORCH_CHECK(tables.scalar_type() == at::kInt && segments.scalar_type() == at::kLong, op,
              ": block_tables must be int32 and segments int64");
  TORCH_CHECK(tables.dim() == 2 && segments.dim() == 2 && segments.size(1) == 4 &&
                  segments.size(0) == tables.size(0),
              op, ": segments must be [S, 4] (row_start, num_rows, num_keys, first_limit), one per block-table row");
  TORCH_CHECK(tables.is_contiguous() && segments.is_contiguous(), op, ": inputs must be contiguous");
}

// q [T, H, D] against int8 caches [blocks, kv_heads, tokens_per_block, D + 2] (D values, then the scale).
void check_int8_caches(const char* op, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && vc.sizes() == kc.sizes(), op,
              ": q must be [T, H, D] and the caches [blocks, kv_heads, tokens_per_block, D + 2]");
  TORCH_CHECK(kc.scalar_type() == at::kChar && vc.scalar_type() == at::kChar, op, ": the caches must be int8");
  TORCH_CHECK(kc.size(3) == q.size(2) + kInt8ScaleBytes && q.size(1) % kc.size(1) == 0, op,
              ": cache rows must be D + 2 bytes and heads a multiple of kv_heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && kc.size(2) % 4 == 0, op, ": head_size must be a multiple of ", kLanes,
              " (this kernel variant's vector width) and tokens_per_block of 4");
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), op, ": inputs must be contiguous");
}

std::vector<Segment> read_segments(const char* op, const at::Tensor& segments, const at::Tensor& tables,
                                   int64_t rows, int64_t tpb) {
  std::vector<Segment> segs(segments.size(0));
  const int64_t* p = segments.data_ptr<int64_t>();
  for (size_t s = 0; s < segs.size(); ++s) {
    segs[s] = {p[4 * s], p[4 * s + 1], p[4 * s + 2], p[4 * s + 3]};
    const Segment& sg = segs[s];
    TORCH_CHECK(sg.row_start >= 0 && sg.num_rows >= 0 && sg.row_start + sg.num_rows <= rows,
                op, ": segment ", s, " rows lie outside q");
    TORCH_CHECK(sg.num_keys >= 1 && sg.num_keys <= tables.size(1) * tpb && sg.first_limit >= 1,
                op, ": segment ", s, " needs 1 <= num_keys <= its blocks' tokens and first_limit >= 1");
  }
  return segs;
}

// The kernel over caches checked by the caller: of q's dtype T, or int8 rows (Int8Rows); q's dtype picks T.
template <bool Int8Rows>
std::tuple<at::Tensor, at::Tensor> prefill(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                                           const at::Tensor& segments, double scale) {
  check_indices(op, block_tables, segments);
  const int64_t tpb = k_cache.size(2), group = q.size(1) / k_cache.size(1);
  const int64_t tile_tokens = std::max<int64_t>(1, kColsTarget / group);
  const int64_t ncp = (tile_tokens * group + kColBlock - 1) / kColBlock * kColBlock;
  const Shape sh{q.size(1), k_cache.size(1), q.size(2), tpb, block_tables.size(1), group, tile_tokens, ncp,
                 std::max<int64_t>(1, kTileKeys / tpb)};
  const std::vector<Segment> segs = read_segments(op, segments, block_tables, q.size(0), tpb);
  const std::vector<Item> items = make_items(segs, sh);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  dispatch_float_types(q, op, [&](auto tag) {
    using T = decltype(tag);
    using Cache = std::conditional_t<Int8Rows, int8_t, T>;
    const Inputs<T, Cache> in{q.data_ptr<T>(), k_cache.data_ptr<Cache>(), v_cache.data_ptr<Cache>(),
                              block_tables.data_ptr<int32_t>(), segs.data(), out.data_ptr<T>(),
                              lse.data_ptr<float>(), static_cast<float>(scale)};
    prefill_all<T, Cache>(in, sh, items);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> paged_prefill(const at::Tensor& q, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                 const at::Tensor& segments, double scale) {
  check_query_and_caches("paged_prefill", "[T, H, D]", q, k_cache, v_cache);
  return prefill<false>("paged_prefill", q, k_cache, v_cache, block_tables, segments, scale);
}

// The same over int8 caches (kv_cache_dtype int8), read in place: a quarter of fp32's bytes per key.
std::tuple<at::Tensor, at::Tensor> paged_prefill_int8(const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                      const at::Tensor& segments, double scale) {
  check_int8_caches("paged_prefill_int8", q, k_cache, v_cache);
  return prefill<true>("paged_prefill_int8", q, k_cache, v_cache, block_tables, segments, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor segments, "
        "float scale) -> (Tensor, Tensor)");
  m.def("paged_prefill_int8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor segments, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_prefill_int8", &paged_prefill_int8);
}
