// Each row's greedy token: the first maximal logit of float32 rows [R, V] and its index, in one pass
// (engine/sampler.py, greedy_tokens). torch's max(dim=-1) tracks the index element by element: 1.5 ms
// for 32 rows of 49,152 here against 0.16 for amax alone, the largest cost of a batch-32 step outside
// the model. Here each lane keeps its first maximum and where it was; the lanes, then a row's chunks,
// are merged keeping the smallest index among equal values, so the index is argmax's (the first one).
// A row holding a NaN reports a NaN maximum, as torch's max propagates it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using namespace trtprompt_vec;

typedef int32_t vi32 __attribute__((vector_size(kLanes * sizeof(int32_t))));

// Elements one work item scans: a decode step's 32 rows of a 49,152-token vocabulary make 192 items for
// two threads; one row alone still splits.
constexpr int64_t kChunk = 8192;

struct Best {
  float value;
  int64_t index;
  bool nan;
};

// The earlier of two candidates wins a tie: a is the one scanned first.
inline Best better(const Best& a, const Best& b) {
  const bool take_b = b.value > a.value || (b.value == a.value && b.index < a.index);
  return {take_b ? b.value : a.value, take_b ? b.index : a.index, a.nan || b.nan};
}

// The first maximum of x[begin, end) (indices into the row; a vocabulary fits int32).
Best scan(const float* x, int64_t begin, int64_t end) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  vf vmax = vf{} + kNegInf;
  vi32 lane, nan = {};
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  vi32 cur = lane + static_cast<int32_t>(begin), vidx = cur;  // an all -inf run reports its first index
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes, cur += static_cast<int32_t>(kLanes)) {
    const vf v = load(x + i);
    const vi32 gt = v > vmax;  // strict: a lane keeps its first maximum
    vmax = gt ? v : vmax;
    vidx = gt ? cur : vidx;
    nan |= v != v;
  }
  Best b{kNegInf, begin, false};
  for (int l = 0; l < kLanes; ++l) b = better(b, Best{vmax[l], vidx[l], nan[l] != 0});
  for (; i < end; ++i) b = better(b, Best{x[i], i, x[i] != x[i]});
  return b;
}

std::tuple<at::Tensor, at::Tensor> greedy_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "greedy_rows: logits must be a contiguous float32 [rows, vocab] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab <= std::numeric_limits<int32_t>::max(), "greedy_rows: vocab must be 1 to 2^31 - 1");
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  const float* x = logits.data_ptr<float>();
  std::vector<Best> part(rows * chunks);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t r = it / chunks, c = it % chunks;
      part[it] = scan(x + r * vocab, c * kChunk, std::min(vocab, (c + 1) * kChunk));
    }
  });
  at::Tensor index = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor best = at::empty({rows}, logits.options());
  int64_t* ip = index.data_ptr<int64_t>();
  float* bp = best.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    Best b = part[r * chunks];
    for (int64_t c = 1; c < chunks; ++c) b = better(b, part[r * chunks + c]);
    ip[r] = b.index;
    bp[r] = b.nan ? std::numeric_limits<float>::quiet_NaN() : b.value;
  }
  return {best, index};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("greedy_rows(Tensor logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("greedy_rows", &greedy_rows);
}
