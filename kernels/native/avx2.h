// The AVX-512 intrinsics the kernels use, on AVX2 and FMA: the build for a CPU without AVX512F
// (AMD before Zen 4, Intel client cores; kernels/native/__init__.py). common.h includes this
// after <immintrin.h> where __AVX512F__ is not defined: from here on the 512-bit vector types
// name pairs of 256-bit registers, and each intrinsic is a function of the same name's meaning
// on the two halves. Every lane computes what the AVX-512 instruction computes (the same IEEE
// operations in the same order: the horizontal reductions in GCC's own order, VSCALEFPS in one
// rounding), so the kernels written with them (attention, norms, rotary, routing) compute the
// AVX-512 build's bits (tests/test_native_bf16_emulation.py). The products are the exception:
// they sum in an order of their own, written for 16 registers (products_avx2.h).
// Masked 16-bit loads and stores have no AVX2 form: a whole vector is a plain load or store, a
// tail goes through a small buffer, never touching memory outside its lanes.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace avx2 {

struct F16 {  // __m512: lanes 0-7 in lo, 8-15 in hi
  __m256 lo, hi;
};
struct I16 {  // __m512i
  __m256i lo, hi;
};
struct D8 {  // __m512d
  __m256d lo, hi;
};

// ---- masks: bit i of a 16-bit mask <-> lane i all ones --------------------------------------
inline __m256i lanes_of(unsigned bits8) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits8)), bit), bit);
}
inline unsigned bits_of(__m256 lanes) { return unsigned(_mm256_movemask_ps(lanes)); }
inline unsigned bits_of(__m256i lanes) { return bits_of(_mm256_castsi256_ps(lanes)); }
inline I16 lanes16_of(__mmask16 k) { return {lanes_of(k & 0xFF), lanes_of(k >> 8)}; }

