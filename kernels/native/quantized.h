// The few-row product with a weight kept as DeepSeek's checkpoints store it (kernels/quant.py):
//
//   y[m, n] = sum_b scale[n, b] * sum_{k in block b} x[m, k] * w[n, k]     x, y bf16
//
// - FP8: w e4m3, one byte a value, a float32 scale per row per block_k of K (the checkpoint's
//   128 x 128 or 32 x 32 grid expanded to rows at load);
// - MXFP4: w e2m1, two values a byte (the even column in the low nibble), an e8m0 scale (2^(b -
//   127)) per row per 32 of K.
// The weight is widened in registers as it is read, exactly (every e4m3 and e2m1 value is a bf16
// value), each block's products summed in float32 and its scale applied to that sum in float32
// (one multiply-add per block), as the reference dequantizes: the weight's bytes are what streams
// from memory, one byte a weight (half for MXFP4) where the bf16 products read two.
//
// Two forms, each row's operations independent of the rows beside it (batch invariance):
// - qcolumns_512, in the AVX-512 intrinsics: the weight widened to bf16 pairs and multiplied by
//   VDPBF16PS (or its emulation), the AVX-512 builds' path. The AVX2 build compiles it on avx2.h's
//   emulation too, where tests force it (use_quant_generic), so its logic is checked on any CPU.
// - qcolumns_avx2, the AVX2 build's own: x widened to float32 once per call, the weight widened
//   to float32 as it is read (FP8 by placing its bits in a float's: a sign-extending load, a
//   shift and an AND for 8 values; MXFP4 through a byte shuffle), FMAs.
// Block sizes are multiples of 32 (the Python side sends others to torch); K any length.

#pragma once

#include "products.h"

namespace {

enum : int64_t { W_BF16 = 0, W_FP8 = 1, W_MXFP4 = 2 };

// A weight as the products take it: row n at data + n * ld (ld in the format's storage units:
// bf16 values, or bytes), its scales at scale + n * lds (float32 for FP8, e8m0 bytes for MXFP4),
// one per block_k of K. W_BF16: a plain bf16 weight (scale unused).
struct QW {
  const void* data = nullptr;
  int64_t ld = 0;
  const void* scale = nullptr;
  int64_t lds = 0;
  int64_t block_k = 0;
  int64_t fmt = W_BF16;

