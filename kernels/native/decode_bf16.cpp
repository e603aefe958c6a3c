// Decode's CPU kernels in bf16, on x86 CPUs with AVX512-BF16: the few-row product (linear_bf16),
// the routed experts of a few tokens (moe_pairs), MLA decode attention over the
// paged cache (mla_decode; on the AMX tile unit, for any batch, where it can), RMSNorm with its residual add (rms_norm) and rotary embedding (rotary). Pointers arrive as integers (torch.Tensor.data_ptr()); the Python
// wrappers in __init__.py check shapes, dtypes and strides.
//
//   y[m, n] = sum_k x[m, k] * w[n, k]     x [M, K], w [N, K], y [M, N]; bf16 in and out
//
// With a handful of rows the product is bound by reading w, and the BLAS behind torch spends
// more on each call than on the bytes: a 512 x 512 bf16 weight (0.5 MB) took ~125 us at one row
// through torch, 4 GB/s, where the memory gives ~20. This kernel reads each weight row once for
// all rows of x, multiplies bf16 pairs with VDPBF16PS (exact products, float32 sums, as the BLAS
// does), and rounds each sum to bf16 to nearest-even (as torch's bf16 matmul does).
//
// Layout: the N output columns are shared over threads (torch's, or the kernels' own pool: see
// use_pool) when the weight is large enough to pay for it, in chunks of whole column steps;
// within a chunk, columns go in tiles of TILE_N, and each tile for every row of x in blocks of ROWS_PER_PASS, COLS columns at a time
// (ROWS_PER_PASS x COLS accumulators, each x vector loaded once per COLS columns), so a weight row
// is read from memory once and from L1 for the following blocks. x is small (M rows of K) and
// stays in L1.

#include <ATen/Parallel.h>
#include <pthread.h>
#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "pool.h"

namespace {

constexpr int64_t TILE_N = 16;        // columns converted to bf16 together
constexpr int64_t ROWS_PER_PASS = 4;  // rows of x accumulated at once per weight row
constexpr int COLS = 4;               // weight rows (output columns) accumulated at once
// How a call's work is shared, set by use_pool:
// - over torch's OpenMP threads (at::parallel_for), only from OMP_MIN_BYTES of weight (or of
//   cache, for attention). A parallel region ends in a barrier that waits for every thread, and on
//   a shared or busy CPU a descheduled thread holds it for a scheduler tick: a batch-1 step of the
//   bench model took 570 ms instead of 28 with every product split that way. One thread reads a
//   layer's 0.25-1 MB weights at 7-8 GB/s; the LM head (32 MB) still gains 1.3x from two.
// - over the kernels' own pool (pool.h), from POOL_MIN_BYTES: its caller never waits on a helper
//   that is not running, so even a layer's small products are split safely: 1.2-1.8x on one
//   row through 0.5-2 MB weights.
//   But its helpers spin between calls, as OpenMP's do after a region: the two pools spinning
//   at once on two cores starve each other (a batch-8 step, whose attention is torch's, 19 ->
//   32 ms). So the engine turns it on only for steps whose work is all native (use_pool).
constexpr int64_t OMP_MIN_BYTES = int64_t(4) << 20;
constexpr int64_t POOL_MIN_BYTES = int64_t(128) << 10;
// The tile attention is bound by reading the cache: from 1 MB of it two OpenMP threads pay (a
// batch-8 step's attention, bench model, ~250 cached tokens: 2.0 -> 1.4 ms).
constexpr int64_t TILE_ATTENTION_OMP_MIN_BYTES = int64_t(1) << 20;
constexpr int64_t CHUNK_BYTES = int64_t(64) << 10;  // about this much weight per chunk

int64_t g_pool_min_bytes = POOL_MIN_BYTES;  // set_pool_min_bytes: tests and benchmarks
std::mutex g_pool_lock;
std::atomic<pool::Pool*> g_pool{nullptr};
std::atomic<int> g_pool_threads{0};  // the pool's threads, the caller's included; 0: OpenMP's instead

// Sets the pool's threshold (negative: POOL_MIN_BYTES); -> the one it replaces.
int64_t set_pool_min_bytes(int64_t bytes) {
  const int64_t before = g_pool_min_bytes;
  g_pool_min_bytes = bytes < 0 ? POOL_MIN_BYTES : bytes;
  return before;
}

// threads >= 1: calls share their work over the pool, with that many threads (the caller's
// included); 0: over torch's OpenMP threads. -> the setting it replaces.
int64_t use_pool(int64_t threads) { return g_pool_threads.exchange(int(std::max<int64_t>(0, threads))); }

// The pool with `want` threads (helpers = want - 1). Rebuilt when the count changes, and in a
// forked child (whose helpers did not survive the fork); a pool replaced is left to its sleeping
// helpers, never freed, as a call may still be using it.
pool::Pool& pool_of(int want) {
  pool::Pool* p = g_pool.load();
  if (p != nullptr && p->threads() == want) return *p;
  std::lock_guard<std::mutex> hold(g_pool_lock);
  p = g_pool.load();
  if (p == nullptr || p->threads() != want) g_pool.store(p = new pool::Pool(want - 1));
  return *p;
}

// Threads a parallel call may use now.
int threads_now() {
  const int pooled = g_pool_threads.load();
  return pooled > 0 ? pooled : std::max(1, at::get_num_threads());
}

// f(begin, end) over [0, n), in chunks of `chunk`, shared when `bytes` of memory are read (see above).
// omp_min_bytes: where OpenMP's threads start (the tile attention, bound by reading the cache,
// gains from two threads from less).
template <typename F>
inline void maybe_parallel(int64_t n, int64_t chunk, int64_t bytes, const F& f, int64_t omp_min_bytes = OMP_MIN_BYTES) {
  const int pooled = g_pool_threads.load();
  chunk = std::max<int64_t>(1, chunk);
  if (pooled > 0 && bytes >= g_pool_min_bytes) {
    pool_of(pooled).run(n, chunk, f);
  } else if (pooled == 0 && bytes >= omp_min_bytes) {
    at::parallel_for(0, n, chunk, f);
  } else if (n > 0) {
    f(0, n);
  }
}

// The K-dimension lanes of one 32-element step: every lane, or the tail's first `left`.
inline __mmask32 lanes(int64_t left) {
  return left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
}

// out[r][c] = x[m0 + r] . w[n0 + c] for ROWS rows and COLS columns at once: each k step loads
// the COLS weight vectors and the ROWS x vectors once and issues ROWS x COLS VDPBF16PS. A tail of
// fewer than COLS columns repeats its last column (computed, not stored).
template <int ROWS>
inline void dot_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                      int64_t cols, float out[][COLS]) {
  const uint16_t* w_rows[COLS];
  for (int c = 0; c < COLS; ++c) w_rows[c] = w + (c < cols ? c : cols - 1) * ldw;
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = lanes(K - k);
    __m512bh wv[COLS];
    for (int c = 0; c < COLS; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w_rows[c] + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

// Rows m0 .. m0 + rows (rows <= ROWS_PER_PASS) of columns t0 .. t0 + width into tile.
inline void dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                     int64_t rows, int64_t width, float tile[][TILE_N]) {
  for (int64_t j = 0; j < width; j += COLS) {
    const int64_t cols = width - j < COLS ? width - j : COLS;
    float out[ROWS_PER_PASS][COLS];
    const uint16_t* wj = w + j * ldw;
    switch (rows) {
      case 1: dot_block<1>(x, ldx, wj, ldw, K, cols, out); break;
      case 2: dot_block<2>(x, ldx, wj, ldw, K, cols, out); break;
      case 3: dot_block<3>(x, ldx, wj, ldw, K, cols, out); break;
      default: dot_block<4>(x, ldx, wj, ldw, K, cols, out); break;
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) tile[r][j + c] = out[r][c];
  }
}

// Columns n0 .. n1 of y, all M rows.
void columns(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, uint16_t* y, int64_t ldy,
             int64_t M, int64_t K, int64_t n0, int64_t n1) {
  alignas(64) float tile[ROWS_PER_PASS][TILE_N];
  for (int64_t t0 = n0; t0 < n1; t0 += TILE_N) {
    const int64_t width = n1 - t0 < TILE_N ? n1 - t0 : TILE_N;
    const __mmask16 out_mask = width == TILE_N ? __mmask16(0xFFFF) : (__mmask16(1) << width) - 1;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
      const int64_t rows = M - m0 < ROWS_PER_PASS ? M - m0 : ROWS_PER_PASS;
      dot_tile(x + m0 * ldx, ldx, w + t0 * ldw, ldw, K, rows, width, tile);
      for (int64_t r = 0; r < rows; ++r) {
        const __m256bh packed = _mm512_cvtneps_pbh(_mm512_load_ps(tile[r]));
        _mm256_mask_storeu_epi16(y + (m0 + r) * ldy + t0, out_mask, (__m256i)packed);
      }
    }
  }
}

