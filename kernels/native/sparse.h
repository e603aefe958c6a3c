// DeepSeek-V3.2's sparse attention (DeepSeek Sparse Attention) on the CPU: the lightning indexer's
// scores and top-k over a paged key cache (indexer_topk), and MLA decode attention over the cache
// slots it chose (sparse_mla_decode). The math of kernels/sparse_mla.py.

#pragma once

#include <functional>
#include <numeric>

#include "attention.h"

namespace {

// Scores of one query token against keys[0, len) (bf16 rows of dI elements):
//   I[s] = sum_h w[h] * max(0, scale * (q[h] . keys[s]))
// float32 throughout: 16 heads in the lanes of one register, each head's dot summed in dimension
// order (the products of bf16 values are exact). The query is widened once into columns (qT[d]:
// dimension d of 16 heads) and each key's elements are broadcast against them, KEYS_AT_ONCE keys
// at a time so a column is loaded once for them; the heads' terms are then summed across the
// lanes. (Dotting each head with each key through VDPBF16PS, emulated on AVX2, and summing the 16
// dots' lanes after: the whole top-k of 4,096 keys took 0.31 ms a layer against 0.20 at batch 1
// on the 2-core Zen 3 EPYC, selection included.)
constexpr int64_t KEYS_AT_ONCE = 4;

inline void indexer_scores(const uint16_t* q, int64_t q_h, const float* w, const uint16_t* const* keys,
                           int64_t len, int64_t heads, int64_t dI, float scale, float* out) {
  struct Kept {
    std::vector<float> columns, weights, keys;
  };
  thread_local Kept kept;
  const int64_t groups = (heads + 15) / 16;
  float* qT = scratch(kept.columns, groups * dI * 16);  // [group][d][16 heads], 0 past the heads
  float* wg = scratch(kept.weights, groups * 16);
  float* kf = scratch(kept.keys, KEYS_AT_ONCE * dI);  // the keys at hand, widened
  for (int64_t g = 0; g < groups * 16; ++g) {
    wg[g] = g < heads ? w[g] : 0.0f;
    for (int64_t d = 0; d < dI; ++d) qT[((g / 16) * dI + d) * 16 + g % 16] = g < heads ? from_bf16(q[g * q_h + d]) : 0.0f;
  }
  const __m512 zero = _mm512_setzero_ps(), scales = _mm512_set1_ps(scale);
  for (int64_t s0 = 0; s0 < len; s0 += KEYS_AT_ONCE) {
    const int64_t n = std::min(KEYS_AT_ONCE, len - s0);
    for (int64_t j = 0; j < KEYS_AT_ONCE; ++j) {  // past the last key: a repeat of it, not scored
      const uint16_t* k = keys[s0 + std::min(j, n - 1)];
      int64_t d = 0;
      for (; d + 16 <= dI; d += 16)
        _mm512_storeu_ps(kf + j * dI + d, widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + d))));
      for (; d < dI; ++d) kf[j * dI + d] = from_bf16(k[d]);
    }
    float sums[KEYS_AT_ONCE] = {0.0f};
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc[KEYS_AT_ONCE];
      for (int64_t j = 0; j < KEYS_AT_ONCE; ++j) acc[j] = _mm512_setzero_ps();
      const float* columns = qT + g * dI * 16;
      for (int64_t d = 0; d < dI; ++d) {
        const __m512 c = _mm512_loadu_ps(columns + d * 16);
        for (int64_t j = 0; j < KEYS_AT_ONCE; ++j) acc[j] = _mm512_fmadd_ps(c, _mm512_set1_ps(kf[j * dI + d]), acc[j]);
      }
      const __m512 weights = _mm512_loadu_ps(wg + g * 16);
      for (int64_t j = 0; j < KEYS_AT_ONCE; ++j)
        sums[j] += _mm512_reduce_add_ps(_mm512_mul_ps(weights, _mm512_max_ps(_mm512_mul_ps(acc[j], scales), zero)));
    }
    for (int64_t j = 0; j < n; ++j) out[s0 + j] = sums[j];
  }
}

