// y = x @ W^T for a few rows of x (decode steps): the weight is streamed from memory once per
// eight rows, each weight vector converted to float32 in registers and used by every row.
//
// With one to a few dozen tokens a step, a linear is bound by reading its weight, and a GEMM
// library's per-call work (oneDNN's primitive lookup, blocking for large M) is a share of a
// call that moves ~1 MB. This kernel does the least that reads each weight byte once: rows of W
// split between threads, a float32 dot product per (row of x, row of W). Weight formats:
//   float32 / bfloat16 [N, K]                    the engine dtype's weight
//   int8 [N, K] + float32 scale [N]              per output channel (int8_wo, W8A16)
//   int8 [N, K] + float32 scale [N, K / G]       per group of G input columns (int8_wo with int8_group_size):
//       each widened weight vector times its group's scale (one multiply per vector, shared by the M rows)
//   uint8 [N, K / 2] + float32 [N, K / G, 2]     int4 in groups of G columns (int4_wo, W4A16):
//       value = nibble * scale + minimum, (scale, minimum) per group; within a group, byte b holds
//       column b (low nibble) and column b + G / 2 (high nibble): a vector of bytes unpacks into two
//       runs of columns.
// x is float32 or bfloat16 [M, K]; y [M, N] in x's dtype, accumulated in float32. Design and
// figures: docs/design.md, "Few-rows linear".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "typed_vec.h"
#include "vec.h"
#include "widen.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace trtprompt_vec;

constexpr int64_t kRowsPerPass = kMaxUnrolledRows;  // rows of x that share one read of the weight
constexpr int64_t kOutRowsPerTask = 16;  // rows of W a thread takes at a time (parallel_for grain)

// The weight's kLanes values at column k of row n, as float32 (without the int formats' scales), and where its
// rows lie in memory (rows is the weight's N, for prefetch bounds).
struct F32Weight {
  const float* w;
  int64_t k_dim, rows;
  vf at(int64_t n, int64_t k) const { return load(w + n * k_dim + k); }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * k_dim); }
  static constexpr int64_t kBytes = sizeof(float);
  static constexpr bool kGrouped = false;  // grouped formats also give scale(n, k) and group
};

struct Bf16Weight {
  const uint16_t* w;
  int64_t k_dim, rows;
  vf at(int64_t n, int64_t k) const { return load_bf16(w + n * k_dim + k); }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * k_dim); }
  static constexpr int64_t kBytes = sizeof(uint16_t);
  static constexpr bool kGrouped = false;
};

struct Int8Weight {
  const int8_t* w;
  int64_t k_dim, rows;
  vf at(int64_t n, int64_t k) const { return __builtin_convertvector(widen_s8(w + n * k_dim + k), vf); }
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * k_dim); }
  static constexpr int64_t kBytes = sizeof(int8_t);
  static constexpr bool kGrouped = false;
};

// Grouped int8: dot_rows broadcasts each row's group scale once per group and multiplies each widened vector by
// it (shared by the M rows). Looking the scale up at every vector ran SmolLM2's one-row step at 1.7x the
// per-row format's time. The index is unsigned (a signed division by G rounds towards zero: four instructions
// a row and group where a shift does) and splat is a broadcast (vf{} + s added a zero first): one row's linears
// took 0.93-0.94x the time (docs/design.md, "Few-rows linear").
template <int64_t G>
struct Int8GroupWeight : Int8Weight {
  const float* scales;  // [N, K / G]
  vf scale(int64_t n, int64_t k) const {
    return splat(scales[static_cast<uint64_t>(n) * static_cast<uint64_t>(k_dim / G) + static_cast<uint64_t>(k) / G]);
  }
  static constexpr bool kGrouped = true;
  static constexpr int64_t group = G;  // a constant: the group's loop unrolls whole
};

// Software prefetch of the weight. R rows are read side by side, each only K values long, and the hardware
// prefetchers lose the streams at every jump to the next R rows: one thread streamed SmolLM2's int8 linears at
// 7-11 GB/s, and at 19 GB/s when each group of R rows asks for the group kPrefetchGroups ahead while it is read,
// its step's share per k iteration (a burst at the group's start: 15 GB/s; docs/design.md, "Few-rows linear").
constexpr int64_t kPrefetchGroups = 2;
constexpr int64_t kLine = 64;

