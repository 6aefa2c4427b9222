// y = x @ W^T on the vector FMA units over W packed once into panels of kPanel = 2 x kLanes output columns,
// [N / kPanel, K, kPanel]: on AVX2 every call of a float32 layer linear (one row to a prefill chunk), lm_head's
// calls of a few dozen rows, and int8_wo's of 2-256 rows (engine/panel_linear.py has the bounds and why).
//
// A call streams the panels in memory order (the hardware prefetchers follow one stream per thread); each
// panel meets the rows of x in blocks of up to kBlockRows rows, the block's 2 x kBlockRows vector sums kept
// in registers: per column k, two weight vectors and one broadcast value of x per row, no horizontal sums.
// A panel is taken kChunk columns of K at a time, every block of rows reading that chunk from cache, and a
// thread runs kGroupBlocks blocks over all its panels before the next ones.
// Weight formats:
//   float32 [N / P, K, P]                    the float32 engine's weight
//   int8 [N / P, K, P] + float32 scale [N]   per output channel (int8_wo), widened to float32 per vector
//   int8 [N / P, K, P] + float32 scale [N / P, K / G, P]   a scale per group of G input columns (int8_wo with
//       int8_group_size), each widened weight vector times its group's scales (the sums need no per-group pass);
//       from kWidenRows rows a chunk is widened and scaled once for all blocks of rows (ChunkPanels)
//   bfloat16 [N / P, K / 2, P, 2]             input columns in pairs, on the bf16 dot product (bf16_panels.cpp;
//       the AVX-512 variant, bfloat16 x, no scale)
// x is float32 or bfloat16 [M, K]; y [M, N] in x's dtype, plus an optional float32 bias [N]. Design and
// figures: docs/design.md, "Panel linear".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16_panels.h"
#include "typed_vec.h"
#include "vec.h"
#include "widen.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using namespace trtprompt_vec;

constexpr int64_t kPanel = 2 * kLanes;
// Rows of x a register block holds: its 2 x kBlockRows sums, two weight vectors and a broadcast fit the
// variant's 16 (AVX2) or 32 (AVX-512) vector registers.
constexpr int kBlockRows = kLanes == 16 ? 12 : 6;

// A panel's weight vector (half 0 or 1 of its kPanel columns) at column k of K, as float32 (before a grouped
// format's scales: kGrouped formats give them per group, scale()).
struct F32Panels {
  const float* w;
  int64_t k_dim;
  vf at(int64_t p, int64_t k, int half) const { return load(w + (p * k_dim + k) * kPanel + half * kLanes); }
  static constexpr int kRows = kBlockRows;
  static constexpr bool kGrouped = false;
};

// One row fewer a block: with six rows GCC kept the int8 block's sums on the stack in its loop (one more register
// than it would spare), which ran 32 rows at 1.4x and 64 rows at 2x the float32 block's time.
struct Int8Panels {
  const int8_t* w;
  int64_t k_dim;
  vf at(int64_t p, int64_t k, int half) const {
    return __builtin_convertvector(widen_s8(w + (p * k_dim + k) * kPanel + half * kLanes), vf);
  }
  static constexpr int kRows = kBlockRows - 1;
  static constexpr bool kGrouped = false;
};

// Grouped scales, packed into panels as the weight is. A block loads a group's two scale vectors once and
// multiplies each widened weight vector by them: 5 rows' sums, two weights, two scales and a broadcast fill
// AVX2's 16 registers. (Loading the scale at every k, as a memory operand, ran SmolLM2's linears at 1.2x the
// per-row format's time at 32 rows.)
template <int64_t G>
struct Int8GroupPanels {
  const int8_t* w;
  const float* scales;  // [N / P, K / G, P]
  int64_t k_dim;
  vf at(int64_t p, int64_t k, int half) const {
    return __builtin_convertvector(widen_s8(w + (p * k_dim + k) * kPanel + half * kLanes), vf);
  }
  vf scale(int64_t p, int64_t k, int half) const {
    return load(scales + (p * (k_dim / G) + k / G) * kPanel + half * kLanes);
  }
  static constexpr int kRows = kBlockRows - 1;
  static constexpr bool kGrouped = true;
  static constexpr int64_t group = G;  // a constant: the group's loop unrolls whole
};

// Where a block's sums go: out [M, N] in T, times the int8 scale and plus the bias where there are.
template <typename T>
struct Output {
  T* out;
  int64_t n_dim;
  const float* scale;
  const float* bias;
  void put(int64_t row, int64_t col, vf sum) const {
    if (scale != nullptr) sum *= load(scale + col);
    if (bias != nullptr) sum += load(bias + col);
    store_as(out + row * n_dim + col, sum);
  }
};