// The indexer of T query tokens, each over its own context in a paged key cache: token t sees
// keys 0 .. lens[t] - 1 of its block table (row j: block table[j / block_size], row j %
// block_size), scored as indexer_scores; out[t] gets the cache slots (block * block_size + row)
// of its best min(topk, lens[t]) keys, -1 after them. Where lens[t] <= topk every key is chosen,
// unscored. The best `topk` are found by selection, not a sort: the topk-th best score (nth_element
// over a copy of the scores), then every key above it and the earliest of those equal to it, in
// key order -- so attention reads the chosen rows in cache order (in selection's order the rows
// were scattered: sparse decode took ~1.3x the time a dense one took per row). Work: (token, span
// of KEY_SPAN keys) for the scores, then a token at a time for the selection. Returns the block
// ids outside [0, num_blocks) the lengths reach (0: all fine; the caller raises).
constexpr int64_t KEY_SPAN = 512;

int64_t indexer_topk(int64_t q_ptr, int64_t q_t, int64_t q_h, int64_t w_ptr, int64_t w_t, int64_t k_ptr,
                     int64_t k_block, int64_t k_row, int64_t num_blocks, int64_t block_size, int64_t table_ptr,
                     int64_t table_t, int64_t max_blocks, int64_t lens_ptr, int64_t out_ptr, int64_t out_t, int64_t T,
                     int64_t heads, int64_t dI, int64_t topk, double scale) {
  const auto* q = reinterpret_cast<const uint16_t*>(q_ptr);
  const auto* w = reinterpret_cast<const float*>(w_ptr);
  const auto* keys = reinterpret_cast<const uint16_t*>(k_ptr);
  const auto* table = reinterpret_cast<const int32_t*>(table_ptr);
  const auto* lens = reinterpret_cast<const int32_t*>(lens_ptr);
  auto* out = reinterpret_cast<int64_t*>(out_ptr);
  std::vector<int64_t> len(T), offset(T + 1, 0);  // each token's visible keys; its scores' place
  std::atomic<int64_t> bad{0};
  for (int64_t t = 0; t < T; ++t) {
    len[t] = std::min<int64_t>(std::max<int32_t>(lens[t], 0), max_blocks * block_size);
    for (int64_t b = 0; b < (len[t] + block_size - 1) / block_size; ++b) {
      const int32_t id = table[t * table_t + b];
      if (id < 0 || id >= num_blocks) bad.fetch_add(1);
    }
    offset[t + 1] = offset[t] + (len[t] > topk ? len[t] : 0);
  }
  if (bad.load()) return bad.load();
  const auto slot = [&](int64_t t, int64_t j) { return int64_t(table[t * table_t + j / block_size]) * block_size + j % block_size; };
  std::vector<float> scores(offset[T]);
  std::vector<std::pair<int64_t, int64_t>> spans;  // (token, first key)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; len[t] > topk && s < len[t]; s += KEY_SPAN) spans.emplace_back(t, s);
  // Threads share the spans from a few thousand keys on: each key's bytes are read once, but
  // scored by every head (as much work as heads / 2 times its bytes streamed by a product).
  const int64_t span_work = KEY_SPAN * dI * std::max<int64_t>(heads, 2);
  maybe_parallel(int64_t(spans.size()), 1, int64_t(spans.size()) * span_work, [&](int64_t i0, int64_t i1) {
    std::vector<const uint16_t*> rows(KEY_SPAN);
    for (int64_t i = i0; i < i1; ++i) {
      const auto [t, s0] = spans[i];
      const int64_t n = std::min(KEY_SPAN, len[t] - s0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = s0 + j;
        rows[j] = keys + int64_t(table[t * table_t + at / block_size]) * k_block + (at % block_size) * k_row;
      }
      indexer_scores(q + t * q_t, q_h, w + t * w_t, rows.data(), n, heads, dI, float(scale),
                     scores.data() + offset[t] + s0);
    }
  });
  maybe_parallel(T, 1, offset[T] * 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> sorted;
    for (int64_t t = t0; t < t1; ++t) {
      int64_t* o = out + t * out_t;
      if (len[t] <= topk) {
        for (int64_t j = 0; j < topk; ++j) o[j] = j < len[t] ? slot(t, j) : -1;
        continue;
      }
      const float* s = scores.data() + offset[t];
      sorted.assign(s, s + len[t]);
      std::nth_element(sorted.begin(), sorted.begin() + (topk - 1), sorted.end(), std::greater<float>());
      const float kth = sorted[topk - 1];
      int64_t ties = topk - std::count_if(sorted.begin(), sorted.begin() + topk, [&](float v) { return v > kth; });
      int64_t n = 0;
      for (int64_t j = 0; j < len[t] && n < topk; ++j)
        if (s[j] > kth || (s[j] == kth && ties-- > 0)) o[n++] = slot(t, j);
    }
  });
  return 0;
}

