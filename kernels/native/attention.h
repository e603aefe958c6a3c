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
// there are fewer sequences than threads); each cache row is loaded once per HEAD_GROUP heads for
// the scores and once for all the item's heads for the output, whose float32 sums stay in L1.
constexpr int64_t HEAD_GROUP = 8;

// Scores s[0, len) -> their softmax rounded to bf16 (float32 inside), in place; 0 where every
// score is -inf (all rows refused). The sum runs in 16 lanes (exp16), then across them.
inline void softmax_rounded(float* s, int64_t len) {
  __m512 tops = _mm512_set1_ps(-INFINITY);  // the maximum in lanes (exact in any order)
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(s + i));
  float top = _mm512_reduce_max_ps(tops);
  for (; i < len; ++i) top = std::max(top, s[i]);
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
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sums));  // >= 1: the top's own term
  for (int64_t j = 0; j < len; j += 16) {  // bf16(e / total), widened back
    const __m512 p = _mm512_div_ps(_mm512_maskz_loadu_ps(mask(j), s + j), total);
    _mm512_mask_storeu_ps(s + j, mask(j), widen16(narrow16(p)));
  }
}

// A thread's buffers for the attention of its sequences, reused from one to the next.
struct AttendScratch {
  std::vector<float> s, acc;     // scores [heads, len], float32 output sums [heads, L]
  std::vector<uint32_t> pairs;   // q in pairs (amx_attend)
  std::vector<uint16_t> probs;   // bf16 probabilities, 16 rows of whole 32-row steps (amx_attend)
};

void attend(const uint16_t* q, int64_t q_h, const uint16_t* kv, int64_t kv_block, int64_t kv_row,
            int64_t num_blocks, int64_t block_size, const int32_t* table, int64_t len, uint16_t* o, int64_t o_h,
            int64_t heads, int64_t W, int64_t L, float scale, AttendScratch& scratch, std::atomic<int64_t>& bad) {
  std::vector<float>&s = scratch.s, &acc = scratch.acc;
  s.assign(heads * len, 0.0f);  // [heads, len]
  acc.assign(heads * L, 0.0f);  // [heads, L]
  auto row_of = [&](int64_t j) -> const uint16_t* {
    const int32_t block = table[j / block_size];
    if (block < 0 || block >= num_blocks) return nullptr;
    return kv + block * kv_block + (j % block_size) * kv_row;
  };
  for (int64_t h0 = 0; h0 < heads; h0 += HEAD_GROUP) {
    const int64_t group = std::min(HEAD_GROUP, heads - h0);
    for (int64_t j = 0; j < len; ++j) {
      const uint16_t* row = row_of(j);
      if (row == nullptr) {
        bad.fetch_add(1);
        for (int64_t g = 0; g < group; ++g) s[(h0 + g) * len + j] = -INFINITY;
        continue;
      }
      __m512 dot[HEAD_GROUP];
      for (int64_t g = 0; g < group; ++g) dot[g] = _mm512_setzero_ps();
      for (int64_t k = 0; k < W; k += 32) {
        const __mmask32 mask = lanes(W - k);
        const __m512bh kv_k = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
        for (int64_t g = 0; g < group; ++g)
          dot[g] = _mm512_dpbf16_ps(dot[g], kv_k, (__m512bh)_mm512_maskz_loadu_epi16(mask, q + (h0 + g) * q_h + k));
      }
      for (int64_t g = 0; g < group; ++g)
        s[(h0 + g) * len + j] = from_bf16(to_bf16(from_bf16(to_bf16(_mm512_reduce_add_ps(dot[g]))) * scale));
    }
  }
  for (int64_t h = 0; h < heads; ++h) softmax_rounded(&s[h * len], len);
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* row = row_of(j);
    if (row == nullptr) continue;
    int64_t l = 0;
    for (; l + 16 <= L; l += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + l)));
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      for (int64_t h = 0; h < heads; ++h) {
        float* a = &acc[h * L + l];
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(s[h * len + j]), v, _mm512_loadu_ps(a)));
      }
    }
    for (; l < L; ++l)
      for (int64_t h = 0; h < heads; ++h) acc[h * L + l] += s[h * len + j] * from_bf16(row[l]);
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t l = 0; l < L; ++l) o[h * o_h + l] = to_bf16(acc[h * L + l]);
}