// Columns of K a pass over a panel takes: the chunk (16 KB of float32 weight on AVX2) stays in cache while every
// block of rows reads it. On SmolLM2's layer linears 256 was at or ahead of whole panels, 128 and 64 behind.
constexpr int64_t kChunk = 256;

// Independent sums a one-row block keeps per weight vector: one row streams W from memory, and with a single
// chain per vector the FMA latency (4 cycles) capped a core at one weight line per 4 cycles, so it could not
// catch up after a stall. Four chains read SmolLM2's 120 layer linears and lm_head at one row in 0.94x the time
// (2-core Zen 3, docs/design.md "Panel linear").
constexpr int kOneRowChains = 4;
static_assert(kOneRowChains == 4, "one_row_sums adds its chains up as two pairs");

// Sums of one row of x times columns [k0, k1) of panel p (a format without per-group scales), kOneRowChains
// interleaved chains added up at the end: into acc0 / acc1, which hold the sums so far.
template <typename W>
void one_row_sums(const float* xr, const W& w, int64_t p, int64_t k0, int64_t k1, vf& acc0, vf& acc1) {
  vf a0[kOneRowChains] = {}, a1[kOneRowChains] = {};
  int64_t k = k0;
  for (; k + kOneRowChains <= k1; k += kOneRowChains) {
#pragma GCC unroll 4
    for (int j = 0; j < kOneRowChains; ++j) {
      const vf xb = splat(xr[k + j]);
      a0[j] += xb * w.at(p, k + j, 0);
      a1[j] += xb * w.at(p, k + j, 1);
    }
  }
  for (; k < k1; ++k) {
    const vf xb = splat(xr[k]);
    a0[0] += xb * w.at(p, k, 0);
    a1[0] += xb * w.at(p, k, 1);
  }
  acc0 += (a0[0] + a0[1]) + (a0[2] + a0[3]);
  acc1 += (a1[0] + a1[1]) + (a1[2] + a1[3]);
}