// MLA decode attention of T query tokens, each over its own chosen cache rows: slots[t, 0..K)
// (block * block_size + row, -1: none), read in place; the math and roundings of mla_decode
// (attend), over the chosen rows instead of a block table's first len. Returns the slots outside
// the cache (0: all fine; the caller raises).
int64_t sparse_mla_decode(int64_t q_ptr, int64_t q_t, int64_t q_h, int64_t kv_ptr, int64_t kv_block,
                          int64_t kv_row, int64_t num_blocks, int64_t block_size, int64_t slots_ptr, int64_t slots_t,
                          int64_t K, int64_t o_ptr, int64_t o_t, int64_t o_h, int64_t T, int64_t H, int64_t W,
                          int64_t L, double scale) {
  const auto* q = reinterpret_cast<const uint16_t*>(q_ptr);
  const auto* kv = reinterpret_cast<const uint16_t*>(kv_ptr);
  const auto* slots = reinterpret_cast<const int64_t*>(slots_ptr);
  auto* o = reinterpret_cast<uint16_t*>(o_ptr);
  std::atomic<int64_t> bad{0};
  const int64_t splits = std::min<int64_t>(H, std::max<int64_t>(1, (threads_now() + T - 1) / T));
  const int64_t per_split = (H + splits - 1) / splits;
  const int64_t reads = T * K * W * 2 * ((H + HEAD_GROUP - 1) / HEAD_GROUP);
  maybe_parallel(T * splits, 1, reads, [&](int64_t i0, int64_t i1) {
    AttendScratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / splits, h0 = (i % splits) * per_split, h1 = std::min(H, h0 + per_split);
      if (h0 >= h1) continue;
      scratch.zeros.assign(W, 0);
      std::vector<const uint16_t*>& rows = scratch.rows;
      rows.clear();
      for (int64_t j = 0; j < K; ++j) {
        const int64_t s = slots[t * slots_t + j];
        if (s < 0) continue;
        if (s >= num_blocks * block_size) {
          if (h0 == 0) bad.fetch_add(1);
          continue;
        }
        rows.push_back(kv + (s / block_size) * kv_block + (s % block_size) * kv_row);
      }
      const int64_t len = int64_t(rows.size());
      rows.resize(len + AHEAD + 2, scratch.zeros.data());  // a pair's second row, the rows prefetched ahead
      attend_rows(q + t * q_t + h0 * q_h, q_h, rows.data(), len, o + t * o_t + h0 * o_h, o_h, h1 - h0, W, L,
                  float(scale), {}, scratch);
    }
  }, ATTENTION_OMP_MIN_BYTES);
  return bad.load();
}

}  // namespace
