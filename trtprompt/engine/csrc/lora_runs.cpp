// Adapter products for short runs of rows with one adapter each (decode rows of a batch mixing adapters):
//
//   y[first:end, out_offset:out_offset + out_features] += (x[first:end] @ A_p^T) @ B_p
//
// for each pair p (one module of the fused linear) of the run's adapter, in float32, y updated in place and
// rounded once, as torch's y.add_(float32 product) is. A batch of 32 decode rows and 8 adapters leaves 4
// rows per adapter: torch's GEMMs then cost a call each (two per module and run), and one GEMM over every
// adapter's columns computes 8 times the products needed. Here each run's rows (up to kRows at a time)
// read each weight vector of their adapter once; a run is one task of the thread pool.
//
//   y      [T, N] float32 or bfloat16, unit column stride
//   x      [T, K] y's dtype, unit column stride, K a multiple of kLanes
//   runs   int64 [R, 3]: first row, end row, slot
//   a      [C, K] float32 or bfloat16: every pair's A rows (rank rows each)
//   b      1-D, a's dtype: every pair's B [rank, out_features], row-major
//   pairs  int64 [P, 6]: slot, first row in a, rank, offset in b, out_offset, out_features
// Design: docs/lora.md, "Batched products".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "typed_vec.h"
#include "vec.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using namespace trtprompt_vec;

constexpr int64_t kRows = kMaxUnrolledRows;  // rows of a run that share each read of the adapter's weights
constexpr int64_t kPairFields = 6;  // slot, a_row, rank, b_offset, out_offset, out_features