struct GroupPrefetch {
  const char* ahead;  // the first row kPrefetchGroups groups on; nullptr where that is past the weight
  int64_t step;       // its bytes to request per k iteration (R rows x kLanes values)
  void at(int64_t k) const {
    if (ahead == nullptr) return;
    const char* p = ahead + (k / kLanes) * step;
    for (int64_t b = 0; b < step; b += kLine) __builtin_prefetch(p + b, 0, 1);
  }
};

template <int R, typename W>
GroupPrefetch group_prefetch(const W& w, int64_t n) {
  const int64_t first = n + kPrefetchGroups * R;
  return {first + R <= w.rows ? w.row(first) : nullptr, R * kLanes * W::kBytes};
}

// Independent sums in flight: an FMA waits ~4 cycles for its accumulator, so one chain per row of W would
// run at a quarter of the FMA rate. R rows of W at once give R * M chains (R * M >= 4 for every M). With
// four rows of x or more, two rows of W also halve the loads of x per FMA (a load per FMA otherwise bounds
// the loop); AVX-512's 32 registers hold the 2 x 8 sums, AVX2's 16 do not.
template <int M>
constexpr int out_rows_at_once() {
  if constexpr (M >= 4) return kLanes >= 16 ? 2 : 1;
  return M == 1 ? 4 : 2;
}

// Dot products of M rows of xf (float32 [M, K]) with rows [n0, n1) of W, into acc_out[(n - n0) * 8 + r].
// Sums (R x M) up to which a grouped weight's group sums are kept apart and scaled at the group's end; above, each
// weight vector is scaled instead (their registers would not fit AVX2's 16 beside the running sums).
constexpr int kGroupSums = 6;

template <int M, typename W>
void dot_rows(const float* xf, int64_t k_dim, const W& w, int64_t n0, int64_t n1, float* acc_out) {
  constexpr int R = out_rows_at_once<M>();
  int64_t span = k_dim;  // columns between scale changes
  if constexpr (W::kGrouped) span = W::group;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    vf acc[R][M] = {};
    const GroupPrefetch prefetch = group_prefetch<R>(w, n);
    for (int64_t g0 = 0; g0 < k_dim; g0 += span) {
      if constexpr (W::kGrouped && R * M <= kGroupSums) {
        // Few sums: each group's own sums are scaled once at its end (an FMA per sum a group, not a multiply
        // per weight vector).
        vf part[R][M] = {};
        for (int64_t k = g0; k < g0 + span; k += kLanes) {
          prefetch.at(k);
          for (int j = 0; j < R; ++j) {
            const vf wv = w.at(n + j, k);
            for (int r = 0; r < M; ++r) part[j][r] += load(xf + r * k_dim + k) * wv;
          }
        }
        for (int j = 0; j < R; ++j) {
          const vf s = w.scale(n + j, g0);
          for (int r = 0; r < M; ++r) acc[j][r] += part[j][r] * s;
        }
        continue;
      }
      vf s[R] = {};
      if constexpr (W::kGrouped)
        for (int j = 0; j < R; ++j) s[j] = w.scale(n + j, g0);
      for (int64_t k = g0; k < g0 + span; k += kLanes) {
        prefetch.at(k);
        for (int j = 0; j < R; ++j) {
          vf wv = w.at(n + j, k);
          if constexpr (W::kGrouped) wv *= s[j];
          for (int r = 0; r < M; ++r) acc[j][r] += load(xf + r * k_dim + k) * wv;
        }
      }
    }
    for (int j = 0; j < R; ++j)
      for (int r = 0; r < M; ++r) acc_out[(n + j - n0) * kRowsPerPass + r] = hsum(acc[j][r]);
  }
  for (; n < n1; ++n) {  // the last rows of a task when R does not divide it
    vf acc[M] = {};
    for (int64_t g0 = 0; g0 < k_dim; g0 += span) {
      vf s{};
      if constexpr (W::kGrouped) s = w.scale(n, g0);
      for (int64_t k = g0; k < g0 + span; k += kLanes) {
        vf wv = w.at(n, k);
        if constexpr (W::kGrouped) wv *= s;
        for (int r = 0; r < M; ++r) acc[r] += load(xf + r * k_dim + k) * wv;
      }
    }
    for (int r = 0; r < M; ++r) acc_out[(n - n0) * kRowsPerPass + r] = hsum(acc[r]);
  }
}

// int4 rows are read one at a time; the row kInt4RowsAhead on (as many bytes ahead as int8's prefetch) is
// requested at the same offsets while this one is read.
constexpr int64_t kInt4RowsAhead = 16;

