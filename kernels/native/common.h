// What every kernel here shares: the includes, how a call's work is shared over threads
// (maybe_parallel), the K lanes of a 32-wide step, and bf16 <-> float32.

#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>
#include <immintrin.h>
#ifndef __AVX512F__
#include "avx2.h"  // the AVX-512 intrinsics below on pairs of AVX2 registers
#endif
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
#include <string>
#include <utility>
#include <vector>

#include "pool.h"

namespace {

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
// The decode attention: from 1 MB of cache two OpenMP threads pay (a batch-8 step's attention on
// the tile unit, bench model, ~250 cached tokens: 2.0 -> 1.4 ms).
constexpr int64_t ATTENTION_OMP_MIN_BYTES = int64_t(1) << 20;
constexpr int64_t CHUNK_BYTES = int64_t(64) << 10;  // about this much weight per chunk
// Row-wise work (rms_norm, rotary) over a prefill's rows: from 64 KB of rows OpenMP's threads pay
// (a 4096-token chunk holds 4 MB of hidden states). Bench model, bf16, 2-core Zen 4, a prefill of
// 32 x 128-token prompts: its norms took 100 ms and its rotary 86 of the step's ~1.5 s, a row at a
// time on one thread; with blocks of rows and 16 lanes, over both threads, 32 and 12.
constexpr int64_t ROWS_OMP_MIN_BYTES = int64_t(64) << 10;

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

// One 32-element step of bf16 values from p: the first `left` (all 32 from 32 on), zeros after
// them. A whole step is a plain load: on the 2-core Zen 4, in the build without AVX512-BF16, the
// absorbed per-head products (8 heads' 512 x 64 weights, out of cache) took 89 us with every step
// a masked load, 24 with plain ones (22-25 either way with the instructions).
inline __m512i load32(const uint16_t* p, int64_t left) {
  return left >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(lanes(left), p);
}

// The lanes of one 16-wide float32 step: every lane, or the tail's first `left`.
inline __mmask16 lanes16(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}


// n elements of a call's scratch, not initialised, in `kept`: a buffer its call site keeps per
// thread (thread_local) and only grows, so a decode step's working buffers cost neither an
// allocation nor the zeroing a std::vector of n does (a layer's attention at 32 tokens zeroed
// ~2 MB a step, all of it overwritten before it was read). Valid until the site's next call on
// this thread.
template <typename T>
T* scratch(std::vector<T>& kept, int64_t n) {
  if (int64_t(kept.size()) < n) kept.resize(n);
  return kept.data();
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

// 16 at a time: bf16 -> float32 (exact).
inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// The two AVX512-BF16 instructions the kernels use: VDPBF16PS (dot_bf16) and VCVTNEPS2BF16
// (narrow16). A build for a CPU without them (AVX512F and BW only: Skylake-SP to Ice Lake; see
// kernels/native/__init__.py) computes the same bits from AVX512F instructions:
// - dot_bf16: lane i of acc += a[2i + 1] b[2i + 1], then += a[2i] b[2i], each a float32
//   multiply-add rounded to nearest even (a product of two bf16 values is exact in float32). The
//   instruction's order; on the 2-core Zen 4 it and two FMAs agreed on all of 3.2M random lanes,
//   the other order on 94%. One difference is kept: the instruction flushes denormal inputs and
//   sums (|x| < 2^-126) to zero, the two FMAs keep them.
// - narrow16: float32 -> bf16 rounding to nearest even, NaN quieted, denormals to a signed zero
//   (as the instruction; to_bf16 keeps them).
#ifdef __AVX512BF16__
inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
inline __m256i narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const auto odd = [&](__m512i x) { return _mm512_castsi512_ps(_mm512_and_si512(x, high)); };
  const auto even = [](__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); };
  return _mm512_fmadd_ps(even(a), even(b), _mm512_fmadd_ps(odd(a), odd(b), acc));
}
__attribute__((always_inline)) inline __m256i narrow16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), top = _mm512_srli_epi32(u, 16);
  const __m512i odd_top = _mm512_and_si512(top, _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd_top, _mm512_set1_epi32(0x7FFF))), 16);
  h = _mm512_mask_or_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), top, _mm512_set1_epi32(0x40));
  h = _mm512_mask_and_epi32(h, _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000)), top,
                            _mm512_set1_epi32(0x8000));
  return _mm512_cvtepi32_epi16(h);
}
#endif

// Lane i of the result: the sum of v[i]'s 16 lanes. Four levels of shuffles and additions give
// the 16 sums at once (one alone takes ~8 instructions); the levels leave them in the lane order
// of an involution, so reading the inputs in that order puts each sum in its own lane.
inline __m512 sum_lanes16(const __m512* v) {
  constexpr int ORDER[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: v[i]'s in the low half, v[i + 8]'s in the high
    const __m512 a = v[ORDER[i]], b = v[ORDER[i + 8]];
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // 128-bit quarters
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {  // pairs of lanes
    const __m512d a = _mm512_castps_pd(x[i]), b = _mm512_castps_pd(x[i + 2]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// e^x in 16 lanes, within 2 ulp of std::exp: x = n ln2 + r (ln2 in two parts, |r| <= ln2 / 2),
// e^r by its Taylor series to r^7 (truncation under 0.1 ulp), scaled by 2^n in one rounding
// (denormal results too). Exactly 0 below -104 (-inf included), inf above 88.72, NaN for NaN, as
// std::exp. The softmaxes and SiLUs here called std::exp once per element (with their scalar
// roundings, a B = 256 step at 300-token contexts took 137 ms against 123).
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  __m512 e = _mm512_scalef_ps(p, n);
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ),
                         _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

// exp16 over n floats (a tail of fewer than 16 through masked lanes).
inline void exp_floats(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    _mm512_mask_storeu_ps(y + i, m, exp16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

}  // namespace
