// MLA decode attention over the paged latent cache, read in place (mla_decode): with VDPBF16PS,
// or on the AMX tile unit.

#pragma once

#include "products.h"

namespace {

// MLA decode attention, one query token per sequence, over the paged latent cache (the math of
// kernels/mla.py), with the torch path's roundings (_mla_decode_fast):
//   s[h, j]  = bf16(bf16(q[b, h] . cache[j]) * scale)      j < seq_lens[b]
//   p[h]     = bf16(softmax_j(s[h]))                        (float32 inside)
//   o[b, h]  = bf16(sum_j p[h, j] * cache[j, :L])
// Cache row j of sequence b is row j % block_size of block block_table[b, j / block_size], read
// in place (no gather). A work item is a sequence and a range of its heads (all of them unless
// there are fewer sequences than threads). Through VDPBF16PS (attend) the heads go in groups of
// HEAD_GROUP: each cache row is loaded once per group for its scores, and once per 32 output
// columns, whose float32 sums for the group stay in registers over the whole sequence.
constexpr int64_t HEAD_GROUP = 8;

// Scores s[0, len) -> their softmax rounded to bf16 (float32 inside), in place; 0 where every
// score is -inf (all rows refused). The sum runs in 16 lanes (exp16), then across them.
// With a finite `sink` (DeepSeek-V4's per-head sink logit) the softmax is over the scores and the
// sink, whose own term is dropped: the scores' probabilities sum to less than one.
inline void softmax_rounded(float* s, int64_t len, float sink = -INFINITY) {
  __m512 tops = _mm512_set1_ps(-INFINITY);  // the maximum in lanes (exact in any order)
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(s + i));
  float top = _mm512_reduce_max_ps(tops);
  for (; i < len; ++i) top = std::max(top, s[i]);
  top = std::max(top, sink);
  if (top == -INFINITY) {
    std::fill_n(s, len, 0.0f);
    return;
  }
  const auto mask = [&](int64_t j) { return lanes16(len - j); };
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask(j), s + j), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(s + j, mask(j), e);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(mask(j), e));
  }
  float summed = _mm512_reduce_add_ps(sums);
  if (sink != -INFINITY) summed += std::exp(sink - top);
  const __m512 total = _mm512_set1_ps(summed);  // >= 1: the top's own term
  for (int64_t j = 0; j < len; j += 16) {  // bf16(e / total), widened back
    const __m512 p = _mm512_div_ps(_mm512_maskz_loadu_ps(mask(j), s + j), total);
    _mm512_mask_storeu_ps(s + j, mask(j), widen16(narrow16(p)));
  }
}

// A thread's buffers for the attention of its sequences, reused from one to the next.
struct AttendScratch {
  std::vector<float> s;                // scores [heads, len], then their probabilities
  std::vector<const uint16_t*> rows;   // the sequence's cache rows (attend), a zero row where refused
  std::vector<uint16_t> zeros;         // that zero row, W long
  std::vector<uint32_t> pairs;         // q in pairs (amx_attend); probabilities in pairs (attend)
  std::vector<uint16_t> probs;         // bf16 probabilities, 16 rows of whole 32-row steps (amx_attend)
  std::vector<float> work;             // q split, then the output's sums (the AVX2 build's loops)
};

// Scores s[g * len + j] of G heads (q + g * q_h) against rows[0, len), through VDPBF16PS: two
// rows at a time, so each head's q is loaded once for both, and the dot products' sums across
// lanes 16 at a time (sum_lanes16). The rows AHEAD on are prefetched meanwhile (Zen 4, B = 256
// sequences of ~290 tokens, ms a layer: none 13.5, 4 rows ahead 9.6, 8 8.5, 16 10.3).
constexpr int64_t AHEAD = 8;

// Scores as their dot products come, each as 16 lanes of float32 sums: staged 16 at a time, then
// each summed across its lanes (sum_lanes16: one score's sum does not depend on those beside it),
// rounded to bf16, scaled and rounded again, into s[at].
struct ScoreStage {
  float* s;
  float scale;
  __m512 stage[16];
  int64_t at[16];
  int n = 0;

  void add(__m512 dot, int64_t where) { stage[n] = dot, at[n++] = where; }
  void flush_for(int more) {  // room for `more` scores
    if (n + more > 16) flush();
  }
  void flush() {
    if (n == 0) return;
    for (int i = n; i < 16; ++i) stage[i] = _mm512_setzero_ps();
    const __m512 dot = widen16(narrow16(sum_lanes16(stage)));  // bf16(bf16(q . row) * scale)
    alignas(64) float out[16];
    _mm512_store_ps(out, widen16(narrow16(_mm512_mul_ps(dot, _mm512_set1_ps(scale)))));
    for (int i = 0; i < n; ++i) s[at[i]] = out[i];
    n = 0;
  }
};