// ---- set, cast, load, store -----------------------------------------------------------------
inline F16 set1_ps(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline I16 set1_epi32(int32_t i) { return {_mm256_set1_epi32(i), _mm256_set1_epi32(i)}; }
inline I16 set1_epi16(int16_t i) { return {_mm256_set1_epi16(i), _mm256_set1_epi16(i)}; }
inline F16 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline I16 set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7, int e6, int e5,
                     int e4, int e3, int e2, int e1, int e0) {
  return {_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7), _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15)};
}
inline F16 castsi512_ps(I16 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
inline I16 castps_si512(F16 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
inline D8 castps_pd(F16 a) { return {_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
inline F16 castpd_ps(D8 a) { return {_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
inline I16 castsi256_si512(__m256i a) { return {a, _mm256_setzero_si256()}; }
template <int IMM>
inline I16 inserti64x4(I16 a, __m256i b) {
  return IMM & 1 ? I16{a.lo, b} : I16{b, a.hi};
}

inline F16 loadu_ps(const void* p) {
  const auto* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
inline void storeu_ps(void* p, F16 v) {
  auto* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, v.lo), _mm256_storeu_ps(f + 8, v.hi);
}
inline I16 loadu_si512(const void* p) {
  const auto* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
inline void store_si512(void* p, I16 v) {
  auto* d = static_cast<__m256i*>(p);
  _mm256_storeu_si256(d, v.lo), _mm256_storeu_si256(d + 1, v.hi);
}
inline F16 maskz_loadu_ps(__mmask16 k, const void* p) {
  const auto* f = static_cast<const float*>(p);
  return {_mm256_maskload_ps(f, lanes_of(k & 0xFF)), _mm256_maskload_ps(f + 8, lanes_of(k >> 8))};
}
inline void mask_storeu_ps(void* p, __mmask16 k, F16 v) {
  auto* f = static_cast<float*>(p);
  _mm256_maskstore_ps(f, lanes_of(k & 0xFF), v.lo), _mm256_maskstore_ps(f + 8, lanes_of(k >> 8), v.hi);
}

// 16-bit lanes under a mask of N bits, through a buffer unless every lane is on.
template <int N>
inline void masked_copy16(uint16_t* to, const uint16_t* from, uint64_t k) {
  if ((k & (k + 1)) == 0) {  // the first popcount(k) lanes: a tail
    std::memcpy(to, from, 2 * size_t(__builtin_popcountll(k)));
    return;
  }
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) to[i] = from[i];
}
inline __m256i maskz_loadu_epi16_256(__mmask16 k, const void* p) {
  if (k == 0xFFFF) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t t[16] = {};
  masked_copy16<16>(t, static_cast<const uint16_t*>(p), k);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
}
inline void mask_storeu_epi16_256(void* p, __mmask16 k, __m256i v) {
  if (k == 0xFFFF) return _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  alignas(32) uint16_t t[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), v);
  masked_copy16<16>(static_cast<uint16_t*>(p), t, k);
}
inline __m256i maskz_loadu_epi8_256(__mmask32 k, const void* p) {  // the first popcount(k) bytes
  if (k == ~__mmask32(0)) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint8_t t[32] = {};
  std::memcpy(t, p, size_t(__builtin_popcount(k)));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
}
inline I16 maskz_loadu_epi16(__mmask32 k, const void* p) {
  if (k == ~__mmask32(0)) return loadu_si512(p);
  alignas(32) uint16_t t[32] = {};
  masked_copy16<32>(t, static_cast<const uint16_t*>(p), k);
  return loadu_si512(t);
}
inline void mask_storeu_epi16(void* p, __mmask32 k, I16 v) {
  if (k == ~__mmask32(0)) return store_si512(p, v);
  alignas(32) uint16_t t[32];
  store_si512(t, v);
  masked_copy16<32>(static_cast<uint16_t*>(p), t, k);
}

// ---- arithmetic, lane by lane ------------------------------------------------------------------
#define PDSERVE_AVX2_F2(name, op) \
  inline F16 name(F16 a, F16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
#define PDSERVE_AVX2_I2(name, op) \
  inline I16 name(I16 a, I16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
PDSERVE_AVX2_F2(add_ps, _mm256_add_ps)
PDSERVE_AVX2_F2(sub_ps, _mm256_sub_ps)
PDSERVE_AVX2_F2(mul_ps, _mm256_mul_ps)
PDSERVE_AVX2_F2(div_ps, _mm256_div_ps)
PDSERVE_AVX2_F2(max_ps, _mm256_max_ps)
PDSERVE_AVX2_I2(add_epi32, _mm256_add_epi32)
PDSERVE_AVX2_I2(mullo_epi32, _mm256_mullo_epi32)
PDSERVE_AVX2_I2(and_si512, _mm256_and_si256)
PDSERVE_AVX2_I2(or_si512, _mm256_or_si256)
PDSERVE_AVX2_I2(add_epi16, _mm256_add_epi16)
PDSERVE_AVX2_I2(unpacklo_epi16, _mm256_unpacklo_epi16)
PDSERVE_AVX2_I2(unpackhi_epi16, _mm256_unpackhi_epi16)
#undef PDSERVE_AVX2_F2
#undef PDSERVE_AVX2_I2
inline D8 unpacklo_pd(D8 a, D8 b) { return {_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)}; }
inline D8 unpackhi_pd(D8 a, D8 b) { return {_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)}; }
inline F16 fmadd_ps(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnmadd_ps(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline I16 slli_epi16(I16 a, int n) { return {_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }
inline I16 slli_epi32(I16 a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline I16 srli_epi32(I16 a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
template <int IMM>
inline F16 roundscale_ps(F16 a) {
  static_assert((IMM & 0xF0) == 0, "only scale 0 (rounding to an integer)");
  return {_mm256_round_ps(a.lo, IMM), _mm256_round_ps(a.hi, IMM)};
}
// a * 2^floor(b) in one rounding, for b already an integer (exp16's): 2^b in two exact halves,
// each a normal float32, the first product exact for the |a| ~ 1 exp16 gives it.
inline F16 scalef_ps(F16 a, F16 b) {
  const auto half = [](__m256 x, __m256 n) {
    __m256i e = _mm256_cvtps_epi32(n);
    e = _mm256_max_epi32(_mm256_min_epi32(e, _mm256_set1_epi32(254)), _mm256_set1_epi32(-252));
    const __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
    const auto pow2 = [](__m256i k) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
    };
    return _mm256_mul_ps(_mm256_mul_ps(x, pow2(e1)), pow2(e2));
  };
  return {half(a.lo, b.lo), half(a.hi, b.hi)};
}

// ---- masked moves and compares -------------------------------------------------------------------
template <int CMP>
inline __mmask16 cmp_ps_mask(F16 a, F16 b) {
  return __mmask16(bits_of(_mm256_cmp_ps(a.lo, b.lo, CMP)) | bits_of(_mm256_cmp_ps(a.hi, b.hi, CMP)) << 8);
}
template <int CMP>
inline __mmask16 mask_cmp_ps_mask(__mmask16 k, F16 a, F16 b) {
  return k & cmp_ps_mask<CMP>(a, b);
}
inline __mmask16 testn_epi32_mask(I16 a, I16 b) {
  const __m256i zero = _mm256_setzero_si256();
  return __mmask16(bits_of(_mm256_cmpeq_epi32(_mm256_and_si256(a.lo, b.lo), zero)) |
                   bits_of(_mm256_cmpeq_epi32(_mm256_and_si256(a.hi, b.hi), zero)) << 8);
}
// 16-bit lanes, a lane at a time (run here only by the generic quantized products, which tests
// force): bit i set where a[i] & b[i] is not zero; lane i of b where bit i of k, else a's.
inline __mmask32 test_epi16_mask(I16 a, I16 b) {
  alignas(32) uint16_t x[32], y[32];
  store_si512(x, a), store_si512(y, b);
  __mmask32 k = 0;
  for (int i = 0; i < 32; ++i) k |= __mmask32((x[i] & y[i]) != 0) << i;
  return k;
}
inline I16 mask_blend_epi16(__mmask32 k, I16 a, I16 b) {
  alignas(32) uint16_t x[32], y[32];
  store_si512(x, a), store_si512(y, b);
  for (int i = 0; i < 32; ++i)
    if ((k >> i) & 1) x[i] = y[i];
  return loadu_si512(x);
}
inline I16 mask_mov_epi32(I16 src, __mmask16 k, I16 a) {
  const I16 m = lanes16_of(k);
  return {_mm256_blendv_epi8(src.lo, a.lo, m.lo), _mm256_blendv_epi8(src.hi, a.hi, m.hi)};
}
inline F16 mask_mov_ps(F16 src, __mmask16 k, F16 a) { return castsi512_ps(mask_mov_epi32(castps_si512(src), k, castps_si512(a))); }
inline F16 maskz_mov_ps(__mmask16 k, F16 a) { return castsi512_ps(and_si512(castps_si512(a), lanes16_of(k))); }
inline I16 mask_or_epi32(I16 src, __mmask16 k, I16 a, I16 b) {
  return mask_mov_epi32(src, k, {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)});
}
inline I16 mask_and_epi32(I16 src, __mmask16 k, I16 a, I16 b) { return mask_mov_epi32(src, k, and_si512(a, b)); }

// ---- widening, narrowing, shuffles ----------------------------------------------------------------
inline I16 cvtepi8_epi16(__m256i b) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(b)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1))};
}
inline I16 cvtepu8_epi32(__m128i b) { return {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))}; }
inline I16 cvtepu16_epi32(__m256i h) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1))};
}
inline __m256i cvtepi32_epi16(I16 v) {  // each lane's low 16 bits
  const __m256i low_halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8,
                                              9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const auto eight = [&](__m256i x) {  // 8 lanes -> 8 x 16 bits in the low 128
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, low_halves), 0x08));
  };
  return _mm256_set_m128i(eight(v.hi), eight(v.lo));
}
// 128-bit lane l (0-3) of a, as the low or high half of a 256-bit pair.
template <int IMM>
inline F16 shuffle_f32x4(F16 a, F16 b) {
  constexpr int l0 = IMM & 3, l1 = (IMM >> 2) & 3, l2 = (IMM >> 4) & 3, l3 = (IMM >> 6) & 3;
  return {_mm256_permute2f128_ps(a.lo, a.hi, l0 | l1 << 4), _mm256_permute2f128_ps(b.lo, b.hi, l2 | l3 << 4)};
}
template <int IMM>
inline F16 shuffle_ps(F16 a, F16 b) {
  return {_mm256_shuffle_ps(a.lo, b.lo, IMM), _mm256_shuffle_ps(a.hi, b.hi, IMM)};
}
// Lane i: (idx[i] & 16 ? b : a)[idx[i] & 15].
inline F16 permutex2var_ps(F16 a, I16 idx, F16 b) {
  const auto half = [&](__m256i i) {
    const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)), bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 27));
    const __m256 from_a = _mm256_blendv_ps(_mm256_permutevar8x32_ps(a.lo, i), _mm256_permutevar8x32_ps(a.hi, i), bit3);
    const __m256 from_b = _mm256_blendv_ps(_mm256_permutevar8x32_ps(b.lo, i), _mm256_permutevar8x32_ps(b.hi, i), bit3);
    return _mm256_blendv_ps(from_a, from_b, bit4);
  };
  return {half(idx.lo), half(idx.hi)};
}
// 16-bit lane i: a[idx[i] & 31]. Run here only by the tile paths' software tiles and the generic
// quantized products (quantized.h), both forced by tests; the next, only on the tile paths.
inline I16 permutexvar_epi16(I16 idx, I16 a) {
  alignas(32) uint16_t i[32], v[32], out[32];
  store_si512(i, idx), store_si512(v, a);
  for (int j = 0; j < 32; ++j) out[j] = v[i[j] & 31];
  return loadu_si512(out);
}
template <int SCALE>
inline F16 i32gather_ps(I16 idx, const void* base) {
  const auto* f = static_cast<const float*>(base);
  return {_mm256_i32gather_ps(f, idx.lo, SCALE), _mm256_i32gather_ps(f, idx.hi, SCALE)};
}

