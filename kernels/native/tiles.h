// The AMX tile operations the kernels use, two ways: on the tile unit, and in software on any CPU.
//
// The tile paths (amx_columns in products.h, amx_attend in attention.h) are templates on
// `bool SOFT` and write their tile operations as TILE_ZERO, TILE_LOAD, TILE_STORE and TILE_DOT.
// SOFT = false is the tile unit (TILEZERO, TILELOADD, TILESTORED, TDPBF16PS); SOFT = true runs the
// same operations on a thread's own 8 tiles in memory (soft_tiles), so the tile paths' logic (the
// operand layouts, the tails, refused blocks, threads) is tested on a CPU without the unit
// (native.use_amx(True, emulated=True)). Every tile is configured 16 rows of 64 bytes
// (amx_configure), and so are the software ones.
//
// The software TDPBF16PS adds, per output and per pair k of the inner dimension, the even
// product and then the odd one to the float32 sum, each a fused multiply-add. The unit's own
// roundings inside a pair (and its flush of denormals) are not claimed: tests hold the tile paths
// to float32 sums in some order, never to these bits.

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"  // from_bf16

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7, each 16 rows of 64 bytes.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12's declares a read of 8 bytes only, and the stores above were dropped.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

namespace soft_tiles {

struct alignas(64) Tile {
  uint8_t bytes[16][64];
};

// This thread's tiles, as the unit's registers are per thread.
inline Tile& tile(int t) {
  thread_local Tile tiles[8];
  return tiles[t];
}

inline void zero(int t) { std::memset(tile(t).bytes, 0, sizeof(Tile)); }

inline void load(int t, const void* base, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tile(t).bytes[r], static_cast<const uint8_t*>(base) + r * stride, 64);
}

inline void store(int t, void* base, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, tile(t).bytes[r], 64);
}

// C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1]: A and B bf16, C float32.
inline void dot(int c, int a, int b) {
  float C[16][16];
  uint16_t A[16][32], B[16][32];
  std::memcpy(C, tile(c).bytes, sizeof(C));
  std::memcpy(A, tile(a).bytes, sizeof(A));
  std::memcpy(B, tile(b).bytes, sizeof(B));
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) {
      const float even = from_bf16(A[m][2 * k]), odd = from_bf16(A[m][2 * k + 1]);
      for (int n = 0; n < 16; ++n) {
        C[m][n] = std::fma(even, from_bf16(B[k][2 * n]), C[m][n]);
        C[m][n] = std::fma(odd, from_bf16(B[k][2 * n + 1]), C[m][n]);
      }
    }
  std::memcpy(tile(c).bytes, C, sizeof(C));
}

}  // namespace soft_tiles

}  // namespace

// The tile operations in a kernel templated on `bool SOFT` (tile numbers are literals: the
// unit's instructions name their registers).
#define TILE_OP(soft, unit) \
  do {                      \
    if constexpr (SOFT)     \
      soft;                 \
    else                    \
      unit;                 \
  } while (0)
#define TILE_ZERO(t) TILE_OP(soft_tiles::zero(t), _tile_zero(t))
#define TILE_LOAD(t, base, stride) TILE_OP(soft_tiles::load(t, base, stride), _tile_loadd(t, base, stride))
#define TILE_STORE(t, base, stride) TILE_OP(soft_tiles::store(t, base, stride), _tile_stored(t, base, stride))
#define TILE_DOT(c, a, b) TILE_OP(soft_tiles::dot(c, a, b), _tile_dpbf16ps(c, a, b))