// ---- AMX: the same product on the tile unit, where the CPU has it (AMX-BF16) ----------------
//
// VDPBF16PS does 32 multiply-adds per instruction and each output still ends in a horizontal
// sum, so from 2 rows on `columns` is bound by arithmetic (about 20 G multiply-adds/s on one
// core here). A TDPBF16PS does 16 x 16 x 32 at once: a product of up to 32 rows then costs what
// reading its weight costs. The weight is the tile product's A operand as it lies in memory (16
// weight rows of 32 values, a row stride apart), so nothing is repacked; x, small, is the B
// operand, transposed into pairs (VNNI layout) once per call: C^T[n, m] = sum_k w[n, k] x[m, k].
// Every row of x gets the same operations whatever M is, so a row's result does not depend on
// the rows beside it (a speculative verification computes each token as a one-token decode).

bool g_amx_granted = false;  // Linux granted this process the tile state (the CPU has the unit)
bool g_amx = false;          // the products use it

// Asks for the tile state once; then turns the AMX products on or off (on only where granted).
bool use_amx(bool on) {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (on && !g_amx_granted) g_amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  g_amx = on && g_amx_granted;
  return g_amx;
}

constexpr int64_t AMX_N = 32;  // weight rows per step: two C tiles of 16
constexpr int64_t AMX_M = 32;  // rows of x per pass: two B tiles of 16
constexpr int64_t AMX_K = 32;  // K per tile product (16 pairs)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 C (n half x m half), 4-5 A (the two weight halves), 6-7 B (the two x halves).
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12's declares a read of 8 bytes only, and the stores above were dropped.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// Columns [n0, n1) (n1 - n0 a multiple of AMX_N) of rows [0, M) (M <= AMX_M) from xt, x packed as
// xt[k / 2][m][2] for 32 rows (rows past M zero). K a multiple of AMX_K.
__attribute__((target("amx-tile,amx-bf16"))) void amx_columns(const uint32_t* xt, const uint16_t* w, int64_t ldw,
                                                                uint16_t* y, int64_t ldy, int64_t M, int64_t K,
                                                                int64_t n0, int64_t n1) {
  alignas(64) float c[16 * 16];
  const bool two = M > 16;
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t n = n0; n < n1; n += AMX_N) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += AMX_K) {
      const uint32_t* b = xt + (k / 2) * AMX_M;  // 16 pair rows of 32 m (64 + 64 bytes)
      _tile_loadd(6, b, AMX_M * 4);
      if (two) _tile_loadd(7, b + 16, AMX_M * 4);
      _tile_loadd(4, w + n * ldw + k, ldw * 2);
      _tile_loadd(5, w + (n + 16) * ldw + k, ldw * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    for (int t = 0; t < (two ? 4 : 2); ++t) {  // C tile t: c[n' * 16 + m'] -> y[m_base + m'][n + ...]
      switch (t) {
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      const int64_t n_base = n + (t % 2) * 16, m_base = (t / 2) * 16;
      for (int64_t m = m_base; m < std::min(M, m_base + 16); ++m) {
        const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(int(m - m_base))), c, 4);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n_base), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// x rows [m0, m0 + rows) (rows <= AMX_M) as xt[k / 2][m][2], rows past `rows` zero.
inline void pack_pairs(const uint16_t* x, int64_t ldx, int64_t rows, int64_t K, std::vector<uint32_t>& xt) {
  xt.assign((K / 2) * AMX_M, 0u);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < K / 2; ++i) std::memcpy(&xt[i * AMX_M + m], x + m * ldx + 2 * i, 4);  // (x[2i], x[2i+1])
}

// Whether columns of a product with inner dimension K run on the tile unit (whole AMX_N steps).
inline bool amx_takes(int64_t K) { return g_amx && K % AMX_K == 0; }

// Columns [n0, n1) of y = x w^T, all M rows: on the tile unit where it can (amx_takes, whole
// 32-column steps), `columns` for the rest. xt: x already packed by pack_pairs (M <= AMX_M), or
// null to pack here.
void product(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, uint16_t* y, int64_t ldy, int64_t M,
             int64_t K, int64_t n0, int64_t n1, const uint32_t* xt = nullptr) {
  const int64_t n_amx = amx_takes(K) ? n0 + (n1 - n0) / AMX_N * AMX_N : n0;
  if (n_amx > n0) {
    amx_configure();
    if (xt != nullptr && M <= AMX_M) {
      amx_columns(xt, w, ldw, y, ldy, M, K, n0, n_amx);
    } else {
      std::vector<uint32_t> packed;
      for (int64_t m0 = 0; m0 < M; m0 += AMX_M) {
        const int64_t rows = std::min(AMX_M, M - m0);
        pack_pairs(x + m0 * ldx, ldx, rows, K, packed);
        amx_columns(packed.data(), w, ldw, y + m0 * ldy, ldy, rows, K, n0, n_amx);
      }
    }
  }
  if (n_amx < n1) columns(x, ldx, w, ldw, y, ldy, M, K, n_amx, n1);
}

// Pointers as integers (torch.Tensor.data_ptr()): the Python wrapper checks shapes, dtypes and
// strides, so this file needs neither torch's tensor headers nor their build time. B products
// y[b] = x[b] @ w[b]^T (B = 1 for a plain linear; the heads of attention's absorbed products
// otherwise), their columns shared over the threads together in chunks of whole AMX steps; on
// the tile unit, each x[b] is packed once before.
void linear_bf16(int64_t x_ptr, int64_t x_batch, int64_t ldx, int64_t w_ptr, int64_t w_batch, int64_t ldw,
                 int64_t y_ptr, int64_t y_batch, int64_t ldy, int64_t B, int64_t M, int64_t N, int64_t K) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* w = reinterpret_cast<const uint16_t*>(w_ptr);
  auto* y = reinterpret_cast<uint16_t*>(y_ptr);
  const int64_t steps = (N + AMX_N - 1) / AMX_N;  // a chunk is whole 32-column steps
  std::vector<std::vector<uint32_t>> packed(amx_takes(K) && M <= AMX_M && N >= AMX_N ? B : 0);
  for (int64_t b = 0; b < int64_t(packed.size()); ++b) pack_pairs(x + b * x_batch, ldx, M, K, packed[b]);
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (AMX_N * K * 2));  // steps per chunk
  maybe_parallel(B * steps, chunk, B * N * K * 2, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {  // [i0, i1) may span several products: one step range each
      const int64_t b = i / steps, s0 = i % steps, s1 = std::min(steps, s0 + (i1 - i));
      product(x + b * x_batch, ldx, w + b * w_batch, ldw, y + b * y_batch, ldy, M, K, s0 * AMX_N,
              std::min(N, s1 * AMX_N), packed.empty() ? nullptr : packed[b].data());
      i += s1 - s0;
    }
  });
}