template <int G>
void attend_scores(const uint16_t* q, int64_t q_h, const uint16_t* const* rows, int64_t len, int64_t W,
                   float scale, float* s) {
  ScoreStage scores{s, scale};
  for (int64_t j = 0; j < len; j += 2) {
    const uint16_t *a = rows[j], *b = rows[j + 1];  // rows[len] is the zero row
    const uint16_t *pa = rows[std::min(j + AHEAD, len)], *pb = rows[std::min(j + AHEAD + 1, len)];
    __m512 da[G], db[G];
    for (int g = 0; g < G; ++g) da[g] = db[g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < W; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(pa + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pb + k), _MM_HINT_T0);
      const __m512i ka = load32(a + k, W - k), kb = load32(b + k, W - k);
      for (int g = 0; g < G; ++g) {
        const __m512i qg = load32(q + g * q_h + k, W - k);
        da[g] = dot_bf16(da[g], ka, qg);
        db[g] = dot_bf16(db[g], kb, qg);
      }
    }
    scores.flush_for(2 * G);
    for (int g = 0; g < G; ++g) scores.add(da[g], g * len + j);
    if (j + 1 < len)
      for (int g = 0; g < G; ++g) scores.add(db[g], g * len + j + 1);
  }
  scores.flush();
}

// o[g * o_h + l] = bf16(sum_j p[g, j] rows[j][l]) for l < L, through VDPBF16PS over pairs of rows:
// pp[g * pairs + i] holds (p[g, 2i], p[g, 2i + 1]) in bf16, rows[2i], rows[2i + 1] are interleaved
// 16 bits at a time (within 128-bit lanes), and each 32 columns' sums for the G heads stay in
// registers over the whole sequence.
template <int G>
void attend_output(const uint32_t* pp, int64_t pairs, const uint16_t* const* rows, int64_t L, uint16_t* o,
                   int64_t o_h) {
  // Column c of 32 lies in lane 4 (c / 8) + c % 4 of the low (c % 8 < 4) or high interleaving.
  alignas(64) int32_t order[32];
  for (int c = 0; c < 32; ++c) order[c] = (c % 8 < 4 ? 0 : 16) + 4 * (c / 8) + c % 4;
  const __m512i first = _mm512_load_si512(order), second = _mm512_load_si512(order + 16);
  for (int64_t l0 = 0; l0 < L; l0 += 32) {
    const __mmask32 m = lanes(L - l0);
    __m512 lo[G], hi[G];
    for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
      const __m512i a = load32(rows[2 * i] + l0, L - l0), b = load32(rows[2 * i + 1] + l0, L - l0);
      const __m512i ab_lo = _mm512_unpacklo_epi16(a, b), ab_hi = _mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < G; ++g) {
        const __m512i p = _mm512_set1_epi32(int32_t(pp[g * pairs + i]));
        lo[g] = dot_bf16(lo[g], ab_lo, p);
        hi[g] = dot_bf16(hi[g], ab_hi, p);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256i c0 = narrow16(_mm512_permutex2var_ps(lo[g], first, hi[g]));
      const __m256i c1 = narrow16(_mm512_permutex2var_ps(lo[g], second, hi[g]));
      _mm512_mask_storeu_epi16(o + g * o_h + l0, m, _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1));
    }
  }
}

bool g_attend_generic = false;  // the AVX2 build runs the loops above (tests: use_attend_generic)

// The AVX2 build's decode attention through the loops above on avx2.h's emulation (on) or through
// its own below (off), for tests; -> the setting it replaces. The AVX-512 builds have one form.
bool use_attend_generic(bool on) {
  const bool before = g_attend_generic;
  g_attend_generic = on;
  return before;
}

#ifndef __AVX512F__
// ---- the AVX2 build's own loops: the same arithmetic, so the same bits ----------------------------
// On avx2.h's emulation the loops above keep 2G to 4G vectors of sums in 16 registers and spill,
// and widen each head's q again for every pair of rows. These do each float32 operation of them in
// the same order: q split once a sequence and four heads' sums in registers (attend_scores_avx2),
// the probabilities widened once and the output's sums in L1 (attend_output_avx2).