// ---- horizontal reductions, in GCC's <avx512fintrin.h> order --------------------------------------
inline float reduce_add_ps(F16 a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
inline float reduce_max_ps(F16 a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
inline int32_t reduce_min_epi32(I16 a) {
  const __m256i t3 = _mm256_min_epi32(a.hi, a.lo);
  __m128i t = _mm_min_epi32(_mm256_extracti128_si256(t3, 1), _mm256_castsi256_si128(t3));
  t = _mm_min_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::min(_mm_cvtsi128_si32(t), _mm_extract_epi32(t, 1));
}

}  // namespace avx2

// The kernels' names for the above.
#define __m512 avx2::F16
#define __m512i avx2::I16
#define __m512d avx2::D8
#define _mm512_set1_ps avx2::set1_ps
#define _mm512_set1_epi32 avx2::set1_epi32
#define _mm512_set1_epi16 avx2::set1_epi16
#define _mm256_maskz_loadu_epi8 avx2::maskz_loadu_epi8_256
#define _mm512_or_si512 avx2::or_si512
#define _mm512_add_epi16 avx2::add_epi16
#define _mm512_slli_epi16 avx2::slli_epi16
#define _mm512_test_epi16_mask avx2::test_epi16_mask
#define _mm512_mask_blend_epi16 avx2::mask_blend_epi16
#define _mm512_cvtepi8_epi16 avx2::cvtepi8_epi16
#define _mm512_cvtepu8_epi32 avx2::cvtepu8_epi32
#define _mm512_setzero_ps avx2::setzero_ps
#define _mm512_set_epi32 avx2::set_epi32
#define _mm512_castsi512_ps avx2::castsi512_ps
#define _mm512_castps_si512 avx2::castps_si512
#define _mm512_castps_pd avx2::castps_pd
#define _mm512_castpd_ps avx2::castpd_ps
#define _mm512_castsi256_si512 avx2::castsi256_si512
#define _mm512_inserti64x4(a, b, imm) avx2::inserti64x4<(imm)>(a, b)
#define _mm512_loadu_ps avx2::loadu_ps
#define _mm512_load_ps avx2::loadu_ps
#define _mm512_storeu_ps avx2::storeu_ps
#define _mm512_store_ps avx2::storeu_ps
#define _mm512_loadu_si512 avx2::loadu_si512
#define _mm512_load_si512 avx2::loadu_si512
#define _mm512_store_si512 avx2::store_si512
#define _mm512_storeu_si512 avx2::store_si512
#define _mm512_maskz_loadu_ps avx2::maskz_loadu_ps
#define _mm512_mask_storeu_ps avx2::mask_storeu_ps
#define _mm256_maskz_loadu_epi16 avx2::maskz_loadu_epi16_256
#define _mm256_mask_storeu_epi16 avx2::mask_storeu_epi16_256
#define _mm512_maskz_loadu_epi16 avx2::maskz_loadu_epi16
#define _mm512_mask_storeu_epi16 avx2::mask_storeu_epi16
#define _mm512_add_ps avx2::add_ps
#define _mm512_sub_ps avx2::sub_ps
#define _mm512_mul_ps avx2::mul_ps
#define _mm512_div_ps avx2::div_ps
#define _mm512_max_ps avx2::max_ps
#define _mm512_add_epi32 avx2::add_epi32
#define _mm512_mullo_epi32 avx2::mullo_epi32
#define _mm512_and_si512 avx2::and_si512
#define _mm512_unpacklo_epi16 avx2::unpacklo_epi16
#define _mm512_unpackhi_epi16 avx2::unpackhi_epi16
#define _mm512_unpacklo_pd avx2::unpacklo_pd
#define _mm512_unpackhi_pd avx2::unpackhi_pd
#define _mm512_fmadd_ps avx2::fmadd_ps
#define _mm512_fnmadd_ps avx2::fnmadd_ps
#define _mm512_slli_epi32 avx2::slli_epi32
#define _mm512_srli_epi32 avx2::srli_epi32
#define _mm512_roundscale_ps(a, imm) avx2::roundscale_ps<(imm)>(a)
#define _mm512_scalef_ps avx2::scalef_ps
#define _mm512_cmp_ps_mask(a, b, imm) avx2::cmp_ps_mask<(imm)>(a, b)
#define _mm512_mask_cmp_ps_mask(k, a, b, imm) avx2::mask_cmp_ps_mask<(imm)>(k, a, b)
#define _mm512_testn_epi32_mask avx2::testn_epi32_mask
#define _mm512_mask_mov_epi32 avx2::mask_mov_epi32
#define _mm512_mask_mov_ps avx2::mask_mov_ps
#define _mm512_maskz_mov_ps avx2::maskz_mov_ps
#define _mm512_mask_or_epi32 avx2::mask_or_epi32
#define _mm512_mask_and_epi32 avx2::mask_and_epi32
#define _mm512_cvtepu16_epi32 avx2::cvtepu16_epi32
#define _mm512_cvtepi32_epi16 avx2::cvtepi32_epi16
#define _mm512_shuffle_f32x4(a, b, imm) avx2::shuffle_f32x4<(imm)>(a, b)
#define _mm512_shuffle_ps(a, b, imm) avx2::shuffle_ps<(imm)>(a, b)
#define _mm512_permutex2var_ps avx2::permutex2var_ps
#define _mm512_permutexvar_epi16 avx2::permutexvar_epi16
#define _mm512_i32gather_ps(idx, base, scale) avx2::i32gather_ps<(scale)>(idx, base)
#define _mm512_reduce_add_ps avx2::reduce_add_ps
#define _mm512_reduce_max_ps avx2::reduce_max_ps
#define _mm512_reduce_min_epi32 avx2::reduce_min_epi32