// bf16 <-> float32, rounding to nearest even (as torch does; NaN stays NaN).
inline float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// The experts of a few decode tokens, given as (expert, token, weight) pairs grouped by expert
// (kernels/moe.py _fused_moe_few passes them in ascending expert order, then the shared expert's),
// with the torch loop's arithmetic and roundings:
//   gate_up = bf16(x[t] @ w13[e]^T)                       [2I]
//   act     = bf16(bf16(silu(gate)) * up)                  [I]
//   out[t]  = bf16(out[t] + bf16(bf16(act @ w2[e]^T) * weight))
// Expert -1 is the shared expert (its own weights s13 [2Is, H], s2 [H, Is]; weight 1, added after
// a token's routed experts, as `out + shared(x)` rounds). An expert's pairs (a run of equal
// experts) are one product of their rows, so its weights are read once. Experts are shared over
// the threads whole (one thread streams an expert's weights end to end: 35 GB/s on two threads
// at batch 1, where splitting every expert's products by columns, in two rounds, reached 25);
// each pair's scaled output lands in its own row, and the additions into out then run in pair
// order on one thread, so the sums round exactly as the loop's.
void moe_pairs(int64_t x_ptr, int64_t ldx, int64_t w13_ptr, int64_t w13_expert, int64_t ld13, int64_t w2_ptr,
               int64_t w2_expert, int64_t ld2, int64_t out_ptr, int64_t ldo, const std::vector<int64_t>& experts,
               const std::vector<int64_t>& tokens, const std::vector<float>& weights, int64_t H, int64_t I,
               int64_t s13_ptr, int64_t ld_s13, int64_t s2_ptr, int64_t ld_s2, int64_t Is) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* w13 = reinterpret_cast<const uint16_t*>(w13_ptr);
  const auto* w2 = reinterpret_cast<const uint16_t*>(w2_ptr);
  const auto* s13 = reinterpret_cast<const uint16_t*>(s13_ptr);
  const auto* s2 = reinterpret_cast<const uint16_t*>(s2_ptr);
  auto* out = reinterpret_cast<uint16_t*>(out_ptr);
  const int64_t P = int64_t(experts.size());
  std::vector<int64_t> runs;  // [runs[r], runs[r + 1]): the pairs of one expert
  for (int64_t p = 0; p < P; ++p)
    if (p == 0 || experts[p] != experts[p - 1]) runs.push_back(p);
  runs.push_back(P);
  const int64_t R = int64_t(runs.size()) - 1;
  std::vector<uint16_t> scaled(P * H);  // [P, H]: bf16(bf16(down) * weight) of each pair
  maybe_parallel(R, 1, R * 3 * I * H * 2, [&](int64_t r0, int64_t r1) {
    std::vector<uint16_t> xs, gate_up, act, down;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t p0 = runs[r], m = runs[r + 1] - p0, e = experts[p0];
      const bool shared = e < 0;
      const int64_t inter = shared ? Is : I;
      const uint16_t* we13 = shared ? s13 : w13 + e * w13_expert;
      const uint16_t* we2 = shared ? s2 : w2 + e * w2_expert;
      xs.resize(m * H), gate_up.resize(m * 2 * inter), act.resize(m * inter), down.resize(m * H);
      for (int64_t i = 0; i < m; ++i) std::memcpy(&xs[i * H], x + tokens[p0 + i] * ldx, H * 2);
      product(xs.data(), H, we13, shared ? ld_s13 : ld13, gate_up.data(), 2 * inter, m, H, 0, 2 * inter);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < inter; ++j) {
          const float g = from_bf16(gate_up[i * 2 * inter + j]);
          const float silu = from_bf16(to_bf16(g / (1.0f + std::exp(-g))));
          act[i * inter + j] = to_bf16(silu * from_bf16(gate_up[i * 2 * inter + inter + j]));
        }
      product(act.data(), inter, we2, shared ? ld_s2 : ld2, down.data(), H, m, inter, 0, H);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t h = 0; h < H; ++h)
          scaled[(p0 + i) * H + h] = to_bf16(from_bf16(down[i * H + h]) * weights[p0 + i]);
    }
  });
  for (int64_t p = 0; p < P; ++p) {
    uint16_t* ot = out + tokens[p] * ldo;
    const uint16_t* sp = &scaled[p * H];
    for (int64_t h = 0; h < H; ++h) ot[h] = to_bf16(from_bf16(ot[h]) + from_bf16(sp[h]));
  }
}