  const uint8_t* row(int64_t n) const {
    return static_cast<const uint8_t*>(data) + n * ld * (fmt == W_BF16 ? 2 : 1);
  }
  // The weight offset by `units` of data and `scales` of scale (an expert's: e * its strides).
  QW offset(int64_t units, int64_t scales) const {
    QW w = *this;
    w.data = row(0) + units * (fmt == W_BF16 ? 2 : 1);
    if (scale != nullptr) w.scale = static_cast<const uint8_t*>(scale) + scales * (fmt == W_FP8 ? 4 : 1);
    return w;
  }
  // Row n's scale of block b, as a float32.
  float scale_of(int64_t n, int64_t b) const;
  // Bytes a row of K values takes.
  int64_t row_bytes(int64_t K) const { return fmt == W_BF16 ? 2 * K : fmt == W_FP8 ? K : K / 2; }
};

inline QW bf16_weight(const void* w, int64_t ld) { return QW{w, ld, nullptr, 0, 0, W_BF16}; }

// An e8m0 byte's value, 2^(b - 127) (b = 0: 2^-127, a denormal; 255: NaN).
inline float e8m0(uint8_t b) {
  if (b == 255) return NAN;
  if (b == 0) return 0x1p-127f;
  const uint32_t bits = uint32_t(b) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float QW::scale_of(int64_t n, int64_t b) const {
  if (fmt == W_FP8) return static_cast<const float*>(scale)[n * lds + b];
  return e8m0(static_cast<const uint8_t*>(scale)[n * lds + b]);
}

bool g_quant_generic = false;  // the AVX2 build takes qcolumns_512 (tests: use_quant_generic)

bool use_quant_generic(bool on) {
  const bool before = g_quant_generic;
  g_quant_generic = on;
  return before;
}

// ---- qcolumns_512: the weight widened to bf16 pairs, VDPBF16PS ----------------------------------

// bf16 of m x 2^-9 (e4m3's subnormals, m = 1-7), by m.
alignas(64) constexpr uint16_t E4M3_SUBNORMAL[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
// bf16 of each e2m1 code (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
alignas(64) constexpr uint16_t E2M1_BF16[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                                 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// 32 e4m3 values from p as 32 bf16 values, exactly; zeros past `left`. A normal e4m3 value's bits
// moved into bf16's fields with its exponent rebiased (+120: bf16's 127 less e4m3's 7), a
// subnormal one (exponent 0: m x 2^-9) from a table. (e4m3's NaN, 0x7F, is not kept: checkpoints
// hold none.)
inline __m512i widen_e4m3(const uint8_t* p, int64_t left) {
  const __m256i b = left >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                               : _mm256_maskz_loadu_epi8(lanes(left), p);
  const __m512i w = _mm512_cvtepi8_epi16(b);  // sign-extended: bit 15 is the sign, bits 6-0 the rest
  const __m512i sign = _mm512_and_si512(w, _mm512_set1_epi16(int16_t(0x8000)));
  const __m512i fields = _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(int16_t(0x87F0)));
  const __m512i normal = _mm512_add_epi16(fields, _mm512_set1_epi16(0x3C00));
  const __m512i subnormal = _mm512_or_si512(
      _mm512_permutexvar_epi16(w, _mm512_loadu_si512(E4M3_SUBNORMAL)), sign);  // index: bits 4-0, m when e = 0
  return _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x78)), subnormal, normal);
}

// 32 e2m1 values from 16 bytes at p (the even value in each byte's low nibble) as 32 bf16 values
// in pairs (even, odd), as VDPBF16PS takes them.
inline __m512i widen_e2m1(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // a byte a pair
  const __m512i codes = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)),
                                        _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xF0)), 12));
  return _mm512_permutexvar_epi16(codes, _mm512_loadu_si512(E2M1_BF16));
}

// out[r][c] = x[r] . w[n + c] for ROWS rows of x and weight rows [n, n + width) (width <= TILE_N),
// each weight row read once, front to back, for all ROWS rows. A block's sum in two parts
// interleaved over k, each part times the block's scale into its total; then the totals added and
// summed across lanes for TILE_N columns at once.
template <int ROWS>
inline void qdot_rows_512(const uint16_t* x, int64_t ldx, const QW& w, int64_t n, int64_t K, int64_t width,
                          float out[][16]) {
  __m512 sums[ROWS][16];
  const bool fp8 = w.fmt == W_FP8;
  for (int c = 0; c < 16; ++c) {
    if (c >= width) {
      for (int r = 0; r < ROWS; ++r) sums[r][c] = _mm512_setzero_ps();
      continue;
    }
    const uint8_t* row = w.row(n + c);
    __m512 total[ROWS][2];
    for (int r = 0; r < ROWS; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += w.block_k, ++b) {
      const int64_t k1 = std::min(K, k0 + w.block_k);
      __m512 acc[ROWS][2];
      for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      int i = 0;
      for (int64_t k = k0; k < k1; k += 32, i ^= 1) {
        const uint8_t* wk = fp8 ? row + k : row + k / 2;
        _mm_prefetch(reinterpret_cast<const char*>(wk + 2048), _MM_HINT_T0);
        const __m512i wv = fp8 ? widen_e4m3(wk, k1 - k) : widen_e2m1(wk);
        for (int r = 0; r < ROWS; ++r) acc[r][i] = dot_bf16(acc[r][i], wv, load32(x + r * ldx + k, k1 - k));
      }
      const __m512 s = _mm512_set1_ps(w.scale_of(n + c, b));
      for (int r = 0; r < ROWS; ++r) {
        total[r][0] = _mm512_fmadd_ps(acc[r][0], s, total[r][0]);
        total[r][1] = _mm512_fmadd_ps(acc[r][1], s, total[r][1]);
      }
    }
    for (int r = 0; r < ROWS; ++r) sums[r][c] = _mm512_add_ps(total[r][0], total[r][1]);
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out[r], sum_lanes16(sums[r]));
}

