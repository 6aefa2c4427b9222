// y = x @ W^T for bfloat16 x and W on the CPU's bf16 dot product (avx512_bf16's vdpbf16ps: 16 float32 sums, each
// += two bf16 products), over W packed once into panels of kPanel = 32 output columns holding input columns in
// pairs, [N / 32, K / 2, 32, 2]: one 64-byte load is the pairs (k, k + 1) of 16 columns, the operand the instruction
// takes. The float32 panel kernel (panel_linear.cpp) multiplies in float32 FMAs, half the bf16 dot product's rate;
// oneDNN's bf16 GEMM uses the same instruction but ran SmolLM2's layer linears at 32 rows in ~1.35x this kernel's
// time on a 2-core Zen 4 (docs/design.md, "bf16 panels"). The loops are the float32 kernel's: panels in memory
// order, blocks of up to 12 rows against a chunk of K kept in cache, groups of blocks whose rows of x stay in L2.
//
// Built only into the AVX-512 variant by a GCC that knows the instruction (the functions carry its target,
// so the rest of the library keeps the variant's flags); whether the CPU has it is the caller's check
// (engine/panel_linear.py). Elsewhere bf16_panels_compiled() is false and the entry refuses.
#include "bf16_panels.h"

#include "bf16_dot.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#if TRTPROMPT_BF16_DOT
#include <algorithm>
#include <cstring>
#include <vector>

TRTPROMPT_BF16_DOT_BEGIN
namespace {

using trtprompt_bf16_dot::pair_at;
using trtprompt_bf16_dot::pairs_at;

constexpr int64_t kPanel = 32;
constexpr int kBlockRows = 12;  // 2 x 12 sums, two weight vectors and a broadcast: 27 of 32 registers
// Input columns a pass over a panel takes, in pairs: 128 KB of panel, in L2 while every block of rows reads it.
// SmolLM2's K (576, 1,536) fits whole; chunks of 128 pairs (16 KB, for L1) ran its layer linears at 1.1-1.15x
// the time of whole panels at 32-2,048 rows, the partial sums' stores and loads between chunks included.
constexpr int64_t kChunkPairs = 1024;
constexpr int64_t kGroupBlocks = 8;  // 96 rows of x a group (110 KB at K = 576) stay in L2 as panels pass
constexpr int kOneRowChains = 4;      // one row: independent sums per weight vector, as the float32 kernel

inline __m512bh weights(const uint16_t* panel, int64_t kk, int half) {
  return pairs_at(panel + (kk * kPanel + half * 16) * 2);
}

// Where a block's sums go: y [M, N] bf16 (rounded to nearest even, as c10::BFloat16), plus the bias.
struct Output {
  c10::BFloat16* y;
  int64_t n_dim;
  const float* bias;
  void put(int64_t row, int64_t col, __m512 sum) const {
    if (bias != nullptr) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + col));
    const __m256bh h = _mm512_cvtneps_pbh(sum);
    std::memcpy(y + row * n_dim + col, &h, sizeof h);
  }
};

void one_row(const uint16_t* xr, const uint16_t* panel, int64_t kk0, int64_t kk1, __m512& acc0, __m512& acc1) {
  __m512 a0[kOneRowChains], a1[kOneRowChains];
  for (int j = 0; j < kOneRowChains; ++j) a0[j] = _mm512_setzero_ps(), a1[j] = _mm512_setzero_ps();
  int64_t kk = kk0;
  for (; kk + kOneRowChains <= kk1; kk += kOneRowChains) {
#pragma GCC unroll 4
    for (int j = 0; j < kOneRowChains; ++j) {
      const __m512bh xb = pair_at(xr + 2 * (kk + j));
      a0[j] = _mm512_dpbf16_ps(a0[j], xb, weights(panel, kk + j, 0));
      a1[j] = _mm512_dpbf16_ps(a1[j], xb, weights(panel, kk + j, 1));
    }
  }
  for (; kk < kk1; ++kk) {
    const __m512bh xb = pair_at(xr + 2 * kk);
    a0[0] = _mm512_dpbf16_ps(a0[0], xb, weights(panel, kk, 0));
    a1[0] = _mm512_dpbf16_ps(a1[0], xb, weights(panel, kk, 1));
  }
  acc0 = _mm512_add_ps(acc0, _mm512_add_ps(_mm512_add_ps(a0[0], a0[1]), _mm512_add_ps(a0[2], a0[3])));
  acc1 = _mm512_add_ps(acc1, _mm512_add_ps(_mm512_add_ps(a1[0], a1[1]), _mm512_add_ps(a1[2], a1[3])));
}

