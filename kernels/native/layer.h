// A layer's parts for a decode step's few tokens: RMSNorm, rotary, the whole attention
// (mla_attention), routing (route), the whole MoE block (moe_block) and the MTP layer's input
// (mtp_input, last: placed before the others it moved their code, and batch-1 steps ran ~1 %
// slower in interleaved rounds).

#pragma once

#include "attention.h"
#include "experts.h"
#include "sparse.h"

namespace {

// RMSNorm of bf16 rows, with the residual add fused, in kernels/norm.py's roundings (HF's):
//   h = bf16(x + residual)  (the new residual stream, written to sum; or h = x without one)
//   y = bf16(weight * bf16(h * rsqrt(mean(h^2) + eps)))
// A row's squares are summed in float32 in 16 lanes, then across them (torch sums in another
// order: the output agrees to one bf16 rounding); the rest runs 16 lanes at a time too. (Summed
// one after another, a row's chain of additions waited on itself: 3.8 % of a batch-1 MTP step's
// samples on the 2-core Zen 4.) Rows go in blocks of NORM_ROWS, and a prefill's thousands of
// rows are shared over the threads; each row's arithmetic is the same whatever the rows. sum may
// be res (the stream updated in place), y may be x.
constexpr int64_t NORM_ROWS = 8;
void rms_norm(int64_t x_ptr, int64_t ldx, int64_t res_ptr, int64_t ldr, int64_t w_ptr, int64_t y_ptr, int64_t ldy,
              int64_t sum_ptr, int64_t lds, int64_t M, int64_t D, double eps) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* res = reinterpret_cast<const uint16_t*>(res_ptr);
  const auto* w = reinterpret_cast<const uint16_t*>(w_ptr);
  auto* y = reinterpret_cast<uint16_t*>(y_ptr);
  auto* sum = reinterpret_cast<uint16_t*>(sum_ptr);
  const int64_t Dp = (D + 15) / 16 * 16;
  maybe_parallel((M + NORM_ROWS - 1) / NORM_ROWS, 2, M * D * 2, [&](int64_t b0, int64_t b1) {
    std::vector<float> h(NORM_ROWS * Dp);  // a block's rows h, widened
    for (int64_t m0 = b0 * NORM_ROWS; m0 < std::min(M, b1 * NORM_ROWS); m0 += NORM_ROWS) {
      const int64_t rows = std::min(NORM_ROWS, M - m0);
      float squares[NORM_ROWS];
      for (int64_t r = 0; r < rows; ++r) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const int64_t m = m0 + r;
          const __mmask16 mask = lanes16(D - d);
          __m512 v = widen16(_mm256_maskz_loadu_epi16(mask, x + m * ldx + d));
          if (res != nullptr) {
            const __m256i rounded =
                narrow16(_mm512_add_ps(v, widen16(_mm256_maskz_loadu_epi16(mask, res + m * ldr + d))));
            _mm256_mask_storeu_epi16(sum + m * lds + d, mask, rounded);
            v = widen16(rounded);
          }
          _mm512_storeu_ps(&h[r * Dp + d], v);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        squares[r] = _mm512_reduce_add_ps(acc);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(squares[r] / float(D) + float(eps)));
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 mask = lanes16(D - d);
          const __m512 normed = widen16(narrow16(_mm512_mul_ps(_mm512_loadu_ps(&h[r * Dp + d]), scale)));
          const __m512 wv = widen16(_mm256_maskz_loadu_epi16(mask, w + d));
          _mm256_mask_storeu_epi16(y + (m0 + r) * ldy + d, mask, narrow16(_mm512_mul_ps(wv, normed)));
        }
      }
    }
  }, ROWS_OMP_MIN_BYTES);
}


// LayerNorm of bf16 rows with a bias (DeepSeek-V3.2's indexer keys; engine/models/layers.py
// LayerNorm takes it for bf16 rows, so its Python and one-call paths share these bits), in
// float32, a row at a time in one order: mean = sum(x) / D, var = sum((x - mean)^2) / D,
//   y = bf16((x - mean) * (1 / sqrt(var + eps)) * weight + bias)
// (torch's float32 layer_norm sums in another order: the output agrees to one bf16 rounding).
// Rows are few (a step's tokens) and short (d_I = 128): scalar, shared over threads from a
// prefill's thousands of rows on. y may be x.
void layer_norm(int64_t x_ptr, int64_t ldx, int64_t w_ptr, int64_t b_ptr, int64_t y_ptr, int64_t ldy, int64_t M,
                int64_t D, double eps) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* w = reinterpret_cast<const uint16_t*>(w_ptr);
  const auto* b = reinterpret_cast<const uint16_t*>(b_ptr);
  auto* y = reinterpret_cast<uint16_t*>(y_ptr);
  maybe_parallel(M, 16, M * D * 2, [&](int64_t m0, int64_t m1) {
    std::vector<float> h(D);
    for (int64_t m = m0; m < m1; ++m) {
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += (h[d] = from_bf16(x[m * ldx + d]));
      const float mean = sum / float(D);
      float squares = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        h[d] -= mean;
        squares += h[d] * h[d];
      }
      const float rstd = 1.0f / std::sqrt(squares / float(D) + float(eps));
      for (int64_t d = 0; d < D; ++d) y[m * ldy + d] = to_bf16(h[d] * rstd * from_bf16(w[d]) + from_bf16(b[d]));
    }
  }, ROWS_OMP_MIN_BYTES);
}