constexpr int64_t QROWS = 4;  // rows of x per pass over a tile's weight rows

// Columns n0 .. n1 of y, all M rows: tiles of 16 weight rows, each for every row of x in passes of QROWS.
void qcolumns_512(const uint16_t* x, int64_t ldx, const QW& w, uint16_t* y, int64_t ldy, int64_t M, int64_t K,
                  int64_t n0, int64_t n1) {
  alignas(64) float tile[QROWS][16];
  for (int64_t t0 = n0; t0 < n1; t0 += 16) {
    const int64_t width = std::min<int64_t>(16, n1 - t0);
    for (int64_t m0 = 0; m0 < M; m0 += QROWS) {
      const int64_t rows = std::min(QROWS, M - m0);
      const uint16_t* xm = x + m0 * ldx;
      switch (rows) {
        case 1: qdot_rows_512<1>(xm, ldx, w, t0, K, width, tile); break;
        case 2: qdot_rows_512<2>(xm, ldx, w, t0, K, width, tile); break;
        case 3: qdot_rows_512<3>(xm, ldx, w, t0, K, width, tile); break;
        default: qdot_rows_512<4>(xm, ldx, w, t0, K, width, tile); break;
      }
      for (int64_t r = 0; r < rows; ++r)
        _mm256_mask_storeu_epi16(y + (m0 + r) * ldy + t0, lanes16(width), narrow16(_mm512_loadu_ps(tile[r])));
    }
  }
}

#ifndef __AVX512F__
// ---- qcolumns_avx2: the AVX2 build's, on x widened to float32 -----------------------------------

// FP8's x is scaled by FP8_X_SCALE; the outputs take the scale back, with the widening's 2^120
// (FP8_UNDO).
constexpr float FP8_X_SCALE = 0x1p40f;
constexpr float FP8_UNDO = 0x1p80f;  // 2^120 / FP8_X_SCALE

// x's M rows widened to float32 in order, row m at xw + m * split_width(K), zeros past K; FP8's
// times FP8_X_SCALE (exact).
inline void widen_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* xw, int64_t fmt) {
  const int64_t K32 = split_width(K);
  const __m256 scale = _mm256_set1_ps(fmt == W_FP8 ? FP8_X_SCALE : 1.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K32; k += 8) {
      const int64_t left = K - k;
      __m128i v;
      if (left >= 8) {
        v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + m * ldx + k));
      } else {
        alignas(16) uint16_t t[8] = {};
        if (left > 0) std::memcpy(t, x + m * ldx + k, size_t(left) * 2);
        v = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
      }
      const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
      _mm256_storeu_ps(xw + m * K32 + k, _mm256_mul_ps(f, scale));
    }
}

// 8 e4m3 values from p as float32, each 2^-120 times its value, exactly: each byte sign-extended
// to 32 bits and shifted so its 7 low bits (4 exponent, 3 mantissa) land at the low end of the
// float's exponent and the top of its mantissa, the sign kept in bit 31 (the biases differ by 120,
// and an e4m3 subnormal lands on a float subnormal of the same scale; x's FP8_X_SCALE keeps the
// products normal). Three instructions for 8 values, one of them a shift: the shift units are
// the scarcer (two of Zen 3's four vector pipes), and placing each byte from a 32-bit load took
// seven shifts for 32 values. A CPU flushing subnormal inputs (MXCSR DAZ,
// torch.set_flush_denormal) would lose e4m3's.
__attribute__((always_inline)) inline __m256 widen_e4m3x8_avx2(const uint8_t* p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(int32_t(0x87F00000u))));
}