// n floats of scratch (common.h) from a 32-byte boundary in `kept`; -> that boundary.
inline float* aligned32(std::vector<float>& kept, int64_t n) {
  float* p = scratch(kept, n + 8);
  return p + (-reinterpret_cast<uintptr_t>(p) & 31) / 4;
}

// The 32 values p[0, 32) (zeros past `left`) as dot_bf16's emulation splits them: the two 16-value
// halves h[0], h[1], each as its odd values (the high 16 bits of each 32-bit pair, in place) and
// its even ones (the low 16 bits shifted up), float32 and exact.
struct Split32 {
  __m256 odd[2], even[2];
};
__attribute__((always_inline)) inline Split32 split32(const uint16_t* p, int64_t left) {
  __m256i h[2];
  if (left >= 32) {
    h[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    h[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  } else {
    alignas(32) uint16_t t[32] = {};
    std::memcpy(t, p, size_t(std::max<int64_t>(left, 0)) * 2);
    h[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
    h[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(t + 16));
  }
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  Split32 v;
  for (int i = 0; i < 2; ++i) {
    v.odd[i] = _mm256_castsi256_ps(_mm256_and_si256(h[i], high));
    v.even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(h[i], 16));
  }
  return v;
}

// N heads' dot products with one cache row `a` (W values), as dot_bf16 sums them: for each 32
// values, lane i += odd products then even ones, in two 8-lane halves (lo, hi). qw holds each
// head's q split (split32) a chunk at a time: [head][chunk][odd 0, odd 1, even 0, even 1][8].
template <int N>
__attribute__((always_inline)) inline void row_dots(const uint16_t* a, const uint16_t* ahead, const float* qw,
                                                    int64_t per_head, int64_t W, __m256* lo, __m256* hi) {
  for (int n = 0; n < N; ++n) lo[n] = hi[n] = _mm256_setzero_ps();
  for (int64_t k = 0, c = 0; k < W; k += 32, ++c) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
    const Split32 r = split32(a + k, W - k);
    for (int n = 0; n < N; ++n) {
      const float* qc = qw + n * per_head + c * 32;
      lo[n] = _mm256_fmadd_ps(r.even[0], _mm256_load_ps(qc + 16), _mm256_fmadd_ps(r.odd[0], _mm256_load_ps(qc), lo[n]));
      hi[n] = _mm256_fmadd_ps(r.even[1], _mm256_load_ps(qc + 24), _mm256_fmadd_ps(r.odd[1], _mm256_load_ps(qc + 8), hi[n]));
    }
  }
}

// attend_scores' bits: each row's G dot products (four heads at a time, the row read again from
// cache for the next four), staged as attend_scores stages them.
template <int G>
void attend_scores_avx2(const uint16_t* q, int64_t q_h, const uint16_t* const* rows, int64_t len, int64_t W,
                        float scale, float* s, std::vector<float>& qw_buf) {
  const int64_t per_head = (W + 31) / 32 * 32;
  float* qw = aligned32(qw_buf, G * per_head);
  for (int g = 0; g < G; ++g)
    for (int64_t k = 0; k < W; k += 32) {
      const Split32 v = split32(q + g * q_h + k, W - k);
      float* at = qw + g * per_head + k;
      _mm256_store_ps(at, v.odd[0]), _mm256_store_ps(at + 8, v.odd[1]);
      _mm256_store_ps(at + 16, v.even[0]), _mm256_store_ps(at + 24, v.even[1]);
    }
  ScoreStage scores{s, scale};
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* ahead = rows[std::min(j + AHEAD, len)];  // rows[len] is the zero row
    scores.flush_for(G);
    for (int g0 = 0; g0 < G; g0 += 4) {
      __m256 lo[4], hi[4];
      const auto dots = [&](auto heads) {
        constexpr int N = decltype(heads)::value;
        row_dots<N>(rows[j], g0 == 0 ? ahead : nullptr, qw + g0 * per_head, per_head, W, lo, hi);
        for (int i = 0; i < N; ++i) scores.add(avx2::F16{lo[i], hi[i]}, (g0 + i) * len + j);
      };
      switch (std::min(4, G - g0)) {
        case 1: dots(std::integral_constant<int, 1>()); break;
        case 2: dots(std::integral_constant<int, 2>()); break;
        case 3: dots(std::integral_constant<int, 3>()); break;
        default: dots(std::integral_constant<int, 4>()); break;
      }
    }
  }
  scores.flush();
}