// Rotary embedding of bf16 rows x [N, G, R] (G heads, or 1) at each token's cos/sin [N, R/2]
// (float32), in kernels/rotary.py's reference roundings: cos and sin rounded to bf16, every
// product and sum rounded to bf16; pairs taken interleaved (x[2i], x[2i+1]) or as halves, and
// written as halves, out [N, G, R] contiguous; 16 pairs at a time. A prefill's thousands of rows
// are shared over the threads, as rms_norm's.
void rotary(int64_t x_ptr, int64_t x_n, int64_t x_g, int64_t cos_ptr, int64_t sin_ptr, int64_t ld_cs,
            int64_t out_ptr, int64_t N, int64_t G, int64_t R, bool interleaved) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* cos = reinterpret_cast<const float*>(cos_ptr);
  const auto* sin = reinterpret_cast<const float*>(sin_ptr);
  auto* out = reinterpret_cast<uint16_t*>(out_ptr);
  const int64_t half = R / 2;
  auto round = [](__m512 v) { return widen16(narrow16(v)); };
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  maybe_parallel(N, 16, N * G * R * 2, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* xr = x + n * x_n + g * x_g;
        uint16_t* o = out + (n * G + g) * R;
        for (int64_t i = 0; i < half; i += 16) {  // 16 pairs at a time
          const __mmask16 mask = lanes16(half - i);
          const __m512 c = round(_mm512_maskz_loadu_ps(mask, cos + n * ld_cs + i));
          const __m512 s = round(_mm512_maskz_loadu_ps(mask, sin + n * ld_cs + i));
          __m512 x1, x2;
          if (interleaved) {  // 16 (x[2i], x[2i+1]) pairs, each a 32-bit lane: the low half widens to x1
            const __m512i pairs = _mm512_maskz_loadu_epi16(lanes(2 * (half - i)), xr + 2 * i);
            x1 = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            x2 = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
          } else {
            x1 = widen16(_mm256_maskz_loadu_epi16(mask, xr + i));
            x2 = widen16(_mm256_maskz_loadu_epi16(mask, xr + half + i));
          }
          const __m512 o1 = _mm512_sub_ps(round(_mm512_mul_ps(x1, c)), round(_mm512_mul_ps(x2, s)));
          const __m512 o2 = _mm512_add_ps(round(_mm512_mul_ps(x2, c)), round(_mm512_mul_ps(x1, s)));
          _mm256_mask_storeu_epi16(o + i, mask, narrow16(o1));
          _mm256_mask_storeu_epi16(o + half + i, mask, narrow16(o2));
        }
      }
  }, ROWS_OMP_MIN_BYTES);
}


// The latent cache rows of M tokens from the attention's input x [M, hidden] (after the layer's
// norm): kv_a = kv_a(x); c = norm(kv_a[:, :L]); k_pe = rotary(kv_a[:, L:]); cache[slot] = (c,
// k_pe), slots [M] int64, -1 to skip (MLAttention.store_latents). Returns the count of slots
// outside the cache (skipped).
int64_t store_latents(int64_t x_ptr, int64_t M, int64_t hidden, const QW& kva, int64_t kva_norm_ptr, double kv_eps,
                      int64_t cos_ptr, int64_t sin_ptr, bool interleaved, int64_t kv_ptr, int64_t num_blocks,
                      int64_t block_size, int64_t slots_ptr, int64_t R, int64_t L) {
  const int64_t W = L + R;
  std::vector<uint16_t> kv_a(M * W), c(M * L), k_pe(M * R);
  linear_w(x_ptr, hidden, kva, int64_t(kv_a.data()), W, M, W, hidden);
  rms_norm(int64_t(kv_a.data()), W, 0, 0, kva_norm_ptr, int64_t(c.data()), L, 0, L, M, L, kv_eps);
  rotary(int64_t(kv_a.data() + L), W, R, cos_ptr, sin_ptr, R / 2, int64_t(k_pe.data()), M, 1, R, interleaved);
  auto* kv = reinterpret_cast<uint16_t*>(kv_ptr);
  const auto* slots = reinterpret_cast<const int64_t*>(slots_ptr);
  int64_t bad = 0;
  for (int64_t i = 0; i < M; ++i) {
    if (slots[i] < 0) continue;
    if (slots[i] >= num_blocks * block_size) {
      ++bad;
      continue;
    }
    std::memcpy(kv + slots[i] * W, &c[i * L], L * 2);
    std::memcpy(kv + slots[i] * W + L, &k_pe[i * R], R * 2);
  }
  return bad;
}


// A plan's weight (a LayerPlan's, an IndexerPlan's): the fields of a WeightArgs (data, ld, scale,
// lds, block_k, fmt), and them as one.
#define PDSERVE_WEIGHT(INT, w) INT(w) INT(w##_ld) INT(w##_scale) INT(w##_lds) INT(w##_block) INT(w##_fmt)
#define PLAN_WEIGHT(p, w) WeightArgs{(p).w, (p).w##_ld, (p).w##_scale, (p).w##_lds, (p).w##_block, (p).w##_fmt}

// DeepSeek-V3.2's lightning indexer of one layer, as mla_attention takes it (engine/models/
// deepseek_v32.py Indexer): wq [nI * dI, q_lora] from the query latent, wk [dI, hidden] and the
// key LayerNorm (k_norm, k_bias, k_eps), weights_proj wp [nI, hidden] (scaled by w_scale =
// nI^-1/2), the leading `rope` elements of every key and query head roped in halves, the best
// `topk` keys chosen (scale: dI^-1/2). A row of an int64 tensor filled by kernels/native/blocks.py
// IndexerWeights by the field names indexer_plan_fields() gives.
#define PDSERVE_INDEXER_PLAN(INT, REAL)                                                           \
  PDSERVE_WEIGHT(INT, wq) PDSERVE_WEIGHT(INT, wk) INT(k_norm) INT(k_bias) PDSERVE_WEIGHT(INT, wp) \
  INT(heads) INT(dim) INT(rope) INT(topk) REAL(k_eps) REAL(scale) REAL(w_scale)