// The experts of T tokens from their top-k ids [T, K] (int64; -1: an expert on another rank) and
// weights [T, K] (float32): moe_pairs over their pairs grouped by expert in ascending order, an
// expert's pairs in (token, k) order (kernels/moe.py _fused_moe_few's order), then the shared
// expert's when s13_ptr is given. Returns the count of ids >= E (0: fine; the caller raises).
int64_t moe_topk(int64_t x_ptr, int64_t ldx, int64_t w13_ptr, int64_t w13_expert, int64_t ld13, int64_t w2_ptr,
                 int64_t w2_expert, int64_t ld2, int64_t out_ptr, int64_t ldo, int64_t ids_ptr, int64_t weights_ptr,
                 int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, int64_t s13_ptr, int64_t ld_s13,
                 int64_t s2_ptr, int64_t ld_s2, int64_t Is) {
  const auto* ids = reinterpret_cast<const int64_t*>(ids_ptr);
  const auto* topk_weights = reinterpret_cast<const float*>(weights_ptr);
  std::vector<int64_t> pairs;  // flat (token, k) indices of the local experts' pairs
  int64_t bad = 0;
  for (int64_t p = 0; p < T * K; ++p) {
    if (ids[p] >= E) ++bad;
    if (ids[p] >= 0) pairs.push_back(p);
  }
  if (bad != 0) return bad;
  std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<int64_t> experts, tokens;
  std::vector<float> weights;
  for (const int64_t p : pairs) experts.push_back(ids[p]), tokens.push_back(p / K), weights.push_back(topk_weights[p]);
  if (s13_ptr != 0)
    for (int64_t t = 0; t < T; ++t) experts.push_back(-1), tokens.push_back(t), weights.push_back(1.0f);
  moe_pairs(x_ptr, ldx, w13_ptr, w13_expert, ld13, w2_ptr, w2_expert, ld2, out_ptr, ldo, experts, tokens, weights, H,
            I, s13_ptr, ld_s13, s2_ptr, ld_s2, Is);
  return 0;
}


// MLA decode attention, one query token per sequence, over the paged latent cache (the math of
// kernels/mla.py), with the torch path's roundings (_mla_decode_fast):
//   s[h, j]  = bf16(bf16(q[b, h] . cache[j]) * scale)      j < seq_lens[b]
//   p[h]     = bf16(softmax_j(s[h]))                        (float32 inside)
//   o[b, h]  = bf16(sum_j p[h, j] * cache[j, :L])
// Cache row j of sequence b is row j % block_size of block block_table[b, j / block_size], read
// in place (no gather). A work item is a sequence and a range of its heads (all of them unless
// there are fewer sequences than threads); each cache row is loaded once per HEAD_GROUP heads for
// the scores and once for all the item's heads for the output, whose float32 sums stay in L1.
constexpr int64_t HEAD_GROUP = 8;

// Scores s[0, len) -> their softmax rounded to bf16 (float32 inside), in place; 0 where every
// score is -inf (all rows refused).
inline void softmax_rounded(float* s, int64_t len) {
  __m512 tops = _mm512_set1_ps(-INFINITY);  // the maximum in lanes (exact in any order)
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(s + i));
  float top = _mm512_reduce_max_ps(tops), total = 0.0f;
  for (; i < len; ++i) top = std::max(top, s[i]);
  for (int64_t j = 0; j < len; ++j) total += (s[j] = top == -INFINITY ? 0.0f : std::exp(s[j] - top));
  for (int64_t j = 0; j < len; ++j) s[j] = total > 0.0f ? from_bf16(to_bf16(s[j] / total)) : 0.0f;
}

// A thread's buffers for the attention of its sequences, reused from one to the next.
struct AttendScratch {
  std::vector<float> s, acc;     // scores [heads, len], float32 output sums [heads, L]
  std::vector<uint32_t> pairs;   // q in pairs (amx_attend)
  std::vector<uint16_t> probs;   // bf16 probabilities, 16 rows of whole 32-row steps (amx_attend)
};

void attend(const uint16_t* q, int64_t q_h, const uint16_t* kv, int64_t kv_block, int64_t kv_row,
            int64_t num_blocks, int64_t block_size, const int32_t* table, int64_t len, uint16_t* o, int64_t o_h,
            int64_t heads, int64_t W, int64_t L, float scale, AttendScratch& scratch, std::atomic<int64_t>& bad) {
  std::vector<float>&s = scratch.s, &acc = scratch.acc;
  s.assign(heads * len, 0.0f);  // [heads, len]
  acc.assign(heads * L, 0.0f);  // [heads, L]
  auto row_of = [&](int64_t j) -> const uint16_t* {
    const int32_t block = table[j / block_size];
    if (block < 0 || block >= num_blocks) return nullptr;
    return kv + block * kv_block + (j % block_size) * kv_row;
  };
  for (int64_t h0 = 0; h0 < heads; h0 += HEAD_GROUP) {
    const int64_t group = std::min(HEAD_GROUP, heads - h0);
    for (int64_t j = 0; j < len; ++j) {
      const uint16_t* row = row_of(j);
      if (row == nullptr) {
        bad.fetch_add(1);
        for (int64_t g = 0; g < group; ++g) s[(h0 + g) * len + j] = -INFINITY;
        continue;
      }
      __m512 dot[HEAD_GROUP];
      for (int64_t g = 0; g < group; ++g) dot[g] = _mm512_setzero_ps();
      for (int64_t k = 0; k < W; k += 32) {
        const __mmask32 mask = lanes(W - k);
        const __m512bh kv_k = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
        for (int64_t g = 0; g < group; ++g)
          dot[g] = _mm512_dpbf16_ps(dot[g], kv_k, (__m512bh)_mm512_maskz_loadu_epi16(mask, q + (h0 + g) * q_h + k));
      }
      for (int64_t g = 0; g < group; ++g)
        s[(h0 + g) * len + j] = from_bf16(to_bf16(from_bf16(to_bf16(_mm512_reduce_add_ps(dot[g]))) * scale));
    }
  }
  for (int64_t h = 0; h < heads; ++h) softmax_rounded(&s[h * len], len);
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* row = row_of(j);
    if (row == nullptr) continue;
    int64_t l = 0;
    for (; l + 16 <= L; l += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + l)));
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      for (int64_t h = 0; h < heads; ++h) {
        float* a = &acc[h * L + l];
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(s[h * len + j]), v, _mm512_loadu_ps(a)));
      }
    }
    for (; l < L; ++l)
      for (int64_t h = 0; h < heads; ++h) acc[h * L + l] += s[h * len + j] * from_bf16(row[l]);
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t l = 0; l < L; ++l) o[h * o_h + l] = to_bf16(acc[h * L + l]);
}