// int4 in groups: the group's scale and minimum are folded into each weight vector (one FMA per
// vector, shared by the M rows), so the sum needs no per-group pass. Low and high nibbles feed
// separate sums (two chains per row).
template <int M>
void dot_rows_int4(const float* xf, int64_t k_dim, const uint8_t* w, const float* scale, int64_t group,
                   int64_t n_dim, int64_t n0, int64_t n1, float* acc_out) {
  const int64_t half = group / 2, groups = k_dim / group;
  for (int64_t n = n0; n < n1; ++n) {
    vf acc_lo[M] = {}, acc_hi[M] = {};
    const uint8_t* row = w + n * (k_dim / 2);
    const uint8_t* ahead = n + kInt4RowsAhead < n_dim ? row + kInt4RowsAhead * (k_dim / 2) : nullptr;
    for (int64_t g = 0; g < groups; ++g) {
      const vf s = vf{} + scale[2 * (n * groups + g)], low = vf{} + scale[2 * (n * groups + g) + 1];
      for (int64_t b = 0; b < half; b += kLanes) {
        if (ahead != nullptr && (g * half + b) % kLine == 0) __builtin_prefetch(ahead + g * half + b, 0, 1);
        const vi q = widen_u8(row + g * half + b);
        const vf wlo = __builtin_convertvector(q & 15, vf) * s + low;
        const vf whi = __builtin_convertvector(q >> 4, vf) * s + low;
        const int64_t k = g * group + b;
        for (int r = 0; r < M; ++r) {
          acc_lo[r] += load(xf + r * k_dim + k) * wlo;
          acc_hi[r] += load(xf + r * k_dim + k + half) * whi;
        }
      }
    }
    for (int r = 0; r < M; ++r) acc_out[(n - n0) * kRowsPerPass + r] = hsum(acc_lo[r] + acc_hi[r]);
  }
}

// Grouped int8 with the group size as a constant (the sizes the build writes).
template <int M>
void dot_rows_int8_groups(const float* xf, const Int8Weight& w, const float* scales, int64_t group, int64_t n0,
                          int64_t n1, float* acc_out) {
  switch (group) {
    case 32: return dot_rows<M>(xf, w.k_dim, Int8GroupWeight<32>{w, scales}, n0, n1, acc_out);
    case 64: return dot_rows<M>(xf, w.k_dim, Int8GroupWeight<64>{w, scales}, n0, n1, acc_out);
    case 128: return dot_rows<M>(xf, w.k_dim, Int8GroupWeight<128>{w, scales}, n0, n1, acc_out);
    default: TORCH_CHECK(false, "few_rows_linear: int8 group ", group, " is not 32, 64 or 128");
  }
}

// Runs fn(m, n0, n1, buf) over the weight's rows in parallel; buf holds kOutRowsPerTask x kRowsPerPass sums.
template <typename Fn>
void for_each_task(int64_t n_dim, Fn&& fn) {
  at::parallel_for(0, (n_dim + kOutRowsPerTask - 1) / kOutRowsPerTask, 1, [&](int64_t t0, int64_t t1) {
    float buf[kOutRowsPerTask * kRowsPerPass];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kOutRowsPerTask, n1 = std::min(n_dim, n0 + kOutRowsPerTask);
      fn(n0, n1, buf);
    }
  });
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight, int64_t k_dim) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "few_rows_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "few_rows_linear: x must be float32 or bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "few_rows_linear: weight must be a contiguous 2-D tensor");
  TORCH_CHECK(x.size(1) == k_dim, "few_rows_linear: x has ", x.size(1), " columns, the weight ", k_dim);
  TORCH_CHECK(k_dim % kLanes == 0, "few_rows_linear: K (", k_dim, ") must be a multiple of ", kLanes);
}

// Every row of x as float32 [M, K] (each task's passes read them all).
void x_as_float(const at::Tensor& x, float* dst) {
  const int64_t m = x.size(0), k = x.size(1);
  if (x.scalar_type() == at::kFloat)
    rows_as_float(x.data_ptr<float>(), k, m, k, dst);
  else
    rows_as_float(x.data_ptr<c10::BFloat16>(), k, m, k, dst);
}

