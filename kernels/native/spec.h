// A greedy speculative decode step with MTP drafts in one call (greedy_spec_step): the target's
// verification of every request's drafts, the acceptance, and the MTP layer's passes that write
// its cache rows and draft the next step's tokens. It runs what engine/runner.py (verify_greedy)
// and engine/spec_decode/drafter.py (draft_with_mtp) run for such a step, through the same
// functions, so the bits are theirs (where their products are native: up to max_rows() rows);
// what it saves is their Python between the native calls (~0.2 ms a step at batch 1 on the 2-core
// EPYC), which cost a step with drafts twice what it cost a plain decode step and ate the drafts'
// gain on a small model.

#pragma once

#include "layer.h"
#include "argmax.h"

namespace {

// The LM head's greedy tokens of M rows of hidden states h [M, H] (contiguous): argmax over the
// first `vocab` of the head's lm_rows logits, as the model's greedy_tokens takes them (the whole
// product, then the argmax of the vocabulary's columns).
void greedy_rows(const uint16_t* h, int64_t M, int64_t H, int64_t lm_ptr, int64_t lm_rows, int64_t vocab,
                 int64_t* out) {
  std::vector<uint16_t> logits(M * lm_rows);
  linear_bf16(int64_t(h), 0, H, lm_ptr, 0, H, int64_t(logits.data()), 0, lm_rows, 1, M, lm_rows, H);
  argmax_bf16(int64_t(logits.data()), lm_rows, M, vocab, int64_t(out));
}

// The rows one MTP pass runs: each row's next token, its input hidden state and what its
// attention takes (cos/sin, slot, block table, length), gathered from the step's rows.
struct MtpRows {
  int64_t half, width, H;
  std::vector<int64_t> ids, slots;
  std::vector<uint16_t> h;
  std::vector<float> cos, sin;
  std::vector<int32_t> table, lens;

