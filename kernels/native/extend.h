// Prefill ("extend") attention: kernels/attention.py extend_attention without its LSE, the
// attention of MLA's prefill chunks (engine/models/mla.py _prefill, the non-absorbed form). Per
// head, n queries at positions ctx - n .. ctx - 1 over the ctx keys of their sequence:
//
//   s[i, j] = scale <q_i, k_j>   (j <= ctx - n + i)        o_i = sum_j softmax_j(s[i]) v_j
//
// bf16 in and out, float32 inside: flash attention's online softmax (a running maximum m and sum
// l per query, its output's sums rescaled by e^(m - m') when the maximum grows), the keys in
// chunks of EXT_KEYS from key 0. Torch's SDPA took the math path here (its CPU flash kernel wants
// one head size for q, k and v; MLA's v is narrower): the whole causal square of scores and a
// softmax over it, 22 % of a prefill of 8 x 512-token prompts on the bench model.
//
// - A chunk's keys are widened once per head: K transposed ([d][key], so a query's scores are
//   FMAs of its q's broadcast values over 16 keys at a time), V as it is.
// - Queries go in tiles of EXT_ROWS: the scores of a tile over a chunk, its softmax step, then
//   its output's sums over the chunk's values (in L1, 16 columns at a time).
// - Causal: a tile reads the keys up to its last query's, the chunks past it not at all; a
//   query's keys past its own are masked to -inf (its probability exactly 0).
// - A query's bits depend only on its own position and the keys: the chunks start at key 0
//   whatever n, a query's sums never mix with its tile's others, and a tile's extra keys (masked
//   for the query) add exact zeros. So a prompt's rows are the same in any prefill chunking
//   (batch_invariant).

#pragma once

#include "attention.h"  // g_attend_generic

namespace {

constexpr int64_t EXT_KEYS = 256;  // keys a chunk: K^T and V of 128 + 64 KB at Dqk 128, Dv 64
// Queries a tile, in both forms below. The AVX-512 form's 4 rows x 2 groups of 16 keys are 8 chains
// of FMAs; the AVX2 form's 4 rows x 16 keys (or columns of V) are 8 chains of 8 lanes, two a cycle
// at Zen 3's 4-cycle latency. (6 rows there, 12 chains, took 6.0 ms against 4.2 for the bench
// model's 8 heads over a 512-token prompt, 2-core Zen 3.)
constexpr int EXT_ROWS = 4;
constexpr int EXT_GROUPS = 2;  // 16-key groups a score pass of the AVX-512 form

struct ExtendScratch {
  std::vector<float> q, kt, v, s, o, m, l;
};

// scores[r * EXT_KEYS + j] = q[r] . kt[:, j] for R queries (q row-major, Dqk floats each) and the
// keys [0, keys) of the chunk (kt: [Dqk][EXT_KEYS]), keys rounded up to whole 16-key groups. Each
// score one chain of FMAs over d, in order (so the two forms below give the same bits).
template <int R>
inline void extend_scores_512(const float* q, int64_t Dqk, const float* kt, int64_t keys, float* scores) {
  const int64_t groups = (keys + 15) / 16;
  int64_t g = 0;
  const auto pass = [&](auto width) {
    constexpr int G = decltype(width)::value;
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < G; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* k = kt + g * 16;
    for (int64_t d = 0; d < Dqk; ++d, k += EXT_KEYS) {
      __m512 kv[G];
      for (int c = 0; c < G; ++c) kv[c] = _mm512_loadu_ps(k + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_set1_ps(q[r * Dqk + d]);
        for (int c = 0; c < G; ++c) acc[r][c] = _mm512_fmadd_ps(qv, kv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < G; ++c) _mm512_storeu_ps(scores + r * EXT_KEYS + (g + c) * 16, acc[r][c]);
    g += G;
  };
  while (g + EXT_GROUPS <= groups) pass(std::integral_constant<int, EXT_GROUPS>());
  while (g < groups) pass(std::integral_constant<int, 1>());
}

// out[r] = out[r] * alpha[r] + sum_{j < keys} p[r * EXT_KEYS + j] v[j] for R queries, v: [keys][Dv];
// each output one chain of FMAs over j, in order.
template <int R>
inline void extend_values_512(const float* p, const float* v, int64_t keys, int64_t Dv, const float* alpha,
                              float* out) {
  for (int64_t c = 0; c < Dv; c += 16) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_mul_ps(_mm512_loadu_ps(out + r * Dv + c), _mm512_set1_ps(alpha[r]));
    const float* vc = v + c;
    for (int64_t j = 0; j < keys; ++j, vc += Dv) {
      const __m512 vv = _mm512_loadu_ps(vc);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * EXT_KEYS + j]), vv, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * Dv + c, acc[r]);
  }
}

