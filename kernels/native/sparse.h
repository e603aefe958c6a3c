// DeepSeek-V3.2's sparse attention (DeepSeek Sparse Attention) on the CPU: the lightning indexer's
// scores and top-k over a paged key cache (indexer_topk), and MLA decode attention over the cache
// slots it chose (sparse_mla_decode). The math of kernels/sparse_mla.py.

#pragma once

#include <numeric>

#include "attention.h"

namespace {

// Scores of one query token against keys[0, len) (bf16 rows of dI elements):
//   I[s] = sum_h w[h] * max(0, scale * (q[h] . keys[s]))
// float32 throughout: the products of bf16 values are exact, their sums through VDPBF16PS (or its
// emulation), then the heads' 16-lane sums 16 at a time (sum_lanes16). Heads go in groups of 16.
inline void indexer_scores(const uint16_t* q, int64_t q_h, const float* w, const uint16_t* const* keys,
                           int64_t len, int64_t heads, int64_t dI, float scale, float* out) {
  std::fill_n(out, len, 0.0f);
  for (int64_t h0 = 0; h0 < heads; h0 += 16) {
    const int64_t group = std::min<int64_t>(16, heads - h0);
    alignas(64) float wg[16] = {0};
    for (int64_t g = 0; g < group; ++g) wg[g] = w[h0 + g];
    const __m512 weights = _mm512_loadu_ps(wg), zero = _mm512_setzero_ps(), scales = _mm512_set1_ps(scale);
    for (int64_t s = 0; s < len; ++s) {
      __m512 acc[16];
      for (int g = 0; g < 16; ++g) acc[g] = _mm512_setzero_ps();
      const uint16_t* k = keys[s];
      for (int64_t d = 0; d < dI; d += 32) {
        const __m512i kv = load32(k + d, dI - d);
        for (int64_t g = 0; g < group; ++g) acc[g] = dot_bf16(acc[g], kv, load32(q + (h0 + g) * q_h + d, dI - d));
      }
      const __m512 dots = sum_lanes16(acc);  // lane g: head h0 + g's dot (0 past the group)
      const __m512 terms = _mm512_mul_ps(weights, _mm512_max_ps(_mm512_mul_ps(dots, scales), zero));
      alignas(64) float t[16];
      _mm512_store_ps(t, terms);
      float sum = 0.0f;
      for (int64_t g = 0; g < group; ++g) sum += t[g];
      out[s] += sum;
    }
  }
}

// The indexer of T query tokens, each over its own context in a paged key cache: token t sees
// keys 0 .. lens[t] - 1 of its block table (row j: block table[j / block_size], row j %
// block_size), scored as indexer_scores; out[t] gets the cache slots (block * block_size + row)
// of its best min(topk, lens[t]) keys, -1 after them. Where lens[t] <= topk every key is chosen,
// unscored. The best `topk` are found by selection (nth_element; ties to the earlier key), not a
// sort: attention reads them in any order. Work: (token, span of KEY_SPAN keys) for the scores,
// then a token at a time for the selection. Returns the block ids outside [0, num_blocks) the
// lengths reach (0: all fine; the caller raises).
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
    std::vector<int32_t> order;
    for (int64_t t = t0; t < t1; ++t) {
      int64_t* o = out + t * out_t;
      if (len[t] <= topk) {
        for (int64_t j = 0; j < topk; ++j) o[j] = j < len[t] ? slot(t, j) : -1;
        continue;
      }
      const float* s = scores.data() + offset[t];
      order.resize(len[t]);
      std::iota(order.begin(), order.end(), 0);
      std::nth_element(order.begin(), order.begin() + (topk - 1), order.end(), [&](int32_t a, int32_t b) {
        return s[a] > s[b] || (s[a] == s[b] && a < b);
      });
      for (int64_t j = 0; j < topk; ++j) o[j] = slot(t, order[j]);
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