struct IndexerPlan {  // every field 8 bytes, in the macro's order
#define PDSERVE_INT_FIELD(name) int64_t name;
#define PDSERVE_REAL_FIELD(name) double name;
  PDSERVE_INDEXER_PLAN(PDSERVE_INT_FIELD, PDSERVE_REAL_FIELD)
#undef PDSERVE_INT_FIELD
#undef PDSERVE_REAL_FIELD
};

std::vector<std::pair<std::string, bool>> indexer_plan_fields() {
#define PDSERVE_INT_NAME(name) {#name, false},
#define PDSERVE_REAL_NAME(name) {#name, true},
  return {PDSERVE_INDEXER_PLAN(PDSERVE_INT_NAME, PDSERVE_REAL_NAME)};
#undef PDSERVE_INT_NAME
#undef PDSERVE_REAL_NAME
}

// The rope of the leading R elements of G heads of dI in rows x [M, G * dI], in place: the
// indexer's `_rope` (rotary into a buffer, copied back), in halves.
void rope_leading(uint16_t* x, int64_t M, int64_t G, int64_t dI, int64_t R, int64_t cos_ptr, int64_t sin_ptr,
                  std::vector<uint16_t>& kept) {
  uint16_t* roped = scratch(kept, M * G * R);
  rotary(int64_t(x), G * dI, dI, cos_ptr, sin_ptr, R / 2, int64_t(roped), M, G, R, false);
  for (int64_t r = 0; r < M * G; ++r) std::memcpy(x + r * dI, roped + r * R, R * 2);
}

// Every token's indexer key LayerNorm(x wk), roped, stored at its slot of the key cache
// [num_blocks, block_size, dI] (Indexer.store_keys); x is the layer's normed input. Slots outside
// the cache are skipped (the latent cache's store, the same size, counts them).
void store_indexer_keys(const IndexerPlan& ix, int64_t x_ptr, int64_t hidden, int64_t M, int64_t cos_ptr,
                        int64_t sin_ptr, int64_t keys_ptr, int64_t num_blocks, int64_t block_size,
                        const int64_t* slots) {
  struct Kept {
    std::vector<uint16_t> k, kn, roped;
  };
  thread_local Kept kept;
  const int64_t dI = ix.dim;
  uint16_t *k = scratch(kept.k, M * dI), *kn = scratch(kept.kn, M * dI);
  linear_w(x_ptr, hidden, weight_of(PLAN_WEIGHT(ix, wk)), int64_t(k), dI, M, dI, hidden);
  layer_norm(int64_t(k), dI, ix.k_norm, ix.k_bias, int64_t(kn), dI, M, dI, ix.k_eps);
  rope_leading(kn, M, 1, dI, ix.rope, cos_ptr, sin_ptr, kept.roped);
  auto* keys = reinterpret_cast<uint16_t*>(keys_ptr);
  for (int64_t i = 0; i < M; ++i)
    if (slots[i] >= 0 && slots[i] < num_blocks * block_size) std::memcpy(keys + slots[i] * dI, kn + i * dI, dI * 2);
}

// The indexer's part of a decode step (SparseMLAttention's store_cache and choose): every token's
// key stored (store_indexer_keys); then, where some token's context is longer than topk, the
// queries (wq of the query latent q_an, roped), the head weights and the cache slots each token
// attends to -> chosen [M, topk] (-1: none). Returns the block ids outside the cache its tables
// reach (0: fine).
int64_t indexer_step(const IndexerPlan& ix, int64_t x_ptr, int64_t hidden, int64_t q_an_ptr, int64_t q_lora,
                     int64_t M, int64_t cos_ptr, int64_t sin_ptr, int64_t keys_ptr, int64_t num_blocks,
                     int64_t block_size, const int64_t* slots, int64_t table_ptr, int64_t max_blocks,
                     const int32_t* lens, bool any_sparse, int64_t* chosen) {
  struct Kept {
    std::vector<uint16_t> q, roped, w;
    std::vector<float> weights;
  };
  thread_local Kept kept;
  const int64_t nI = ix.heads, dI = ix.dim;
  store_indexer_keys(ix, x_ptr, hidden, M, cos_ptr, sin_ptr, keys_ptr, num_blocks, block_size, slots);
  if (!any_sparse) return 0;
  uint16_t *q = scratch(kept.q, M * nI * dI), *w = scratch(kept.w, M * nI);
  linear_w(q_an_ptr, q_lora, weight_of(PLAN_WEIGHT(ix, wq)), int64_t(q), nI * dI, M, nI * dI, q_lora);
  rope_leading(q, M, nI, dI, ix.rope, cos_ptr, sin_ptr, kept.roped);
  linear_w(x_ptr, hidden, weight_of(PLAN_WEIGHT(ix, wp)), int64_t(w), nI, M, nI, hidden);
  float* weights = scratch(kept.weights, M * nI);
  for (int64_t i = 0; i < M * nI; ++i) weights[i] = from_bf16(w[i]) * float(ix.w_scale);
  return indexer_topk(int64_t(q), nI * dI, dI, int64_t(weights), nI, keys_ptr, block_size * dI, dI, num_blocks,
                      block_size, table_ptr, max_blocks, max_blocks, int64_t(lens), int64_t(chosen), ix.topk, M, nI,
                      dI, ix.topk, ix.scale);
}

