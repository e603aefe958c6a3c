// The few-row product, on the AMX tile unit where the CPU has it, with VDPBF16PS elsewhere:
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
// within a chunk, columns go in tiles of TILE_N, and each tile for every row of x in blocks of
// FIRST_PASS_ROWS, then ROWS_PER_PASS (dot_rows), so a weight row is read from memory once and
// from cache for the following blocks. x is small (M rows of K) and stays in L1.

#pragma once

#include "common.h"
#include "tiles.h"
#ifndef __AVX512F__
#include "products_avx2.h"  // the AVX2 build's `columns` and its order of additions
#endif

namespace {

#ifdef __AVX512F__
constexpr int64_t TILE_N = 16;        // columns converted to bf16 together
// Rows of x accumulated at once per weight row: 4 in a tile's first pass, which reads the weight
// from memory, then ROWS_PER_PASS from cache. A VDPBF16PS's result comes many cycles after it
// starts (on the 2-core Zen 4, 8 / 16 / 24 independent sums ran 2.0 / 3.8 / 4.2 G instructions
// a second), so the 24 sums of 6 rows keep the unit busier than 4 rows' 16: a step's products at
// 32 / 64 / 128 / 256 rows 1.02 / 1.03-1.04 / 1.00-1.04 / 1.05x over two runs (products_ab.py
// against 01dd21d, 2026-12-05), 1.00x up to 8 rows. The emulation (two float32 multiply-adds
// and their operands per VDPBF16PS) ran 0.97x with 6, so that build keeps 4.
constexpr int64_t FIRST_PASS_ROWS = 4;
#ifdef __AVX512BF16__
constexpr int64_t ROWS_PER_PASS = 6;
#else
constexpr int64_t ROWS_PER_PASS = 4;
#endif
// dot_rows prefetches the weight this many elements (8 KB) ahead of each step it reads: a tile's
// weight rows lie one after another, so that is a few rows on. The hardware's prefetchers alone
// fell behind: all of a bench-model decode step's products (87 MB, weights out of cache, 2-core
// Zen 4, 2026-12-04), ms at 1 / 4 / 32 rows over both threads, without -> with: 2.33 -> 2.24,
// 2.99 -> 2.64, 8.88 -> 7.84 through VDPBF16PS, 2.43 -> 2.28, 3.88 -> 3.16, 13.1 -> 11.6 through
// its emulation. On one thread, 2 / 4 / 8 / 16 KB ahead took 2.67 / 2.58 / 2.52 / 2.61 ms at one row.
constexpr int64_t PREFETCH_AHEAD = 4096;

// out[r][c] = x[r] . w[c] for ROWS rows of x and weight rows [0, width) (width <= TILE_N). Each
// weight row is read once, front to back, for all ROWS rows: one stream the prefetchers follow
// (four or eight rows read side by side, a vector of each in turn, ran at half the rate: 10
// against 20 GB/s on one Zen 4 core). A sum runs in four parts interleaved over k, then across
// lanes for TILE_N columns at once (sum_lanes16): the same operations for a row whatever ROWS is,
// so a row's result does not depend on the rows beside it (a speculative verification computes
// each token as a one-token decode).
template <int ROWS>
inline void dot_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, int64_t width,
                     float out[][TILE_N]) {
  __m512 sums[ROWS][TILE_N];
  for (int c = 0; c < TILE_N; ++c) {
    if (c >= width) {
      for (int r = 0; r < ROWS; ++r) sums[r][c] = _mm512_setzero_ps();
      continue;
    }
    const uint16_t* row = w + c * ldw;
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128)
      for (int i = 0; i < 4; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(row + k + 32 * i + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512(row + k + 32 * i);
        for (int r = 0; r < ROWS; ++r)
          acc[r][i] = dot_bf16(acc[r][i], wv, _mm512_loadu_si512(x + r * ldx + k + 32 * i));
      }
    for (; k < K; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k + PREFETCH_AHEAD), _MM_HINT_T0);
      const __m512i wv = load32(row + k, K - k);
      for (int r = 0; r < ROWS; ++r) acc[r][0] = dot_bf16(acc[r][0], wv, load32(x + r * ldx + k, K - k));
    }
    for (int r = 0; r < ROWS; ++r)
      sums[r][c] = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
  }
  for (int r = 0; r < ROWS; ++r) _mm512_store_ps(out[r], sum_lanes16(sums[r]));
}