// 8 e2m1 values from 4 bytes at p (the even value in each byte's low nibble) as float32 twice
// their value (integers, exact), in order. (The block's scale takes the half.)
__attribute__((always_inline)) inline __m256 widen_e2m1x8_avx2(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  const __m128i b = _mm_cvtsi32_si128(four), nibble = _mm_set1_epi8(0x0F);
  const __m128i twice = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(twice, codes)));
}

// Bytes of a row holding 8 of its values.
constexpr int64_t bytes8(int64_t fmt) { return fmt == W_FP8 ? 8 : 4; }

// 8 values of a weight row from its bytes at p, as float32 (FP8: 2^-120 times, MXFP4: twice).
template <int64_t FMT>
__attribute__((always_inline)) inline __m256 widen8_avx2(const uint8_t* p) {
  return FMT == W_FP8 ? widen_e4m3x8_avx2(p) : widen_e2m1x8_avx2(p);
}

// Row n's scale of block b, as a float32, the format known.
template <int64_t FMT>
inline float scale_avx2(const QW& w, int64_t n, int64_t b) {
  if (FMT == W_FP8) return static_cast<const float*>(w.scale)[n * w.lds + b];
  return e8m0(static_cast<const uint8_t*>(w.scale)[n * w.lds + b]);
}

// Bytes of a weight row read ahead: 8 KB, as the bf16 products' 4,096 values. V3's expert shape
// (2048 x 7168) from memory, 2-core Zen 3 (quant_linear.py against 4 KB): 1.19x at one row, 1.15x
// at two, the same from four; the bench model's smaller products the same.
constexpr int64_t QPREFETCH = 8192;

// What the outputs are multiplied by (a power of two, exact): the widenings' scales undone.
constexpr float undo_avx2(int64_t fmt) { return fmt == W_FP8 ? FP8_UNDO : 0.5f; }

// Every output x[m] . w[n] sums the same way, whatever the rows and columns beside it: per block
// of K, two chains of FMAs in 8 lanes (each 16 values of k: the first 8 into one, the last 8 into
// the other), added, times the block's scale into the output's total; zeros past K. A chain's
// FMAs wait on each other (4 cycles each on Zen 3): one row over one weight row, two chains, ran
// at about half the rate its widening allows, so a pass runs one to three rows of x (MXFP4: one
// or two, its widening needing two more registers) over two weight rows at a time, four over one.
// - Up to QREG_ROWS rows, each weight row is widened in registers as it is read, once a pass of
//   up to four rows.
// - More rows widen a tile of 16 columns' chunk of K (QTILE_K) into float32 once, then run three
//   rows of x over two of its columns at a time: 10 loads for 12 FMAs, 12 chains (15 registers;
//   two rows over two columns, 8 chains, waited on their FMAs).