// Sparse MLA for M decode tokens (SparseMLAttention.forward's attention): a token whose context
// fits in topk attends densely over it (mla_decode), the others over their chosen cache slots
// (sparse_mla_decode), each kind in one call over its tokens' rows (gathered where the step holds
// both). q [M, H, W], o [M, H, L]. -> the block ids or slots outside the cache (0: fine).
int64_t attend_chosen(const uint16_t* q, int64_t kv_ptr, int64_t num_blocks, int64_t block_size, int64_t table_ptr,
                      int64_t max_blocks, const int32_t* lens, const int64_t* chosen, int64_t topk, uint16_t* o,
                      int64_t M, int64_t H, int64_t W, int64_t L, double scale) {
  struct Kept {
    std::vector<int64_t> dense, sparse, chosen;
    std::vector<uint16_t> q, o;
    std::vector<int32_t> table, lens;
  };
  thread_local Kept kept;  // a step's gathered rows: written whole before they are read
  std::vector<int64_t>&dense = kept.dense, &sparse = kept.sparse;
  dense.clear(), sparse.clear();
  for (int64_t i = 0; i < M; ++i) (lens[i] <= topk ? dense : sparse).push_back(i);
  const auto* table = reinterpret_cast<const int32_t*>(table_ptr);
  if (dense.empty())
    return sparse_mla_decode(int64_t(q), H * W, W, kv_ptr, block_size * W, W, num_blocks, block_size, int64_t(chosen),
                             topk, topk, int64_t(o), H * L, L, M, H, W, L, scale);
  const int64_t nd = int64_t(dense.size()), ns = int64_t(sparse.size());
  // The dense rows, then the sparse ones.
  uint16_t *qg = scratch(kept.q, M * H * W), *og = scratch(kept.o, M * H * L);
  int32_t *table_d = scratch(kept.table, nd * max_blocks), *lens_d = scratch(kept.lens, nd);
  int64_t* chosen_s = scratch(kept.chosen, ns * topk);
  for (int64_t j = 0; j < M; ++j) {
    const int64_t i = j < nd ? dense[j] : sparse[j - nd];
    std::memcpy(qg + j * H * W, q + i * H * W, H * W * 2);
    if (j < nd) {
      std::memcpy(table_d + j * max_blocks, table + i * max_blocks, max_blocks * 4);
      lens_d[j] = lens[i];
    } else {
      std::memcpy(chosen_s + (j - nd) * topk, chosen + i * topk, topk * 8);
    }
  }
  int64_t bad = mla_decode(int64_t(qg), H * W, W, kv_ptr, block_size * W, W, num_blocks, block_size, int64_t(table_d),
                           max_blocks, max_blocks, int64_t(lens_d), int64_t(og), H * L, L, nd, H, W, L, scale);
  if (bad == 0 && ns > 0)
    bad = sparse_mla_decode(int64_t(qg + nd * H * W), H * W, W, kv_ptr, block_size * W, W, num_blocks, block_size,
                            int64_t(chosen_s), topk, topk, int64_t(og + nd * H * L), H * L, L, ns, H, W, L, scale);
  for (int64_t j = 0; j < M; ++j) std::memcpy(o + (j < nd ? dense[j] : sparse[j - nd]) * H * L, og + j * H * L, H * L * 2);
  return bad;
}

