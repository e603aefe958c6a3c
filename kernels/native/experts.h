// The routed and shared experts of a few decode tokens (moe_pairs, moe_topk).

#pragma once

#include <memory>

#include "quantized.h"

namespace {

// dst[i] = bf16(src[i] * w) over n bf16s, 16 lanes at a time (RNE, as to_bf16).
inline void scale_bf16(const uint16_t* src, float w, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    const __m512 v = widen16(_mm256_maskz_loadu_epi16(m, src + i));
    _mm256_mask_storeu_epi16(dst + i, m, narrow16(_mm512_mul_ps(v, _mm512_set1_ps(w))));
  }
}

// acc[i] = bf16(acc[i] + x[i]) over n bf16s, 16 lanes at a time (RNE, as to_bf16).
inline void add_bf16(uint16_t* acc, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    const __m512 a = widen16(_mm256_maskz_loadu_epi16(m, acc + i)), b = widen16(_mm256_maskz_loadu_epi16(m, x + i));
    const __m512 sum = _mm512_add_ps(a, b);
    _mm256_mask_storeu_epi16(acc + i, m, narrow16(sum));
  }
}

// SwiGLU's activation of m rows of gate_up [m, 2I] (gate columns, then up) into act [m, I], in
// the torch loop's roundings: act = bf16(bf16(silu(gate)) * up).
inline void swiglu_act(const uint16_t* gate_up, uint16_t* act, int64_t m, int64_t inter) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < inter; j += 16) {  // 16 lanes: exp16, and RNE bf16 roundings as to_bf16
      const __mmask16 mask = lanes16(inter - j);
      const __m512 g = widen16(_mm256_maskz_loadu_epi16(mask, gate_up + i * 2 * inter + j));
      const __m512 up = widen16(_mm256_maskz_loadu_epi16(mask, gate_up + i * 2 * inter + inter + j));
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = widen16(narrow16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e))));
      _mm256_mask_storeu_epi16(act + i * inter + j, mask, narrow16(_mm512_mul_ps(silu, up)));
    }
}


// A layer's experts as the kernels take them: the routed ones' w13 [E, 2I, H] and w2 [E, H, I]
// (expert e's at e times its strides, in data units and in scales), and the shared expert's
// (s13 [2Is, H], s2 [H, Is]; data null when there is none), each bf16 or kept quantized.
struct Experts {
  QW w13, w2;
  int64_t w13_expert = 0, w13_scale_expert = 0, w2_expert = 0, w2_scale_expert = 0, I = 0;
  QW s13, s2;
  int64_t Is = 0;

  QW gate_up(int64_t e) const { return e < 0 ? s13 : w13.offset(e * w13_expert, e * w13_scale_expert); }
  QW down(int64_t e) const { return e < 0 ? s2 : w2.offset(e * w2_expert, e * w2_scale_expert); }
  int64_t inter(int64_t e) const { return e < 0 ? Is : I; }
  bool has_shared() const { return s13.data != nullptr; }
};

// bf16 experts from their pointers and strides (the bf16 entry points' arguments).
inline Experts bf16_experts(int64_t w13_ptr, int64_t w13_expert, int64_t ld13, int64_t w2_ptr, int64_t w2_expert,
                            int64_t ld2, int64_t I, int64_t s13_ptr, int64_t ld_s13, int64_t s2_ptr, int64_t ld_s2,
                            int64_t Is) {
  Experts x;
  x.w13 = bf16_weight(reinterpret_cast<const void*>(w13_ptr), ld13);
  x.w2 = bf16_weight(reinterpret_cast<const void*>(w2_ptr), ld2);
  x.w13_expert = w13_expert, x.w2_expert = w2_expert, x.I = I;
  if (s13_ptr != 0) {
    x.s13 = bf16_weight(reinterpret_cast<const void*>(s13_ptr), ld_s13);
    x.s2 = bf16_weight(reinterpret_cast<const void*>(s2_ptr), ld_s2);
    x.Is = Is;
  }
  return x;
}