  MtpRows(int64_t half, int64_t width, int64_t H) : half(half), width(width), H(H) {}
  int64_t size() const { return int64_t(ids.size()); }
  void clear() { ids.clear(), slots.clear(), h.clear(), cos.clear(), sin.clear(), table.clear(), lens.clear(); }
  void add(int64_t id, const uint16_t* hidden, const float* c, const float* s, int64_t slot, const int32_t* tab,
           int32_t len) {
    ids.push_back(id), slots.push_back(slot), lens.push_back(len);
    h.insert(h.end(), hidden, hidden + H);
    cos.insert(cos.end(), c, c + half), sin.insert(sin.end(), s, s + half);
    table.insert(table.end(), tab, tab + width);
  }
};

// Per request r (R of them, each S = 1 + k rows of the batch in order: its last known token, then
// its k drafts, at positions [M]): the target stack over the M = R * S rows as decode_stack runs
// it (cos/sin from the rope tables [P, half] at each position), each row's greedy token into
// tokens [M], the drafts accepted (the longest prefix of its drafts equal to the target's tokens
// before them) into accepted [R]. Its emitted tokens are then tokens[r*S .. r*S+a].
// Then the MTP layer (its own plan, cache, final norm; the input from the norms and eh_proj as
// mtp_input) over each request's known rows r*S .. r*S+a, each with its next token. A request
// drafts room = min(K, caps[r] - (a + 1)) tokens (caps: engine/spec_decode/drafter.py's
// draft_cap, what max_tokens and the model length leave). Its rows other than the newest (all of
// them where room is 0) only get their MTP cache rows (the layer's norm, then store_latents:
// MTPLayer.store_kv), written first; its newest row runs the whole layer and drafts the first
// token. Each further draft runs the layer reused one position on (the previous draft, the
// previous output g), its slot from its own block table. A draft is the argmax of the first
// draft_vocab of the draft head's logits (its weights [draft_rows, H]: the LM head, or a draft
// vocabulary's rows of it), the row mapped to its token through draft_ids [draft_vocab] where they
// are given (0: the row is the token). drafts [R, K] gets them, -1 past room.
// -> 0; the count of block ids and slots outside the cache (nothing after it ran), or of positions
// past the rope tables (nothing ran) or the block table (a draft's: the passes before it ran); or
// minus the count of ids outside [0, V) (nothing ran). With indexers (DeepSeek-V3.2), keys_ptrs
// [layers] and mtp_keys_ptrs [1] name the layers' and the MTP layer's indexer-key caches
// (decode_stack's keys_ptrs; 0 without), and the rows that only store MTP cache rows store the MTP
// layer's indexer keys too (SparseMLAttention.store_cache).
int64_t greedy_spec_step(int64_t plan_ptr, int64_t num_layers, int64_t ids_ptr, int64_t embed_ptr, int64_t V,
                         int64_t M, int64_t H, int64_t kv_ptrs_ptr, int64_t keys_ptrs_ptr, int64_t mtp_keys_ptrs_ptr,
                         int64_t num_blocks, int64_t block_size,
                         int64_t slots_ptr, int64_t table_ptr, int64_t max_blocks, int64_t lens_ptr, int64_t norm_ptr,
                         double norm_eps, int64_t lm_ptr, int64_t lm_rows, int64_t vocab, int64_t mtp_plan_ptr,
                         int64_t mtp_kv_ptrs_ptr, int64_t mtp_norm_ptr, double mtp_norm_eps, int64_t enorm_ptr,
                         double e_eps, int64_t hnorm_ptr, double h_eps, int64_t eh_ptr, int64_t rope_cos_ptr,
                         int64_t rope_sin_ptr, int64_t num_positions, int64_t half, int64_t R, int64_t S,
                         int64_t positions_ptr, int64_t caps_ptr, int64_t K, int64_t draft_ptr, int64_t draft_rows,
                         int64_t draft_vocab, int64_t draft_ids_ptr, int64_t tokens_ptr, int64_t accepted_ptr, int64_t drafts_ptr) {
  const auto* ids = reinterpret_cast<const int64_t*>(ids_ptr);
  const auto* positions = reinterpret_cast<const int64_t*>(positions_ptr);
  const auto* caps = reinterpret_cast<const int64_t*>(caps_ptr);
  const auto* rope_cos = reinterpret_cast<const float*>(rope_cos_ptr);
  const auto* rope_sin = reinterpret_cast<const float*>(rope_sin_ptr);
  const auto* slots = reinterpret_cast<const int64_t*>(slots_ptr);
  const auto* table = reinterpret_cast<const int32_t*>(table_ptr);
  const auto* lens = reinterpret_cast<const int32_t*>(lens_ptr);
  const auto* mtp_plan = reinterpret_cast<const LayerPlan*>(mtp_plan_ptr);
  const auto* draft_ids = reinterpret_cast<const int64_t*>(draft_ids_ptr);
  auto* tokens = reinterpret_cast<int64_t*>(tokens_ptr);
  auto* accepted = reinterpret_cast<int64_t*>(accepted_ptr);
  auto* drafts = reinterpret_cast<int64_t*>(drafts_ptr);
  std::fill(drafts, drafts + R * K, int64_t(-1));

  int64_t bad = 0;
  for (int64_t t = 0; t < M; ++t) bad += positions[t] < 0 || positions[t] >= num_positions;
  if (bad) return bad;
  std::vector<float> cos(M * half), sin(M * half);
  for (int64_t t = 0; t < M; ++t) {
    std::memcpy(&cos[t * half], rope_cos + positions[t] * half, half * 4);
    std::memcpy(&sin[t * half], rope_sin + positions[t] * half, half * 4);
  }
  std::vector<uint16_t> hidden(M * H);
  bad = decode_stack(plan_ptr, num_layers, ids_ptr, 0, embed_ptr, V, M, H, int64_t(cos.data()), int64_t(sin.data()),
                     kv_ptrs_ptr, keys_ptrs_ptr, num_blocks, block_size, slots_ptr, table_ptr, max_blocks, lens_ptr, norm_ptr,
                     norm_eps, int64_t(hidden.data()));
  if (bad) return bad;
  greedy_rows(hidden.data(), M, H, lm_ptr, lm_rows, vocab, tokens);

  // The known rows: those that only store their MTP cache rows, and the newest of each drafting
  // request, which run the whole layer.
  std::vector<int64_t> room(R);
  MtpRows stored(half, max_blocks, H), rows(half, max_blocks, H);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t first = r * S;
    int64_t a = 0;
    while (a < S - 1 && ids[first + 1 + a] == tokens[first + a]) ++a;
    accepted[r] = a;
    room[r] = std::min(K, caps[r] - (a + 1));
    for (int64_t t = first; t <= first + a; ++t)
      (t == first + a && room[r] > 0 ? rows : stored)
          .add(tokens[t], &hidden[t * H], &cos[t * half], &sin[t * half], slots[t], table + t * max_blocks, lens[t]);
  }
  const int64_t mtp_kv = reinterpret_cast<const int64_t*>(mtp_kv_ptrs_ptr)[0];
  std::vector<uint16_t> u, g, normed;
  const int64_t n_stored = stored.size();
  if (n_stored > 0) {
    const LayerPlan& p = mtp_plan[0];
    u.resize(n_stored * H), normed.resize(n_stored * H);
    mtp_input(int64_t(stored.ids.data()), embed_ptr, H, V, int64_t(stored.h.data()), H, enorm_ptr, e_eps, hnorm_ptr,
              h_eps, eh_ptr, int64_t(u.data()), n_stored, H);  // the target's tokens: in [0, vocab)
    rms_norm(int64_t(u.data()), H, 0, 0, p.pre_norm, int64_t(normed.data()), H, 0, H, n_stored, H, p.pre_eps);
    bad = store_latents(int64_t(normed.data()), n_stored, H, weight_of(PLAN_WEIGHT(p, kva)), p.kva_norm, p.kv_eps,
                        int64_t(stored.cos.data()),
                        int64_t(stored.sin.data()), p.interleaved != 0, mtp_kv, num_blocks, block_size,
                        int64_t(stored.slots.data()), p.rope, p.latent);
    if (bad) return bad;
    if (p.indexer != 0)
      store_indexer_keys(*reinterpret_cast<const IndexerPlan*>(p.indexer), int64_t(normed.data()), H, n_stored,
                         int64_t(stored.cos.data()), int64_t(stored.sin.data()),
                         reinterpret_cast<const int64_t*>(mtp_keys_ptrs_ptr)[0], num_blocks, block_size,
                         stored.slots.data());
  }