// attend_output's bits: column l of head g sums, pair by pair, rows[2i + 1][l] p[g, 2i + 1] and
// then rows[2i][l] p[g, 2i] (dot_bf16's odd then even). A pass takes P pairs and N heads over
// every 16 columns: the sums come from memory (L1: sums[g * ld + l], G x L floats), take the
// P pairs' 2P FMAs in order and go back, so each column keeps its order, with the FMAs, not the
// stores, setting the pace. 16 columns read as 8 32-bit words: the even columns are the words
// shifted up, the odd ones the words ANDed (both exact bf16 -> float32), and sums hold a block's
// 8 even columns, then its 8 odd ones. p[g * len + j] are the bf16-rounded probabilities.
template <int P, int N>
__attribute__((always_inline)) inline void output_pass(const uint16_t* const* rows, int64_t i, const float* pw,
                                                       int64_t G, int64_t L, float* sums, int64_t ld,
                                                       const uint16_t* const* ahead) {
  const uint16_t* r[2 * P];  // in the order summed: 2i + 1, 2i, 2i + 3, 2i + 2, ...
  __m256 p[N][2 * P];
  for (int q = 0; q < P; ++q) {
    r[2 * q] = rows[2 * (i + q) + 1], r[2 * q + 1] = rows[2 * (i + q)];
    for (int n = 0; n < N; ++n)
      for (int odd = 0; odd < 2; ++odd) p[n][2 * q + odd] = _mm256_broadcast_ss(pw + ((i + q) * G + n) * 2 + odd);
  }
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  // The 16 columns at l of the rows v[k] + l: the even columns, then the odd.
  const auto block = [&](const uint16_t* const* v, int64_t l) {
    for (int part = 0; part < 2; ++part) {
      __m256 c[2 * P];
      for (int k = 0; k < 2 * P; ++k) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[k]));
        c[k] = _mm256_castsi256_ps(part == 0 ? _mm256_slli_epi32(w, 16) : _mm256_and_si256(w, high));
      }
      for (int n = 0; n < N; ++n) {
        float* sum = sums + n * ld + l + 8 * part;
        __m256 acc = _mm256_load_ps(sum);
        for (int k = 0; k < 2 * P; ++k) acc = _mm256_fmadd_ps(c[k], p[n][k], acc);
        _mm256_store_ps(sum, acc);
      }
    }
  };
  const int64_t whole = L / 16 * 16;
  for (int64_t l = 0; l < whole; l += 16) {
    const uint16_t* v[2 * P];
    for (int k = 0; k < 2 * P; ++k) {
      v[k] = r[k] + l;
      if (ahead != nullptr && l % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead[k] + l), _MM_HINT_T0);
    }
    block(v, l);
  }
  if (whole < L) {  // the last columns, zeros past L
    alignas(32) uint16_t tail[2 * P][16] = {};
    const uint16_t* v[2 * P];
    for (int k = 0; k < 2 * P; ++k) std::memcpy(tail[k], r[k] + whole, size_t(L - whole) * 2), v[k] = tail[k];
    block(v, whole);
  }
}

template <int G>
void attend_output_avx2(const float* p, int64_t len, const uint16_t* const* rows, int64_t L, uint16_t* o,
                        int64_t o_h, std::vector<float>& buf) {
  // A head's sums 16 floats past a multiple of 16 (no 4 KB strides between the heads').
  const int64_t L16 = (L + 15) / 16 * 16 + 16, pairs = (len + 1) / 2;
  float* sums = aligned32(buf, G * L16 + 2 * G * pairs);
  float* pw = sums + G * L16;  // pw[(i * G + g) * 2 + {0, 1}]: p[g, 2i + 1], p[g, 2i] (0 past len)
  std::fill_n(sums, G * L16, 0.0f);
  for (int64_t i = 0; i < pairs; ++i)
    for (int g = 0; g < G; ++g)
      for (int odd = 0; odd < 2; ++odd) {
        const int64_t j = 2 * i + 1 - odd;
        pw[(i * G + g) * 2 + odd] = j < len ? from_bf16(to_bf16(p[g * len + j])) : 0.0f;
      }
  constexpr int64_t AHEAD_PAIRS = 4;
  for (int64_t i = 0; i < pairs; i += 2) {
    const bool two = i + 2 <= pairs;
    const uint16_t* ahead[4];  // rows AHEAD_PAIRS on, prefetched while the first heads' pass runs
    for (int k = 0; k < 4; ++k) ahead[k] = rows[std::min(2 * (i + AHEAD_PAIRS) + k, len)];  // rows[len]: zeros
    for (int g0 = 0; g0 < G; g0 += 2) {
      const uint16_t* const* pf = g0 == 0 ? ahead : nullptr;
      float* sg = sums + g0 * L16;
      const float* pg = pw + 2 * g0;
      if (G - g0 >= 2)
        two ? output_pass<2, 2>(rows, i, pg, G, L, sg, L16, pf) : output_pass<1, 2>(rows, i, pg, G, L, sg, L16, pf);
      else
        two ? output_pass<2, 1>(rows, i, pg, G, L, sg, L16, pf) : output_pass<1, 1>(rows, i, pg, G, L, sg, L16, pf);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t l = 0; l < L; l += 16) {
      const float* sum = sums + g * L16 + l;
      const __m256i c = narrow16(avx2::F16{_mm256_load_ps(sum), _mm256_load_ps(sum + 8)});  // even, odd
      const __m128i even = _mm256_castsi256_si128(c), odd = _mm256_extracti128_si256(c, 1);
      const __m256i cols = _mm256_set_m128i(_mm_unpackhi_epi16(even, odd), _mm_unpacklo_epi16(even, odd));
      if (L - l >= 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + g * o_h + l), cols);
      else
        _mm256_mask_storeu_epi16(o + g * o_h + l, lanes16(L - l), cols);
    }
}
#endif