// Keeps v in a register: compilers otherwise fold its load into each FMA that uses it (R loads of one
// vector), and the loop, bound by loads (two a cycle), ran ~20% slower. Only where a vf is one register
// (AVX ymm, AVX-512 zmm); elsewhere the compiler's choice stands.
inline void in_register(vf& v) {
#if (TRTPROMPT_LANES == 8 && defined(__AVX__)) || (TRTPROMPT_LANES == 16 && defined(__AVX512F__))
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

inline vf load_w(const float* p) { return load(p); }
inline vf load_w(const uint16_t* p) { return load_bf16(p); }
inline float scalar(float v) { return v; }
inline float scalar(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void add_into(float* y, vf v) { store(y, load(y) + v); }
inline void add_into(uint16_t* y, vf v) { store_bf16(y, load_bf16(y) + v); }
inline void add_into(float* y, float v) { *y += v; }
inline void add_into(uint16_t* y, float v) {
  const c10::BFloat16 r(scalar(*y) + v);  // rounds to nearest even
  std::memcpy(y, &r, sizeof r);
}

// An FMA waits ~4 cycles for its accumulator: R weight rows (or vectors) at once keep R * M sums in flight.
// AVX2 has 16 vector registers, not 32: 8 rows take R = 1 there (2 x 8 sums spilled; R = 1 measured 0-10 %
// faster on the avx2 build, side by side on the AVX-512 Xeon; R = 3 on avx512 was within its noise).
template <int M>
constexpr int in_flight() {
#if TRTPROMPT_LANES == 8
  return M >= 6 ? 1 : (M >= 3 ? 2 : (M == 1 ? 8 : 4));
#else
  return M >= 4 ? 2 : (M == 1 ? 8 : 4);
#endif
}

// The rank remainder, one row of a at a time; s rows `stride` apart.
template <int M, typename W>
void shrink_rows(const float* xf, int64_t k_dim, const W* a, int64_t rows, float* s, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) {
    vf acc[M] = {};
    for (int64_t k = 0; k < k_dim; k += kLanes) {
      const vf w = load_w(a + i * k_dim + k);
      for (int r = 0; r < M; ++r) acc[r] += load(xf + r * k_dim + k) * w;
    }
    for (int r = 0; r < M; ++r) s[r * stride + i] = hsum(acc[r]);
  }
}

// s [M, rank] = xf [M, K] @ a[0:rank]^T.
template <int M, int R, typename W>
void shrink(const float* xf, int64_t k_dim, const W* a, int64_t rank, float* s) {
  int64_t i = 0;
  for (; i + R <= rank; i += R) {
    vf acc[R][M] = {};
    for (int64_t k = 0; k < k_dim; k += kLanes) {
      vf w[R];
      for (int j = 0; j < R; ++j) w[j] = load_w(a + (i + j) * k_dim + k);
      for (int r = 0; r < M; ++r) {
        vf xv = load(xf + r * k_dim + k);
        in_register(xv);
        for (int j = 0; j < R; ++j) acc[j][r] += xv * w[j];
      }
    }
    for (int j = 0; j < R; ++j)
      for (int r = 0; r < M; ++r) s[r * rank + i + j] = hsum(acc[j][r]);
  }
  if constexpr (R > 1) {
    if (i < rank) shrink_rows<M>(xf, k_dim, a + i * k_dim, rank - i, s + i, rank);
  }
}

// y[r, 0:n] += s[r] @ b [rank, n] for M rows of y (y_stride apart).
template <int M, int R, typename W, typename Y>
void expand(const float* s, int64_t rank, const W* b, int64_t n, Y* y, int64_t y_stride) {
  int64_t c = 0;
  for (; c + R * kLanes <= n; c += R * kLanes) {
    vf acc[R][M] = {};
    for (int64_t i = 0; i < rank; ++i) {
      for (int j = 0; j < R; ++j) {
        const vf bv = load_w(b + i * n + c + j * kLanes);
        for (int r = 0; r < M; ++r) acc[j][r] += s[r * rank + i] * bv;
      }
    }
    for (int j = 0; j < R; ++j)
      for (int r = 0; r < M; ++r) add_into(y + r * y_stride + c + j * kLanes, acc[j][r]);
  }
  for (; c + kLanes <= n; c += kLanes) {
    vf acc[M] = {};
    for (int64_t i = 0; i < rank; ++i) {
      const vf bv = load_w(b + i * n + c);
      for (int r = 0; r < M; ++r) acc[r] += s[r * rank + i] * bv;
    }
    for (int r = 0; r < M; ++r) add_into(y + r * y_stride + c, acc[r]);
  }
  for (; c < n; ++c) {  // out_features not a multiple of kLanes
    for (int r = 0; r < M; ++r) {
      float v = 0.f;
      for (int64_t i = 0; i < rank; ++i) v += s[r * rank + i] * scalar(b[i * n + c]);
      add_into(y + r * y_stride + c, v);
    }
  }
}

// The element type rows_as_float (typed_vec.h) reads: bfloat16 rows are handled here as their uint16_t bits.
template <typename X>
using Typed = std::conditional_t<std::is_same_v<X, uint16_t>, c10::BFloat16, X>;

struct Task {
  int64_t first, rows, slot;
};

// A run's rows in tasks of at most kRows.
std::vector<Task> tasks_of(const at::Tensor& runs) {
  std::vector<Task> tasks;
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < runs.size(0); ++i)
    for (int64_t first = r[3 * i]; first < r[3 * i + 1]; first += kRows)
      tasks.push_back({first, std::min(kRows, r[3 * i + 1] - first), r[3 * i + 2]});
  return tasks;
}

template <typename X, typename W>
void run_tasks(const std::vector<Task>& tasks, at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
               const at::Tensor& b, const at::Tensor& pairs, int64_t max_rank) {
  const int64_t k_dim = x.size(1), num_pairs = pairs.size(0);
  const int64_t* pp = pairs.data_ptr<int64_t>();
  X* yp = reinterpret_cast<X*>(y.data_ptr());
  const X* xp = reinterpret_cast<const X*>(x.data_ptr());
  const W* ap = reinterpret_cast<const W*>(a.data_ptr());
  const W* bp = reinterpret_cast<const W*>(b.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(kRows * k_dim), s(kRows * max_rank);
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      rows_as_float(reinterpret_cast<const Typed<X>*>(xp + task.first * x.stride(0)), x.stride(0), task.rows, k_dim,
                    xf.data());
      for (int64_t p = 0; p < num_pairs; ++p) {
        const int64_t* f = pp + p * kPairFields;
        if (f[0] != task.slot) continue;
        with_rows(task.rows, [&](auto rows) {
          constexpr int M = decltype(rows)::value;
          shrink<M, in_flight<M>()>(xf.data(), k_dim, ap + f[1] * k_dim, f[2], s.data());
          expand<M, in_flight<M>()>(s.data(), f[2], bp + f[3], f[5], yp + task.first * y.stride(0) + f[4],
                                    y.stride(0));
        });
      }
    }
  });
}