  // Pass j drafts token j of every request with room > j, one row each; g [rows, H] its output.
  std::vector<int64_t> drafting, drafted;
  for (int64_t j = 0; j < K; ++j) {
    const int64_t n = rows.size();
    if (n == 0) break;
    u.resize(n * H), g.resize(n * H);
    mtp_input(int64_t(rows.ids.data()), embed_ptr, H, V, int64_t(rows.h.data()), H, enorm_ptr, e_eps, hnorm_ptr,
              h_eps, eh_ptr, int64_t(u.data()), n, H);
    bad = decode_stack(mtp_plan_ptr, 1, 0, int64_t(u.data()), embed_ptr, V, n, H, int64_t(rows.cos.data()),
                       int64_t(rows.sin.data()), int64_t(&mtp_kv), mtp_keys_ptrs_ptr, num_blocks, block_size, int64_t(rows.slots.data()),
                       int64_t(rows.table.data()), max_blocks, int64_t(rows.lens.data()), mtp_norm_ptr,
                       mtp_norm_eps, int64_t(g.data()));
    if (bad) return bad;
    drafting.clear();
    for (int64_t r = 0; r < R; ++r)
      if (room[r] > j) drafting.push_back(r);  // the rows of this pass, in order
    drafted.resize(n);
    greedy_rows(g.data(), n, H, draft_ptr, draft_rows, draft_vocab, drafted.data());
    if (draft_ids != nullptr)
      for (auto& d : drafted) d = draft_ids[d];
    rows.clear();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = drafting[i];
      drafts[r * K + j] = drafted[i];
      if (room[r] <= j + 1) continue;  // the next pass drafts token j + 1 where room allows
      const int64_t pos = positions[r * S + accepted[r]] + j + 1;
      const int32_t* tab = table + r * S * max_blocks;
      if (pos >= num_positions || pos / block_size >= max_blocks) return 1;
      const int64_t slot = int64_t(tab[pos / block_size]) * block_size + pos % block_size;
      rows.add(drafted[i], &g[i * H], rope_cos + pos * half, rope_sin + pos * half, slot, tab, int32_t(pos + 1));
    }
  }
  return 0;
}

}  // namespace
