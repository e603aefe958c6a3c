// DeepSeek-V4's kernels: its attention over a window and compressed entries with sinks
// (v4_attention), its compressors' gated pooling (compress_pool), and its manifold-constrained
// hyper-connections (mHC), a token's hc residual streams
// [hc, H] bf16 around one block (engine/models/deepseek_v4.py HyperConnection has the equations):
//   hc_pre:   the streams -> the block's input (their sigmoid-weighted sum), the weights that
//             spread the block's output over the streams (post) and the Sinkhorn-normalised
//             stream mixing (comb);
//   hc_merge: the streams after the block, post_j * out + sum_i comb[i, j] * X_i.
// In torch a token's mHC is ~50 small ops (the Sinkhorn's 20 row / column normalisations alone
// 80), ~0.8 ms per block on the bench-v4 model (2-core EPYC): here a few microseconds. The
// arithmetic is the reference's, in float32, in its order where it has one; sums of products run
// 16 lanes at a time then across them (the reference's own order is oneDNN's), so the block input
// and the new streams agree with the reference to a bf16 rounding.

#pragma once

#include "attention.h"

namespace {

// DeepSeek-V4 attention of T query tokens, each over its own rows of two caches viewed as rows of
// D elements: slots of the sliding window's cache (wslots [T, Kw]) and of the compressed entries'
// (eslots [T, Kc]; none for a sliding layer), -1 for none. A row is both key and value (K = V), H
// heads of D, and a learnt sink logit per head that takes part in the softmax without a value:
//   s[h, j] = bf16(bf16(q[h] . row_j) * scale)
//   p[h]    = bf16(softmax over (s[h, :], sink[h])), the sink's own term dropped
//   o[h]    = bf16(sum_j p[h, j] row_j)
// (mla_decode's roundings, attention.h). Work: a token and a range of its heads, as
// sparse_mla_decode's. Returns the slots out of range (0: all fine; the caller raises).
int64_t v4_attention(int64_t q_ptr, int64_t q_t, int64_t q_h, int64_t win_ptr, int64_t win_rows, int64_t ent_ptr,
                     int64_t ent_rows, int64_t ws_ptr, int64_t ws_t, int64_t Kw, int64_t es_ptr, int64_t es_t,
                     int64_t Kc, int64_t sinks_ptr, int64_t o_ptr, int64_t o_t, int64_t o_h, int64_t T, int64_t H,
                     int64_t D, double scale) {
  const auto* q = reinterpret_cast<const uint16_t*>(q_ptr);
  const auto* win = reinterpret_cast<const uint16_t*>(win_ptr);
  const auto* ent = reinterpret_cast<const uint16_t*>(ent_ptr);
  const auto* wslots = reinterpret_cast<const int64_t*>(ws_ptr);
  const auto* eslots = reinterpret_cast<const int64_t*>(es_ptr);
  const auto* sinks = reinterpret_cast<const float*>(sinks_ptr);
  auto* o = reinterpret_cast<uint16_t*>(o_ptr);
  std::atomic<int64_t> bad{0};
  const int64_t splits = std::min<int64_t>(H, std::max<int64_t>(1, (threads_now() + T - 1) / T));
  const int64_t per_split = (H + splits - 1) / splits;
  const int64_t reads = T * (Kw + Kc) * D * 2 * ((H + HEAD_GROUP - 1) / HEAD_GROUP);
  maybe_parallel(T * splits, 1, reads, [&](int64_t i0, int64_t i1) {
    AttendScratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / splits, h0 = (i % splits) * per_split, h1 = std::min(H, h0 + per_split);
      if (h0 >= h1) continue;
      scratch.zeros.assign(D, 0);
      std::vector<const uint16_t*>& rows = scratch.rows;
      rows.clear();
      const auto add = [&](const int64_t* slots, int64_t K, const uint16_t* cache, int64_t num_rows) {
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = slots[j];
          if (s < 0) continue;
          if (s >= num_rows) {
            if (h0 == 0) bad.fetch_add(1);
            continue;
          }
          rows.push_back(cache + s * D);
        }
      };
      add(wslots + t * ws_t, Kw, win, win_rows);
      if (Kc) add(eslots + t * es_t, Kc, ent, ent_rows);
      const int64_t len = int64_t(rows.size());
      rows.resize(len + AHEAD + 2, scratch.zeros.data());  // a pair's second row, the rows prefetched ahead
      attend_rows(q + t * q_t + h0 * q_h, q_h, rows.data(), len, o + t * o_t + h0 * o_h, o_h, h1 - h0, D, D,
                  float(scale), {}, scratch, sinks + h0);
    }
  }, ATTENTION_OMP_MIN_BYTES);
  return bad.load();
}

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// A compressor's gated pooling of E entries, each over its S slots (kv, gate [E, S, W] float32; an
// empty slot's gate is -inf), then its RMSNorm:
//   pooled[w] = sum_s softmax_s(gate[:, w]) kv[s, w];   out = weight * pooled / sqrt(mean(pooled^2) + eps)
// float32 throughout; 16 channels at a time, the softmax per channel over the slots (its max
// first, as torch's). Work: entries over the threads.
void compress_pool(int64_t kv_ptr, int64_t gate_ptr, int64_t w_ptr, int64_t out_ptr, int64_t E, int64_t S, int64_t W,
                   double eps) {
  const auto* kv = reinterpret_cast<const float*>(kv_ptr);
  const auto* gate = reinterpret_cast<const float*>(gate_ptr);
  const auto* weight = reinterpret_cast<const float*>(w_ptr);
  auto* out = reinterpret_cast<float*>(out_ptr);
  maybe_parallel(E, 1, E * S * W * 8, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const float* k = kv + e * S * W;
      const float* g = gate + e * S * W;
      float* o = out + e * W;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t w = 0; w < W; w += 16) {
        const __mmask16 mask = lanes16(W - w);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t s = 0; s < S; ++s) top = _mm512_max_ps(top, _mm512_maskz_loadu_ps(mask, g + s * W + w));
        __m512 num = _mm512_setzero_ps(), den = _mm512_setzero_ps();
        for (int64_t s = 0; s < S; ++s) {
          const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, g + s * W + w), top));
          den = _mm512_add_ps(den, p);
          num = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(mask, k + s * W + w), num);
        }
        const __m512 pooled = _mm512_maskz_mov_ps(mask, _mm512_div_ps(num, den));
        _mm512_mask_storeu_ps(o + w, mask, pooled);
        squares = _mm512_fmadd_ps(pooled, pooled, squares);
      }
      const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / float(W) + float(eps));
      for (int64_t w = 0; w < W; ++w) o[w] = weight[w] * (o[w] * r);
    }
  }, ROWS_OMP_MIN_BYTES);
}