// The task's sums (buf [n - n0][r]) into out [r0 + r, n], times the int8 row scale where there is one.
template <typename T>
void store_rows(T* out, int64_t n_dim, int64_t r0, int64_t m, int64_t n0, int64_t n1, const float* buf,
                const float* row_scale) {
  for (int64_t r = 0; r < m; ++r) {
    T* row = out + (r0 + r) * n_dim;
    for (int64_t n = n0; n < n1; ++n)
      row[n] = static_cast<T>(buf[(n - n0) * kRowsPerPass + r] * (row_scale ? row_scale[n] : 1.f));
  }
}

void store_rows(at::Tensor& out, int64_t r0, int64_t m, int64_t n0, int64_t n1, const float* buf,
                const float* row_scale) {
  if (out.scalar_type() == at::kFloat)
    store_rows(out.data_ptr<float>(), out.size(1), r0, m, n0, n1, buf, row_scale);
  else
    store_rows(out.data_ptr<c10::BFloat16>(), out.size(1), r0, m, n0, n1, buf, row_scale);
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                           int64_t group) {
  const auto wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar || wt == at::kByte,
              "few_rows_linear: weight must be float32, bfloat16, int8 or uint8 (packed int4)");
  const bool int4 = wt == at::kByte;
  const int64_t n_dim = weight.size(0), k_dim = int4 ? weight.size(1) * 2 : weight.size(1);
  check_inputs(x, weight, k_dim);
  const bool scaled = weight.scalar_type() == at::kChar || int4;
  TORCH_CHECK(!scaled || (scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous()),
              "few_rows_linear: int8 and int4 weights need a contiguous float32 scale");
  if (int4) {
    TORCH_CHECK(group > 0 && group % (2 * kLanes) == 0 && k_dim % group == 0,
                "few_rows_linear: int4 group (", group, ") must divide K and be a multiple of ", 2 * kLanes);
    TORCH_CHECK(scale->numel() == n_dim * (k_dim / group) * 2,
                "few_rows_linear: int4 scale must be [N, K / group, 2]: (scale, minimum) per group");
  } else if (scaled && group > 0) {
    TORCH_CHECK((group == 32 || group == 64 || group == 128) && k_dim % group == 0,
                "few_rows_linear: int8 group (", group, ") must be 32, 64 or 128 and divide K");
    TORCH_CHECK(scale->numel() == n_dim * (k_dim / group), "few_rows_linear: grouped int8 scale must be [N, K / group]");
  } else if (scaled) {
    TORCH_CHECK(scale->numel() == n_dim, "few_rows_linear: int8 scale must be [N]");
  }
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  std::vector<float> xf(x.size(0) * k_dim);
  x_as_float(x, xf.data());
  const bool int8_groups = scaled && !int4 && group > 0;
  const float* row_scale = (scaled && !int4 && !int8_groups) ? scale->data_ptr<float>() : nullptr;
  // Each task's rows of W are read from memory once: every pass of kRowsPerPass rows of x runs over them
  // while they are in cache (a task's 16 rows take 9-98 KB on SmolLM2), rather than each pass streaming W.
  for_each_task(n_dim, [&](int64_t n0, int64_t n1, float* buf) {
    for (int64_t r0 = 0; r0 < x.size(0); r0 += kRowsPerPass) {
      const int64_t m = std::min(kRowsPerPass, x.size(0) - r0);
      const float* xp = xf.data() + r0 * k_dim;
      with_rows(m, [&](auto rows) {
        constexpr int M = decltype(rows)::value;
        switch (weight.scalar_type()) {
          case at::kFloat:
            dot_rows<M>(xp, k_dim, F32Weight{weight.data_ptr<float>(), k_dim, n_dim}, n0, n1, buf);
            break;
          case at::kBFloat16:
            dot_rows<M>(xp, k_dim,
                        Bf16Weight{reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()), k_dim, n_dim},
                        n0, n1, buf);
            break;
          case at::kChar:
            if (int8_groups)
              dot_rows_int8_groups<M>(xp, Int8Weight{weight.data_ptr<int8_t>(), k_dim, n_dim},
                                      scale->data_ptr<float>(), group, n0, n1, buf);
            else
              dot_rows<M>(xp, k_dim, Int8Weight{weight.data_ptr<int8_t>(), k_dim, n_dim}, n0, n1, buf);
            break;
          default:
            dot_rows_int4<M>(xp, k_dim, weight.data_ptr<uint8_t>(), scale->data_ptr<float>(), group, n_dim, n0,
                             n1, buf);
        }
        store_rows(out, r0, m, n0, n1, buf, row_scale);
      });
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? scale, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
