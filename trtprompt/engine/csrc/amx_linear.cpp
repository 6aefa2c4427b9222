// y = x @ W^T in bfloat16 on AMX tiles (Intel Sapphire Rapids and later), for a decode step's rows.
//
// oneDNN's bf16 GEMM runs on AMX too, but for a call of 8-64 rows its per-call work and blocking cost
// as much as reading the weight: SmolLM2's 120 layer linears took about as long at 8 rows as at 32.
// Here the weight is packed once (pack_tiles in amx_linear.py) into the tile layout AMX multiplies by,
// 16 output rows x 32 columns per 1 KB tile, laid out in the order a task reads them, so a call streams
// the weight once, in order, and every tile of it meets all rows of x while it is in cache.
//
//   packed [N / 16, K / 32, 16, 32]: packed[nb, kb, r, 2 c + j] = W[16 nb + c, 32 kb + 2 r + j]
//   x bf16 [M, K] (any M; passes of 32 rows), y bf16 [M, N], summed in float32 (AMX's TDPBF16PS).
// The packed weight is bf16; or int8 with a float32 scale per output row (int8_wo), widened into bf16 in cache
// (exact: bf16 holds every int8), the sums scaled as they are written; or int4 (int4_wo) tiles of 256 bytes,
// byte i holding element i of the tile in its low nibble and element i + 256 in its high one, with the
// (scale, minimum) of each tile's 16 output rows [N / 16, K / 32, 2, 16]: widened as q * scale + minimum.
//
//
// Built only into the avx512 variant, in functions compiled for AMX; amx_bf16_ready() says whether this
// CPU has AMX-BF16 and Linux lets the process use its tile registers (they must be requested once).
// Design and figures: docs/design.md, "AMX linear".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 11
#define TRTPROMPT_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileRows = 16;   // rows of x (and output rows of W) per tile
constexpr int64_t kTileK = 32;      // bf16 columns per tile row (64 bytes)
constexpr int64_t kTileValues = kTileRows * kTileK;  // weights per B tile: 1 KB in bf16
constexpr int64_t kPassRows = 32;   // rows of x per pass: two A tiles
constexpr int64_t kBlockOut = 32;   // output columns a task takes at a time: two B tiles

#ifdef TRTPROMPT_AMX
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// Linux hands out the tile registers' state (8 KB per thread) only to a process that asked (arch_prctl).
bool request_tile_state() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return tile && bf16 && (a & (1u << 5));  // and AVX512_BF16, for the output's conversion
}

// The 64-byte operand of LDTILECFG: palette 1; tiles 0-3 are C (m tile i % 2, n tile i / 2), 4-5 A (rows of
// x), 6-7 B (the weight). Rows of the A and C tiles are the pass's rows of x in each half.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm statements that do not tell the compiler which memory they read or write
// (its _tile_loadconfig names only the config's first 8 bytes): the config is passed whole, and a barrier
// orders the stores a tile load reads and the loads of what a tile store wrote.
inline void load_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

TileConfig tile_config(int64_t m) {
  TileConfig cfg;
  const uint8_t lo = static_cast<uint8_t>(std::min(m, kTileRows)), hi = static_cast<uint8_t>(m - lo);
  const uint8_t m_rows[2] = {lo, hi};
  for (int t = 0; t < 4; ++t) cfg.rows[t] = m_rows[t % 2], cfg.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) cfg.rows[t] = m_rows[t - 4], cfg.colsb[t] = 64;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t = 0; t < 8; ++t)
    if (cfg.rows[t] == 0) cfg.colsb[t] = 0;  // an unused tile is configured empty
  return cfg;
}

// What the sums take on their way out: the int8 weight's row scale and the bias, where there are.
struct Epilogue {
  const float* scale;  // [N] or nullptr
  const float* bias;   // [N] or nullptr
};

// C tile (16 x 16 float32 in buf) rows [0, rows) into y[row0 + i, n0 : n0 + 16] as bf16, through the epilogue.
AMX_TARGET void store_tile(const float* buf, int64_t rows, c10::BFloat16* y, int64_t n_dim, int64_t row0, int64_t n0,
                           Epilogue ep) {
  const __m512 s = ep.scale ? _mm512_loadu_ps(ep.scale + n0) : _mm512_set1_ps(1.f);
  const __m512 b = ep.bias ? _mm512_loadu_ps(ep.bias + n0) : _mm512_setzero_ps();
  for (int64_t i = 0; i < rows; ++i) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_loadu_ps(buf + i * 16), s, b));
    std::memcpy(y + (row0 + i) * n_dim + n0, &v, 32);
  }
}