template <int G>
void attend_group(const uint16_t* q, int64_t q_h, const uint16_t* const* rows, int64_t len, uint16_t* o,
                  int64_t o_h, int64_t W, int64_t L, float scale, const std::vector<int64_t>& refused,
                  AttendScratch& scratch, const float* sinks = nullptr) {
  std::vector<float>& s = scratch.s;
  s.resize(G * len);
#ifndef __AVX512F__
  const bool own = !g_attend_generic;
  if (own) attend_scores_avx2<G>(q, q_h, rows, len, W, scale, s.data(), scratch.work);
  else
#endif
    attend_scores<G>(q, q_h, rows, len, W, scale, s.data());
  for (const int64_t j : refused)
    for (int g = 0; g < G; ++g) s[g * len + j] = -INFINITY;
  for (int g = 0; g < G; ++g) softmax_rounded(&s[g * len], len, sinks != nullptr ? sinks[g] : -INFINITY);
#ifndef __AVX512F__
  if (own) return attend_output_avx2<G>(s.data(), len, rows, L, o, o_h, scratch.work);
#endif
  const int64_t pairs = (len + 1) / 2;
  std::vector<uint32_t>& pp = scratch.pairs;
  pp.resize(G * pairs);
  for (int g = 0; g < G; ++g) {
    const float* p = &s[g * len];
    for (int64_t i = 0; i < pairs; ++i) {  // exact: the probabilities are bf16 already
      const uint32_t second = 2 * i + 1 < len ? to_bf16(p[2 * i + 1]) : 0;
      pp[g * pairs + i] = uint32_t(to_bf16(p[2 * i])) | second << 16;
    }
  }
  attend_output<G>(pp.data(), pairs, rows, L, o, o_h);
}

// A sequence's cache rows, looked up once through its block table: scratch.rows[j] is row j for
// j < len, and the zero row (scratch.zeros, W long) past len up to `size` and in a block whose id
// lies outside the cache. Each such id is counted in `bad` once; its rows are refused (appended
// to `refused`): they score -inf and read as zeros.
inline void look_up_rows(const uint16_t* kv, int64_t kv_block, int64_t kv_row, int64_t num_blocks,
                         int64_t block_size, const int32_t* table, int64_t len, int64_t size, int64_t W,
                         AttendScratch& scratch, std::vector<int64_t>& refused, std::atomic<int64_t>& bad) {
  scratch.zeros.assign(W, 0);
  std::vector<const uint16_t*>& rows = scratch.rows;
  rows.assign(size, scratch.zeros.data());
  for (int64_t j0 = 0; j0 < len; j0 += block_size) {
    const int32_t block = table[j0 / block_size];
    const int64_t n = std::min(block_size, len - j0);
    if (block < 0 || block >= num_blocks) {
      bad.fetch_add(1);
      for (int64_t j = j0; j < j0 + n; ++j) refused.push_back(j);
      continue;
    }
    for (int64_t r = 0; r < n; ++r) rows[j0 + r] = kv + block * kv_block + r * kv_row;
  }
}