// The same attention on the tile unit (amx_attend_takes: AMX granted, whole 16-row tiles in a
// block, W a multiple of 32 and L of 64), with the same roundings; only the float32 sums go in
// another order. Per group of up to 16 heads:
// - scores, C[j, h] = sum_k cache[j, k] q[h, k]: 16 cache rows of a block are the A operand as
//   they lie (a row stride apart), q the B operand in pairs (VNNI);
// - output, C[h, l] = sum_j p[h, j] cache[j, l]: the bf16 probabilities are the A operand, and
//   each 32 cache rows are paired into the B operand's layout, 64 columns (4 C tiles) at a time.
// Rows past len (a block's unwritten end, or refused) give scores that are never read and pair
// as zeros, so nothing they hold reaches the output.
inline bool amx_attend_takes(int64_t block_size, int64_t W, int64_t L) {
  return g_amx && block_size % 16 == 0 && W % AMX_K == 0 && L % 64 == 0;
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_attend(
    const uint16_t* q, int64_t q_h, const uint16_t* kv, int64_t kv_block, int64_t kv_row, int64_t num_blocks,
    int64_t block_size, const int32_t* table, int64_t len, uint16_t* o, int64_t o_h, int64_t heads, int64_t W,
    int64_t L, float scale, AttendScratch& scratch, std::atomic<int64_t>& bad) {
  auto row_of = [&](int64_t j) -> const uint16_t* {
    const int32_t block = table[j / block_size];
    if (block < 0 || block >= num_blocks) return nullptr;
    return kv + block * kv_block + (j % block_size) * kv_row;
  };
  const int64_t padded = (len + 31) / 32 * 32;  // a row of probabilities: whole A operands of 32
  alignas(64) float c[16 * 16];
  alignas(64) uint32_t vp[4 * 16 * 16];  // 32 cache rows x 64 columns in pairs: 4 B operands
  __m512i pair_up;                       // (row a, row b) halves -> (a[0], b[0], a[1], b[1], ...)
  {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 16; ++i) idx[2 * i] = uint16_t(i), idx[2 * i + 1] = uint16_t(16 + i);
    pair_up = _mm512_load_si512(idx);
  }
  amx_configure();
  for (int64_t h0 = 0; h0 < heads; h0 += 16) {
    const int64_t group = std::min<int64_t>(16, heads - h0);
    std::vector<uint32_t>& qp = scratch.pairs;  // q[h0 + g] as qp[k / 2][g][2], heads past group zero
    qp.assign((W / 2) * 16, 0u);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < W / 2; ++i) std::memcpy(&qp[i * 16 + g], q + (h0 + g) * q_h + 2 * i, 4);
    std::vector<float>& s = scratch.s;  // [group, len]
    s.resize(group * len);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const int64_t rows = std::min<int64_t>(16, len - j0);
      const uint16_t* row = row_of(j0);  // its 16 rows lie in one block (block_size % 16 == 0)
      if (row == nullptr) {
        if (h0 == 0) bad.fetch_add(rows);
        for (int64_t g = 0; g < group; ++g) std::fill_n(&s[g * len + j0], rows, -INFINITY);
        continue;
      }
      _tile_zero(0);
      for (int64_t k = 0; k < W; k += AMX_K) {
        _tile_loadd(4, row + k, kv_row * 2);
        _tile_loadd(6, qp.data() + (k / 2) * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, c, 64);
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t g = 0; g < group; ++g)
          s[g * len + j0 + t] = from_bf16(to_bf16(from_bf16(to_bf16(c[t * 16 + g])) * scale));
    }
    std::vector<uint16_t>& p = scratch.probs;  // [16, padded] bf16, zero past len and past group
    p.assign(16 * padded, 0);
    for (int64_t g = 0; g < group; ++g) {
      softmax_rounded(&s[g * len], len);
      for (int64_t j = 0; j < len; ++j) p[g * padded + j] = to_bf16(s[g * len + j]);  // exact: already bf16
    }
    for (int64_t l0 = 0; l0 < L; l0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j0 = 0; j0 < len; j0 += 32) {
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t j = j0 + 2 * r;
          const uint16_t* a = j < len ? row_of(j) : nullptr;
          const uint16_t* b = j + 1 < len ? row_of(j + 1) : nullptr;
          for (int64_t i = 0; i < 4; ++i) {
            const __m256i va = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + l0 + 16 * i))
                                 : _mm256_setzero_si256();
            const __m256i vb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + l0 + 16 * i))
                                 : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1);
            _mm512_store_si512(vp + (i * 16 + r) * 16, _mm512_permutexvar_epi16(pair_up, both));
          }
        }
        _tile_loadd(4, p.data() + j0, padded * 2);
        _tile_loadd(6, vp, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, vp + 256, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, vp + 512, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, vp + 768, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      for (int t = 0; t < 4; ++t) {  // C tile t: c[g * 16 + l'] -> o[h0 + g][l0 + 16 t + l']
        switch (t) {
          case 0: _tile_stored(0, c, 64); break;
          case 1: _tile_stored(1, c, 64); break;
          case 2: _tile_stored(2, c, 64); break;
          default: _tile_stored(3, c, 64); break;
        }
        for (int64_t g = 0; g < group; ++g)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (h0 + g) * o_h + l0 + 16 * t),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + g * 16)));
      }
    }
  }
}