// The experts of a few decode tokens, given as (expert, token, weight) pairs grouped by expert
// (kernels/moe.py _fused_moe_few passes them in ascending expert order, then the shared expert's),
// with the torch loop's arithmetic and roundings:
//   gate_up = bf16(x[t] @ w13[e]^T)                       [2I]
//   act     = bf16(bf16(silu(gate)) * up)                  [I]
//   out[t]  = bf16(out[t] + bf16(bf16(act @ w2[e]^T) * weight))
// Expert -1 is the shared expert (weight 1, added after a token's routed experts, as `out +
// shared(x)` rounds). An expert's pairs (a run of equal experts) are one product of their rows,
// so its weights are read once. Experts are shared over the threads whole (one thread streams an
// expert's weights end to end: 35 GB/s on two threads at batch 1, where splitting every expert's
// products by columns, in two rounds, reached 25); each pair's scaled output lands in its own
// row, and the additions into out then run in pair order on one thread, so the sums round
// exactly as the loop's.
void run_pairs(const uint16_t* x, int64_t ldx, const Experts& ex, uint16_t* out, int64_t ldo,
               const std::vector<int64_t>& experts, const std::vector<int64_t>& tokens,
               const std::vector<float>& weights, int64_t H) {
  const int64_t P = int64_t(experts.size());
  std::vector<int64_t> runs;  // [runs[r], runs[r + 1]): the pairs of one expert
  for (int64_t p = 0; p < P; ++p)
    if (p == 0 || experts[p] != experts[p - 1]) runs.push_back(p);
  runs.push_back(P);
  const int64_t R = int64_t(runs.size()) - 1;
  std::unique_ptr<uint16_t[]> scaled(new uint16_t[P * H]);  // [P, H]: bf16(bf16(down) * weight), every row written
  maybe_parallel(R, 1, R * 3 * ex.I * ex.w13.row_bytes(H), [&](int64_t r0, int64_t r1) {
    std::vector<uint16_t> xs, gate_up, act, down;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t p0 = runs[r], m = runs[r + 1] - p0, e = experts[p0], inter = ex.inter(e);
      xs.resize(m * H), gate_up.resize(m * 2 * inter), act.resize(m * inter), down.resize(m * H);
      for (int64_t i = 0; i < m; ++i) std::memcpy(&xs[i * H], x + tokens[p0 + i] * ldx, H * 2);
      product(xs.data(), H, ex.gate_up(e), gate_up.data(), 2 * inter, m, H, 0, 2 * inter);
      swiglu_act(gate_up.data(), act.data(), m, inter);
      product(act.data(), inter, ex.down(e), down.data(), H, m, inter, 0, H);
      for (int64_t i = 0; i < m; ++i) scale_bf16(&down[i * H], weights[p0 + i], &scaled[(p0 + i) * H], H);
    }
  });
  // The additions into out, in pair order for every column (so the sums round as the loop's),
  // the columns shared over the threads.
  const int64_t cols = 64;
  maybe_parallel((H + cols - 1) / cols, 1, P * H * 4, [&](int64_t c0, int64_t c1) {
    const int64_t h0 = c0 * cols, n = std::min(H, c1 * cols) - h0;
    for (int64_t p = 0; p < P; ++p) add_bf16(out + tokens[p] * ldo + h0, &scaled[p * H + h0], n);
  });
}