// One MLA layer's attention for M decode tokens (a batch-1 decode, a verification's tokens) in
// one call: MLAttention.forward's native calls (with store_latents and _decode), in its order
// and through the same functions here, so the bits are the Python path's; what it saves is the
// ~15 Python calls between them (~0.15 ms a layer). Weights contiguous, no biases:
//   q      = q_b(norm(q_a(x)))  (or q_proj(x) when qa_ptr is 0)    [M, H, nope + R]
//   q_pe   = rotary(q[..., nope:])                                   [M, H, R]
//   kv_a   = kv_a(x); c = norm(kv_a[:, :L]); k_pe = rotary(kv_a[:, L:]); cache[slot] = (c, k_pe)
//   q_lat  = q_nope @ w_uk[h] per head (w_uk_t [H, L, nope], heads wuk_h apart)   [M, H, L]
//   o_lat  = mla_decode([q_lat, q_pe]) over the paged cache           [M, H, L]
//   out    = o_proj(o_lat @ w_uv[h]^T per head)  (w_uv [H, v, L], heads wuv_h apart)   [M, hidden]
// Every projection, the per-head ones too, bf16 or kept quantized (a head's scales *_scale_h apart).
// Token i is sequence i of table [M, max_blocks] / lens [M] (a verification's tokens come
// expanded, as kernels/mla.py passes them); slots [M] int64, -1 to skip. With the decoder
// layer's norms (pre_norm_ptr, post_norm_ptr), x is the layer's input before its norm, res the
// residual stream it is added to (0 in the first layer: x is the stream), and out gets the
// post-attention norm of (attention + stream), res_out the new stream: DecoderLayer's rms_norm
// calls around the attention. With an indexer (indexer_ptr: an IndexerPlan; DeepSeek-V3.2's
// SparseMLAttention), each token's indexer key is stored too (keys_ptr: the layer's key cache,
// [num_blocks, block_size, dI]) and a token whose context is longer than its topk attends over
// the slots the indexer chose (indexer_step, attend_chosen). Returns the count of block ids and
// slots outside the cache (0: fine; the caller raises).
int64_t mla_attention(int64_t x_ptr, int64_t M, int64_t hidden, const WeightArgs& qa_args, int64_t qa_norm_ptr,
                      int64_t q_lora, double q_eps, const WeightArgs& qb_args, const WeightArgs& kva_args,
                      int64_t kva_norm_ptr, double kv_eps, const WeightArgs& wuk_args, int64_t wuk_h,
                      int64_t wuk_scale_h, const WeightArgs& wuv_args, int64_t wuv_h, int64_t wuv_scale_h,
                      const WeightArgs& o_args, int64_t cos_ptr,
                      int64_t sin_ptr, bool interleaved, int64_t kv_ptr, int64_t num_blocks, int64_t block_size,
                      int64_t slots_ptr, int64_t table_ptr, int64_t max_blocks, int64_t lens_ptr, int64_t out_ptr,
                      int64_t H, int64_t nope, int64_t R, int64_t L, int64_t v, double scale, int64_t pre_norm_ptr,
                      double pre_eps, int64_t res_ptr, int64_t post_norm_ptr, double post_eps, int64_t res_out_ptr,
                      int64_t indexer_ptr, int64_t keys_ptr) {
  const int64_t qk = nope + R, W = L + R;
  const QW qa = weight_of(qa_args), qb = weight_of(qb_args), kva = weight_of(kva_args), o = weight_of(o_args);
  struct Kept {
    std::vector<uint16_t> q, q_pe, q_lat, q_full, o_lat, o_v, o_heads, normed, attended, q_a, q_an;
    std::vector<int64_t> chosen;
  };
  thread_local Kept kept;  // every buffer below is written whole before it is read
  uint16_t *q = scratch(kept.q, M * H * qk), *q_pe = scratch(kept.q_pe, M * H * R),
           *q_lat = scratch(kept.q_lat, H * M * L), *q_full = scratch(kept.q_full, M * H * W),
           *o_lat = scratch(kept.o_lat, M * H * L), *o_v = scratch(kept.o_v, H * M * v),
           *o_heads = scratch(kept.o_heads, M * H * v), *normed = nullptr;
  auto at = [](uint16_t* b, int64_t offset = 0) { return int64_t(b + offset); };
  if (pre_norm_ptr != 0) {  // x is the residual stream before the layer's input norm (added to res when given)
    normed = scratch(kept.normed, M * hidden);
    const int64_t sum_ptr = res_ptr != 0 ? res_out_ptr : 0;  // without a residual, x itself is the stream
    rms_norm(x_ptr, hidden, res_ptr, hidden, pre_norm_ptr, at(normed), hidden, sum_ptr, hidden, M, hidden, pre_eps);
    if (res_ptr == 0)
      std::memcpy(reinterpret_cast<uint16_t*>(res_out_ptr), reinterpret_cast<const uint16_t*>(x_ptr), M * hidden * 2);
    x_ptr = at(normed);
  }
  const int64_t final_out = out_ptr;
  if (post_norm_ptr != 0) out_ptr = at(scratch(kept.attended, M * hidden));
  uint16_t* q_an = nullptr;  // the query latent
  if (qa.data != nullptr) {
    uint16_t* q_a = scratch(kept.q_a, M * q_lora);
    q_an = scratch(kept.q_an, M * q_lora);
    linear_w(x_ptr, hidden, qa, at(q_a), q_lora, M, q_lora, hidden);
    rms_norm(at(q_a), q_lora, 0, 0, qa_norm_ptr, at(q_an), q_lora, 0, q_lora, M, q_lora, q_eps);
    linear_w(at(q_an), q_lora, qb, at(q), H * qk, M, H * qk, q_lora);
  } else {
    linear_w(x_ptr, hidden, qb, at(q), H * qk, M, H * qk, hidden);
  }
  rotary(at(q, nope), H * qk, qk, cos_ptr, sin_ptr, R / 2, at(q_pe), M, H, R, interleaved);

  int64_t bad = store_latents(x_ptr, M, hidden, kva, kva_norm_ptr, kv_eps, cos_ptr, sin_ptr, interleaved, kv_ptr,
                              num_blocks, block_size, slots_ptr, R, L);

  linear_w(at(q), qk, H * qk, weight_of(wuk_args), wuk_h, wuk_scale_h, at(q_lat), M * L, L, H, M, L, nope);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(&q_full[(i * H + h) * W], &q_lat[(h * M + i) * L], L * 2);
      std::memcpy(&q_full[(i * H + h) * W + L], &q_pe[(i * H + h) * R], R * 2);
    }
  const auto* ix = reinterpret_cast<const IndexerPlan*>(indexer_ptr);
  const auto* lens = reinterpret_cast<const int32_t*>(lens_ptr);
  bool any_sparse = false;  // a token whose context is longer than the indexer's topk
  for (int64_t i = 0; ix != nullptr && i < M; ++i) any_sparse |= lens[i] > ix->topk;
  int64_t* chosen = any_sparse ? scratch(kept.chosen, M * ix->topk) : nullptr;
  if (bad == 0 && ix != nullptr)
    bad = indexer_step(*ix, x_ptr, hidden, at(q_an), q_lora, M, cos_ptr, sin_ptr, keys_ptr, num_blocks, block_size,
                       reinterpret_cast<const int64_t*>(slots_ptr), table_ptr, max_blocks, lens, any_sparse, chosen);
  if (bad == 0 && !any_sparse)
    bad = mla_decode(at(q_full), H * W, W, kv_ptr, block_size * W, W, num_blocks, block_size, table_ptr, max_blocks,
                     max_blocks, lens_ptr, at(o_lat), H * L, L, M, H, W, L, scale);
  else if (bad == 0)
    bad = attend_chosen(q_full, kv_ptr, num_blocks, block_size, table_ptr, max_blocks, lens, chosen, ix->topk, o_lat,
                        M, H, W, L, scale);
  if (bad != 0) return bad;
  linear_w(at(o_lat), L, H * L, weight_of(wuv_args), wuv_h, wuv_scale_h, at(o_v), M * v, v, H, M, v, L);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t h = 0; h < H; ++h) std::memcpy(&o_heads[(i * H + h) * v], &o_v[(h * M + i) * v], v * 2);
  linear_w(at(o_heads), H * v, o, out_ptr, hidden, M, hidden, H * v);
  if (post_norm_ptr != 0)  // the post-attention norm over attended + the stream, which it then replaces
    rms_norm(out_ptr, hidden, res_out_ptr, hidden, post_norm_ptr, final_out, hidden, res_out_ptr, hidden, M, hidden,
             post_eps);
  return 0;
}