// Returns the number of block ids outside [0, num_blocks) met (0: all fine; the caller raises).
int64_t mla_decode(int64_t q_ptr, int64_t q_b, int64_t q_h, int64_t kv_ptr, int64_t kv_block, int64_t kv_row,
                   int64_t num_blocks, int64_t block_size, int64_t table_ptr, int64_t table_b, int64_t max_blocks,
                   int64_t lens_ptr, int64_t o_ptr, int64_t o_b, int64_t o_h, int64_t B, int64_t H, int64_t W,
                   int64_t L, double scale) {
  const auto* q = reinterpret_cast<const uint16_t*>(q_ptr);
  const auto* kv = reinterpret_cast<const uint16_t*>(kv_ptr);
  const auto* table = reinterpret_cast<const int32_t*>(table_ptr);
  const auto* lens = reinterpret_cast<const int32_t*>(lens_ptr);
  auto* o = reinterpret_cast<uint16_t*>(o_ptr);
  const bool tiles = amx_attend_takes(block_size, W, L) && kv_row == W;
  // Split heads only when there are fewer sequences than threads (a batch-1 decode).
  const int64_t splits = std::min<int64_t>(H, std::max<int64_t>(1, (threads_now() + B - 1) / B));
  const int64_t per_split = (H + splits - 1) / splits;
  std::atomic<int64_t> bad{0};
  int64_t cached = 0;  // cache rows read, times the heads reading them
  for (int64_t b = 0; b < B; ++b) cached += std::max<int32_t>(lens[b], 0);
  // Bytes read: the cache rows, once per head group (of HEAD_GROUP, or of 16 on the tiles).
  const int64_t reads = cached * W * 2 * ((H + (tiles ? 15 : HEAD_GROUP - 1)) / (tiles ? 16 : HEAD_GROUP));
  maybe_parallel(B * splits, 1, reads, [&](int64_t i0, int64_t i1) {
    AttendScratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / splits, h0 = (i % splits) * per_split, h1 = std::min(H, h0 + per_split);
      if (h0 >= h1) continue;
      const int64_t len = std::min<int64_t>(std::max<int32_t>(lens[b], 0), max_blocks * block_size);
      (tiles ? amx_attend : attend)(q + b * q_b + h0 * q_h, q_h, kv, kv_block, kv_row, num_blocks, block_size,
                                    table + b * table_b, len, o + b * o_b + h0 * o_h, o_h, h1 - h0, W, L,
                                    float(scale), scratch, bad);
    }
  }, tiles ? TILE_ATTENTION_OMP_MIN_BYTES : OMP_MIN_BYTES);
  return bad.load();
}


// RMSNorm of bf16 rows, with the residual add fused, in kernels/norm.py's roundings (HF's):
//   h = bf16(x + residual)  (the new residual stream, written to sum; or h = x without one)
//   y = bf16(weight * bf16(h * rsqrt(mean(h^2) + eps)))
// Rows are few (a decode step's tokens) and short: one thread, no parallel region.
void rms_norm(int64_t x_ptr, int64_t ldx, int64_t res_ptr, int64_t ldr, int64_t w_ptr, int64_t y_ptr, int64_t ldy,
              int64_t sum_ptr, int64_t lds, int64_t M, int64_t D, double eps) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* res = reinterpret_cast<const uint16_t*>(res_ptr);
  const auto* w = reinterpret_cast<const uint16_t*>(w_ptr);
  auto* y = reinterpret_cast<uint16_t*>(y_ptr);
  auto* sum = reinterpret_cast<uint16_t*>(sum_ptr);
  std::vector<float> h(D);
  for (int64_t m = 0; m < M; ++m) {
    float squares = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      float v = from_bf16(x[m * ldx + d]);
      if (res != nullptr) {
        const uint16_t rounded = to_bf16(v + from_bf16(res[m * ldr + d]));
        sum[m * lds + d] = rounded;
        v = from_bf16(rounded);
      }
      h[d] = v;
      squares += v * v;
    }
    const float scale = 1.0f / std::sqrt(squares / float(D) + float(eps));
    for (int64_t d = 0; d < D; ++d)
      y[m * ldy + d] = to_bf16(from_bf16(w[d]) * from_bf16(to_bf16(h[d] * scale)));
  }
}


// Rotary embedding of bf16 rows x [N, G, R] (G heads, or 1) at each token's cos/sin [N, R/2]
// (float32), in kernels/rotary.py's reference roundings: cos and sin rounded to bf16, every
// product and sum rounded to bf16; pairs taken interleaved (x[2i], x[2i+1]) or as halves, and
// written as halves, out [N, G, R] contiguous.
void rotary(int64_t x_ptr, int64_t x_n, int64_t x_g, int64_t cos_ptr, int64_t sin_ptr, int64_t ld_cs,
            int64_t out_ptr, int64_t N, int64_t G, int64_t R, bool interleaved) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* cos = reinterpret_cast<const float*>(cos_ptr);
  const auto* sin = reinterpret_cast<const float*>(sin_ptr);
  auto* out = reinterpret_cast<uint16_t*>(out_ptr);
  const int64_t half = R / 2;
  auto round = [](float v) { return from_bf16(to_bf16(v)); };
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* xr = x + n * x_n + g * x_g;
      uint16_t* o = out + (n * G + g) * R;
      for (int64_t i = 0; i < half; ++i) {
        const float c = round(cos[n * ld_cs + i]), s = round(sin[n * ld_cs + i]);
        const float x1 = from_bf16(xr[interleaved ? 2 * i : i]);
        const float x2 = from_bf16(xr[interleaved ? 2 * i + 1 : half + i]);
        o[i] = to_bf16(round(x1 * c) - round(x2 * s));
        o[half + i] = to_bf16(round(x2 * c) + round(x1 * s));
      }
    }
}