#ifndef __AVX512F__
// The same two in AVX2 registers, the AVX2 build's own, the same bits: the forms above on avx2.h's
// pairs ran each half as a loop of its own, 4 chains of FMAs each, bound by the FMAs' latency
// (the bench model's 8 heads over a 512-token prompt, 2-core Zen 3: 4.6 ms against 3.6; torch's
// SDPA 14-19).
template <int R>
inline void extend_scores_avx2(const float* q, int64_t Dqk, const float* kt, int64_t keys, float* scores) {
  for (int64_t g = 0; g < keys; g += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* k = kt + g;
    for (int64_t d = 0; d < Dqk; ++d, k += EXT_KEYS) {
      const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_broadcast_ss(q + r * Dqk + d);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(scores + r * EXT_KEYS + g, acc[r][0]);
      _mm256_storeu_ps(scores + r * EXT_KEYS + g + 8, acc[r][1]);
    }
  }
}

template <int R>
inline void extend_values_avx2(const float* p, const float* v, int64_t keys, int64_t Dv, const float* alpha,
                               float* out) {
  for (int64_t c = 0; c < Dv; c += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
      acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(out + r * Dv + c), a);
      acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(out + r * Dv + c + 8), a);
    }
    const float* vc = v + c;
    for (int64_t j = 0; j < keys; ++j, vc += Dv) {
      const __m256 v0 = _mm256_loadu_ps(vc), v1 = _mm256_loadu_ps(vc + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pv = _mm256_broadcast_ss(p + r * EXT_KEYS + j);
        acc[r][0] = _mm256_fmadd_ps(pv, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pv, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * Dv + c, acc[r][0]);
      _mm256_storeu_ps(out + r * Dv + c + 8, acc[r][1]);
    }
  }
}
#endif

// kt[d * EXT_KEYS + j] = k[j * ldk + d] widened, for keys j < keys (zeros for j in [keys,
// padded)) and d < Dqk: 8 keys x 8 values at a time through an 8 x 8 transpose in AVX2 registers
// (a value at a time, the transpose took ~15 % of the kernel's time), the rest one by one.
inline void widen_keys(const uint16_t* k, int64_t ldk, int64_t keys, int64_t padded, int64_t Dqk, float* kt) {
  const auto widen8 = [](const uint16_t* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  };
  const int64_t whole = keys / 8 * 8, dwhole = Dqk / 8 * 8;
  for (int64_t j = 0; j < whole; j += 8) {
    for (int64_t d = 0; d < dwhole; d += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = widen8(k + (j + i) * ldk + d);  // r[i] = key j + i, values d..d+7
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {  // value d + i (low lanes: keys j..j+3 from r[i], j+4..j+7 from r[i+4])
        _mm256_storeu_ps(kt + (d + i) * EXT_KEYS + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(kt + (d + i + 4) * EXT_KEYS + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
    for (int64_t d = dwhole; d < Dqk; ++d)
      for (int64_t i = 0; i < 8; ++i) kt[d * EXT_KEYS + j + i] = from_bf16(k[(j + i) * ldk + d]);
  }
  for (int64_t j = whole; j < padded; ++j)
    for (int64_t d = 0; d < Dqk; ++d) kt[d * EXT_KEYS + j] = j < keys ? from_bf16(k[j * ldk + d]) : 0.0f;
}

// f(std::integral_constant<int, R>()) for R in [1, EXT_ROWS].
template <typename F>
inline void with_rows(int R, const F& f) {
  static_assert(EXT_ROWS == 4);
  switch (R) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    default: return f(std::integral_constant<int, 4>());
  }
}

// One head's queries [a, b) of the n, over the keys they see.
void extend_head(const uint16_t* q, int64_t ldq, const uint16_t* k, int64_t ldk, const uint16_t* v, int64_t ldv,
                 uint16_t* o, int64_t ldo, int64_t a, int64_t b, int64_t n, int64_t ctx, int64_t Dqk, int64_t Dv,
                 float scale, ExtendScratch& sc) {
  const int64_t rows = b - a, first = ctx - n + a;  // row r sees keys [0, first + r]
  float* qf = scratch(sc.q, rows * Dqk);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < Dqk; ++d) qf[r * Dqk + d] = from_bf16(q[(a + r) * ldq + d]) * scale;
  float* kt = scratch(sc.kt, Dqk * EXT_KEYS);
  float* vf = scratch(sc.v, EXT_KEYS * Dv);
  [[maybe_unused]] const bool own = !g_attend_generic;  // the AVX2 build's own loops (tests: use_attend_generic)
  float* s = scratch(sc.s, EXT_ROWS * EXT_KEYS);
  float* out = scratch(sc.o, rows * Dv);
  float* m = scratch(sc.m, rows);
  float* l = scratch(sc.l, rows);
  std::fill_n(out, rows * Dv, 0.0f);
  std::fill_n(m, rows, -INFINITY);
  std::fill_n(l, rows, 0.0f);
  const int64_t seen = first + rows;  // keys the last row sees
  for (int64_t k0 = 0; k0 < seen; k0 += EXT_KEYS) {
    const int64_t keys = std::min(EXT_KEYS, seen - k0), padded = (keys + 15) / 16 * 16;
    widen_keys(k + k0 * ldk, ldk, keys, padded, Dqk, kt);
    for (int64_t j = 0; j < padded; ++j) {  // V widened, zeros past the chunk's keys
      if (j >= keys) {
        std::fill_n(vf + j * Dv, Dv, 0.0f);
        continue;
      }
      const uint16_t* vr = v + (k0 + j) * ldv;
      for (int64_t c = 0; c < Dv; c += 16)
        _mm512_storeu_ps(vf + j * Dv + c, widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + c))));
    }
    for (int64_t r0 = 0; r0 < rows; r0 += EXT_ROWS) {
      const int R = int(std::min<int64_t>(EXT_ROWS, rows - r0));
      const int64_t tile_keys = std::min(keys, first + r0 + R - k0);  // up to the tile's last row's
      if (tile_keys <= 0) continue;  // every row's keys end before this chunk
      const int64_t span = (tile_keys + 15) / 16 * 16;
      const float* qt = qf + r0 * Dqk;
      with_rows(R, [&](auto width) {
        constexpr int W = decltype(width)::value;
#ifndef __AVX512F__
        if (own) return extend_scores_avx2<W>(qt, Dqk, kt, tile_keys, s);
#endif
        extend_scores_512<W>(qt, Dqk, kt, tile_keys, s);
      });
      float alpha[EXT_ROWS];
      for (int r = 0; r < R; ++r) {
        float* sr = s + r * EXT_KEYS;
        const int64_t visible = std::min(span, first + r0 + r + 1 - k0);  // this row's keys here
        for (int64_t j = std::max<int64_t>(visible, 0); j < span; ++j) sr[j] = -INFINITY;
        __m512 tops = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < span; j += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(sr + j));
        // finite: key 0 is in every row's first chunk, and a later chunk's maximum is over it
        const float before = m[r0 + r], top = std::max(before, _mm512_reduce_max_ps(tops));
        __m512 sums = _mm512_setzero_ps();
        for (int64_t j = 0; j < span; j += 16) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(top)));
          _mm512_storeu_ps(sr + j, e);
          sums = _mm512_add_ps(sums, e);
        }
        alpha[r] = before == top ? 1.0f : std::exp(before - top);  // 0 from -inf
        l[r0 + r] = l[r0 + r] * alpha[r] + _mm512_reduce_add_ps(sums);
        m[r0 + r] = top;
      }
      float* ot = out + r0 * Dv;
      with_rows(R, [&](auto width) {
        constexpr int W = decltype(width)::value;
#ifndef __AVX512F__
        if (own) return extend_values_avx2<W>(s, vf, tile_keys, Dv, alpha, ot);
#endif
        extend_values_512<W>(s, vf, tile_keys, Dv, alpha, ot);
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t c = 0; c < Dv; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (a + r) * ldo + c),
                          narrow16(_mm512_mul_ps(_mm512_loadu_ps(out + r * Dv + c), inv)));
  }
}

