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
#include <cmath>
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

// screen_rows: engine/greedy_head.py's screen in two passes over a row instead of torch's eight. Pass one finds a
// row's floor, the largest lower bound max_j (s_j - bound_j |x|_1) of any logit; pass two recomputes each token
// whose upper bound s_j + bound_j |x|_1 reaches it from its float weight row, and writes -inf for the others.

// Lower bounds' maximum over [begin, end) of one row.
float floor_of(const float* s, const float* bound, float norm, int64_t begin, int64_t end) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  vf best = splat(kNegInf);
  const vf n = splat(norm);
  int64_t j = begin;
  for (; j + kLanes <= end; j += kLanes) {
    const vf low = load(s + j) - load(bound + j) * n;
    best = low > best ? low : best;
  }
  float out = kNegInf;
  for (int l = 0; l < kLanes; ++l) out = std::max(out, best[l]);
  for (; j < end; ++j) out = std::max(out, s[j] - bound[j] * norm);
  return out;
}

float dot(const float* a, const float* b, int64_t n) {
  vf acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float out = hsum(acc);
  for (; i < n; ++i) out += a[i] * b[i];
  return out;
}

// Tokens [begin, end) of one row: candidates get their exact logit, the rest -inf.
void keep_candidates(float* s, const float* bound, float norm, float floor, const float* x, const float* weight,
                     int64_t hidden, int64_t begin, int64_t end) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = begin; j < end; ++j) {
    s[j] = s[j] + bound[j] * norm >= floor ? dot(x, weight + j * hidden, hidden) : kNegInf;
  }
}

at::Tensor screen_rows(at::Tensor screened, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bound) {
  TORCH_CHECK(screened.dim() == 2 && x.dim() == 2 && weight.dim() == 2 && bound.dim() == 1,
              "screen_rows: screened [rows, vocab], x [rows, hidden], weight [vocab, hidden], bound [vocab]");
  const int64_t rows = screened.size(0), vocab = screened.size(1), hidden = x.size(1);
  TORCH_CHECK(x.size(0) == rows && weight.size(0) == vocab && weight.size(1) == hidden && bound.size(0) == vocab,
              "screen_rows: the shapes disagree");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&screened), &x, &weight, &bound}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "screen_rows: contiguous float32 tensors only");
  }
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  float* s = screened.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>(), *bp = bound.data_ptr<float>();
  std::vector<float> norms(rows), part(rows * chunks), floors(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float n = 0.f;
    for (int64_t i = 0; i < hidden; ++i) n += std::abs(xp[r * hidden + i]);
    norms[r] = n;
  }
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t r = it / chunks, c = it % chunks;
      part[it] = floor_of(s + r * vocab, bp, norms[r], c * kChunk, std::min(vocab, (c + 1) * kChunk));
    }
  });
  for (int64_t r = 0; r < rows; ++r) floors[r] = *std::max_element(&part[r * chunks], &part[r * chunks] + chunks);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t r = it / chunks, c = it % chunks;
      keep_candidates(s + r * vocab, bp, norms[r], floors[r], xp + r * hidden, wp, hidden, c * kChunk,
                      std::min(vocab, (c + 1) * kChunk));
    }
  });
  return screened;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("greedy_rows(Tensor logits) -> (Tensor, Tensor)");
  m.def("screen_rows(Tensor(a!) screened, Tensor x, Tensor weight, Tensor bound) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("greedy_rows", &greedy_rows);
  m.impl("screen_rows", &screen_rows);
}