// One MLA layer's attention for M decode tokens (a batch-1 decode, a verification's tokens) in
// one call: MLAttention.forward's native calls (with store_latents and _decode), in its order
// and through the same functions here, so the bits are the Python path's; what it saves is the
// ~15 Python calls between them (~0.15 ms a layer). Weights contiguous, no biases:
//   q      = q_b(norm(q_a(x)))  (or q_proj(x) when qa_ptr is 0)    [M, H, nope + R]
//   q_pe   = rotary(q[..., nope:])                                   [M, H, R]
//   kv_a   = kv_a(x); c = norm(kv_a[:, :L]); k_pe = rotary(kv_a[:, L:]); cache[slot] = (c, k_pe)
//   q_lat  = q_nope @ w_uk[h] per head (w_uk_t [H, L, nope])         [M, H, L]
//   o_lat  = mla_decode([q_lat, q_pe]) over the paged cache           [M, H, L]
//   out    = o_proj(o_lat @ w_uv[h]^T per head)  (w_uv [H, v, L], heads wuv_h apart)   [M, hidden]
// Token i is sequence i of table [M, max_blocks] / lens [M] (a verification's tokens come
// expanded, as kernels/mla.py passes them); slots [M] int64, -1 to skip. With the decoder
// layer's norms (pre_norm_ptr, post_norm_ptr), x is the layer's input before its norm, res the
// residual stream it is added to (0 in the first layer: x is the stream), and out gets the
// post-attention norm of (attention + stream), res_out the new stream: DecoderLayer's rms_norm
// calls around the attention. Returns the count of block ids and slots outside the cache (0:
// fine; the caller raises).
int64_t mla_attention(int64_t x_ptr, int64_t M, int64_t hidden, int64_t qa_ptr, int64_t qa_norm_ptr, int64_t q_lora,
                      double q_eps, int64_t qb_ptr, int64_t kva_ptr, int64_t kva_norm_ptr, double kv_eps,
                      int64_t wuk_ptr, int64_t wuv_ptr, int64_t wuv_h, int64_t o_ptr, int64_t cos_ptr,
                      int64_t sin_ptr, bool interleaved, int64_t kv_ptr, int64_t num_blocks, int64_t block_size,
                      int64_t slots_ptr, int64_t table_ptr, int64_t max_blocks, int64_t lens_ptr, int64_t out_ptr,
                      int64_t H, int64_t nope, int64_t R, int64_t L, int64_t v, double scale, int64_t pre_norm_ptr,
                      double pre_eps, int64_t res_ptr, int64_t post_norm_ptr, double post_eps, int64_t res_out_ptr) {
  const int64_t qk = nope + R, W = L + R;
  std::vector<uint16_t> q(M * H * qk), q_pe(M * H * R), kv_a(M * W), c(M * L), k_pe(M * R), q_lat(H * M * L),
      q_full(M * H * W), o_lat(M * H * L), o_v(H * M * v), o_heads(M * H * v), normed, attended;
  auto at = [](std::vector<uint16_t>& b, int64_t offset = 0) { return int64_t(b.data() + offset); };
  if (pre_norm_ptr != 0) {  // x is the residual stream before the layer's input norm (added to res when given)
    normed.resize(M * hidden);
    const int64_t sum_ptr = res_ptr != 0 ? res_out_ptr : 0;  // without a residual, x itself is the stream
    rms_norm(x_ptr, hidden, res_ptr, hidden, pre_norm_ptr, at(normed), hidden, sum_ptr, hidden, M, hidden, pre_eps);
    if (res_ptr == 0)
      std::memcpy(reinterpret_cast<uint16_t*>(res_out_ptr), reinterpret_cast<const uint16_t*>(x_ptr), M * hidden * 2);
    x_ptr = at(normed);
  }
  const int64_t final_out = out_ptr;
  if (post_norm_ptr != 0) attended.resize(M * hidden), out_ptr = at(attended);
  if (qa_ptr != 0) {
    std::vector<uint16_t> q_a(M * q_lora), q_an(M * q_lora);
    linear_bf16(x_ptr, 0, hidden, qa_ptr, 0, hidden, at(q_a), 0, q_lora, 1, M, q_lora, hidden);
    rms_norm(at(q_a), q_lora, 0, 0, qa_norm_ptr, at(q_an), q_lora, 0, q_lora, M, q_lora, q_eps);
    linear_bf16(at(q_an), 0, q_lora, qb_ptr, 0, q_lora, at(q), 0, H * qk, 1, M, H * qk, q_lora);
  } else {
    linear_bf16(x_ptr, 0, hidden, qb_ptr, 0, hidden, at(q), 0, H * qk, 1, M, H * qk, hidden);
  }
  rotary(at(q, nope), H * qk, qk, cos_ptr, sin_ptr, R / 2, at(q_pe), M, H, R, interleaved);

  linear_bf16(x_ptr, 0, hidden, kva_ptr, 0, hidden, at(kv_a), 0, W, 1, M, W, hidden);
  rms_norm(at(kv_a), W, 0, 0, kva_norm_ptr, at(c), L, 0, L, M, L, kv_eps);
  rotary(at(kv_a, L), W, R, cos_ptr, sin_ptr, R / 2, at(k_pe), M, 1, R, interleaved);
  auto* kv = reinterpret_cast<uint16_t*>(kv_ptr);
  const auto* slots = reinterpret_cast<const int64_t*>(slots_ptr);
  int64_t bad = 0;
  for (int64_t i = 0; i < M; ++i) {
    if (slots[i] < 0) continue;
    if (slots[i] >= num_blocks * block_size) {
      ++bad;
      continue;
    }
    std::memcpy(kv + slots[i] * W, &c[i * L], L * 2);
    std::memcpy(kv + slots[i] * W + L, &k_pe[i * R], R * 2);
  }

  linear_bf16(at(q), qk, H * qk, wuk_ptr, L * nope, nope, at(q_lat), M * L, L, H, M, L, nope);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(&q_full[(i * H + h) * W], &q_lat[(h * M + i) * L], L * 2);
      std::memcpy(&q_full[(i * H + h) * W + L], &q_pe[(i * H + h) * R], R * 2);
    }
  if (bad == 0)
    bad = mla_decode(at(q_full), H * W, W, kv_ptr, block_size * W, W, num_blocks, block_size, table_ptr, max_blocks,
                     max_blocks, lens_ptr, at(o_lat), H * L, L, M, H, W, L, scale);
  if (bad != 0) return bad;
  linear_bf16(at(o_lat), L, H * L, wuv_ptr, wuv_h, L, at(o_v), M * v, v, H, M, v, L);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t h = 0; h < H; ++h) std::memcpy(&o_heads[(i * H + h) * v], &o_v[(h * M + i) * v], v * 2);
  linear_bf16(at(o_heads), 0, H * v, o_ptr, 0, H * v, out_ptr, 0, hidden, 1, M, hidden, H * v);
  if (post_norm_ptr != 0)  // the post-attention norm over attended + the stream, which it then replaces
    rms_norm(out_ptr, hidden, res_out_ptr, hidden, post_norm_ptr, final_out, hidden, res_out_ptr, hidden, M, hidden,
             post_eps);
  return 0;
}