// total[r][c] = x[r] . w[n + c], r < ROWS, c < COLS, for ROWS rows of widened x (K32 floats apart),
// each weight row widened in registers.
template <int64_t FMT, int ROWS, int COLS>
inline void qdot_reg_avx2(const float* x, int64_t K32, const QW& w, int64_t n, int64_t K, __m256 total[][COLS]) {
  const uint8_t* rows[COLS];
  for (int c = 0; c < COLS; ++c) rows[c] = w.row(n + c);
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) total[r][c] = _mm256_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += w.block_k, ++b) {
    const int64_t k1 = std::min(K, k0 + w.block_k);
    __m256 acc[ROWS][COLS][2];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < COLS; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    const auto step = [&](const uint8_t* const* p, int64_t k) {  // 32 values of k from the bytes at p[c]
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < COLS; ++c) {
          const __m256 wv = widen8_avx2<FMT>(p[c] + i * bytes8(FMT));
          for (int r = 0; r < ROWS; ++r)
            acc[r][c][i & 1] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K32 + k + 8 * i), acc[r][c][i & 1]);
        }
    };
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      const uint8_t* p[COLS];
      for (int c = 0; c < COLS; ++c) {
        p[c] = rows[c] + k * bytes8(FMT) / 8;
        _mm_prefetch(reinterpret_cast<const char*>(p[c] + QPREFETCH), _MM_HINT_T0);
      }
      step(p, k);
    }
    if (k < k1) {  // FP8's last values of K, zeros after (MXFP4's K is whole 32s)
      alignas(32) uint8_t tail[COLS][32] = {};
      const uint8_t* p[COLS];
      for (int c = 0; c < COLS; ++c) std::memcpy(tail[c], rows[c] + k, size_t(k1 - k)), p[c] = tail[c];
      step(p, k);
    }
    for (int c = 0; c < COLS; ++c) {
      const __m256 s = _mm256_set1_ps(scale_avx2<FMT>(w, n + c, b));
      for (int r = 0; r < ROWS; ++r)
        total[r][c] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][c][0], acc[r][c][1]), s, total[r][c]);
    }
  }
}

// totals[r * 16 + c], r < ROWS, c < 16: x[r] . w[n + c] for ROWS rows (up to four) of widened x
// (K32 floats apart) over columns [n, n + width) (zeros for the others).
template <int64_t FMT, int ROWS>
inline void qdot_rows_reg_avx2(const float* x, int64_t K32, const QW& w, int64_t n, int64_t K, int64_t width,
                               __m256* totals) {
  constexpr int COLS = ROWS < (FMT == W_FP8 ? 4 : 3) ? 2 : 1;  // at most 12 chains in registers
  for (int64_t c = 0; c < 16; c += COLS) {
    __m256 total[ROWS][COLS];
    if (c + COLS <= width) {
      qdot_reg_avx2<FMT, ROWS, COLS>(x, K32, w, n + c, K, total);
    } else if (c < width) {  // the last column alone
      __m256 one[ROWS][1];
      qdot_reg_avx2<FMT, ROWS, 1>(x, K32, w, n + c, K, one);
      for (int r = 0; r < ROWS; ++r) total[r][0] = one[r][0], total[r][COLS - 1] = _mm256_setzero_ps();
    } else {
      for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < COLS; ++j) total[r][j] = _mm256_setzero_ps();
    }
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < COLS; ++j) totals[r * 16 + c + j] = total[r][j];
  }
}

// Rows up to which the weight is widened in registers, not into a tile (the register passes
// against the tile, 2-core Zen 3, benchmarks/quant_linear.py at V3's expert shape and 512 x 512:
// 1.10-1.13x at 5 rows, 1.01-1.09x at 8; at 12 the tile won by 1.1x in an earlier form of it).
constexpr int64_t QREG_ROWS = 8;

