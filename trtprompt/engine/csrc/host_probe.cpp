// The vector FMA units' rate on this host now, for benchmark reports (bench/host_speed.py).
//
// A shared host's speed moves by up to 1.6x within minutes (other tenants), and a ratio between two runtimes
// means little without the state the host was in. Each thread runs kChains independent chains of vector
// multiply-adds on registers only (no loads or stores in the loop): enough chains to cover the FMA latency
// on every variant's vector width, so the figure is the units' rate, not a kernel's.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <chrono>
#include <vector>

namespace {

using namespace trtprompt_vec;

// Two FMA pipes x ~4 cycles' latency need 8 chains in flight; 12 leave room on every variant.
constexpr int kChains = 12;

// GFLOP/s of all threads together over `iterations` rounds of kChains FMAs each.
double fma_rate(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "fma_rate: iterations must be positive");
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads, 0.f);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      vf acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = splat(static_cast<float>(c + t));
      const vf mul = splat(0.999f), add = splat(0.001f);
      for (int64_t i = 0; i < iterations; ++i)
        for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * mul + add;
      vf total = acc[0];
      for (int c = 1; c < kChains; ++c) total += acc[c];
      sink[t] = hsum(total);
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  asm volatile("" : : "g"(sink.data()) : "memory");  // the chains' results are read: the loop stays
  return 2.0 * kLanes * kChains * static_cast<double>(iterations) * threads / seconds / 1e9;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("fma_rate(int iterations) -> float", &fma_rate);
}