// q [n, H, Dqk] (token stride ldq, head stride hq), k [ctx, H, Dqk] (ldk, hk), v [ctx, H, Dv] (ldv,
// hv), o [n, H, Dv] (ldo, ho), all bf16 with unit stride along the last dimension; Dv a multiple
// of 16, ctx >= n >= 1 (the Python side checks). Heads (and, when there are fewer than two per
// thread, ranges of queries) are shared over the threads.
void extend_attention(int64_t q_ptr, int64_t ldq, int64_t hq, int64_t k_ptr, int64_t ldk, int64_t hk, int64_t v_ptr,
                      int64_t ldv, int64_t hv, int64_t o_ptr, int64_t ldo, int64_t ho, int64_t n, int64_t ctx,
                      int64_t H, int64_t Dqk, int64_t Dv, double scale) {
  const auto* q = reinterpret_cast<const uint16_t*>(q_ptr);
  const auto* k = reinterpret_cast<const uint16_t*>(k_ptr);
  const auto* v = reinterpret_cast<const uint16_t*>(v_ptr);
  auto* o = reinterpret_cast<uint16_t*>(o_ptr);
  const int64_t threads = threads_now();
  const int64_t splits = std::min(n, std::max<int64_t>(1, (2 * threads + H - 1) / H));
  const int64_t per = (n + splits - 1) / splits;
  const int64_t bytes = H * ctx * (Dqk + Dv) * 2;
  maybe_parallel(H * splits, 1, bytes, [&](int64_t i0, int64_t i1) {
    thread_local ExtendScratch sc;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / splits, a = (i % splits) * per, b = std::min(n, a + per);
      if (a >= b) continue;
      extend_head(q + h * hq, ldq, k + h * hk, ldk, v + h * hv, ldv, o + h * ho, ldo, a, b, n, ctx, Dqk, Dv,
                  float(scale), sc);
    }
  }, ATTENTION_OMP_MIN_BYTES);
}

}  // namespace