// The same attention on the tile unit (amx_attend_takes: AMX granted, whole 16-row tiles in a
// block, W a multiple of 32 and L of 64), with the same roundings; only the float32 sums go in
// another order. Per group of up to 16 heads:
// - scores, C[j, h] = sum_k cache[j, k] q[h, k]: 16 cache rows of a block are the A operand as
//   they lie (a row stride apart), q the B operand in pairs (VNNI);
// - output, C[h, l] = sum_j p[h, j] cache[j, l]: the bf16 probabilities are the A operand, and
//   each 32 cache rows are paired into the B operand's layout, 64 columns (4 C tiles) at a time.
// Rows past len (a block's unwritten end, or refused) give scores that are never read and pair
// as zeros, so nothing they hold reaches the output.
inline bool amx_attend_takes(int64_t block_size, int64_t W, int64_t L) {
  return g_amx && block_size % 16 == 0 && W % AMX_K == 0 && L % 64 == 0;
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_attend(
    const uint16_t* q, int64_t q_h, const uint16_t* kv, int64_t kv_block, int64_t kv_row, int64_t num_blocks,
    int64_t block_size, const int32_t* table, int64_t len, uint16_t* o, int64_t o_h, int64_t heads, int64_t W,
    int64_t L, float scale, AttendScratch& scratch, std::atomic<int64_t>& bad) {
  auto row_of = [&](int64_t j) -> const uint16_t* {
    const int32_t block = table[j / block_size];
    if (block < 0 || block >= num_blocks) return nullptr;
    return kv + block * kv_block + (j % block_size) * kv_row;
  };
  const int64_t padded = (len + 31) / 32 * 32;  // a row of probabilities: whole A operands of 32
  alignas(64) float c[16 * 16];
  alignas(64) uint32_t vp[4 * 16 * 16];  // 32 cache rows x 64 columns in pairs: 4 B operands
  __m512i pair_up;                       // (row a, row b) halves -> (a[0], b[0], a[1], b[1], ...)
  {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 16; ++i) idx[2 * i] = uint16_t(i), idx[2 * i + 1] = uint16_t(16 + i);
    pair_up = _mm512_load_si512(idx);
  }
  amx_configure();
  for (int64_t h0 = 0; h0 < heads; h0 += 16) {
    const int64_t group = std::min<int64_t>(16, heads - h0);
    std::vector<uint32_t>& qp = scratch.pairs;  // q[h0 + g] as qp[k / 2][g][2], heads past group zero
    qp.assign((W / 2) * 16, 0u);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < W / 2; ++i) std::memcpy(&qp[i * 16 + g], q + (h0 + g) * q_h + 2 * i, 4);
    std::vector<float>& s = scratch.s;  // [group, len]
    s.resize(group * len);
    // Four blocks of 16 rows at a time, each into its own C tile: their chains of products are
    // independent, so the tile unit overlaps them instead of waiting on each product's result
    // (each score still sums over k in the same order, so the bits are those of one at a time).
    auto scores_of = [&](int64_t j0, int64_t rows) {  // c[t * 16 + g] -> s[g][j0 + t]
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t g = 0; g < group; ++g)
          s[g * len + j0 + t] = from_bf16(to_bf16(from_bf16(to_bf16(c[t * 16 + g])) * scale));
    };
    constexpr int64_t SPAN = 64;  // rows: four blocks of 16
    for (int64_t j0 = 0; j0 < len; j0 += SPAN) {
      const uint16_t* rows_of[4] = {nullptr, nullptr, nullptr, nullptr};
      int64_t valid = 0;
      for (int64_t q4 = 0; q4 < 4; ++q4) {
        const int64_t j = j0 + 16 * q4;
        if (j >= len) break;
        const int64_t rows = std::min<int64_t>(16, len - j);
        rows_of[q4] = row_of(j);  // its 16 rows lie in one block (block_size % 16 == 0)
        if (rows_of[q4] == nullptr) {
          if (h0 == 0) bad.fetch_add(rows);
          for (int64_t g = 0; g < group; ++g) std::fill_n(&s[g * len + j], rows, -INFINITY);
        } else {
          ++valid;
        }
      }
      const auto rows_at = [&](int64_t q4) { return std::min<int64_t>(16, len - j0 - 16 * q4); };
      if (valid == 4) {
        const uint16_t *a0 = rows_of[0], *a1 = rows_of[1], *a2 = rows_of[2], *a3 = rows_of[3];
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < W; k += AMX_K) {
          _tile_loadd(6, qp.data() + (k / 2) * 16, 64);
          _tile_loadd(4, a0 + k, kv_row * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, a1 + k, kv_row * 2);
          _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(7, a2 + k, kv_row * 2);
          _tile_dpbf16ps(2, 7, 6);
          _tile_loadd(4, a3 + k, kv_row * 2);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, c, 64);
        scores_of(j0, 16);
        _tile_stored(1, c, 64);
        scores_of(j0 + 16, 16);
        _tile_stored(2, c, 64);
        scores_of(j0 + 32, 16);
        _tile_stored(3, c, 64);
        scores_of(j0 + 48, rows_at(3));
        continue;
      }
      for (int64_t q4 = 0; q4 < 4; ++q4) {  // the sequence's last blocks, or around a refused one
        const uint16_t* row = rows_of[q4];
        if (row == nullptr) continue;
        _tile_zero(0);
        for (int64_t k = 0; k < W; k += AMX_K) {
          _tile_loadd(4, row + k, kv_row * 2);
          _tile_loadd(6, qp.data() + (k / 2) * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, c, 64);
        scores_of(j0 + 16 * q4, rows_at(q4));
      }
    }
    std::vector<uint16_t>& p = scratch.probs;  // [16, padded] bf16, zero past len and past group
    p.assign(16 * padded, 0);
    for (int64_t g = 0; g < group; ++g) {
      softmax_rounded(&s[g * len], len);
      for (int64_t j = 0; j < len; ++j) p[g * padded + j] = to_bf16(s[g * len + j]);  // exact: already bf16
    }
    for (int64_t l0 = 0; l0 < L; l0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j0 = 0; j0 < len; j0 += 32) {
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t j = j0 + 2 * r;
          const uint16_t* a = j < len ? row_of(j) : nullptr;
          const uint16_t* b = j + 1 < len ? row_of(j + 1) : nullptr;
          for (int64_t i = 0; i < 4; ++i) {
            const __m256i va = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + l0 + 16 * i))
                                 : _mm256_setzero_si256();
            const __m256i vb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + l0 + 16 * i))
                                 : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1);
            _mm512_store_si512(vp + (i * 16 + r) * 16, _mm512_permutexvar_epi16(pair_up, both));
          }
        }
        _tile_loadd(4, p.data() + j0, padded * 2);
        _tile_loadd(6, vp, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, vp + 256, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, vp + 512, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, vp + 768, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      for (int t = 0; t < 4; ++t) {  // C tile t: c[g * 16 + l'] -> o[h0 + g][l0 + 16 t + l']
        switch (t) {
          case 0: _tile_stored(0, c, 64); break;
          case 1: _tile_stored(1, c, 64); break;
          case 2: _tile_stored(2, c, 64); break;
          default: _tile_stored(3, c, 64); break;
        }
        for (int64_t g = 0; g < group; ++g)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (h0 + g) * o_h + l0 + 16 * t),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + g * 16)));
      }
    }
  }
}

// Returns the number of block ids outside [0, num_blocks) met (0: all fine; the caller raises).
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
  // Split heads only when there are fewer sequences than threads (a batch-1 decode).
  const int64_t splits = std::min<int64_t>(H, std::max<int64_t>(1, (threads_now() + B - 1) / B));
  const int64_t per_split = (H + splits - 1) / splits;
  std::atomic<int64_t> bad{0};
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
      (tiles ? amx_attend : attend)(q + b * q_b + h0 * q_h, q_h, kv, kv_block, kv_row, num_blocks, block_size,
                                    table + b * table_b, len, o + b * o_b + h0 * o_h, o_h, h1 - h0, W, L,
                                    float(scale), scratch, bad);
    }
  }, tiles ? TILE_ATTENTION_OMP_MIN_BYTES : OMP_MIN_BYTES);
  return bad.load();
}

}  // namespace
