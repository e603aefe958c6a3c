// The native kernels' own thread pool: a parallel call whose caller never waits for a helper
// thread that has not started.
//
// Why not at::parallel_for (OpenMP): a parallel region ends in a barrier that every thread must
// reach. On a shared or busy CPU (a prefill and a decode worker on the same two cores, the router
// beside them) a helper descheduled for a scheduler tick holds the caller for that tick, even
// when the work would have taken microseconds: a batch-1 step of the bench model took 570 ms
// instead of 28 with every product split that way. So decode's small products stayed on one
// thread, at 7-8 GB/s where two threads read ~1.5x faster.
//
// Here a call is cut into chunks that the caller and the helpers claim one at a time from a
// shared counter. The caller claims too, so a call finishes even if no helper ever wakes; it
// waits only for chunks a helper has claimed and not yet finished. A helper that arrives late
// finds nothing left and goes back to waiting. Every chunk computes the same thing whoever runs
// it, so results never depend on how the work was shared.
//
// Protocol. `word` packs (generation << 32 | next chunk). The caller first marks the word busy
// (a new generation, no chunk to claim), then writes the job's fields, then publishes chunk 0.
// Claiming is a compare-and-swap of the word to the next chunk: a helper that read fields of
// another job than the one it claims from fails the swap (the word moved on since it read it),
// so it never runs a chunk of a job it did not read whole. `done` counts finished chunks; the
// caller returns once it reaches the job's count, which covers every claimed chunk, so the job
// (its function on the caller's stack) outlives all use. Every access is sequentially
// consistent; they are a handful per call. Helpers spin for SPIN_NS after their last work (a
// decode step's kernels come tens of microseconds apart), then sleep on a futex each publish bumps.
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <thread>

namespace pool {

constexpr int64_t SPIN_NS = 1000000;  // a helper spins this long after its last chunk, then sleeps

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

class Pool {
 public:
  explicit Pool(int helpers) : helpers_(helpers) {
    for (int i = 0; i < helpers; ++i) std::thread([this] { serve(); }).detach();
  }

  int threads() const { return helpers_ + 1; }

  // f(begin, end) over [0, n) in chunks of `chunk`, on the caller and whichever helpers come.
  // One call at a time: a call made while another runs (another engine's thread, or from inside
  // a chunk) runs on its own thread alone.
  template <typename F>
  void run(int64_t n, int64_t chunk, const F& f) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    if (chunks <= 1 || helpers_ == 0 || busy_.exchange(true)) {
      if (n > 0) f(0, n);
      return;
    }
    struct Release {
      std::atomic<bool>& busy;
      ~Release() { busy.store(false); }
    } release{busy_};
    const uint64_t generation = (word_.load() >> 32) + 1;
    word_.store(generation << 32 | BUSY);
    call_.store([](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); });
    ctx_.store(&f);
    chunks_.store(chunks), chunk_.store(chunk), n_.store(n);
    done_.store(0);
    word_.store(generation << 32);
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) syscall(SYS_futex, &epoch_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    work();
    while (done_.load() < chunks) _mm_pause();  // chunks the helpers claimed and still run
  }

 private:
  using Call = void (*)(const void* ctx, int64_t begin, int64_t end);
  static constexpr uint64_t BUSY = 0xFFFFFFFFu;  // the next-chunk field of a job being written

  // Claims and runs chunks of the published job until none is left.
  void work() {
    for (;;) {
      uint64_t w = word_.load();
      if ((w & BUSY) == BUSY) return;
      const Call call = call_.load();
      const void* ctx = ctx_.load();
      const int64_t chunks = chunks_.load(), chunk = chunk_.load(), n = n_.load();
      const int64_t c = int64_t(w & BUSY);
      if (c >= chunks) return;
      if (!word_.compare_exchange_weak(w, w + 1)) continue;  // another claim, or another job
      const int64_t begin = c * chunk;
      call(ctx, begin, begin + chunk < n ? begin + chunk : n);
      done_.fetch_add(1);
    }
  }

  void serve() {
    pthread_setname_np(pthread_self(), "pdserve-native");  // as /proc and top show it
    int64_t idle_since = now_ns();
    uint32_t seen = epoch_.load();
    for (;;) {
      const uint32_t epoch = epoch_.load();
      if (epoch != seen) {
        seen = epoch;
        work();
        idle_since = now_ns();
        continue;
      }
      if (now_ns() - idle_since < SPIN_NS) {
        sched_yield();  // to a runnable thread on this CPU (torch's OpenMP workers, another process)
        continue;
      }
      sleepers_.fetch_add(1);
      if (epoch_.load() == seen)  // a publish after this check changes epoch_, so the wait returns
        syscall(SYS_futex, &epoch_, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
      sleepers_.fetch_sub(1);
      idle_since = now_ns();
    }
  }

  const int helpers_;
  std::atomic<bool> busy_{false};
  std::atomic<Call> call_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> chunks_{0}, chunk_{1}, n_{0};
  alignas(64) std::atomic<uint64_t> word_{BUSY};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> epoch_{0};
  std::atomic<int> sleepers_{0};
};

}  // namespace pool
