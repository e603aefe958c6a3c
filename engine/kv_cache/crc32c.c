/* CRC-32C (Castagnoli) of KV blocks, each over its rows in every layer cache, in layer order:
 * what a NIXL read is checked against end to end (engine/kv_cache/checksum.py builds and loads
 * this with ctypes, which releases the GIL for the call).
 *
 * Block i's checksum is the CRC-32C of the bytes [bases[l] + ids[i] * lens[l], + lens[l]) for
 * l = 0 .. layers - 1, one after the other: the standard CRC-32C (reflected 0x82F63B78, initial
 * and final value all ones) of their concatenation, the value the `crc32c` package on PyPI gives
 * (the tests hold this file to it).
 *
 * Speed. On x86-64 with SSE4.2 the CRC32 instruction takes 8 bytes a cycle but its result is
 * ready three cycles later, so one stream runs at a third of its rate. Blocks are independent and
 * a layer's rows are the same length in every block, so four blocks go through each layer side
 * by side: four streams keep the unit busy and the pass is bound by memory. The blocks are split
 * between `threads` threads (a read's checksums are taken while nothing else runs on the reader).
 * Elsewhere a table, a byte at a time. */

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[256];

static void make_table(void) {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = n;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
    table[n] = c;
  }
}

static uint32_t crc_bytes(uint32_t crc, const uint8_t *p, size_t n) {
  while (n--) crc = table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

__attribute__((target("sse4.2"))) static uint32_t crc_sse(uint32_t crc, const uint8_t *p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  uint32_t c32 = (uint32_t)c;
  for (; n; n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

/* Four streams of the same length, side by side. */
__attribute__((target("sse4.2"))) static void crc_sse4(uint32_t crc[4], const uint8_t *const p[4], size_t n) {
  uint64_t c0 = crc[0], c1 = crc[1], c2 = crc[2], c3 = crc[3];
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w0, w1, w2, w3;
    memcpy(&w0, p[0] + i, 8);
    memcpy(&w1, p[1] + i, 8);
    memcpy(&w2, p[2] + i, 8);
    memcpy(&w3, p[3] + i, 8);
    c0 = _mm_crc32_u64(c0, w0);
    c1 = _mm_crc32_u64(c1, w1);
    c2 = _mm_crc32_u64(c2, w2);
    c3 = _mm_crc32_u64(c3, w3);
  }
  crc[0] = (uint32_t)c0, crc[1] = (uint32_t)c1, crc[2] = (uint32_t)c2, crc[3] = (uint32_t)c3;
  if (i < n)
    for (int s = 0; s < 4; s++) crc[s] = crc_sse(crc[s], p[s] + i, n - i);
}

static int have_sse42;
#endif

static void blocks(const int64_t *ids, int64_t count, int64_t layers, const uint64_t *bases,
                   const uint64_t *lens, uint32_t *out) {
  int64_t i = 0;
#if defined(__x86_64__)
  if (have_sse42) {
    for (; i + 4 <= count; i += 4) {
      uint32_t crc[4] = {~0u, ~0u, ~0u, ~0u};
      for (int64_t l = 0; l < layers; l++) {
        const uint8_t *p[4];
        for (int s = 0; s < 4; s++) p[s] = (const uint8_t *)(uintptr_t)(bases[l] + (uint64_t)ids[i + s] * lens[l]);
        crc_sse4(crc, p, lens[l]);
      }
      for (int s = 0; s < 4; s++) out[i + s] = ~crc[s];
    }
    for (; i < count; i++) {
      uint32_t crc = ~0u;
      for (int64_t l = 0; l < layers; l++)
        crc = crc_sse(crc, (const uint8_t *)(uintptr_t)(bases[l] + (uint64_t)ids[i] * lens[l]), lens[l]);
      out[i] = ~crc;
    }
    return;
  }
#endif
  for (; i < count; i++) {
    uint32_t crc = ~0u;
    for (int64_t l = 0; l < layers; l++)
      crc = crc_bytes(crc, (const uint8_t *)(uintptr_t)(bases[l] + (uint64_t)ids[i] * lens[l]), lens[l]);
    out[i] = ~crc;
  }
}

struct part {
  const int64_t *ids;
  int64_t count, layers;
  const uint64_t *bases, *lens;
  uint32_t *out;
};

static void *run_part(void *arg) {
  struct part *w = arg;
  blocks(w->ids, w->count, w->layers, w->bases, w->lens, w->out);
  return NULL;
}

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void) {
  make_table();
#if defined(__x86_64__)
  __builtin_cpu_init();
  have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
}

/* out[i] = the checksum of block ids[i] (see the top of the file), for i < count, on up to
 * `threads` threads (at most 8). */
void pdserve_crc32c_blocks(const int64_t *ids, int64_t count, int64_t layers, const uint64_t *bases,
                           const uint64_t *lens, uint32_t *out, int threads) {
  pthread_once(&once, init);
  if (threads < 1) threads = 1;
  if (threads > 8) threads = 8;
  if (threads > count / 4) threads = count / 4 > 0 ? (int)(count / 4) : 1;
  struct part parts[8];
  pthread_t tids[8];
  int started[8] = {0};
  int64_t at = 0;
  for (int t = 0; t < threads; t++) {
    int64_t n = (count - at) / (threads - t);
    parts[t] = (struct part){ids + at, n, layers, bases, lens, out + at};
    at += n;
  }
  for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, run_part, &parts[t]) == 0;
  run_part(&parts[0]);
  for (int t = 1; t < threads; t++) {
    if (started[t])
      pthread_join(tids[t], NULL);
    else
      run_part(&parts[t]); /* no thread to be had: this one does that part too */
  }
}

/* The checksum of one byte string, continuing from `crc` (0 to start): crc32c.crc32c(data, crc). */
uint32_t pdserve_crc32c(uint32_t crc, const uint8_t *p, size_t n) {
  pthread_once(&once, init);
#if defined(__x86_64__)
  if (have_sse42) return ~crc_sse(~crc, p, n);
#endif
  return ~crc_bytes(~crc, p, n);
}