// Expert routing of a few tokens after their scores (kernels/gate.py grouped_topk_ref from the
// sigmoid or softmax on), with its float32 operations in its order, so ids and weights are its
// bits: choice = score + bias; with groups (n_group > topk_group) a group's score is the sum of
// its two best choices (with a bias) or its best (without), the topk_group best groups are kept
// and the other experts' choices become `masked`; the top_k choices win, ties to the lowest index
// (as the reference's stable sort); weights = their scores, over their sum + 1e-20 when
// norm_topk_prob, times routed_scaling_factor.
void route(int64_t scores_ptr, int64_t bias_ptr, int64_t T, int64_t E, int64_t n_group, int64_t topk_group,
           int64_t top_k, bool norm_topk_prob, double routed_scaling_factor, int64_t ids_ptr, int64_t weights_ptr) {
  const auto* scores = reinterpret_cast<const float*>(scores_ptr);
  const auto* bias = reinterpret_cast<const float*>(bias_ptr);
  auto* ids = reinterpret_cast<int64_t*>(ids_ptr);
  auto* weights = reinterpret_cast<float*>(weights_ptr);
  const bool grouped = n_group > 1 && topk_group < n_group;
  const int64_t size = E / n_group;
  const float masked = bias != nullptr ? -INFINITY : 0.0f;
  std::vector<float> choice(E), group_score(n_group);
  std::vector<int64_t> order(std::max(E, n_group));
  for (int64_t t = 0; t < T; ++t) {
    const float* st = scores + t * E;
    for (int64_t e = 0; e < E; ++e) choice[e] = bias != nullptr ? st[e] + bias[e] : st[e];
    if (grouped) {
      for (int64_t g = 0; g < n_group; ++g) {
        const float* cg = &choice[g * size];
        int64_t first = 0;  // the best, ties to the lowest index (as torch.topk's first is its max)
        for (int64_t i = 1; i < size; ++i)
          if (cg[i] > cg[first]) first = i;
        float second = -INFINITY;
        for (int64_t i = 0; i < size; ++i)
          if (i != first && cg[i] > second) second = cg[i];
        group_score[g] = bias != nullptr ? cg[first] + second : cg[first];
      }
      for (int64_t g = 0; g < n_group; ++g) order[g] = g;
      std::stable_sort(order.begin(), order.begin() + n_group,
                       [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
      std::vector<bool> kept(n_group, false);
      for (int64_t g = 0; g < topk_group; ++g) kept[order[g]] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!kept[e / size]) choice[e] = masked;
    }
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.begin() + E, [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
    float total = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
      ids[t * top_k + k] = order[k];
      weights[t * top_k + k] = st[order[k]];
      total += st[order[k]];
    }
    for (int64_t k = 0; k < top_k; ++k) {
      float w = weights[t * top_k + k];
      if (norm_topk_prob) w = w / (total + 1e-20f);
      weights[t * top_k + k] = w * float(routed_scaling_factor);
    }
  }
}


// One MoE layer for a decode step's few tokens in one call (DeepseekMoE.forward's work):
//   logits = x . gate^T       the router's product in float32: x's bf16 widened, exact products,
//                             float32 sums in 16 lanes then added (torch's BLAS adds in its own
//                             order: the logits can differ in their last bits)
//   scores = sigmoid(logits), or softmax over the experts (float32, std::exp)
//   `route` from the scores, then the experts with `moe_topk` (the shared one with them).
// gate [E, H] float32 (row stride ld_gate), bias [E] float32 or 0. Every token gets the same
// operations whatever T is, so a verification's tokens are each a one-token decode's bits.
void moe_block(int64_t x_ptr, int64_t ldx, int64_t T, int64_t H, int64_t gate_ptr, int64_t ld_gate, int64_t bias_ptr,
               int64_t E, bool softmax, int64_t n_group, int64_t topk_group, int64_t top_k, bool norm_topk_prob,
               double routed_scaling_factor, const Experts& experts, int64_t out_ptr, int64_t ldo) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* gate = reinterpret_cast<const float*>(gate_ptr);
  std::vector<float> wide(H), scores(T * E), weights(T * top_k);
  std::vector<int64_t> ids(T * top_k);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) wide[h] = from_bf16(x[t * ldx + h]);
    float* st = &scores[t * E];
    for (int64_t e = 0; e < E; ++e) {
      const float* g = gate + e * ld_gate;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; h += 16) {
        const __mmask16 mask = H - h >= 16 ? __mmask16(0xffff) : __mmask16((1u << (H - h)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, &wide[h]), _mm512_maskz_loadu_ps(mask, g + h), acc);
      }
      st[e] = _mm512_reduce_add_ps(acc);
    }
    if (softmax) {
      float top = -INFINITY, total = 0.0f;
      for (int64_t e = 0; e < E; ++e) top = std::max(top, st[e]);
      for (int64_t e = 0; e < E; ++e) total += (st[e] = std::exp(st[e] - top));
      for (int64_t e = 0; e < E; ++e) st[e] /= total;
    } else {
      for (int64_t e = 0; e < E; ++e) st[e] = 1.0f / (1.0f + std::exp(-st[e]));
    }
  }
  route(reinterpret_cast<int64_t>(scores.data()), bias_ptr, T, E, n_group, topk_group, top_k, norm_topk_prob,
        routed_scaling_factor, reinterpret_cast<int64_t>(ids.data()), reinterpret_cast<int64_t>(weights.data()));
  run_topk(x, ldx, experts, reinterpret_cast<uint16_t*>(out_ptr), ldo, ids.data(), weights.data(), T, top_k, E,
           H);  // route's ids lie in [0, E): nothing to refuse
}