// The experts of T tokens from their top-k ids [T, K] (-1: an expert on another rank) and weights
// [T, K]: run_pairs over their pairs grouped by expert in ascending order, an expert's pairs in
// (token, k) order (kernels/moe.py _fused_moe_few's order), then the shared expert's when there is
// one. Returns the count of ids >= E (0: fine; the caller raises).
int64_t run_topk(const uint16_t* x, int64_t ldx, const Experts& ex, uint16_t* out, int64_t ldo, const int64_t* ids,
                 const float* topk_weights, int64_t T, int64_t K, int64_t E, int64_t H) {
  std::vector<int64_t> pairs;  // flat (token, k) indices of the local experts' pairs
  int64_t bad = 0;
  for (int64_t p = 0; p < T * K; ++p) {
    if (ids[p] >= E) ++bad;
    if (ids[p] >= 0) pairs.push_back(p);
  }
  if (bad != 0) return bad;
  std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<int64_t> experts, tokens;
  std::vector<float> weights;
  for (const int64_t p : pairs) experts.push_back(ids[p]), tokens.push_back(p / K), weights.push_back(topk_weights[p]);
  if (ex.has_shared())
    for (int64_t t = 0; t < T; ++t) experts.push_back(-1), tokens.push_back(t), weights.push_back(1.0f);
  run_pairs(x, ldx, ex, out, ldo, experts, tokens, weights, H);
  return 0;
}

// run_pairs with bf16 experts, from Python (kernels/native/blocks.py moe_pairs).
void moe_pairs(int64_t x_ptr, int64_t ldx, int64_t w13_ptr, int64_t w13_expert, int64_t ld13, int64_t w2_ptr,
               int64_t w2_expert, int64_t ld2, int64_t out_ptr, int64_t ldo, const std::vector<int64_t>& experts,
               const std::vector<int64_t>& tokens, const std::vector<float>& weights, int64_t H, int64_t I,
               int64_t s13_ptr, int64_t ld_s13, int64_t s2_ptr, int64_t ld_s2, int64_t Is) {
  run_pairs(reinterpret_cast<const uint16_t*>(x_ptr), ldx,
            bf16_experts(w13_ptr, w13_expert, ld13, w2_ptr, w2_expert, ld2, I, s13_ptr, ld_s13, s2_ptr, ld_s2, Is),
            reinterpret_cast<uint16_t*>(out_ptr), ldo, experts, tokens, weights, H);
}

// Experts in any format from Python's arguments: w13 and w2 with their per-expert (data, scale)
// strides; the shared expert's with s13's data 0 for none.
inline Experts experts_of(const WeightArgs& w13, int64_t w13_expert, int64_t w13_scale_expert, const WeightArgs& w2,
                          int64_t w2_expert, int64_t w2_scale_expert, int64_t I, const WeightArgs& s13,
                          const WeightArgs& s2, int64_t Is) {
  Experts ex;
  ex.w13 = weight_of(w13), ex.w2 = weight_of(w2);
  ex.w13_expert = w13_expert, ex.w13_scale_expert = w13_scale_expert;
  ex.w2_expert = w2_expert, ex.w2_scale_expert = w2_scale_expert, ex.I = I;
  if (std::get<0>(s13) != 0) ex.s13 = weight_of(s13), ex.s2 = weight_of(s2), ex.Is = Is;
  return ex;
}

// run_topk with experts in any format (experts_of), from Python (kernels/native/blocks.py moe_topk).
int64_t moe_topk(int64_t x_ptr, int64_t ldx, const WeightArgs& w13, int64_t w13_expert, int64_t w13_scale_expert,
                   const WeightArgs& w2, int64_t w2_expert, int64_t w2_scale_expert, int64_t out_ptr, int64_t ldo,
                   int64_t ids_ptr, int64_t weights_ptr, int64_t T, int64_t K, int64_t E, int64_t H, int64_t I,
                   const WeightArgs& s13, const WeightArgs& s2, int64_t Is) {
  const Experts ex = experts_of(w13, w13_expert, w13_scale_expert, w2, w2_expert, w2_scale_expert, I, s13, s2, Is);
  return run_topk(reinterpret_cast<const uint16_t*>(x_ptr), ldx, ex, reinterpret_cast<uint16_t*>(out_ptr), ldo,
                  reinterpret_cast<const int64_t*>(ids_ptr), reinterpret_cast<const float*>(weights_ptr), T, K, E,
                  H);
}

}  // namespace
