// Per-token int8 quantization of a W8A8 linear's input, and the per-token rescale of its output, one pass
// each (engine/quant_w8a8.py).
//
// Each row of x [M, K] gets its own scale s = max(max|x|, min_scale) / qmax, and its values become
// round(x / s) + zero_point as uint8 (what oneDNN's u8 x s8 int8 GEMM reads). torch spells this as
// nine passes over the activations (float, abs, amax, clamp, div, div, round, add, cast); at a
// 2,048-token prompt chunk those passes cost more than the AMX GEMM they feed. Every step is torch's
// own float32 arithmetic in the same order (a division correctly rounded, round half to even), so q
// and s equal the torch expression's bit for bit (tests/test_int8_w8a8.py).
//
// scale_rows is the way back: the GEMM's float32 output [M, N] times each row's scale (plus the bias),
// rounded once to the activations' dtype, in one pass where torch's mul_ and cast make two over the
// float32 output.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "dtypes.h"
#include "typed_vec.h"
#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <tuple>

namespace {

using namespace trtprompt_dtypes;
using namespace trtprompt_vec;

// v + 1.5 * 2^23 - 1.5 * 2^23 is v rounded to an integer, half to even (the default rounding mode), for
// |v| < 2^22: here |v| <= qmax.
constexpr float kRoundMagic = 12582912.f;

// v (integers in [0, 255]) stored as kLanes bytes: one narrowing instruction with the variant's ISA
// (compilers narrow a float vector to bytes lane by lane).
inline void store_u8(uint8_t* p, vf v) {
#if TRTPROMPT_LANES == 16 && defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32((__m512)v)));
#elif TRTPROMPT_LANES == 8 && defined(__AVX2__)
  const __m256i i = _mm256_cvttps_epi32((__m256)v);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
#else
  for (int64_t l = 0; l < kLanes; ++l) p[l] = static_cast<uint8_t>(v[l]);
#endif
}

template <typename T>
float row_absmax(const T* x, int64_t k) {
  vf top = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    const vf v = load_as_float(x + i);
    const vf a = v < 0.f ? -v : v;
    top = a > top ? a : top;
  }
  float m = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) m = std::max(m, static_cast<float>(top[l]));
  for (; i < k; ++i) m = std::max(m, std::fabs(static_cast<float>(x[i])));
  return m;
}

template <typename T>
void quantize(const at::Tensor& x, int64_t qmax, int64_t zero_point, double min_scale, at::Tensor& q,
              at::Tensor& scale) {
  const int64_t rows = x.size(0), k = x.size(1);
  const T* xp = x.data_ptr<T>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  const float floor_scale = static_cast<float>(min_scale), zp = static_cast<float>(zero_point);
  at::parallel_for(0, rows, grain_rows(k),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * k;
      const float s = std::max(row_absmax(xr, k), floor_scale) / static_cast<float>(qmax);
      sp[r] = s;
      uint8_t* qr = qp + r * k;
      // |x / s| <= qmax by construction, so round(x / s) + zero_point lies in [zp - qmax, zp + qmax].
      int64_t i = 0;
      for (; i + kLanes <= k; i += kLanes) {
        const vf rounded = (load_as_float(xr + i) / s + kRoundMagic) - kRoundMagic;
        store_u8(qr + i, rounded + zp);
      }
      for (; i < k; ++i) qr[i] = static_cast<uint8_t>(std::nearbyint(static_cast<float>(xr[i]) / s) + zp);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t qmax, int64_t zero_point,
                                                 double min_scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(qmax > 0 && zero_point >= qmax && zero_point + qmax <= 255 && min_scale > 0,
              "quantize_rows: need 0 < qmax <= zero_point, zero_point + qmax <= 255 and min_scale > 0");
  auto q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  auto scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  dispatch_float_types(x, "quantize_rows", [&](auto tag) {
    quantize<decltype(tag)>(x, qmax, zero_point, min_scale, q, scale);
  });
  return {q, scale};
}

// out[r, n] = (y[r, n] * s[r] (+ bias[n])) as T: torch's y.mul_(s) (then + bias), then .to(T).
template <typename T>
void scale(const at::Tensor& y, const at::Tensor& s, const float* bias, at::Tensor& out) {
  const int64_t rows = y.size(0), n = y.size(1);
  const float* yp = y.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* yr = yp + r * n;
      T* o = op + r * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        vf v = load(yr + i) * sp[r];
        if (bias != nullptr) v = v + load(bias + i);
        store_as(o + i, v);
      }
      for (; i < n; ++i) {
        float v = yr[i] * sp[r];
        if (bias != nullptr) v = v + bias[i];
        o[i] = static_cast<T>(v);
      }
    }
  });
}

at::Tensor scale_rows(const at::Tensor& y, const at::Tensor& s, const c10::optional<at::Tensor>& bias,
                      at::ScalarType dtype) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "scale_rows: y must be a contiguous float32 [M, N] tensor");
  TORCH_CHECK(s.is_contiguous() && s.scalar_type() == at::kFloat && s.numel() == y.size(0),
              "scale_rows: s must hold one float32 scale per row of y");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == at::kFloat &&
                                    bias->numel() == y.size(1)),
              "scale_rows: bias must be a contiguous float32 [N]");
  auto out = at::empty(y.sizes(), y.options().dtype(dtype));
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  dispatch_float_types(out, "scale_rows", [&](auto tag) { scale<decltype(tag)>(y, s, b, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("quantize_rows(Tensor x, int qmax, int zero_point, float min_scale) -> (Tensor, Tensor)");
  m.def("scale_rows(Tensor y, Tensor s, Tensor? bias, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("scale_rows", &scale_rows);
}
