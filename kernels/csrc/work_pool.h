// The CPU kernels' threads: a work pool that keeps making progress when fewer cores are
// free than it has threads (kernels/csrc/cpu_kernels.cpp runs every parallel loop on it).
//
// Why not OpenMP's `parallel for`: a team meets at a join barrier, so a step's every loop
// (a decode step runs ~200 of them: four linears, attention and norms per layer) waits for
// its slowest thread. A thread that a neighbour process (a Prometheus scrape, a sidecar,
// another pod under a CPU quota) has descheduled is slow by a whole time slice, and with a
// static split its half of the loop waits for it; meanwhile libgomp's waiting threads
// spin (~300,000 pauses by default) on the very cores the descheduled one needs.
//
// Here a loop is `n` chunks claimed one at a time from a shared counter by whoever is
// running: the calling thread claims chunks too, a worker that wakes late finds nothing
// left and claims nothing, so nobody waits for a thread that is not running; the caller
// waits only for chunks already claimed and in flight (a few microseconds of work each).
// Workers spin briefly (kWorkerSpin) for the next loop, then sleep on a futex; the caller
// spins briefly (kCallerSpin) for in-flight chunks, then sleeps too, which frees its core
// for the descheduled worker (the kernel's idle balance pulls it over).
//
// Which thread runs which chunk never changes a result: every kernel's chunks write
// disjoint outputs with the same arithmetic wherever they run (batch invariance holds).
//
// One loop at a time: a second caller (another Python thread in a kernel, a chunk's body
// calling a parallel kernel) runs its loop alone on its own thread.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pagoda {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

class WorkPool {
 public:
  using Fn = void (*)(void*, int64_t);

  // How long a worker spins for the next loop before it sleeps: a decode step's loops
  // follow one another within microseconds, its steps within a millisecond or so.
  static constexpr std::chrono::microseconds kWorkerSpin{20};
  // How long the caller spins for chunks in flight before it sleeps.
  static constexpr std::chrono::microseconds kCallerSpin{50};

  static constexpr uint64_t kClosed = 0xFFFFFFFFu;  // `next` of a loop no chunk may be claimed from

  static WorkPool& instance() {
    static WorkPool* pool = new WorkPool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  // fn(ctx, i) for every i in [0, n), on the caller and up to `threads` - 1 workers.
  void run(int64_t n, int threads, Fn fn, void* ctx) {
    if (n <= 0) return;
    std::unique_lock<std::mutex> lock(call_mutex_, std::defer_lock);
    if (n == 1 || threads <= 1 || n >= static_cast<int64_t>(kClosed) || !lock.try_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    ensure_workers(threads - 1);
    const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
    // Close the last loop before its fields change: a worker that read its state (every
    // chunk claimed) and then this loop's larger n would otherwise win its compare-exchange
    // on the old state and run this loop's chunk unaccounted for (the loop could return
    // under it). With the state moved on, that compare-exchange fails.
    state_.store((static_cast<uint64_t>(gen) << 32) | kClosed, std::memory_order_seq_cst);
    fn_.store(fn, std::memory_order_release);
    ctx_.store(ctx, std::memory_order_release);
    n_.store(n, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
    generation_.store(gen, std::memory_order_seq_cst);
    if (sleeping_workers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);
    claim_and_run(gen);
    wait_done(static_cast<uint32_t>(n));
  }

  // Workers started so far (threads - 1 of the last loop that ran on the pool).
  int workers() const { return static_cast<int>(workers_.size()); }

 private:
  WorkPool() = default;

  // Claims chunks of loop `gen` until none is left (or the loop is another's by now).
  void claim_and_run(uint32_t gen) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(s >> 32) != gen) return;
      const int64_t next = static_cast<uint32_t>(s), n = n_.load(std::memory_order_acquire);
      if (next >= n) return;
      const Fn fn = fn_.load(std::memory_order_acquire);
      void* const ctx = ctx_.load(std::memory_order_acquire);
      // Succeeds only while the state is still (gen, next): the loop is not closed (run()
      // closes it before it writes another loop's fields), so the fields just read are its.
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      fn(ctx, next);
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == n &&
          caller_sleeping_.load(std::memory_order_seq_cst)) {
        futex_wake_all(&done_);
      }
    }
  }

  void wait_done(uint32_t n) {
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      cpu_relax();
      if ((spins & 63) != 63 || std::chrono::steady_clock::now() - start < kCallerSpin) continue;
      caller_sleeping_.store(1, std::memory_order_seq_cst);
      const uint32_t d = done_.load(std::memory_order_seq_cst);
      if (d < n) futex_wait(&done_, d);
      caller_sleeping_.store(0, std::memory_order_relaxed);
    }
  }

  void worker_main() {
    uint32_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t gen;
      auto start = std::chrono::steady_clock::now();
      for (int spins = 0; (gen = generation_.load(std::memory_order_acquire)) == seen; ++spins) {
        if (stop_.load(std::memory_order_relaxed)) return;
        cpu_relax();
        if ((spins & 63) != 63 || std::chrono::steady_clock::now() - start < kWorkerSpin) continue;
        sleeping_workers_.fetch_add(1, std::memory_order_seq_cst);
        if (generation_.load(std::memory_order_seq_cst) == seen && !stop_.load(std::memory_order_seq_cst)) {
          futex_wait(&generation_, seen);
        }
        sleeping_workers_.fetch_sub(1, std::memory_order_seq_cst);
        start = std::chrono::steady_clock::now();
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = gen;
      claim_and_run(gen);
    }
  }

  // Starts (or restarts, when the count changed, or after a fork) `count` workers; called
  // with call_mutex_ held, so no loop is running.
  void ensure_workers(int count) {
    const pid_t pid = getpid();
    if (pid == pid_ && static_cast<int>(workers_.size()) == count) return;
    if (pid == pid_) {
      stop_.store(true, std::memory_order_seq_cst);
      generation_.fetch_add(1, std::memory_order_seq_cst);  // wakes spinners; no loop is posted
      futex_wake_all(&generation_);
      for (std::thread& t : workers_) t.join();
      workers_.clear();
    } else {
      // A forked child: the parent's workers are not here; their handles are left alone
      // (joining or detaching a thread this process never had is undefined).
      new std::vector<std::thread>(std::move(workers_));
      workers_ = std::vector<std::thread>();
    }
    stop_.store(false, std::memory_order_seq_cst);
    pid_ = pid;
    for (int i = 0; i < count; ++i) workers_.emplace_back([this] { worker_main(); });
  }

  std::mutex call_mutex_;
  std::vector<std::thread> workers_;
  pid_t pid_ = 0;
  alignas(64) std::atomic<uint64_t> state_{0};       // loop generation << 32 | next unclaimed chunk
  alignas(64) std::atomic<uint32_t> generation_{0};  // the loop posted last: workers sleep on it
  std::atomic<int> sleeping_workers_{0};
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<uint32_t> done_{0};  // chunks of the loop finished: the caller sleeps on it
  std::atomic<uint32_t> caller_sleeping_{0};
  std::atomic<Fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0};
};

}  // namespace pagoda
