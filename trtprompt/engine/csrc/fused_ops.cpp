// Row-wise decoder-layer ops that model.py otherwise runs as 3-9 torch ops each:
// RMSNorm (alone, or after the residual add), SiLU(gate) * up, and the rotary embedding.
//
// In a decode step of a few dozen tokens each torch op costs its dispatch, not its
// arithmetic; in a 2,048-token prefill each makes one more pass over memory. Each
// op here rounds where the torch expression it replaces rounds (float32 math, a
// rounding to the tensor's dtype after every torch op), so bfloat16 and float16
// results match the reference path up to the last bit of exp and sqrt.
// Design and measurements: docs/design.md, "Fused layer ops".
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "dtypes.h"
#include "typed_vec.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

namespace {

using namespace trtprompt_dtypes;
using namespace trtprompt_vec;

// x as torch leaves it after rounding a float result to T.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// v rounded as a T result is (torch rounds after every op): float32 as it is, bfloat16 a vector at once.
template <typename T>
inline vf round_vec(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(v);
  } else {
    for (int64_t i = 0; i < kLanes; ++i) v[i] = round_to<T>(v[i]);
    return v;
  }
}

template <typename T>
float sum_squares(const T* x, int64_t n) {
  vf acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = load_as_float(x + i);
    acc += v * v;
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return s;
}

// out = weight * (x.float() * rsqrt(mean(x^2) + eps)).to(T), per row of n.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * n;
      T* o = op + r * n;
      const float inv = 1.f / std::sqrt(sum_squares(xr, n) / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<T>(static_cast<float>(wp[i]) * round_to<T>(static_cast<float>(xr[i]) * inv));
    }
  });
}

// silu(g) = g * sigmoid(g), from e^-|g| so the exponential never overflows; one
// division per lane (the division, not the exponential, bounds its speed). Below
// -87 (e^g under float32's normal range) the result is 0, as torch's.
inline vf silu(vf g) {
  const vf e = exp_nonpositive(g < 0.f ? g : -g);
  const vf inv = 1.f / (1.f + e);
  return g < -87.f ? vf{} : g * (g < 0.f ? e * inv : inv);
}

inline float silu(float g) {
  const float e = std::exp(-std::fabs(g));
  const float inv = 1.f / (1.f + e);
  return g * (g < 0.f ? e * inv : inv);
}

// out [rows, n] = silu(gate) * up of gate_up [rows, 2n] = [gate | up].
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = out.size(-1), rows = out.numel() / n;
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * n;
      const T* u = g + n;
      T* o = op + r * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes)
        store_as(o + i, round_vec<T>(silu(load_as_float(g + i))) * load_as_float(u + i));
      for (; i < n; ++i) o[i] = static_cast<T>(round_to<T>(silu(static_cast<float>(g[i]))) * static_cast<float>(u[i]));
    }
  });
}

// out [rows, heads, d] = cat(x1 c - x2 s, x2 c + x1 s) for x [rows, heads, d] whose rows
// may be strided (views of the fused qkv output) and cos/sin [rows, d/2].
template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * half;
      const T* s = sp + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xi = xp + r * row_stride + h * head_stride;
        T* o = op + (r * heads + h) * d;
        int64_t i = 0;
        for (; i + kLanes <= half; i += kLanes) {
          const vf x1 = load_as_float(xi + i), x2 = load_as_float(xi + i + half);
          const vf ci = load_as_float(c + i), si = load_as_float(s + i);
          store_as(o + i, round_vec<T>(x1 * ci) - round_vec<T>(x2 * si));
          store_as(o + i + half, round_vec<T>(x2 * ci) + round_vec<T>(x1 * si));
        }
        for (; i < half; ++i) {
          const float x1 = static_cast<float>(xi[i]), x2 = static_cast<float>(xi[i + half]);
          const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
          o[i] = static_cast<T>(round_to<T>(x1 * ci) - round_to<T>(x2 * si));
          o[i + half] = static_cast<T>(round_to<T>(x2 * ci) + round_to<T>(x1 * si));
        }
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x must be contiguous [..., n] and weight [n]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  auto out = at::empty(x.sizes(), x.options());
  dispatch_float_types(x, "rms_norm", [&](auto tag) {
    rms_norm_rows<decltype(tag)>(x, weight, static_cast<float>(eps), out);
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual add before each norm, rounded to T as torch's add rounds,
// in the call that norms it (one op where the layer ran two).
template <typename T>
void add_rows(const at::Tensor& x, const at::Tensor& delta, at::Tensor& sum) {
  const T* xp = x.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  at::parallel_for(0, x.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sp[i] = static_cast<T>(static_cast<float>(xp[i]) + static_cast<float>(dp[i]));
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  TORCH_CHECK(delta.is_contiguous() && delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta must be contiguous, of x's shape and dtype");
  TORCH_CHECK(x.is_contiguous(), "add_rms_norm: x must be contiguous");
  auto sum = at::empty(x.sizes(), x.options());
  dispatch_float_types(x, "add_rms_norm", [&](auto tag) { add_rows<decltype(tag)>(x, delta, sum); });
  return {sum, rms_norm(sum, weight, eps)};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be contiguous [T, 2n]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_float_types(gate_up, "silu_and_mul", [&](auto tag) { silu_mul_rows<decltype(tag)>(gate_up, out); });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x must be [T, heads, d] with contiguous rows of even d");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
                  cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2),
              "rotary: cos and sin must be contiguous [T, d/2]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "rotary: x, cos and sin must share a dtype");
  auto out = at::empty(x.sizes(), x.options());
  dispatch_float_types(x, "rotary", [&](auto tag) { rotary_rows<decltype(tag)>(x, cos, sin, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
