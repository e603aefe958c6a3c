// The few-row product in the AVX2 build (a CPU without AVX-512; kernels/native/avx2.h):
//
//   y[m, n] = sum_k x[m, k] * w[n, k]     x [M, K], w [N, K], y [M, N]; bf16 in and out
//
// This build's order of the float32 additions: each output sums in 16 partial sums, two
// registers of 8 lanes. The pair q of k (k = 2q, 2q + 1) goes to register (q / 8) % 2, lane q % 8,
// its even product added before its odd one (a product of two bf16 values is exact in float32, so
// each addition is one rounding). Then the two registers are added, each lane to its own, the 8
// lanes summed as ((0 + 2) + (1 + 3)) + ((4 + 6) + (5 + 7)), and the sum rounded to bf16 to
// nearest-even. The AVX-512 build sums in 64 partial sums (four registers of 16 lanes): the two
// builds' products differ by that order, each a float32 sum rounded once to bf16.
//
// Why its own order: four rows' 64 partial sums of one column are 32 of AVX2's 16 registers. The
// AVX-512 order emulated on pairs of registers spilled them in every step, and from 32 rows, where
// the products are bound by arithmetic, the AVX2 build ran a B = 256 decode step (bench model,
// 2-core Zen 4) at a third of the AVX-512 build's rate, 70% of it in the products. Here six rows of
// one column take 12 registers. x is split once per call into float32 even and odd halves, so a
// row's step over 32 values of k is four FMAs with an operand from memory; a weight row is read
// once, front to back, for all the rows of a block. A step's products (products_ab.py --avx2,
// against the emulation): the same at 1 row, 1.2x at 4, 1.5x at 8, 1.2-1.7x at 32-256; the
// engine's decode at B = 64-256 1.4-1.5x. A broadcast kernel over packed panels of w (one float32
// chain per output) ran 1.5x at 256 rows but 0.6x at one, bound by the packing.
//
// A row's operations do not depend on the rows beside it, so a row's result is the one-row
// product's (a speculative verification computes each token as a one-token decode).

#pragma once

#include "common.h"

namespace {

constexpr int64_t TILE_N = 16;            // columns rounded to bf16 together
constexpr int64_t ROWS_PER_PASS = 6;      // rows of x accumulated at once per weight row
constexpr int64_t PREFETCH_AHEAD = 4096;  // weight elements read ahead (as the AVX-512 build)
// Split x a column tile's passes read before the next tile's, at most: a prefill's 256-row block
// of split x (512 KB at K = 512) was read again from L3 for every 16 columns; in blocks of this
// much it stays in L2 while a thread's columns go by. The same bits. 2-core Zen 3, bench model's
// shapes at 256 rows: 130 -> 137-143 GFLOP/s through 512 x 1024, 1.00-1.11x the others; offline,
// 32 x 512-token prompts and 128 out, 1.09x tok/s (ab_revisions against a338ee2).
constexpr int64_t X_BLOCK_BYTES = int64_t(128) << 10;

// Floats per row of split x: K rounded up to whole 32-value steps.
inline int64_t split_width(int64_t K) { return (K + 31) / 32 * 32; }

// 16 bf16 values from p: the first `left` (all from 16 on; none at or below 0), zeros after them.
inline __m256i load16(const uint16_t* p, int64_t left) {
  if (left >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return left <= 0 ? _mm256_setzero_si256() : _mm256_maskz_loadu_epi16(lanes16(left), p);
}

// Lane i of the result: v[i]'s 8 lanes summed as ((0 + 2) + (1 + 3)) + ((4 + 6) + (5 + 7)).
inline __m256 sum_lanes8(const __m256* v) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // lanes (0 + 2, 1 + 3) of v[2i] and v[2i + 1], interleaved, per 128 bits
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // (0 + 2) + (1 + 3) of v[4i .. 4i + 3], per 128 bits
    u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// x's M rows split for dot_rows, row m at xs + m * split_width(K): per 32-value step of k, its
// first 16 values' 8 even then 8 odd ones, then its last 16's, as float32; zeros past K.
inline void split_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* xs) {
  const int64_t K32 = split_width(K);
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K32; k += 16) {
      const __m256i v = load16(x + m * ldx + k, K - k);
      _mm256_storeu_ps(xs + m * K32 + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_storeu_ps(xs + m * K32 + k + 8, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
    }
}

// sums[r][c] = x[r] . w[c]'s two registers of partial sums, added, for ROWS rows of split x (K32
// floats apart) and weight rows [0, width) (width <= TILE_N; the others zero). Each weight row is
// read once, front to back, for all ROWS rows.
template <int ROWS>
inline void dot_rows(const float* xs, int64_t K32, const uint16_t* w, int64_t ldw, int64_t K, int64_t width,
                     __m256 sums[][TILE_N]) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int c = 0; c < TILE_N; ++c) {
    if (c >= width) {
      for (int r = 0; r < ROWS; ++r) sums[r][c] = _mm256_setzero_ps();
      continue;
    }
    const uint16_t* row = w + c * ldw;
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const auto step = [&](int64_t k, bool whole) {  // 32 values of k: 16 pairs, 8 to each register
      _mm_prefetch(reinterpret_cast<const char*>(row + k + PREFETCH_AHEAD), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        const __m256i wv = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 16 * i))
                                 : load16(row + k + 16 * i, K - k - 16 * i);
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; ++r) {
          const float* xk = xs + r * K32 + k + 16 * i;
          acc[r][i] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xk), acc[r][i]);  // the even products, then the odd
          acc[r][i] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xk + 8), acc[r][i]);
        }
      }
    };
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) step(k, true);
    if (k < K) step(k, false);
    for (int r = 0; r < ROWS; ++r) sums[r][c] = _mm256_add_ps(acc[r][0], acc[r][1]);
  }
}