// Partial sums of rows [r0, r0 + MR) of x (float32 [M, K]) times columns [k0, k1) of panel p, kept in sums
// ([M, kPanel] floats) between chunks; the last chunk writes them to out's columns of the panel.
template <int MR, typename W, typename T>
void block(const float* x, int64_t k_dim, const W& w, int64_t p, int64_t r0, int64_t k0, int64_t k1, float* sums,
           const Output<T>& out) {
  vf acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) {
    acc0[r] = k0 == 0 ? vf{} : load(sums + (r0 + r) * kPanel);
    acc1[r] = k0 == 0 ? vf{} : load(sums + (r0 + r) * kPanel + kLanes);
  }
  const float* xr = x + r0 * k_dim;
  if constexpr (MR == 1 && !W::kGrouped) {
    one_row_sums(xr, w, p, k0, k1, acc0[0], acc1[0]);
  } else {
    int64_t span = k1 - k0;  // columns between scale changes (a chunk is whole groups)
    if constexpr (W::kGrouped) span = W::group;
    for (int64_t g0 = k0; g0 < k1; g0 += span) {
      vf s0{}, s1{};
      if constexpr (W::kGrouped) s0 = w.scale(p, g0, 0), s1 = w.scale(p, g0, 1);
      for (int64_t k = g0; k < g0 + span; ++k) {
        vf w0 = w.at(p, k, 0), w1 = w.at(p, k, 1);
        if constexpr (W::kGrouped) w0 *= s0, w1 *= s1;
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
          const vf xb = splat(xr[r * k_dim + k]);
          acc0[r] += xb * w0;
          acc1[r] += xb * w1;
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (k1 < k_dim) {
      store(sums + (r0 + r) * kPanel, acc0[r]);
      store(sums + (r0 + r) * kPanel + kLanes, acc1[r]);
    } else {
      out.put(r0 + r, p * kPanel, acc0[r]);
      out.put(r0 + r, p * kPanel + kLanes, acc1[r]);
    }
  }
}

template <typename W, typename T>
void block_of(int rows, const float* x, int64_t k_dim, const W& w, int64_t p, int64_t r0, int64_t k0, int64_t k1,
              float* sums, const Output<T>& out) {
  switch (rows) {
    case 1: return block<1>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 2: return block<2>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 3: return block<3>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 4: return block<4>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 5: return block<5>(x, k_dim, w, p, r0, k0, k1, sums, out);
#if TRTPROMPT_LANES == 16
    case 6: return block<6>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 7: return block<7>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 8: return block<8>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 9: return block<9>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 10: return block<10>(x, k_dim, w, p, r0, k0, k1, sums, out);
    case 11: return block<11>(x, k_dim, w, p, r0, k0, k1, sums, out);
#endif
    default: return block<W::kRows>(x, k_dim, w, p, r0, k0, k1, sums, out);
  }
}

// Blocks of rows a thread runs over all its panels before the next ones: their rows of x (48 on AVX2: 110 KB of
// a 576-wide x) stay in L2 while the panels stream past. On SmolLM2's layer linears at 512 and 2,048 rows, 8
// blocks ran at 142-180 GFLOP/s against 150-170 for 4, 12 or all of them (a noisy host: within ~10 %).
constexpr int64_t kGroupBlocks = 8;

// One K chunk of one panel as float32 [k1 - k0, kPanel], widened from grouped int8 and times its groups' scales
// once for every block of the group: the blocks then run the float32 register block, one row more than int8's and no
// widening or scaling per block. Each float is the value the int8 block would compute, summed in the same order:
// the results are equal bit for bit.
struct ChunkPanels {
  const float* buf;
  int64_t k0;
  vf at(int64_t, int64_t k, int half) const { return load(buf + (k - k0) * kPanel + half * kLanes); }
  static constexpr int kRows = kBlockRows;
  static constexpr bool kGrouped = false;
};

template <typename W>
ChunkPanels widen_chunk(const W& w, int64_t p, int64_t k0, int64_t k1, float* buf) {
  static_assert(W::kGrouped, "a chunk is widened for grouped int8 formats only");
  for (int64_t g0 = k0; g0 < k1; g0 += W::group) {
    const vf s0 = w.scale(p, g0, 0), s1 = w.scale(p, g0, 1);
    for (int64_t k = g0; k < g0 + W::group; ++k) {
      store(buf + (k - k0) * kPanel, w.at(p, k, 0) * s0);
      store(buf + (k - k0) * kPanel + kLanes, w.at(p, k, 1) * s1);
    }
  }
  return ChunkPanels{buf, k0};
}

// Every panel against every block of rows, a K chunk at a time, a group of blocks at a time; the M rows split
// into blocks of near-equal size (32 rows on AVX2: 6, 6, 5, 5, 5, 5), since a block of one or two rows holds too
// few sums to keep the FMA units busy. B is the format the blocks read: W itself, or ChunkPanels widened from
// it a chunk at a time (grouped int8).
template <typename B, typename W, typename T>
void panels_times_rows(const float* x, int64_t m, int64_t k_dim, const W& w, int64_t panels, const Output<T>& out) {
  const int64_t blocks = (m + B::kRows - 1) / B::kRows, small = m / blocks, larger = m % blocks;
  // Block b: the first `larger` blocks hold small + 1 rows, the rest small.
  auto first_row = [&](int64_t b) { return b * small + std::min(b, larger); };
  // One block of rows reuses no chunk: it takes the panel's K whole (a pass per chunk cost a one-row call ~5 %).
  const int64_t chunk_cols = blocks == 1 && std::is_same_v<B, W> ? k_dim : kChunk;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> sums(m * kPanel), chunk(std::is_same_v<B, W> ? 0 : kChunk * kPanel);
    for (int64_t g0 = 0; g0 < blocks; g0 += kGroupBlocks) {
      const int64_t g1 = std::min(blocks, g0 + kGroupBlocks);
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t k0 = 0; k0 < k_dim; k0 += chunk_cols) {
          const int64_t k1 = std::min(k_dim, k0 + chunk_cols);
          const B read = [&]() -> B {
            if constexpr (std::is_same_v<B, W>) return w;
            else return widen_chunk(w, p, k0, k1, chunk.data());
          }();
          for (int64_t b = g0; b < g1; ++b) {
            const int rows = static_cast<int>(first_row(b + 1) - first_row(b));
            block_of(rows, x, k_dim, read, p, first_row(b), k0, k1, sums.data(), out);
          }
        }
      }
    }
  });
}

// Rows from which a grouped int8 call widens each chunk once for all its blocks (ChunkPanels) instead of in every
// block. Measured in one process on a 2-core AVX2 EPYC (docs/design.md, "Panel linear"): SmolLM2's layer linears in
// groups of 32 at 12 / 24 / 32 / 256 rows took 0.97 / 0.90 / 0.87 / 0.84x the time of widening in every block, at
// the float32 panel's rate from 24 rows. A scale per output column gains nothing (its block does not scale per
// group; 0.95-1.14x), so that format keeps widening in the block.
constexpr int64_t kWidenRows = 12;

template <typename W, typename T>
void grouped_panels_times_rows(const float* x, int64_t m, int64_t k_dim, const W& w, int64_t panels,
                               const Output<T>& out) {
  if (m >= kWidenRows)
    panels_times_rows<ChunkPanels>(x, m, k_dim, w, panels, out);
  else
    panels_times_rows<W>(x, m, k_dim, w, panels, out);
}