// The attention of `heads` heads (q, a head q_h apart) over rows[0, len) (rows[len], rows[len + 1]
// and those prefetched ahead: the zero row), rows listed in `refused` scoring -inf: the heads in
// groups of HEAD_GROUP (attend_group). mla_decode's rows come from a block table (attend), sparse
// decode's from the slots its indexer chose (sparse.h).
void attend_rows(const uint16_t* q, int64_t q_h, const uint16_t* const* rows, int64_t len, uint16_t* o,
                 int64_t o_h, int64_t heads, int64_t W, int64_t L, float scale, const std::vector<int64_t>& refused,
                 AttendScratch& scratch, const float* sinks = nullptr) {
  for (int64_t h0 = 0; h0 < heads; h0 += HEAD_GROUP) {
    const uint16_t* qh = q + h0 * q_h;
    uint16_t* oh = o + h0 * o_h;
    const auto run = [&](auto group) {  // the heads' sums in registers: their count a constant
      attend_group<decltype(group)::value>(qh, q_h, rows, len, oh, o_h, W, L, scale, refused, scratch,
                                           sinks != nullptr ? sinks + h0 : nullptr);
    };
    switch (std::min(HEAD_GROUP, heads - h0)) {
      case 1: run(std::integral_constant<int, 1>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      case 4: run(std::integral_constant<int, 4>()); break;
      case 5: run(std::integral_constant<int, 5>()); break;
      case 6: run(std::integral_constant<int, 6>()); break;
      case 7: run(std::integral_constant<int, 7>()); break;
      default: run(std::integral_constant<int, 8>()); break;
    }
  }
}

void attend(const uint16_t* q, int64_t q_h, const uint16_t* kv, int64_t kv_block, int64_t kv_row,
            int64_t num_blocks, int64_t block_size, const int32_t* table, int64_t len, uint16_t* o, int64_t o_h,
            int64_t heads, int64_t W, int64_t L, float scale, AttendScratch& scratch, std::atomic<int64_t>& bad) {
  std::vector<int64_t> refused;
  // Past len, the zero row: a pair's second row where len is odd, and the rows prefetched ahead.
  look_up_rows(kv, kv_block, kv_row, num_blocks, block_size, table, len, len + 2, W, scratch, refused, bad);
  attend_rows(q, q_h, scratch.rows.data(), len, o, o_h, heads, W, L, scale, refused, scratch);
}

// The same attention on the tile unit (amx_attend_takes: the products on the tiles and the
// attention not kept off them, whole 16-row tiles in a block, W a multiple of 32 and L of 64),
// with the same roundings; only the float32 sums go in another order. Per group of up to 16 heads:
// - scores, C[j, h] = sum_k cache[j, k] q[h, k]: 16 cache rows of a block are the A operand as
//   they lie (a row stride apart), q the B operand in pairs (VNNI);
// - output, C[h, l] = sum_j p[h, j] cache[j, l]: the bf16 probabilities are the A operand, and
//   each 32 cache rows are paired into the B operand's layout, 64 columns (4 C tiles) at a time.
// Rows past len (a block's unwritten end, or refused) give scores that are never read and pair
// as zeros, so nothing they hold reaches the output. The sequence's rows are looked up once
// (the output pairs each row once per 64 columns); the scores are rounded 16 heads at a time.
bool g_amx_attention = true;  // use_amx_attention: the decode attention may take the tile path

// The decode attention on the tile path where the products take it (on) or always through
// VDPBF16PS (off); -> whether it now takes the tile path.
bool use_amx_attention(bool on) {
  g_amx_attention = on;
  return g_amx && on;
}

inline bool amx_attend_takes(int64_t block_size, int64_t W, int64_t L) {
  return g_amx && g_amx_attention && block_size % 16 == 0 && W % AMX_K == 0 && L % 64 == 0;
}

template <bool SOFT>
__attribute__((target("amx-tile,amx-bf16"))) void amx_attend(
    const uint16_t* q, int64_t q_h, const uint16_t* kv, int64_t kv_block, int64_t kv_row, int64_t num_blocks,
    int64_t block_size, const int32_t* table, int64_t len, uint16_t* o, int64_t o_h, int64_t heads, int64_t W,
    int64_t L, float scale, AttendScratch& scratch, std::atomic<int64_t>& bad) {
  const int64_t padded = (len + 31) / 32 * 32;  // a row of probabilities: whole A operands of 32
  std::vector<int64_t> refused;
  look_up_rows(kv, kv_block, kv_row, num_blocks, block_size, table, len, padded, W, scratch, refused, bad);
  const std::vector<const uint16_t*>& rows = scratch.rows;
  const uint16_t* const zeros = scratch.zeros.data();  // past len, and refused
  alignas(64) float c[2 * 16 * 16];     // C tiles stored: scores one, output two at a time
  alignas(64) uint32_t vp[4 * 16 * 16];  // 32 cache rows x 64 columns in pairs: 4 B operands
  // The output's B operands pair rows 16 bits at a time within 128-bit lanes (unpacklo/hi), so a
  // C tile's 16 columns come in lane order: column c of 32 is lane 4 (c / 8) + c % 4 of the low
  // (c % 8 < 4) or the high tile; put back in order as they are stored.
  alignas(64) int32_t order[32];
  for (int i = 0; i < 32; ++i) order[i] = (i % 8 < 4 ? 0 : 16) + 4 * (i / 8) + i % 4;
  const __m512i first = _mm512_load_si512(order), second = _mm512_load_si512(order + 16);
  if constexpr (!SOFT) amx_configure();
  for (int64_t h0 = 0; h0 < heads; h0 += 16) {
    const int64_t group = std::min<int64_t>(16, heads - h0);
    std::vector<uint32_t>& qp = scratch.pairs;  // q[h0 + g] as qp[k / 2][g][2], heads past group zero
    qp.assign((W / 2) * 16, 0u);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < W / 2; ++i) std::memcpy(&qp[i * 16 + g], q + (h0 + g) * q_h + 2 * i, 4);
    std::vector<float>& s = scratch.s;  // [group, len]
    s.resize(group * len);
    // c[t * 16 + g] -> s[g][j0 + t], bf16(bf16(dot) * scale), the 16 heads of a row at once.
    auto scores_of = [&](int64_t j0, int64_t n) {
      alignas(64) float out[16];
      for (int64_t t = 0; t < n; ++t) {
        const __m512 dot = widen16(narrow16(_mm512_load_ps(c + t * 16)));
        _mm512_store_ps(out, widen16(narrow16(_mm512_mul_ps(dot, _mm512_set1_ps(scale)))));
        for (int64_t g = 0; g < group; ++g) s[g * len + j0 + t] = out[g];
      }
    };
    // Four blocks of 16 rows at a time, each into its own C tile: their chains of products are
    // independent, so the tile unit overlaps them instead of waiting on each product's result
    // (each score still sums over k in the same order, so the bits are those of one at a time).
    constexpr int64_t SPAN = 64;  // rows: four blocks of 16
    for (int64_t j0 = 0; j0 < len; j0 += SPAN) {
      const uint16_t* rows_of[4] = {nullptr, nullptr, nullptr, nullptr};  // each tile's 16 rows lie in one block
      int64_t valid = 0;
      for (int64_t q4 = 0; q4 < 4 && j0 + 16 * q4 < len; ++q4) {
        const int64_t j = j0 + 16 * q4;
        if (rows[j] != zeros) {
          rows_of[q4] = rows[j];
          ++valid;
        } else {  // refused
          for (int64_t g = 0; g < group; ++g) std::fill_n(&s[g * len + j], std::min<int64_t>(16, len - j), -INFINITY);
        }
      }
      const auto rows_at = [&](int64_t q4) { return std::min<int64_t>(16, len - j0 - 16 * q4); };
      if (valid == 4) {
        const uint16_t *a0 = rows_of[0], *a1 = rows_of[1], *a2 = rows_of[2], *a3 = rows_of[3];
        TILE_ZERO(0);
        TILE_ZERO(1);
        TILE_ZERO(2);
        TILE_ZERO(3);
        for (int64_t k = 0; k < W; k += AMX_K) {
          TILE_LOAD(6, qp.data() + (k / 2) * 16, 64);
          TILE_LOAD(4, a0 + k, kv_row * 2);
          TILE_DOT(0, 4, 6);
          TILE_LOAD(5, a1 + k, kv_row * 2);
          TILE_DOT(1, 5, 6);
          TILE_LOAD(7, a2 + k, kv_row * 2);
          TILE_DOT(2, 7, 6);
          TILE_LOAD(4, a3 + k, kv_row * 2);
          TILE_DOT(3, 4, 6);
        }
        TILE_STORE(0, c, 64);
        scores_of(j0, 16);
        TILE_STORE(1, c, 64);
        scores_of(j0 + 16, 16);
        TILE_STORE(2, c, 64);
        scores_of(j0 + 32, 16);
        TILE_STORE(3, c, 64);
        scores_of(j0 + 48, rows_at(3));
        continue;
      }
      for (int64_t q4 = 0; q4 < 4; ++q4) {  // the sequence's last blocks, or around a refused one
        const uint16_t* row = rows_of[q4];
        if (row == nullptr) continue;
        TILE_ZERO(0);
        for (int64_t k = 0; k < W; k += AMX_K) {
          TILE_LOAD(4, row + k, kv_row * 2);
          TILE_LOAD(6, qp.data() + (k / 2) * 16, 64);
          TILE_DOT(0, 4, 6);
        }
        TILE_STORE(0, c, 64);
        scores_of(j0 + 16 * q4, rows_at(q4));
      }
    }
    std::vector<uint16_t>& p = scratch.probs;  // [16, padded] bf16, zero past len and past group
    p.assign(16 * padded, 0);
    for (int64_t g = 0; g < group; ++g) {
      float* sg = &s[g * len];
      softmax_rounded(sg, len);
      for (int64_t j = 0; j < len; j += 16) {  // exact: already bf16
        const __mmask16 m = lanes16(len - j);
        _mm256_mask_storeu_epi16(&p[g * padded + j], m, narrow16(_mm512_maskz_loadu_ps(m, sg + j)));
      }
    }
    for (int64_t l0 = 0; l0 < L; l0 += 64) {
      TILE_ZERO(0);
      TILE_ZERO(1);
      TILE_ZERO(2);
      TILE_ZERO(3);
      for (int64_t j0 = 0; j0 < len; j0 += 32) {
        for (int64_t r = 0; r < 16; ++r) {  // B operand row r: rows j0 + 2r and j0 + 2r + 1 in pairs
          const uint16_t *a = rows[j0 + 2 * r], *b = rows[j0 + 2 * r + 1];
          for (int64_t half = 0; half < 2; ++half) {  // columns l0 + 32 half + [0, 32): tiles 2 half, 2 half + 1
            const __m512i va = _mm512_loadu_si512(a + l0 + 32 * half), vb = _mm512_loadu_si512(b + l0 + 32 * half);
            _mm512_store_si512(vp + (2 * half * 16 + r) * 16, _mm512_unpacklo_epi16(va, vb));
            _mm512_store_si512(vp + ((2 * half + 1) * 16 + r) * 16, _mm512_unpackhi_epi16(va, vb));
          }
        }
        TILE_LOAD(4, p.data() + j0, padded * 2);
        TILE_LOAD(6, vp, 64);
        TILE_DOT(0, 4, 6);
        TILE_LOAD(7, vp + 256, 64);
        TILE_DOT(1, 4, 7);
        TILE_LOAD(6, vp + 512, 64);
        TILE_DOT(2, 4, 6);
        TILE_LOAD(7, vp + 768, 64);
        TILE_DOT(3, 4, 7);
      }
      for (int64_t half = 0; half < 2; ++half) {  // C tiles 2 half (low) and 2 half + 1 (high)
        if (half == 0) {
          TILE_STORE(0, c, 64);
          TILE_STORE(1, c + 256, 64);
        } else {
          TILE_STORE(2, c, 64);
          TILE_STORE(3, c + 256, 64);
        }
        for (int64_t g = 0; g < group; ++g) {  // -> o[h0 + g][l0 + 32 half + [0, 32)]
          const __m512 lo = _mm512_load_ps(c + g * 16), hi = _mm512_load_ps(c + 256 + g * 16);
          const __m256i c0 = narrow16(_mm512_permutex2var_ps(lo, first, hi));
          const __m256i c1 = narrow16(_mm512_permutex2var_ps(lo, second, hi));
          _mm512_storeu_si512(o + (h0 + g) * o_h + l0 + 32 * half,
                              _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1));
        }
      }
    }
  }
}

// Returns the number of block ids outside [0, num_blocks) the sequences' lengths reach in their
// tables (0: all fine; the caller raises).
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
  using Kernel = decltype(&attend);
  const Kernel kernel = !tiles ? attend : g_amx_soft ? Kernel(amx_attend<true>) : Kernel(amx_attend<false>);
  // Split heads only when there are fewer sequences than threads (a batch-1 decode).
  const int64_t splits = std::min<int64_t>(H, std::max<int64_t>(1, (threads_now() + B - 1) / B));
  const int64_t per_split = (H + splits - 1) / splits;
  std::atomic<int64_t> bad{0}, uncounted{0};  // a sequence's refused blocks count in its first split
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
      kernel(q + b * q_b + h0 * q_h, q_h, kv, kv_block, kv_row, num_blocks, block_size, table + b * table_b, len,
             o + b * o_b + h0 * o_h, o_h, h1 - h0, W, L, float(scale), scratch, h0 == 0 ? bad : uncounted);
    }
  }, ATTENTION_OMP_MIN_BYTES);
  return bad.load();
}

}  // namespace