// Columns n0 .. n1 of y, all M rows.
void columns(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, uint16_t* y, int64_t ldy,
             int64_t M, int64_t K, int64_t n0, int64_t n1) {
  alignas(64) float tile[ROWS_PER_PASS][TILE_N];
  for (int64_t t0 = n0; t0 < n1; t0 += TILE_N) {
    const int64_t width = n1 - t0 < TILE_N ? n1 - t0 : TILE_N;
    const __mmask16 out_mask = width == TILE_N ? __mmask16(0xFFFF) : (__mmask16(1) << width) - 1;
    for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
      rows = std::min(M - m0, m0 == 0 ? FIRST_PASS_ROWS : ROWS_PER_PASS);
      const uint16_t *xm = x + m0 * ldx, *wt = w + t0 * ldw;
      switch (rows) {
        case 1: dot_rows<1>(xm, ldx, wt, ldw, K, width, tile); break;
        case 2: dot_rows<2>(xm, ldx, wt, ldw, K, width, tile); break;
        case 3: dot_rows<3>(xm, ldx, wt, ldw, K, width, tile); break;
#ifdef __AVX512BF16__
        case 4: dot_rows<4>(xm, ldx, wt, ldw, K, width, tile); break;
        case 5: dot_rows<5>(xm, ldx, wt, ldw, K, width, tile); break;
        default: dot_rows<6>(xm, ldx, wt, ldw, K, width, tile); break;
#else
        default: dot_rows<4>(xm, ldx, wt, ldw, K, width, tile); break;
#endif
      }
      for (int64_t r = 0; r < rows; ++r) {
        _mm256_mask_storeu_epi16(y + (m0 + r) * ldy + t0, out_mask, narrow16(_mm512_load_ps(tile[r])));
      }
    }
  }
}

#endif  // __AVX512F__ (the AVX2 build's `columns`: products_avx2.h)

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
bool g_amx = false;          // the products (and the attention) take the tile paths
bool g_amx_soft = false;     // ... with the tiles in software (tiles.h): tests, on any CPU

// Turns the tile paths on or off: on the unit (asking once for its state; on only where granted),
// or, with `soft`, on software tiles whatever the CPU has.
bool use_amx(bool on, bool soft) {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (on && !soft && !g_amx_granted)
    g_amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  g_amx = on && (soft || g_amx_granted);
  g_amx_soft = g_amx && soft;
  return g_amx;
}

constexpr int64_t AMX_N = 32;  // weight rows per step: two C tiles of 16
constexpr int64_t AMX_M = 32;  // rows of x per pass: two B tiles of 16
constexpr int64_t AMX_K = 32;  // K per tile product (16 pairs)

