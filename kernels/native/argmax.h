// Each row's argmax over bf16 values (argmax_bf16): greedy sampling straight from the LM head's
// bf16 logits, without widening [M, V] to float32 first (at 256 rows of a 32k vocabulary the
// widening and torch's one-thread max took ~10 ms of a 110 ms decode step).
//
// torch.max(dim=-1)'s answer, which a greedy step has always taken: the first index of the largest
// value, a NaN counting as larger than anything (the first NaN's index). bf16 -> float32 is exact,
// so comparing the floats compares the logits as they are.

#pragma once

#include "common.h"

namespace {

// Row x[0, V) -> its argmax, as above.
inline int64_t argmax_row(const uint16_t* x, int64_t V) {
  // Lane j of `best` holds the largest value among x[j], x[j + 16], ... seen so far, and `where`
  // the first index it came from (a later equal value never replaces it).
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i where = _mm512_set1_epi32(-1);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t i = 0; i < V; i += 16) {
    const int64_t left = V - i;
    const __mmask16 valid = lanes16(left);
    const __m256i raw = _mm256_maskz_loadu_epi16(valid, x + i);
    const __m512 v = widen16(raw);
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
    if (nan != 0) return i + __builtin_ctz(nan);  // the first NaN: nothing after it can win
    const __mmask16 larger = _mm512_mask_cmp_ps_mask(valid, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, larger, v);
    where = _mm512_mask_mov_epi32(where, larger, index);
    index = _mm512_add_epi32(index, step);
  }
  const float top = _mm512_reduce_max_ps(best);
  // The first index among the lanes that hold the top value (-inf everywhere: index 0, as torch).
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const __m512i candidates = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), at_top, where);
  const int32_t first = _mm512_reduce_min_epi32(candidates);
  return first < 0 ? 0 : first;
}

// out[r] = argmax of row r of x [R, V] (row stride ldx); rows shared over the threads.
void argmax_bf16(int64_t x_ptr, int64_t ldx, int64_t R, int64_t V, int64_t out_ptr) {
  const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
  auto* out = reinterpret_cast<int64_t*>(out_ptr);
  maybe_parallel(R, 1, R * V * 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x + r * ldx, V);
  });
}

}  // namespace