void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& runs, const at::Tensor& a,
           const at::Tensor& b, const at::Tensor& pairs) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "lora_runs: y and x must be [T, N], [T, K]");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "lora_runs: y and x need unit column strides");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_runs: y and x must both be float32 or both bfloat16");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_runs: a and b must both be float32 or both bfloat16");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == x.size(1), "lora_runs: a must be contiguous [C, K]");
  TORCH_CHECK(b.dim() == 1 && b.is_contiguous(), "lora_runs: b must be contiguous 1-D");
  TORCH_CHECK(x.size(1) % kLanes == 0, "lora_runs: K (", x.size(1), ") must be a multiple of ", kLanes);
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && runs.dim() == 2 && runs.size(1) == 3,
              "lora_runs: runs must be contiguous int64 [R, 3]");
  TORCH_CHECK(pairs.scalar_type() == at::kLong && pairs.is_contiguous() && pairs.dim() == 2 &&
                  pairs.size(1) == kPairFields,
              "lora_runs: pairs must be contiguous int64 [P, 6]");
}

// Bounds of every run and pair, checked once per call: the tasks index without checks.
int64_t checked_max_rank(const at::Tensor& y, const at::Tensor& runs, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& pairs) {
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < runs.size(0); ++i)
    TORCH_CHECK(0 <= r[3 * i] && r[3 * i] <= r[3 * i + 1] && r[3 * i + 1] <= y.size(0), "lora_runs: run ", i,
                " is outside y's ", y.size(0), " rows");
  int64_t max_rank = 0;
  const int64_t* p = pairs.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs.size(0); ++i, p += kPairFields) {
    TORCH_CHECK(p[1] >= 0 && p[2] > 0 && p[1] + p[2] <= a.size(0), "lora_runs: pair ", i, "'s A rows are outside a");
    TORCH_CHECK(p[3] >= 0 && p[3] + p[2] * p[5] <= b.numel(), "lora_runs: pair ", i, "'s B is outside b");
    TORCH_CHECK(p[4] >= 0 && p[5] > 0 && p[4] + p[5] <= y.size(1), "lora_runs: pair ", i, "'s columns are outside y");
    max_rank = std::max(max_rank, p[2]);
  }
  return max_rank;
}

void lora_runs(at::Tensor y, const at::Tensor& x, const at::Tensor& runs, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& pairs) {
  check(y, x, runs, a, b, pairs);
  const int64_t max_rank = checked_max_rank(y, runs, a, b, pairs);
  const std::vector<Task> tasks = tasks_of(runs);
  const bool x_bf16 = x.scalar_type() == at::kBFloat16, w_bf16 = a.scalar_type() == at::kBFloat16;
  if (x_bf16 && w_bf16) return run_tasks<uint16_t, uint16_t>(tasks, y, x, a, b, pairs, max_rank);
  if (x_bf16) return run_tasks<uint16_t, float>(tasks, y, x, a, b, pairs, max_rank);
  if (w_bf16) return run_tasks<float, uint16_t>(tasks, y, x, a, b, pairs, max_rank);
  run_tasks<float, float>(tasks, y, x, a, b, pairs, max_rank);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("lora_runs(Tensor(a!) y, Tensor x, Tensor runs, Tensor a, Tensor b, Tensor pairs) -> ()");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("lora_runs", &lora_runs);
}