// ROWS rows of x (K32 floats apart, from the chunk's start) over COLS columns' widened chunks (wc,
// ld floats apart; blocks of bk values over span values, zeros past K): per block, the sums times
// the block's scale (scales[c * blocks + j]) into totals[r * 16 + c] (from zero in K's first chunk).
template <int ROWS, int COLS>
inline void qdot_tile_avx2(const float* x, int64_t K32, const float* wc, int64_t ld, int64_t span, int64_t bk,
                           const float* scales, int64_t blocks, bool first, __m256* totals) {
  __m256 total[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) total[r][c] = first ? _mm256_setzero_ps() : totals[r * 16 + c];
  for (int64_t b0 = 0, j = 0; b0 < span; b0 += bk, ++j) {
    const int64_t last = b0 + split_width(std::min(span, b0 + bk) - b0);
    __m256 acc[ROWS][COLS][2];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < COLS; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int64_t k = b0; k < last; k += 16)
      for (int h = 0; h < 2; ++h) {  // each chain's 8 values: two columns' weights, each row's x
        // Every load once, kept in a register for the FMAs that use it (GCC would fold the loads
        // into the FMAs, loading each again for each use).
        __m256 a = _mm256_loadu_ps(wc + k + 8 * h), b = a;  // columns 0 and 1
        if (COLS == 2) b = _mm256_loadu_ps(wc + ld + k + 8 * h);
        asm("" : "+x"(a), "+x"(b));
        for (int r = 0; r < ROWS; ++r) {
          __m256 xr = _mm256_loadu_ps(x + r * K32 + k + 8 * h);
          asm("" : "+x"(xr));
          acc[r][0][h] = _mm256_fmadd_ps(a, xr, acc[r][0][h]);
          if (COLS == 2) acc[r][COLS - 1][h] = _mm256_fmadd_ps(b, xr, acc[r][COLS - 1][h]);
        }
      }
    for (int c = 0; c < COLS; ++c) {
      const __m256 s = _mm256_set1_ps(scales[c * blocks + j]);
      for (int r = 0; r < ROWS; ++r)
        total[r][c] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][c][0], acc[r][c][1]), s, total[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) totals[r * 16 + c] = total[r][c];
}

constexpr int64_t QTILE_K = 1024;  // values of K per tile: 16 columns' widened chunk, 64 KB
constexpr int64_t QTILE_ROWS = 3;  // rows of x over a tile's two columns at a time

// totals[m * 16 + c]: x[m] . w[n + c] for M rows of widened x (K32 floats apart) over columns [n,
// n + width): K in chunks of whole blocks (QTILE_K values, or one block if larger), each chunk's
// 16 columns widened once into tile (16 x split_width(chunk)), then every row over it, three rows
// over two columns at a time.
template <int64_t FMT>
inline void qdot_rows_avx2(const float* xs, int64_t K32, const QW& w, int64_t n, int64_t M, int64_t K, int64_t width,
                           __m256* totals, std::vector<float>& tile_kept) {
  const int64_t bk = w.block_k, chunk = std::max<int64_t>(1, QTILE_K / bk) * bk, ld = split_width(chunk);
  float* tile = scratch(tile_kept, 16 * ld);
  thread_local std::vector<float> scales_kept;  // per column, its blocks' scales in this chunk
  float* scales = scratch(scales_kept, 16 * (chunk / bk));
  for (int64_t m = 0; m < M; ++m)  // columns past width: zeros (the others start in K's first chunk)
    for (int64_t c = width; c < 16; ++c) totals[m * 16 + c] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk), span = k1 - k0, blocks = (span + bk - 1) / bk;
    for (int64_t c = 0; c < width; ++c) {
      const uint8_t* row = w.row(n + c);
      float* out = tile + c * ld;
      int64_t k = k0;
      for (; k + 32 <= k1; k += 32) {
        const uint8_t* p = row + k * bytes8(FMT) / 8;
        _mm_prefetch(reinterpret_cast<const char*>(p + QPREFETCH), _MM_HINT_T0);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + (k - k0) + 8 * i, widen8_avx2<FMT>(p + i * bytes8(FMT)));
      }
      if (k < k1) {  // FP8's last values of K, zeros after
        alignas(32) uint8_t tail[32] = {};
        std::memcpy(tail, row + k, size_t(k1 - k));
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + (k - k0) + 8 * i, widen_e4m3x8_avx2(tail + 8 * i));
      }
      for (int64_t j = 0; j < blocks; ++j) scales[c * blocks + j] = scale_avx2<FMT>(w, n + c, k0 / bk + j);
    }
    for (int64_t m0 = 0; m0 < M; m0 += QTILE_ROWS)
      for (int64_t c = 0; c < width; c += 2) {
        const float* x = xs + m0 * K32 + k0;
        const float *wc = tile + c * ld, *sc = scales + c * blocks;
        __m256* t = totals + m0 * 16 + c;
        const auto run = [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          if (c + 1 < width) return qdot_tile_avx2<R, 2>(x, K32, wc, ld, span, bk, sc, blocks, k0 == 0, t);
          qdot_tile_avx2<R, 1>(x, K32, wc, ld, span, bk, sc, blocks, k0 == 0, t);
        };
        switch (std::min(QTILE_ROWS, M - m0)) {
          case 1: run(std::integral_constant<int, 1>()); break;
          case 2: run(std::integral_constant<int, 2>()); break;
          default: run(std::integral_constant<int, 3>()); break;
        }
      }
  }
}