// group: input columns per int8 scale (0: a scale per output column, or a float32 weight).
template <typename T>
void run(const float* x, const at::Tensor& panels, const float* scale, const float* bias, int64_t group,
         at::Tensor& y) {
  const int64_t m = y.size(0), n_dim = y.size(1), k_dim = panels.size(1), count = panels.size(0);
  if (group > 0) {
    const Output<T> out{y.data_ptr<T>(), n_dim, nullptr, bias};
    const int8_t* w = panels.data_ptr<int8_t>();
    switch (group) {
      case 32: return grouped_panels_times_rows(x, m, k_dim, Int8GroupPanels<32>{w, scale, k_dim}, count, out);
      case 64: return grouped_panels_times_rows(x, m, k_dim, Int8GroupPanels<64>{w, scale, k_dim}, count, out);
      default: return grouped_panels_times_rows(x, m, k_dim, Int8GroupPanels<128>{w, scale, k_dim}, count, out);
    }
  }
  const Output<T> out{y.data_ptr<T>(), n_dim, scale, bias};
  if (panels.scalar_type() == at::kChar)
    panels_times_rows<Int8Panels>(x, m, k_dim, Int8Panels{panels.data_ptr<int8_t>(), k_dim}, count, out);
  else
    panels_times_rows<F32Panels>(x, m, k_dim, F32Panels{panels.data_ptr<float>(), k_dim}, count, out);
}

// The int8 scale's columns per group: 0 for a scale per output column, else G (the scale [N / P, K / G, P]).
int64_t check_inputs(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "panel_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "panel_linear: x must be float32 or bfloat16");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel,
              "panel_linear: the weight must be contiguous panels [N / ", kPanel, ", K, ", kPanel, "]");
  TORCH_CHECK(panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kChar,
              "panel_linear: the weight must be float32 or int8");
  TORCH_CHECK(x.size(1) == panels.size(1), "panel_linear: x has ", x.size(1), " columns, the weight ", panels.size(1));
  const int64_t n_dim = panels.size(0) * kPanel, k_dim = panels.size(1);
  const bool int8 = panels.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == scale.has_value(), "panel_linear: an int8 weight needs its scale, a float32 one has none");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == n_dim),
              "panel_linear: the bias must be contiguous float32 [N]");
  if (!int8) return 0;
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous(),
              "panel_linear: the scale must be contiguous float32");
  if (scale->dim() == 1) {
    TORCH_CHECK(scale->numel() == n_dim, "panel_linear: a scale per output column must be [N]");
    return 0;
  }
  TORCH_CHECK(scale->dim() == 3 && scale->size(0) == panels.size(0) && scale->size(2) == kPanel &&
                  scale->size(1) > 0 && k_dim % scale->size(1) == 0,
              "panel_linear: grouped scales must be panels [N / ", kPanel, ", K / G, ", kPanel, "]");
  const int64_t group = k_dim / scale->size(1);
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "panel_linear: the group (", group,
              ") must be 32, 64 or 128");
  return group;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& scale,
                        const c10::optional<at::Tensor>& bias) {
  if (panels.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!scale.has_value(), "panel_linear: bf16 panels take no scale");
    TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                      bias->numel() == panels.size(0) * panels.size(2)),
                "panel_linear: the bias must be contiguous float32 [N]");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "panel_linear: x must be a contiguous [M, K] tensor");
    return trtprompt_bf16_panels::linear(x, panels, bias.has_value() ? bias->data_ptr<float>() : nullptr);
  }
  const int64_t group = check_inputs(x, panels, scale, bias);
  at::Tensor y = at::empty({x.size(0), panels.size(0) * kPanel}, x.options());
  if (x.size(0) == 0) return y;
  std::vector<float> converted;
  const float* xf = nullptr;
  if (x.scalar_type() == at::kFloat) {
    xf = x.data_ptr<float>();
  } else {
    converted.resize(x.numel());
    rows_as_float(x.data_ptr<c10::BFloat16>(), x.size(1), x.size(0), x.size(1), converted.data());
    xf = converted.data();
  }
  const float* s = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (y.scalar_type() == at::kFloat)
    run<float>(xf, panels, s, b, group, y);
  else
    run<c10::BFloat16>(xf, panels, s, b, group, y);
  return y;
}

// Output columns per panel in this variant (pack_panels packs the weight for it).
int64_t panel_width() { return kPanel; }

// Whether this build runs bf16 panels (where the CPU has avx512_bf16: engine/panel_linear.py checks).
bool bf16_panels_compiled() { return trtprompt_bf16_panels::compiled(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("panel_width() -> int", &panel_width);
  m.def("bf16_panels_compiled() -> bool", &bf16_panels_compiled);
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("panel_linear", &panel_linear);
}