// Columns n0 .. n1 of y, all M rows: blocks of rows (X_BLOCK_BYTES of split x), each through tiles
// of TILE_N columns in passes of ROWS_PER_PASS rows. xs: x split by split_rows, or null to split
// it here.
void columns(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, uint16_t* y, int64_t ldy, int64_t M,
             int64_t K, int64_t n0, int64_t n1, const float* xs = nullptr) {
  const int64_t K32 = split_width(K);
  if (xs == nullptr) {
    thread_local std::vector<float> kept;
    float* split = scratch(kept, M * K32);
    split_rows(x, ldx, M, K, split);
    xs = split;
  }
  __m256 sums[ROWS_PER_PASS][TILE_N];
  const int64_t block = std::max<int64_t>(1, X_BLOCK_BYTES / (K32 * 4 * ROWS_PER_PASS)) * ROWS_PER_PASS;
  for (int64_t b0 = 0; b0 < M; b0 += block) {  // rows [b0, b1) through every column tile
    const int64_t b1 = std::min(M, b0 + block);
    for (int64_t t0 = n0; t0 < n1; t0 += TILE_N) {
      const int64_t width = n1 - t0 < TILE_N ? n1 - t0 : TILE_N;
      const __mmask16 out_mask = width == TILE_N ? __mmask16(0xFFFF) : (__mmask16(1) << width) - 1;
      for (int64_t m0 = b0; m0 < b1; m0 += ROWS_PER_PASS) {
        const int64_t rows = std::min(b1 - m0, ROWS_PER_PASS);
        const float* xm = xs + m0 * K32;
        const uint16_t* wt = w + t0 * ldw;
        switch (rows) {
          case 1: dot_rows<1>(xm, K32, wt, ldw, K, width, sums); break;
          case 2: dot_rows<2>(xm, K32, wt, ldw, K, width, sums); break;
          case 3: dot_rows<3>(xm, K32, wt, ldw, K, width, sums); break;
          case 4: dot_rows<4>(xm, K32, wt, ldw, K, width, sums); break;
          case 5: dot_rows<5>(xm, K32, wt, ldw, K, width, sums); break;
          default: dot_rows<6>(xm, K32, wt, ldw, K, width, sums); break;
        }
        for (int64_t r = 0; r < rows; ++r)
          _mm256_mask_storeu_epi16(y + (m0 + r) * ldy + t0, out_mask,
                                   narrow16(__m512{sum_lanes8(sums[r]), sum_lanes8(sums[r] + 8)}));
      }
    }
  }
}

}  // namespace