// Rows [r0, r0 + MR) of x times pairs [kk0, kk1) of panel p; sums ([M, kPanel] floats) carry them between chunks,
// and the last chunk writes them out.
template <int MR>
void block(const uint16_t* x, int64_t k_dim, const uint16_t* panel, int64_t p, int64_t r0, int64_t kk0,
           int64_t kk1, float* sums, const Output& out) {
  __m512 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) {
    acc0[r] = kk0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r0 + r) * kPanel);
    acc1[r] = kk0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r0 + r) * kPanel + 16);
  }
  const uint16_t* xr = x + r0 * k_dim;
  if constexpr (MR == 1) {
    one_row(xr, panel, kk0, kk1, acc0[0], acc1[0]);
  } else {
    for (int64_t kk = kk0; kk < kk1; ++kk) {
      const __m512bh w0 = weights(panel, kk, 0), w1 = weights(panel, kk, 1);
#pragma GCC unroll 12
      for (int r = 0; r < MR; ++r) {
        const __m512bh xb = pair_at(xr + r * k_dim + 2 * kk);
        acc0[r] = _mm512_dpbf16_ps(acc0[r], xb, w0);
        acc1[r] = _mm512_dpbf16_ps(acc1[r], xb, w1);
      }
    }
  }
  const bool last = 2 * kk1 == k_dim;
  for (int r = 0; r < MR; ++r) {
    if (last) {
      out.put(r0 + r, p * kPanel, acc0[r]);
      out.put(r0 + r, p * kPanel + 16, acc1[r]);
    } else {
      _mm512_storeu_ps(sums + (r0 + r) * kPanel, acc0[r]);
      _mm512_storeu_ps(sums + (r0 + r) * kPanel + 16, acc1[r]);
    }
  }
}

template <int... R>
void block_of(int rows, std::integer_sequence<int, R...>, const uint16_t* x, int64_t k_dim, const uint16_t* panel,
              int64_t p, int64_t r0, int64_t kk0, int64_t kk1, float* sums, const Output& out) {
  ((rows == R + 1 ? block<R + 1>(x, k_dim, panel, p, r0, kk0, kk1, sums, out) : void()), ...);
}

void panels_times_rows(const uint16_t* x, int64_t m, int64_t k_dim, const uint16_t* w, int64_t panels,
                       const Output& out) {
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows, small = m / blocks, larger = m % blocks;
  auto first_row = [&](int64_t b) { return b * small + std::min(b, larger); };
  const int64_t pairs = k_dim / 2;
  const int64_t chunk = blocks == 1 ? pairs : kChunkPairs;  // one block reuses no chunk: K whole
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> sums(m * kPanel);
    for (int64_t g0 = 0; g0 < blocks; g0 += kGroupBlocks) {
      const int64_t g1 = std::min(blocks, g0 + kGroupBlocks);
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* panel = w + p * pairs * kPanel * 2;
        for (int64_t kk0 = 0; kk0 < pairs; kk0 += chunk) {
          const int64_t kk1 = std::min(pairs, kk0 + chunk);
          for (int64_t b = g0; b < g1; ++b) {
            const int rows = static_cast<int>(first_row(b + 1) - first_row(b));
            block_of(rows, std::make_integer_sequence<int, kBlockRows>{}, x, k_dim, panel, p, first_row(b), kk0,
                     kk1, sums.data(), out);
          }
        }
      }
    }
  });
}

}  // namespace

TRTPROMPT_BF16_DOT_END
#endif  // TRTPROMPT_BF16_DOT

namespace trtprompt_bf16_panels {

bool compiled() { return TRTPROMPT_BF16_DOT != 0; }

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const float* bias) {
  TORCH_CHECK(compiled(), "panel_linear: bf16 panels need the AVX-512 kernel variant built by GCC >= 10");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "panel_linear: bf16 panels take bfloat16 x");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == 32 && panels.size(3) == 2 && panels.is_contiguous(),
              "panel_linear: bf16 panels must be contiguous [N / 32, K / 2, 32, 2]");
  TORCH_CHECK(x.size(1) == 2 * panels.size(1), "panel_linear: x has ", x.size(1), " columns, the weight ",
              2 * panels.size(1));
  at::Tensor y = at::empty({x.size(0), panels.size(0) * 32}, x.options());
#if TRTPROMPT_BF16_DOT
  if (x.size(0) > 0)
    panels_times_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), x.size(0), x.size(1),
                      reinterpret_cast<const uint16_t*>(panels.data_ptr<c10::BFloat16>()), panels.size(0),
                      Output{y.data_ptr<c10::BFloat16>(), y.size(1), bias});
#endif
  return y;
}

}  // namespace trtprompt_bf16_panels