// Where a pass finds B tile (b, kb) of its block when they are bf16: in place, each step asking for the next
// block's share into L2 (the weight is two streams 18-48 KB apart; prefetching them this way took 0.83-0.88x
// the time of leaving it to the hardware).
struct Bf16Tiles {
  const c10::BFloat16* b0;
  const char* ahead;  // the next block's tiles, or nullptr
  int64_t kbs;
  const c10::BFloat16* at(int b, int64_t kb) const {
    const int64_t bytes = 2 * kTileValues;
    if (ahead != nullptr)
      for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(ahead + (b * kbs + kb) * bytes + l, 0, 1);
    return b0 + (b * kbs + kb) * kTileValues;
  }
};

// The packed weight as the kernel reads it. Tile t = nb * (K / 32) + kb.
enum class Format { kBf16, kInt8, kInt4 };

struct PackedWeight {
  const void* data;
  const float* tile_scale;  // int4: [N / 16, K / 32, 2, 16]; else nullptr
  Format format;
  int64_t n_dim, k_dim;
  int64_t tile_bytes() const {
    return format == Format::kBf16 ? 2 * kTileValues : format == Format::kInt8 ? kTileValues : kTileValues / 2;
  }
  const char* tile(int64_t t) const { return static_cast<const char*>(data) + t * tile_bytes(); }
};