// Columns [n0, n1) (n1 - n0 a multiple of AMX_N) of rows [0, M) (M <= AMX_M) from xt, x packed as
// xt[k / 2][m][2] for 32 rows (rows past M zero). K a multiple of AMX_K. Tiles: 0-3 C (n half x
// m half), 4-5 A (the two weight halves), 6-7 B (the two x halves).
template <bool SOFT>
__attribute__((target("amx-tile,amx-bf16"))) void amx_columns(const uint32_t* xt, const uint16_t* w, int64_t ldw,
                                                                uint16_t* y, int64_t ldy, int64_t M, int64_t K,
                                                                int64_t n0, int64_t n1) {
  alignas(64) float c[16 * 16];
  const bool two = M > 16;
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t n = n0; n < n1; n += AMX_N) {
    TILE_ZERO(0);
    TILE_ZERO(1);
    if (two) {
      TILE_ZERO(2);
      TILE_ZERO(3);
    }
    for (int64_t k = 0; k < K; k += AMX_K) {
      const uint32_t* b = xt + (k / 2) * AMX_M;  // 16 pair rows of 32 m (64 + 64 bytes)
      TILE_LOAD(6, b, AMX_M * 4);
      if (two) TILE_LOAD(7, b + 16, AMX_M * 4);
      TILE_LOAD(4, w + n * ldw + k, ldw * 2);
      TILE_LOAD(5, w + (n + 16) * ldw + k, ldw * 2);
      TILE_DOT(0, 4, 6);
      TILE_DOT(1, 5, 6);
      if (two) {
        TILE_DOT(2, 4, 7);
        TILE_DOT(3, 5, 7);
      }
    }
    for (int t = 0; t < (two ? 4 : 2); ++t) {  // C tile t: c[n' * 16 + m'] -> y[m_base + m'][n + ...]
      switch (t) {
        case 0: TILE_STORE(0, c, 64); break;
        case 1: TILE_STORE(1, c, 64); break;
        case 2: TILE_STORE(2, c, 64); break;
        default: TILE_STORE(3, c, 64); break;
      }
      const int64_t n_base = n + (t % 2) * 16, m_base = (t / 2) * 16;
      for (int64_t m = m_base; m < std::min(M, m_base + 16); ++m) {
        const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(int(m - m_base))), c, 4);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n_base), narrow16(v));
      }
    }
  }
}

// x rows [0, M) as passes of AMX_M rows, each pass xt[k / 2][m][2] (rows past M in the last
// pass zero): pass p starts at xt + p * (K / 2) * AMX_M.
inline void pack_pairs(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, std::vector<uint32_t>& xt) {
  const int64_t passes = (M + AMX_M - 1) / AMX_M, pass_size = (K / 2) * AMX_M;
  xt.assign(passes * pass_size, 0u);
  for (int64_t m = 0; m < M; ++m) {
    uint32_t* dst = xt.data() + (m / AMX_M) * pass_size + m % AMX_M;
    for (int64_t i = 0; i < K / 2; ++i) std::memcpy(&dst[i * AMX_M], x + m * ldx + 2 * i, 4);  // (x[2i], x[2i+1])
  }
}

// Whether columns of a product with inner dimension K run on the tile unit (whole AMX_N steps).
inline bool amx_takes(int64_t K) { return g_amx && K % AMX_K == 0; }

// Columns [n0, n1) of y = x w^T, all M rows: on the tile unit where it can (amx_takes, whole
// 32-column steps), `columns` for the rest. xt: x already packed by pack_pairs, or null to pack
// here; xs (the AVX2 build): x already split by split_rows, or null to split here.
void product(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, uint16_t* y, int64_t ldy, int64_t M,
             int64_t K, int64_t n0, int64_t n1, const uint32_t* xt = nullptr, const float* xs = nullptr) {
  const int64_t n_amx = amx_takes(K) ? n0 + (n1 - n0) / AMX_N * AMX_N : n0;
  if (n_amx > n0) {
    if (!g_amx_soft) amx_configure();
    std::vector<uint32_t> packed;
    if (xt == nullptr) pack_pairs(x, ldx, M, K, packed), xt = packed.data();
    for (int64_t m0 = 0; m0 < M; m0 += AMX_M)  // a chunk's weight columns stay in cache for the next pass
      (g_amx_soft ? amx_columns<true> : amx_columns<false>)(xt + (m0 / AMX_M) * (K / 2) * AMX_M, w, ldw,
                                                            y + m0 * ldy, ldy, std::min(AMX_M, M - m0), K, n0, n_amx);
  }
#ifdef __AVX512F__
  if (n_amx < n1) columns(x, ldx, w, ldw, y, ldy, M, K, n_amx, n1);
#else
  if (n_amx < n1) columns(x, ldx, w, ldw, y, ldy, M, K, n_amx, n1, xs);
#endif
}