// A dot product of two float32 rows of length n (n a multiple of 16 or not), 16 lanes at a time.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = lanes16(n - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + d), _mm512_maskz_loadu_ps(mask, b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// x [N, hc, H] bf16 (row n at x + n * ldx, the streams contiguous), fn [(2 + hc) hc, hc H],
// base [(2 + hc) hc], scale [3] float32 -> post [N, hc], comb [N, hc, hc] float32 and the block
// input u [N, H] bf16 (row n at u + n * ldu).
void hc_pre(int64_t x_ptr, int64_t ldx, int64_t fn_ptr, int64_t base_ptr, int64_t scale_ptr, int64_t post_ptr,
            int64_t comb_ptr, int64_t u_ptr, int64_t ldu, int64_t N, int64_t hc, int64_t H, int64_t iters,
            double eps, double norm_eps) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* fn = reinterpret_cast<const float*>(fn_ptr);
  const auto* base = reinterpret_cast<const float*>(base_ptr);
  const auto* scale = reinterpret_cast<const float*>(scale_ptr);
  auto* post = reinterpret_cast<float*>(post_ptr);
  auto* comb = reinterpret_cast<float*>(comb_ptr);
  auto* u = reinterpret_cast<uint16_t*>(u_ptr);
  const int64_t width = hc * H, K = (2 + hc) * hc;
  const float e = float(eps);
  maybe_parallel(N, 1, K * width * 4 + N * width * 2, [&](int64_t n0, int64_t n1) {
    std::vector<float> flat(width), mixes(K), pre(hc);
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* row = x + n * ldx;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < width; d += 16) {
        const __mmask16 mask = lanes16(width - d);
        const __m512 v = widen16(_mm256_maskz_loadu_epi16(mask, row + d));
        _mm512_mask_storeu_ps(&flat[d], mask, v);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / float(width) + float(norm_eps));
      for (int64_t d = 0; d < width; ++d) flat[d] *= r;
      for (int64_t k = 0; k < K; ++k) mixes[k] = dot_f32(flat.data(), fn + k * width, width);
      float* p = post + n * hc;
      float* c = comb + n * hc * hc;
      for (int64_t i = 0; i < hc; ++i) {
        pre[i] = sigmoidf(mixes[i] * scale[0] + base[i]) + e;
        p[i] = 2.0f * sigmoidf(mixes[hc + i] * scale[1] + base[hc + i]);
      }
      for (int64_t i = 0; i < hc; ++i) {  // softmax along each row, then + eps
        float* ci = c + i * hc;
        float m = -INFINITY;
        for (int64_t j = 0; j < hc; ++j) {
          ci[j] = mixes[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
          m = std::max(m, ci[j]);
        }
        float s = 0.0f;
        for (int64_t j = 0; j < hc; ++j) s += (ci[j] = std::exp(ci[j] - m));
        for (int64_t j = 0; j < hc; ++j) ci[j] = ci[j] / s + e;
      }
      const auto columns = [&] {
        for (int64_t j = 0; j < hc; ++j) {
          float s = 0.0f;
          for (int64_t i = 0; i < hc; ++i) s += c[i * hc + j];
          for (int64_t i = 0; i < hc; ++i) c[i * hc + j] /= s + e;
        }
      };
      columns();
      for (int64_t t = 1; t < iters; ++t) {
        for (int64_t i = 0; i < hc; ++i) {
          float s = 0.0f;
          for (int64_t j = 0; j < hc; ++j) s += c[i * hc + j];
          for (int64_t j = 0; j < hc; ++j) c[i * hc + j] /= s + e;
        }
        columns();
      }
      for (int64_t d = 0; d < H; d += 16) {  // u = sum_i pre_i x_i, in float32
        const __mmask16 mask = lanes16(H - d);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < hc; ++i)
          sum = _mm512_fmadd_ps(_mm512_set1_ps(pre[i]), widen16(_mm256_maskz_loadu_epi16(mask, row + i * H + d)), sum);
        _mm256_mask_storeu_epi16(u + n * ldu + d, mask, narrow16(sum));
      }
    }
  }, ROWS_OMP_MIN_BYTES);
}