// moe_block from Python (kernels/native/blocks.py), the experts in any format (experts_of).
void moe_block_py(int64_t x_ptr, int64_t ldx, int64_t T, int64_t H, int64_t gate_ptr, int64_t ld_gate, int64_t bias_ptr,
                  int64_t E, bool softmax, int64_t n_group, int64_t topk_group, int64_t top_k, bool norm_topk_prob,
                  double routed_scaling_factor, const WeightArgs& w13, int64_t w13_expert, int64_t w13_scale_expert,
                  const WeightArgs& w2, int64_t w2_expert, int64_t w2_scale_expert, int64_t out_ptr, int64_t ldo,
                  int64_t I, const WeightArgs& s13, const WeightArgs& s2, int64_t Is) {
  moe_block(x_ptr, ldx, T, H, gate_ptr, ld_gate, bias_ptr, E, softmax, n_group, topk_group, top_k, norm_topk_prob,
            routed_scaling_factor,
            experts_of(w13, w13_expert, w13_scale_expert, w2, w2_expert, w2_scale_expert, I, s13, s2, Is), out_ptr,
            ldo);
}

// The MTP layer's input for M tokens (engine/models/mtp.py), in one call:
//   u = eh_proj([enorm(embed[ids]); hnorm(h)])        [M, 2H] -> [M, H]
// each norm written into its half of one buffer, through rms_norm and linear_bf16 as the
// separate calls run them (the same bits). -> how many ids lie outside [0, V) (nothing is
// computed then).
int64_t mtp_input(int64_t ids_ptr, int64_t embed_ptr, int64_t ld_embed, int64_t V, int64_t h_ptr, int64_t ldh,
                  int64_t enorm_ptr, double e_eps, int64_t hnorm_ptr, double h_eps, int64_t eh_ptr, int64_t y_ptr,
                  int64_t M, int64_t H) {
  const auto* ids = reinterpret_cast<const int64_t*>(ids_ptr);
  int64_t bad = 0;
  for (int64_t m = 0; m < M; ++m) bad += ids[m] < 0 || ids[m] >= V;
  if (bad) return bad;
  std::vector<uint16_t> x(M * 2 * H);  // [enorm(e) | hnorm(h)] per row
  const auto xp = reinterpret_cast<int64_t>(x.data());
  for (int64_t m = 0; m < M; ++m)  // row by row: each embedding is a row of the table
    rms_norm(embed_ptr + ids[m] * ld_embed * 2, 0, 0, 0, enorm_ptr, xp + m * 4 * H, 0, 0, 0, 1, H, e_eps);
  rms_norm(h_ptr, ldh, 0, 0, hnorm_ptr, xp + H * 2, 2 * H, 0, 0, M, H, h_eps);
  linear_bf16(xp, 0, 2 * H, eh_ptr, 0, 2 * H, y_ptr, 0, H, 1, M, H, 2 * H);
  return 0;
}


// A decode step's whole stack of decoder layers in one call (DeepseekV2ForCausalLM.forward for a
// few decode tokens, without its Python between the layers: at batch 1 that Python ran ~35 µs a
// layer on caches the weights had just swept). Each layer is one LayerPlan, the pointers and sizes
// its mla_attention and moe_block calls take, filled once by kernels/native/blocks.py DecodeStack
// by the field names layer_plan_fields() gives. A layer's MLP is its MoE block (moe != 0) or a
// dense SwiGLU MLP (gate_up s13 [2Is, H], down s2 [H, Is]; swiglu's products and roundings). A
// weight's fields are a WeightArgs' (PDSERVE_WEIGHT: data, ld, scale, lds, block_k, fmt).
#define PDSERVE_LAYER_PLAN(INT, REAL)                                                                      \
  PDSERVE_WEIGHT(INT, qa) INT(qa_norm) INT(q_lora) PDSERVE_WEIGHT(INT, qb) PDSERVE_WEIGHT(INT, kva)        \
  INT(kva_norm) PDSERVE_WEIGHT(INT, wuk) INT(wuk_h) INT(wuk_scale_h) PDSERVE_WEIGHT(INT, wuv) INT(wuv_h)    \
  INT(wuv_scale_h) PDSERVE_WEIGHT(INT, o)                                                                  \
  INT(heads) INT(nope) INT(rope) INT(latent) INT(v) INT(interleaved) INT(pre_norm) INT(post_norm)          \
  INT(moe) INT(gate) INT(ld_gate) INT(bias) INT(experts) INT(softmax) INT(n_group) INT(topk_group)        \
  INT(top_k) INT(norm_topk_prob) PDSERVE_WEIGHT(INT, w13) INT(w13_expert) INT(w13_scale_expert)           \
  PDSERVE_WEIGHT(INT, w2) INT(w2_expert) INT(w2_scale_expert) INT(inter)                                  \
  PDSERVE_WEIGHT(INT, s13) PDSERVE_WEIGHT(INT, s2) INT(shared_inter) INT(indexer)                         \
  REAL(q_eps) REAL(kv_eps) REAL(scale) REAL(pre_eps) REAL(post_eps) REAL(routed_scaling_factor)