// totals[m * 16 + c]: x[m] . w[n + c] for all M rows over columns [n, n + width): up to QREG_ROWS
// rows in register passes of four (the last pass the rest), more over the tile.
template <int64_t FMT>
inline void qdot_columns16_avx2(const float* xs, int64_t K32, const QW& w, int64_t n, int64_t M, int64_t K,
                                int64_t width, __m256* totals, std::vector<float>& tile_kept) {
  if (M > QREG_ROWS) return qdot_rows_avx2<FMT>(xs, K32, w, n, M, K, width, totals, tile_kept);
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* x = xs + m0 * K32;
    __m256* t = totals + m0 * 16;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: qdot_rows_reg_avx2<FMT, 1>(x, K32, w, n, K, width, t); break;
      case 2: qdot_rows_reg_avx2<FMT, 2>(x, K32, w, n, K, width, t); break;
      case 3: qdot_rows_reg_avx2<FMT, 3>(x, K32, w, n, K, width, t); break;
      default: qdot_rows_reg_avx2<FMT, 4>(x, K32, w, n, K, width, t); break;
    }
  }
}

void qcolumns_avx2(const uint16_t* x, int64_t ldx, const QW& w, uint16_t* y, int64_t ldy, int64_t M, int64_t K,
                   int64_t n0, int64_t n1, const float* xs) {
  const int64_t K32 = split_width(K);
  thread_local std::vector<float> kept_x, kept_tile;
  thread_local std::vector<__m256> kept_totals;
  if (xs == nullptr) {
    float* widened = scratch(kept_x, M * K32);
    widen_rows(x, ldx, M, K, widened, w.fmt);
    xs = widened;
  }
  __m256* totals = scratch(kept_totals, M * 16);
  for (int64_t t0 = n0; t0 < n1; t0 += 16) {
    const int64_t width = std::min<int64_t>(16, n1 - t0);
    w.fmt == W_FP8 ? qdot_columns16_avx2<W_FP8>(xs, K32, w, t0, M, K, width, totals, kept_tile)
                   : qdot_columns16_avx2<W_MXFP4>(xs, K32, w, t0, M, K, width, totals, kept_tile);
    const __m256 undo = _mm256_set1_ps(undo_avx2(w.fmt));
    for (int64_t m = 0; m < M; ++m)
      _mm256_mask_storeu_epi16(y + m * ldy + t0, lanes16(width),
                               narrow16(__m512{_mm256_mul_ps(sum_lanes8(totals + m * 16), undo),
                                               _mm256_mul_ps(sum_lanes8(totals + m * 16 + 8), undo)}));
  }
}
#endif  // !__AVX512F__

// Columns [n0, n1) of y = x w^T, all M rows, w in any format. xs (the AVX2 build), or null: x
// already prepared, by split_rows for a bf16 w, by widen_rows for a quantized one.
void product(const uint16_t* x, int64_t ldx, const QW& w, uint16_t* y, int64_t ldy, int64_t M, int64_t K, int64_t n0,
             int64_t n1, const float* xs = nullptr) {
  if (w.fmt == W_BF16) return product(x, ldx, static_cast<const uint16_t*>(w.data), w.ld, y, ldy, M, K, n0, n1,
                                      nullptr, xs);
#ifndef __AVX512F__
  if (!g_quant_generic) return qcolumns_avx2(x, ldx, w, y, ldy, M, K, n0, n1, xs);
#endif
  qcolumns_512(x, ldx, w, y, ldy, M, K, n0, n1);
}