// x [N, hc, H] bf16 (contiguous per token, row stride ldx), post [N, hc], comb [N, hc, hc] float32,
// out [N, H] bf16 (row stride ldo) -> y [N, hc, H] bf16 contiguous (may be x):
//   y_j = bf16(bf16(bf16(post_j) out) + bf16(sum_i bf16(comb[i, j]) x_i))   (the reference's roundings)
void hc_merge(int64_t x_ptr, int64_t ldx, int64_t post_ptr, int64_t comb_ptr, int64_t out_ptr, int64_t ldo,
              int64_t y_ptr, int64_t N, int64_t hc, int64_t H) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const auto* post = reinterpret_cast<const float*>(post_ptr);
  const auto* comb = reinterpret_cast<const float*>(comb_ptr);
  const auto* out = reinterpret_cast<const uint16_t*>(out_ptr);
  auto* y = reinterpret_cast<uint16_t*>(y_ptr);
  maybe_parallel(N, 1, N * hc * H * 4, [&](int64_t n0, int64_t n1) {
    std::vector<uint16_t> mixed(hc * H);  // y may be x: every x_i is read before any y_j is written
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* row = x + n * ldx;
      for (int64_t j = 0; j < hc; ++j) {
        const float pj = from_bf16(to_bf16(post[n * hc + j]));
        for (int64_t d = 0; d < H; d += 16) {
          const __mmask16 mask = lanes16(H - d);
          __m512 sum = _mm512_setzero_ps();
          for (int64_t i = 0; i < hc; ++i) {
            const float cij = from_bf16(to_bf16(comb[n * hc * hc + i * hc + j]));
            sum = _mm512_fmadd_ps(_mm512_set1_ps(cij), widen16(_mm256_maskz_loadu_epi16(mask, row + i * H + d)), sum);
          }
          const __m512 spread = widen16(narrow16(
              _mm512_mul_ps(_mm512_set1_ps(pj), widen16(_mm256_maskz_loadu_epi16(mask, out + n * ldo + d)))));
          _mm256_mask_storeu_epi16(&mixed[j * H + d], mask, narrow16(_mm512_add_ps(spread, widen16(narrow16(sum)))));
        }
      }
      std::memcpy(y + n * hc * H, mixed.data(), hc * H * sizeof(uint16_t));
    }
  }, ROWS_OMP_MIN_BYTES);
}

}  // namespace