struct LayerPlan {  // every field 8 bytes, in the macro's order: a row of an int64 tensor
#define PDSERVE_INT_FIELD(name) int64_t name;
#define PDSERVE_REAL_FIELD(name) double name;
  PDSERVE_LAYER_PLAN(PDSERVE_INT_FIELD, PDSERVE_REAL_FIELD)
};

// LayerPlan's fields in order, each (name, whether it is a double).
std::vector<std::pair<std::string, bool>> layer_plan_fields() {
#define PDSERVE_INT_NAME(name) {#name, false},
#define PDSERVE_REAL_NAME(name) {#name, true},
  return {PDSERVE_LAYER_PLAN(PDSERVE_INT_NAME, PDSERVE_REAL_NAME)};
}

// The stack for M decode tokens ids [M] (int64): embedding rows (embed [V, H] contiguous), or the
// rows of input [M, H] (contiguous; ids_ptr 0: an MTP layer's u), then each layer over its own
// cache (kv_ptrs [layers] int64, every cache [num_blocks, block_size, L+R]; a layer with an
// indexer also its key cache, keys_ptrs [layers], [num_blocks, block_size, dI]), then the final norm
// into out [M, H]: the hidden states compute_logits takes. Slots, table, lens, cos and sin as
// mla_attention takes them. -> 0; the count of block ids and slots outside the cache (the first
// layer's: nothing after it ran); or minus the count of ids outside [0, V) (nothing ran).
int64_t decode_stack(int64_t plan_ptr, int64_t num_layers, int64_t ids_ptr, int64_t input_ptr, int64_t embed_ptr,
                     int64_t V, int64_t M, int64_t hidden, int64_t cos_ptr, int64_t sin_ptr, int64_t kv_ptrs_ptr,
                     int64_t keys_ptrs_ptr, int64_t num_blocks, int64_t block_size, int64_t slots_ptr,
                     int64_t table_ptr, int64_t max_blocks, int64_t lens_ptr, int64_t norm_ptr, double norm_eps,
                     int64_t out_ptr) {
  const auto* plans = reinterpret_cast<const LayerPlan*>(plan_ptr);
  const auto* ids = reinterpret_cast<const int64_t*>(ids_ptr);
  const auto* kv_ptrs = reinterpret_cast<const int64_t*>(kv_ptrs_ptr);
  const auto* keys_ptrs = reinterpret_cast<const int64_t*>(keys_ptrs_ptr);  // or null: no layer has an indexer
  int64_t bad = 0;
  if (ids != nullptr)
    for (int64_t m = 0; m < M; ++m) bad += ids[m] < 0 || ids[m] >= V;
  if (bad) return -bad;
  const int64_t H = hidden;
  std::vector<uint16_t> x(M * H), residual(M * H), normed(M * H), gate_up, act;
  const auto at = [](std::vector<uint16_t>& b) { return int64_t(b.data()); };
  if (ids == nullptr)
    std::memcpy(x.data(), reinterpret_cast<const uint16_t*>(input_ptr), M * H * 2);
  else
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(&x[m * H], reinterpret_cast<const uint16_t*>(embed_ptr) + ids[m] * H, H * 2);
  for (int64_t l = 0; l < num_layers; ++l) {
    const LayerPlan& p = plans[l];
    bad = mla_attention(at(x), M, H, PLAN_WEIGHT(p, qa), p.qa_norm, p.q_lora, p.q_eps, PLAN_WEIGHT(p, qb),
                        PLAN_WEIGHT(p, kva), p.kva_norm, p.kv_eps, PLAN_WEIGHT(p, wuk), p.wuk_h, p.wuk_scale_h,
                        PLAN_WEIGHT(p, wuv), p.wuv_h, p.wuv_scale_h, PLAN_WEIGHT(p, o), cos_ptr, sin_ptr,
                        p.interleaved != 0, kv_ptrs[l], num_blocks, block_size,
                        slots_ptr, table_ptr, max_blocks, lens_ptr, at(normed), p.heads, p.nope, p.rope, p.latent, p.v,
                        p.scale, p.pre_norm, p.pre_eps, l == 0 ? 0 : at(residual), p.post_norm, p.post_eps,
                        at(residual), p.indexer, p.indexer != 0 ? keys_ptrs[l] : 0);
    if (bad) return bad;
    if (p.moe) {
      std::fill(x.begin(), x.end(), uint16_t(0));
      moe_block(at(normed), H, M, H, p.gate, p.ld_gate, p.bias, p.experts, p.softmax != 0, p.n_group, p.topk_group,
                p.top_k, p.norm_topk_prob != 0, p.routed_scaling_factor,
                experts_of(PLAN_WEIGHT(p, w13), p.w13_expert, p.w13_scale_expert, PLAN_WEIGHT(p, w2), p.w2_expert,
                           p.w2_scale_expert, p.inter, PLAN_WEIGHT(p, s13), PLAN_WEIGHT(p, s2), p.shared_inter),
                at(x), H);
    } else {
      const int64_t I = p.shared_inter;
      gate_up.resize(M * 2 * I), act.resize(M * I);
      linear_w(at(normed), H, weight_of(PLAN_WEIGHT(p, s13)), at(gate_up), 2 * I, M, 2 * I, H);
      swiglu_act(gate_up.data(), act.data(), M, I);
      linear_w(at(act), I, weight_of(PLAN_WEIGHT(p, s2)), at(x), H, M, H, I);
    }
  }

  rms_norm(at(x), H, at(residual), H, norm_ptr, out_ptr, H, at(residual), H, M, H, norm_eps);
  return 0;
}

}  // namespace
