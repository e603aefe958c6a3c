// y = x @ w^T for the few rows of a decode step, in bf16, on x86 CPUs with AVX512-BF16.
//
//   y[m, n] = sum_k x[m, k] * w[n, k]     x [M, K], w [N, K], y [M, N]; bf16 in and out
//
// With a handful of rows the product is bound by reading w, and the BLAS behind torch spends
// more on each call than on the bytes: a 512 x 512 bf16 weight (0.5 MB) took ~125 us at one row
// through torch, 4 GB/s, where the memory gives ~20. This kernel reads each weight row once for
// all rows of x, multiplies bf16 pairs with VDPBF16PS (exact products, float32 sums, as the BLAS
// does), and rounds each sum to bf16 to nearest-even (as torch's bf16 matmul does).
//
// Layout: the N output columns are split over torch's intra-op threads (at::parallel_for, the
// pool torch's own ops use, so nothing is oversubscribed); a thread takes its columns in tiles of
// TILE_N, and each tile for every row of x in blocks of ROWS_PER_PASS, COLS columns at a time
// (ROWS_PER_PASS x COLS accumulators, each x vector loaded once per COLS columns), so a weight row
// is read from memory once and from L1 for the following blocks. x is small (M rows of K) and
// stays in L1.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t TILE_N = 16;        // columns converted to bf16 together
constexpr int64_t ROWS_PER_PASS = 4;  // rows of x accumulated at once per weight row
constexpr int COLS = 4;               // weight rows (output columns) accumulated at once
constexpr int64_t GRAIN_N = 64;       // fewest columns worth a thread

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

// Pointers as integers (torch.Tensor.data_ptr()): the Python wrapper checks shapes, dtypes and
// strides, so this file needs neither torch's tensor headers nor their build time. B products
// y[b] = x[b] @ w[b]^T (B = 1 for a plain linear; the heads of attention's absorbed products
// otherwise), their columns split over the threads together.
void linear_bf16(int64_t x_ptr, int64_t x_batch, int64_t ldx, int64_t w_ptr, int64_t w_batch, int64_t ldw,
                 int64_t y_ptr, int64_t y_batch, int64_t ldy, int64_t B, int64_t M, int64_t N, int64_t K) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* w = reinterpret_cast<const uint16_t*>(w_ptr);
  auto* y = reinterpret_cast<uint16_t*>(y_ptr);
  at::parallel_for(0, B * N, GRAIN_N, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {  // [i0, i1) may span several products: one column range each
      const int64_t b = i / N, n0 = i % N, n1 = std::min(N, n0 + (i1 - i));
      columns(x + b * x_batch, ldx, w + b * w_batch, ldw, y + b * y_batch, ldy, M, K, n0, n1);
      i += n1 - n0;
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, pybind11::call_guard<pybind11::gil_scoped_release>());
}