// y[b] [M, N] = x[b] [M, K] @ w[b]^T for b < B, w in any format (w[b]: w offset by b * w_batch of
// data units and b * s_batch of scales; x[b] and y[b] b * x_batch and b * y_batch bf16 values on):
// the products' columns shared over the threads in chunks of about CHUNK_BYTES of weight; rows in
// blocks of ROW_BLOCK (each x[b] block widened once, in the AVX2 build, for all its chunks). A bf16
// w takes linear_bf16 (its bits).
void linear_w(int64_t x_ptr, int64_t x_batch, int64_t ldx, const QW& w, int64_t w_batch, int64_t s_batch,
              int64_t y_ptr, int64_t y_batch, int64_t ldy, int64_t B, int64_t M, int64_t N, int64_t K) {
  if (w.fmt == W_BF16)
    return linear_bf16(x_ptr, x_batch, ldx, int64_t(w.data), w_batch, w.ld, y_ptr, y_batch, ldy, B, M, N, K);
  const int64_t step = 16, steps = (N + step - 1) / step;
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (step * w.row_bytes(K)));
  for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int64_t rows = std::min(ROW_BLOCK, M - m0);
    const auto* x = reinterpret_cast<const uint16_t*>(x_ptr) + m0 * ldx;
    auto* y = reinterpret_cast<uint16_t*>(y_ptr) + m0 * ldy;
#ifdef __AVX512F__
    const float* split = nullptr;
    const int64_t split_size = 0;
#else
    const int64_t split_size = rows * split_width(K);
    thread_local std::vector<float> kept;
    float* split = nullptr;
    if (!g_quant_generic) {
      split = scratch(kept, B * split_size);
      for (int64_t b = 0; b < B; ++b) widen_rows(x + b * x_batch, ldx, rows, K, split + b * split_size, w.fmt);
    }
#endif
    const int64_t passes = (rows + QROWS - 1) / QROWS;
    maybe_parallel(B * steps, chunk, B * N * w.row_bytes(K) * passes, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1;) {  // [i0, i1) may span several products: one step range each
        const int64_t b = i / steps, s0 = i % steps, s1 = std::min(steps, s0 + (i1 - i));
        product(x + b * x_batch, ldx, w.offset(b * w_batch, b * s_batch), y + b * y_batch, ldy, rows, K, s0 * step,
                std::min(N, s1 * step), split ? split + b * split_size : nullptr);
        i += s1 - s0;
      }
    });
  }
}

// One product: y [M, N] = x [M, K] @ w^T.
void linear_w(int64_t x_ptr, int64_t ldx, const QW& w, int64_t y_ptr, int64_t ldy, int64_t M, int64_t N, int64_t K) {
  linear_w(x_ptr, 0, ldx, w, 0, 0, y_ptr, 0, ldy, 1, M, N, K);
}

// A weight from Python as (data, ld, scale, lds, block_k, fmt): kernels/native weight_args.
using WeightArgs = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

inline QW weight_of(const WeightArgs& a) {
  const auto [data, ld, scale, lds, block_k, fmt] = a;
  return QW{reinterpret_cast<const void*>(data), ld, reinterpret_cast<const void*>(scale), lds, block_k, fmt};
}

// linear_w from Python: w as weight_args gives it (data, ld, scale, lds, block_k, fmt), with its
// batch strides.
void linear_q(int64_t x_ptr, int64_t x_batch, int64_t ldx, const WeightArgs& w, int64_t w_batch, int64_t s_batch,
              int64_t y_ptr, int64_t y_batch, int64_t ldy, int64_t B, int64_t M, int64_t N, int64_t K) {
  linear_w(x_ptr, x_batch, ldx, weight_of(w), w_batch, s_batch, y_ptr, y_batch, ldy, B, M, N, K);
}

}  // namespace