// An int8 tile as bf16 into dst, prefetching `ahead` (a tile of the next block, or nullptr) into L2.
AMX_TARGET void widen_int8(const int8_t* src, const char* ahead, c10::BFloat16* dst) {
  if (ahead != nullptr)
    for (int64_t l = 0; l < kTileValues; l += 64) __builtin_prefetch(ahead + l, 0, 1);
  for (int64_t i = 0; i < kTileValues; i += 32) {
    const __m128i* p = reinterpret_cast<const __m128i*>(src + i);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// An int4 tile as bf16 into dst: q * scale + minimum of its output row (a tile row's lanes 2c and 2c + 1 are
// output row c's), rounded to bf16 as the dense path's dequantized weight is.
AMX_TARGET void widen_int4(const uint8_t* src, const float* sm, const char* ahead, c10::BFloat16* dst) {
  if (ahead != nullptr)
    for (int64_t l = 0; l < kTileValues / 2; l += 64) __builtin_prefetch(ahead + l, 0, 1);
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 s = _mm512_loadu_ps(sm), m = _mm512_loadu_ps(sm + 16);
  const __m512 s0 = _mm512_permutexvar_ps(first, s), s1 = _mm512_permutexvar_ps(second, s);
  const __m512 m0 = _mm512_permutexvar_ps(first, m), m1 = _mm512_permutexvar_ps(second, m);
  const __m256i low = _mm256_set1_epi8(15);
  for (int half = 0; half < 2; ++half) {
    for (int64_t i = 0; i < kTileValues / 2; i += 32) {  // one tile row: elements half * 256 + i .. + 31
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      q = _mm256_and_si256(half ? _mm256_srli_epi16(q, 4) : q, low);
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
      const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(b, s1, m1), _mm512_fmadd_ps(a, s0, m0));
      _mm512_storeu_si512(dst + half * kTileValues / 2 + i, (__m512i)v);
    }
  }
}

// Quantized tile t as bf16 into dst; `ahead` >= 0: the tile of the next block to prefetch.
AMX_TARGET void widen_tile(const PackedWeight& w, int64_t t, int64_t ahead, c10::BFloat16* dst) {
  const char* next = ahead >= 0 ? w.tile(ahead) : nullptr;
  if (w.format == Format::kInt8)
    widen_int8(reinterpret_cast<const int8_t*>(w.tile(t)), next, dst);
  else
    widen_int4(reinterpret_cast<const uint8_t*>(w.tile(t)), w.tile_scale + t * 2 * kTileRows, next, dst);
}

// Where a pass finds int8 / int4 B tiles: widened one at a time into a 2 KB buffer that stays in L1 (one pass
// only: each pass would widen them again).
struct QuantTiles {
  const PackedWeight* w;
  int64_t first;  // the block's first tile
  int64_t ahead;  // tiles on to prefetch (the next block), 0 for none
  int64_t kbs;
  c10::BFloat16* buf;  // [2][kTileValues]
  const c10::BFloat16* at(int b, int64_t kb) const {
    const int64_t t = first + b * kbs + kb;
    widen_tile(*w, t, ahead ? t + ahead : -1, buf + b * kTileValues);
    memory_barrier();
    return buf + b * kTileValues;
  }
};

// One pass (m <= 32 rows of x from x0) times kBlocks (1 or 2) B tiles' columns, output columns from n0.
template <int kBlocks, typename Tiles>
AMX_TARGET void pass_block(const c10::BFloat16* x0, int64_t m, int64_t k_dim, const Tiles& tiles, c10::BFloat16* y,
                           int64_t n_dim, int64_t row0, int64_t n0, Epilogue ep) {
  const int64_t kbs = k_dim / kTileK, x_stride = k_dim * 2;
  const bool two = m > kTileRows;
  _tile_zero(0);
  _tile_zero(2);
  if (two) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kbs; ++kb) {
    _tile_loadd(4, x0 + kb * kTileK, x_stride);
    if (two) _tile_loadd(5, x0 + kTileRows * k_dim + kb * kTileK, x_stride);
    _tile_loadd(6, tiles.at(0, kb), 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(1, 5, 6);
    if constexpr (kBlocks == 2) {
      _tile_loadd(7, tiles.at(1, kb), 64);
      _tile_dpbf16ps(2, 4, 7);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float buf[4][256];
  _tile_stored(0, buf[0], 64);
  if (two) _tile_stored(1, buf[1], 64);
  if constexpr (kBlocks == 2) {
    _tile_stored(2, buf[2], 64);
    if (two) _tile_stored(3, buf[3], 64);
  }
  memory_barrier();
  const int64_t lo = std::min(m, kTileRows);
  for (int b = 0; b < kBlocks; ++b) {
    store_tile(buf[2 * b], lo, y, n_dim, row0, n0 + b * kTileRows, ep);
    if (two) store_tile(buf[2 * b + 1], m - lo, y, n_dim, row0 + kTileRows, n0 + b * kTileRows, ep);
  }
}

template <typename Tiles>
AMX_TARGET void pass_blocks(const c10::BFloat16* x0, int64_t m, int64_t blocks, const PackedWeight& w,
                            const Tiles& tiles, c10::BFloat16* y, int64_t row0, int64_t n0, Epilogue ep) {
  if (blocks == 2)
    pass_block<2>(x0, m, w.k_dim, tiles, y, w.n_dim, row0, n0, ep);
  else
    pass_block<1>(x0, m, w.k_dim, tiles, y, w.n_dim, row0, n0, ep);
}

// Output columns [n0, n1) (multiples of 16) for every row of x: each pair of B tiles meets every pass.
// Quantized tiles are widened as they are read where one pass covers x, else a block at a time into a
// buffer (L2) that every pass reads.
AMX_TARGET void run_columns(const c10::BFloat16* x, int64_t m_dim, const PackedWeight& w, int64_t n0, int64_t n1,
                            c10::BFloat16* y, Epilogue ep) {
  const int64_t kbs = w.k_dim / kTileK, tiles_end = w.n_dim / kTileRows;
  const bool one_pass = m_dim <= kPassRows, quant = w.format != Format::kBf16;
  std::vector<c10::BFloat16> widened(quant ? (one_pass ? 2 : 2 * kbs) * kTileValues : 0);
  int64_t configured = -1;
  for (int64_t n = n0; n < n1; n += kBlockOut) {
    const int64_t nb = n / kTileRows, blocks = std::min<int64_t>(2, (n1 - n) / kTileRows);
    const int64_t first = nb * kbs, span = blocks * kbs;  // the block's tiles
    const bool fetch = std::min<int64_t>(2, tiles_end - nb - blocks) == blocks;  // the next block is as large
    const c10::BFloat16* b16 = static_cast<const c10::BFloat16*>(w.data) + first * kTileValues;
    if (quant && !one_pass) {
      for (int64_t t = 0; t < span; ++t)
        widen_tile(w, first + t, fetch ? first + t + span : -1, &widened[t * kTileValues]);
      memory_barrier();
      b16 = widened.data();
    }
    for (int64_t r0 = 0; r0 < m_dim; r0 += kPassRows) {
      const int64_t m = std::min(kPassRows, m_dim - r0);
      if (m != configured) {
        load_config(tile_config(m));
        configured = m;
      }
      const c10::BFloat16* x0 = x + r0 * w.k_dim;
      if (quant && one_pass) {
        const QuantTiles tiles{&w, first, fetch ? span : 0, kbs, widened.data()};
        pass_blocks(x0, m, blocks, w, tiles, y, r0, n, ep);
      } else {
        // later passes find the tiles in cache; widened tiles were prefetched as they were widened
        const bool ask = r0 == 0 && fetch && !quant;
        const Bf16Tiles tiles{b16, ask ? reinterpret_cast<const char*>(b16 + span * kTileValues) : nullptr, kbs};
        pass_blocks(x0, m, blocks, w, tiles, y, r0, n, ep);
      }
    }
  }
  _tile_release();
}
#endif

bool amx_bf16_ready() {
#ifdef TRTPROMPT_AMX
  static const bool ready = cpu_has_amx_bf16() && request_tile_state();
  return ready;
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_bf16_ready(), "amx_linear: this CPU or kernel variant has no usable AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "amx_linear: x must be a contiguous bfloat16 [M, K] tensor");
  const auto st = packed.scalar_type();
  const bool int4 = st == at::kByte, int8 = st == at::kChar;
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && (int4 || int8 || st == at::kBFloat16) &&
                  packed.size(2) == kTileRows && packed.size(3) == (int4 ? kTileK / 2 : kTileK),
              "amx_linear: packed must be a contiguous bfloat16 or int8 [N / 16, K / 32, 16, 32] tensor, or uint8 "
              "[N / 16, K / 32, 16, 16] (int4)");
  const int64_t n_dim = packed.size(0) * kTileRows, k_dim = packed.size(1) * kTileK, m_dim = x.size(0);
  TORCH_CHECK(x.size(1) == k_dim, "amx_linear: x has ", x.size(1), " columns, the packed weight ", k_dim);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == n_dim),
              "amx_linear: bias must be a contiguous float32 [N]");
  TORCH_CHECK((int8 || int4) == scale.has_value(),
              "amx_linear: an int8 or int4 packed weight needs its scale, a bf16 one none");
  TORCH_CHECK(!int8 || (scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == n_dim),
              "amx_linear: an int8 weight's scale must be a contiguous float32 [N]");
  TORCH_CHECK(!int4 || (scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->dim() == 4 &&
                        scale->size(0) == packed.size(0) && scale->size(1) == packed.size(1) &&
                        scale->size(2) == 2 && scale->size(3) == kTileRows),
              "amx_linear: an int4 weight's scale must be a contiguous float32 [N / 16, K / 32, 2, 16]");
  at::Tensor y = at::empty({m_dim, n_dim}, x.options());
  if (m_dim == 0) return y;
#ifdef TRTPROMPT_AMX
  const Epilogue ep{int8 ? scale->data_ptr<float>() : nullptr, bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const Format format = int8 ? Format::kInt8 : int4 ? Format::kInt4 : Format::kBf16;
  const PackedWeight w{packed.data_ptr(), int4 ? scale->data_ptr<float>() : nullptr, format, n_dim, k_dim};
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // Tasks of whole 32-column blocks; a thread configures its tiles once per task.
  const int64_t blocks = (n_dim + kBlockOut - 1) / kBlockOut;
  at::parallel_for(0, blocks, 1, [&](int64_t t0, int64_t t1) {
    run_columns(xp, m_dim, w, t0 * kBlockOut, std::min(n_dim, t1 * kBlockOut), yp, ep);
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtprompt, m) {
  m.def("amx_bf16_ready() -> bool", &amx_bf16_ready);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(trtprompt, CPU, m) {
  m.impl("amx_linear", &amx_linear);
}