// Expert routing of a few tokens after their scores (kernels/gate.py grouped_topk_ref from the
// sigmoid or softmax on), with its float32 operations in its order, so ids and weights are its
// bits: choice = score + bias; with groups (n_group > topk_group) a group's score is the sum of
// its two best choices (with a bias) or its best (without), the topk_group best groups are kept
// and the other experts' choices become `masked`; the top_k choices win, ties to the lowest index
// (as the reference's stable sort); weights = their scores, over their sum + 1e-20 when
// norm_topk_prob, times routed_scaling_factor.
void route(int64_t scores_ptr, int64_t bias_ptr, int64_t T, int64_t E, int64_t n_group, int64_t topk_group,
           int64_t top_k, bool norm_topk_prob, double routed_scaling_factor, int64_t ids_ptr, int64_t weights_ptr) {
  const auto* scores = reinterpret_cast<const float*>(scores_ptr);
  const auto* bias = reinterpret_cast<const float*>(bias_ptr);
  auto* ids = reinterpret_cast<int64_t*>(ids_ptr);
  auto* weights = reinterpret_cast<float*>(weights_ptr);
  const bool grouped = n_group > 1 && topk_group < n_group;
  const int64_t size = E / n_group;
  const float masked = bias != nullptr ? -INFINITY : 0.0f;
  std::vector<float> choice(E), group_score(n_group);
  std::vector<int64_t> order(std::max(E, n_group));
  for (int64_t t = 0; t < T; ++t) {
    const float* st = scores + t * E;
    for (int64_t e = 0; e < E; ++e) choice[e] = bias != nullptr ? st[e] + bias[e] : st[e];
    if (grouped) {
      for (int64_t g = 0; g < n_group; ++g) {
        const float* cg = &choice[g * size];
        int64_t first = 0;  // the best, ties to the lowest index (as torch.topk's first is its max)
        for (int64_t i = 1; i < size; ++i)
          if (cg[i] > cg[first]) first = i;
        float second = -INFINITY;
        for (int64_t i = 0; i < size; ++i)
          if (i != first && cg[i] > second) second = cg[i];
        group_score[g] = bias != nullptr ? cg[first] + second : cg[first];
      }
      for (int64_t g = 0; g < n_group; ++g) order[g] = g;
      std::stable_sort(order.begin(), order.begin() + n_group,
                       [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
      std::vector<bool> kept(n_group, false);
      for (int64_t g = 0; g < topk_group; ++g) kept[order[g]] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!kept[e / size]) choice[e] = masked;
    }
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.begin() + E, [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
    float total = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
      ids[t * top_k + k] = order[k];
      weights[t * top_k + k] = st[order[k]];
      total += st[order[k]];
    }
    for (int64_t k = 0; k < top_k; ++k) {
      float w = weights[t * top_k + k];
      if (norm_topk_prob) w = w / (total + 1e-20f);
      weights[t * top_k + k] = w * float(routed_scaling_factor);
    }
  }
}


// One MoE layer for a decode step's few tokens in one call (DeepseekMoE.forward's work):
//   logits = x . gate^T       the router's product in float32: x's bf16 widened, exact products,
//                             float32 sums in 16 lanes then added (torch's BLAS adds in its own
//                             order: the logits can differ in their last bits)
//   scores = sigmoid(logits), or softmax over the experts (float32, std::exp)
//   `route` from the scores, then the experts with `moe_topk` (the shared one with them).
// gate [E, H] float32 (row stride ld_gate), bias [E] float32 or 0. Every token gets the same
// operations whatever T is, so a verification's tokens are each a one-token decode's bits.
void moe_block(int64_t x_ptr, int64_t ldx, int64_t T, int64_t H, int64_t gate_ptr, int64_t ld_gate, int64_t bias_ptr,
               int64_t E, bool softmax, int64_t n_group, int64_t topk_group, int64_t top_k, bool norm_topk_prob,
               double routed_scaling_factor, int64_t w13_ptr, int64_t w13_expert, int64_t ld13, int64_t w2_ptr,
               int64_t w2_expert, int64_t ld2, int64_t out_ptr, int64_t ldo, int64_t I, int64_t s13_ptr,
               int64_t ld_s13, int64_t s2_ptr, int64_t ld_s2, int64_t Is) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* gate = reinterpret_cast<const float*>(gate_ptr);
  std::vector<float> wide(H), scores(T * E), weights(T * top_k);
  std::vector<int64_t> ids(T * top_k);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) wide[h] = from_bf16(x[t * ldx + h]);
    float* st = &scores[t * E];
    for (int64_t e = 0; e < E; ++e) {
      const float* g = gate + e * ld_gate;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; h += 16) {
        const __mmask16 mask = H - h >= 16 ? __mmask16(0xffff) : __mmask16((1u << (H - h)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, &wide[h]), _mm512_maskz_loadu_ps(mask, g + h), acc);
      }
      st[e] = _mm512_reduce_add_ps(acc);
    }
    if (softmax) {
      float top = -INFINITY, total = 0.0f;
      for (int64_t e = 0; e < E; ++e) top = std::max(top, st[e]);
      for (int64_t e = 0; e < E; ++e) total += (st[e] = std::exp(st[e] - top));
      for (int64_t e = 0; e < E; ++e) st[e] /= total;
    } else {
      for (int64_t e = 0; e < E; ++e) st[e] = 1.0f / (1.0f + std::exp(-st[e]));
    }
  }
  route(reinterpret_cast<int64_t>(scores.data()), bias_ptr, T, E, n_group, topk_group, top_k, norm_topk_prob,
        routed_scaling_factor, reinterpret_cast<int64_t>(ids.data()), reinterpret_cast<int64_t>(weights.data()));
  moe_topk(x_ptr, ldx, w13_ptr, w13_expert, ld13, w2_ptr, w2_expert, ld2, out_ptr, ldo,
           reinterpret_cast<int64_t>(ids.data()), reinterpret_cast<int64_t>(weights.data()), T, top_k, E, H, I,
           s13_ptr, ld_s13, s2_ptr, ld_s2, Is);  // route's ids lie in [0, E): nothing to refuse
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); });
  m.def("use_amx", &use_amx);
  m.def("use_pool", &use_pool);
  m.def("set_pool_min_bytes", &set_pool_min_bytes);
  m.def("linear_bf16", &linear_bf16, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("moe_pairs", &moe_pairs, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("moe_topk", &moe_topk, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mla_decode", &mla_decode, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary", &rotary, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mla_attention", &mla_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("route", &route);
  m.def("moe_block", &moe_block, pybind11::call_guard<pybind11::gil_scoped_release>());
}