// Rows per block of a product with many rows (a prefill's, where the products without AVX512-BF16
// run here: native.EMULATED_ROWS). Each block is shared over the threads as a product of its own,
// so a block of x stays in cache while all the weight streams past it once. Without blocks, each
// thread's chunk of columns read all of x: 4096 rows through the LM head's 32000 x 512 took 888
// ms, 557-624 in blocks of 256 (2-core Zen 4, the emulation); through a 512 x 1536 weight, 24.7
// against 23.3. AMX_ROWS and FEW_ROWS fit in one block.
constexpr int64_t ROW_BLOCK = 256;

// Pointers as integers (torch.Tensor.data_ptr()): the Python wrapper checks shapes, dtypes and
// strides, so this file needs neither torch's tensor headers nor their build time. B products
// y[b] = x[b] @ w[b]^T (B = 1 for a plain linear; the heads of attention's absorbed products
// otherwise), their columns shared over the threads together in chunks of whole AMX steps; on
// the tile unit, each x[b] is packed once before (all its rows), in the AVX2 build split once.
// Rows in blocks of ROW_BLOCK.
void linear_bf16(int64_t x_ptr, int64_t x_batch, int64_t ldx, int64_t w_ptr, int64_t w_batch, int64_t ldw,
                 int64_t y_ptr, int64_t y_batch, int64_t ldy, int64_t B, int64_t M, int64_t N, int64_t K) {
  const auto* w = reinterpret_cast<const uint16_t*>(w_ptr);
  const int64_t steps = (N + AMX_N - 1) / AMX_N;  // a chunk is whole 32-column steps
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (AMX_N * K * 2));  // steps per chunk
  for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int64_t rows = std::min(ROW_BLOCK, M - m0);
    const auto* x = reinterpret_cast<const uint16_t*>(x_ptr) + m0 * ldx;
    auto* y = reinterpret_cast<uint16_t*>(y_ptr) + m0 * ldy;
    std::vector<std::vector<uint32_t>> packed(amx_takes(K) && N >= AMX_N ? B : 0);
    for (int64_t b = 0; b < int64_t(packed.size()); ++b) pack_pairs(x + b * x_batch, ldx, rows, K, packed[b]);
#ifdef __AVX512F__
    const float* split = nullptr;
    const int64_t split_size = 0;
#else  // each x[b] split once for all its chunks' columns
    thread_local std::vector<float> kept;
    const int64_t split_size = rows * split_width(K);
    float* split = scratch(kept, B * split_size);
    for (int64_t b = 0; b < B; ++b) split_rows(x + b * x_batch, ldx, rows, K, split + b * split_size);
#endif
    // Up to a pass of rows a product costs reading its weight; each further pass costs about as
    // much again in arithmetic, so the threads start as if that much more were read. A pass is
    // AMX_M rows on the tile unit; the AVX2 build's are ROWS_PER_PASS. Counted in AMX_M there, a
    // prefill block's 256 rows through a weight under 512 KB (the bench model's q_a) ran on one
    // thread: 0.94 ms against 0.57 on two; offline, 32 x 512-token prompts, 1.11x tok/s, 1.09x
    // less CPU (2-core Zen 3, ab_revisions against 9d813c3). Decode steps share over the pool.
#ifdef __AVX512F__
    const int64_t passes = (rows + AMX_M - 1) / AMX_M;
#else
    const int64_t passes = (rows + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
#endif
    maybe_parallel(B * steps, chunk, B * N * K * 2 * passes, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1;) {  // [i0, i1) may span several products: one step range each
        const int64_t b = i / steps, s0 = i % steps, s1 = std::min(steps, s0 + (i1 - i));
        product(x + b * x_batch, ldx, w + b * w_batch, ldw, y + b * y_batch, ldy, rows, K, s0 * AMX_N,
                std::min(N, s1 * AMX_N), packed.empty() ? nullptr : packed[b].data(),
                split ? split + b * split_size : nullptr);
        i += s1 - s0;
      }
    });
  }
}

}  // namespace
