// Pagoda's CPU kernels: paged attention that reads the KV blocks where they lie, the KV
// write, and the fused element-wise steps of a decoder layer (residual add + RMSNorm,
// rotary embedding), and the bf16 small-batch GEMV of the decode linears (AVX512-BF16 CPUs).
// SiLU-and-multiply stays on torch's vectorised ops for larger batches; for a few bf16 rows
// it runs inside `bf16_silu_mlp`, the whole MLP in one call. Built on first use by kernels/cpu_kernels.py
// (torch.utils.cpp_extension, -O3 -march=native, cached on disk); the torch reference
// ops in kernels/reference.py define the semantics and the tests hold these to them.
//
// Why C++ and not more torch ops: at decode a layer is ~30 small eager ops, each a
// dispatch plus a pass over memory, and the reference attention first gathers every
// sequence's K/V into a dense copy (then casts it to float, another copy). Here each op is
// one pass, attention reads K/V once from the cache, and the loops vectorise (AVX-512 on
// this project's CPUs) because they run over contiguous float scratch rows.
//
// Dtypes: float32 and bfloat16 (bf16 rounding as torch's eager ops round: compute in
// float, round to nearest even once per op). Scores, softmax and accumulators are float32;
// the blocked prefill loop rounds the softmax weights to bf16 before they multiply V, as
// torch's flash kernel does.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>

#include <type_traits>
#include <vector>

#include "work_pool.h"

namespace {

// Every parallel loop of these kernels runs on the work pool (work_pool.h: chunks claimed
// by whichever threads are running, so a descheduled thread stalls nothing). True: on
// OpenMP's fork-join team instead, as the kernels ran before the pool; only for A/B
// benchmarks of the two (`set_openmp_loops`, loadtest/bench_noise.py).
std::atomic<bool> g_openmp_loops{false};

// The kernels' thread count: set by `set_kernel_threads` (engine/cpu_threads.py, from the
// CPUs this process can get); 0 (unset) follows torch's at::get_num_threads().
std::atomic<int> g_kernel_threads{0};

inline int kernel_threads() {
  const int n = g_kernel_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : at::get_num_threads();
}

// body(i) for every i in [0, n), on up to `threads` threads, chunks claimed dynamically.
template <typename Body>
inline void parallel_chunks(int64_t n, const Body& body, int64_t threads = kernel_threads()) {
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (g_openmp_loops.load(std::memory_order_relaxed)) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  pagoda::WorkPool::instance().run(
      n, static_cast<int>(threads), [](void* b, int64_t i) { (*static_cast<const Body*>(b))(i); },
      const_cast<void*>(static_cast<const void*>(&body)));
}

// How many near-equal contiguous ranges parallel_ranges cuts [0, units) into: ranges of at
// most about `max_piece` units, as many as a multiple of the threads.
inline int64_t range_count(int64_t units, int64_t max_piece, int64_t threads) {
  const int64_t per_thread = (units + threads * std::max<int64_t>(1, max_piece) - 1) / (threads * std::max<int64_t>(1, max_piece));
  return std::min(units, threads * per_thread);
}

// body(lo, hi) over [0, units) in contiguous ranges of at most about `max_piece` units,
// claimed dynamically; as many ranges as a multiple of the threads, of near-equal size, so
// that on a quiet machine every thread does the same share (9 pieces on 2 threads would
// leave one thread 5 to do while the other waits). Under OpenMP: one contiguous range per thread, the split the
// kernels had before the pool.
template <typename Body>
inline void parallel_ranges(int64_t units, int64_t max_piece, const Body& body) {
  if (units <= 0) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(kernel_threads(), units));
  if (g_openmp_loops.load(std::memory_order_relaxed)) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      body(units * t / nt, units * (t + 1) / nt);
    }
    return;
  }
  const int64_t n = range_count(units, max_piece, threads);
  parallel_chunks(n, [&](int64_t c) { body(units * c / n, units * (c + 1) / n); }, threads);
}


// body(lo, hi, claim_next) over [0, units) in the ranges parallel_ranges makes, except that
// the last `threads` x (a range's units) units are ranges of one unit each, each run
// exactly once, claimed dynamically; a range's body may claim the range its thread runs next
// before it ends (claim_next(): that range's first unit, or -1 when none is left; claimed
// once, however often it is called), so it can pull that range's first data into cache
// while it computes its own last part. Each range is started by whoever wins its flag: a
// thread that finds nothing left to claim takes any range claimed ahead and not yet
// started (its claimer is still busy, or descheduled), so no range waits on a thread that
// is not running, and the claimer, finding it taken, claims another. The one-unit ranges at
// the end: the threads' whole ranges end up to a range apart (one thread's memory was slower,
// or it started later), and with whole ranges to the end the first to finish waited for the
// other's last one (the 1B-class 32-row qkv and o_proj calls: 4-6% of the threads' time idle,
// the start and the end together); single units fill that gap.
template <typename Body>
inline void parallel_claimed_ahead(int64_t units, int64_t max_piece, const Body& body) {
  if (units <= 0) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(kernel_threads(), units));
  if (g_openmp_loops.load(std::memory_order_relaxed)) {  // as parallel_ranges: a range per thread, nothing ahead
    parallel_ranges(units, max_piece, [&](int64_t lo, int64_t hi) { body(lo, hi, [] { return int64_t{-1}; }); });
    return;
  }
  const int64_t whole = range_count(units, max_piece, threads);  // parallel_ranges' ranges
  const int64_t range_units = units / whole;  // a whole range's units (or one fewer)
  // The last tail units one by one (none where the ranges are single units, or too few to split).
  const int64_t tail = range_units > 1 && whole > 2 * threads ? threads * range_units : 0;
  const int64_t head_units = units - tail, head_n = tail ? whole - threads : whole, n = head_n + tail;
  std::unique_ptr<std::atomic<uint8_t>[]> started(new std::atomic<uint8_t>[n]);
  for (int64_t c = 0; c < n; ++c) started[c].store(0, std::memory_order_relaxed);
  std::atomic<int64_t> counter{0};
  auto lo_of = [&](int64_t c) { return c <= head_n ? head_units * c / head_n : head_units + (c - head_n); };
  auto take = [&](int64_t c) {
    uint8_t zero = 0;
    return started[c].load(std::memory_order_relaxed) == 0 &&
           started[c].compare_exchange_strong(zero, 1, std::memory_order_acq_rel);
  };
  auto worker = [&](int64_t) {
    int64_t cur = counter.fetch_add(1, std::memory_order_relaxed);
    for (;;) {
      if (cur >= n) {  // none left to claim: take any range claimed ahead and not started
        cur = -1;
        for (int64_t c = 0; c < n && cur < 0; ++c)
          if (take(c)) cur = c;
        if (cur < 0) return;
      } else if (!take(cur)) {  // taken by another thread meanwhile
        cur = counter.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      int64_t ahead = -2;  // not claimed yet
      auto claim_next = [&]() -> int64_t {
        if (ahead == -2) ahead = counter.fetch_add(1, std::memory_order_relaxed);
        return ahead < n ? lo_of(ahead) : -1;
      };
      body(lo_of(cur), lo_of(cur + 1), claim_next);
      cur = ahead == -2 ? counter.fetch_add(1, std::memory_order_relaxed) : ahead;
    }
  };
  parallel_chunks(threads, worker, threads);
}

// float -> bf16 bits, rounding to nearest even (NaN stays a quiet NaN), branch-free so the
// loops that store rows vectorise (c10::BFloat16's constructor is a scalar call).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// bf16 bits as a float (exact).
inline float bf16_to_float_bits(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x's symmetric int8 code on the grid `scale`: clamp(round_half_even(x / scale), -127, 127)
// (a true division, as torch's), 0 where the scale is 0 or x is NaN.
inline int8_t int8_code(float x, float scale) {
  const float y = scale > 0.f ? std::nearbyint(x / scale) : 0.f;
  return static_cast<int8_t>(y == y ? std::min(127.f, std::max(-127.f, y)) : 0.f);
}

// Store x as T at dst[i].
inline void store(float* dst, int64_t i, float x) { dst[i] = x; }
inline void store(c10::BFloat16* dst, int64_t i, float x) { reinterpret_cast<uint16_t*>(dst)[i] = bf16_bits(x); }

// x rounded to T's precision, as a float (what storing and reloading it would give).
template <typename T> inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const uint32_t bits = static_cast<uint32_t>(bf16_bits(x)) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
}

// Convert a row of `n` values to float (vectorises: bf16 -> float is a 16-bit shift).
template <typename T>
inline void load_row(float* __restrict dst, const T* __restrict src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      dst[i] = f;
    }
  }
}

// exp(x) for x <= 0 (softmax weights), in a form the compiler vectorises (glibc's expf is
// a scalar call): x = n ln2 + f ln2 with f in [0, 1), 2^f by a degree-6 polynomial
// (relative error ~2e-7), 2^n put into the exponent bits. Below -87 it returns ~1e-38
// instead of a denormal or 0; a softmax weight that small contributes nothing either way.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t);
  const float f = t - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 64 == 0) {
    // Four independent accumulators: the FMA chain is not latency-bound.
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 64) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), a3);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// Whether attend_item computes bf16 scores with vdpbf16ps (AVX512-BF16 compiled in, the
// head dim a multiple of 32 known at compile time).
#if defined(__AVX512BF16__)
template <typename T, int64_t HD>
constexpr bool kBf16Dots = std::is_same_v<T, c10::BFloat16> && HD > 0 && HD % 32 == 0;

inline float dot_bf16(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + i + 32), (__m512bh)_mm512_loadu_si512(b + i + 32));
  }
  for (; i < n; i += 32) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#else
template <typename T, int64_t HD>
constexpr bool kBf16Dots = false;

inline float dot_bf16(const c10::BFloat16*, const c10::BFloat16*, int64_t) { return 0.f; }  // unused: kBf16Dots is false
#endif

// One work item of paged attention: sequence `s`, KV head `kvh`, query tokens [i0, i1) of
// the sequence's new tokens. Every query head of the KV head's group is a row; each row
// keeps a running max, sum and float accumulator (online softmax, one pass over K/V).
// HD: the head dim as a compile-time constant (64, 128, 256: the loops over it unroll and
// a row's accumulator stays in registers across a block's keys), or 0 for any other.
template <typename T, int64_t HD>
void attend_item(const T* q, const T* kc, const T* vc, const int32_t* table, T* out, int64_t ctx, int64_t q_len,
                 int64_t i0, int64_t i1, int64_t q_start, int64_t kvh, int64_t H, int64_t Hkv, int64_t head_dim,
                 int64_t BS, float scale, int64_t window, std::vector<float>& scratch) {
  const int64_t D = HD ? HD : head_dim;
  const int64_t g = H / Hkv;
  const int64_t rows = (i1 - i0) * g;
  const int64_t first_pos = ctx - q_len;  // position of new token 0
  scratch.resize(rows * D * 2 + rows * 3 + BS * D * 2 + BS * rows + D);
  float* qf = scratch.data();          // [rows, D] scaled queries
  float* acc = qf + rows * D;          // [rows, D]
  float* mx = acc + rows * D;          // [rows]
  float* sm = mx + rows;               // [rows]
  float* pos = sm + rows;              // [rows] position of each row's token (as float)
  float* kt = pos + rows;              // [D, BS] this block's keys, transposed
  float* vb = kt + BS * D;             // [BS, D] this block's values
  float* sc = vb + BS * D;             // [rows, BS] scores
  float* krow = sc + BS * rows;        // [D] one key row in float
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = (i - i0) * g + j;
      load_row(qf + r * D, q + ((q_start + i) * H + kvh * g + j) * D, D);
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= scale;
      pos[r] = static_cast<float>(first_pos + i);
      mx[r] = -std::numeric_limits<float>::infinity();
      sm[r] = 0.f;
    }
  }
  std::fill(acc, acc + rows * D, 0.f);
  const int64_t last = first_pos + i1 - 1;  // newest position any row attends to
  int64_t lo = 0;
  if (window > 0) lo = std::max<int64_t>(0, first_pos + i0 - window + 1);
  const int64_t row_stride = Hkv * D;  // between consecutive tokens of a block
  for (int64_t b = lo / BS; b * BS <= last; ++b) {
    const int64_t phys = table[b];
    const int64_t t0 = std::max(lo, b * BS), t1 = std::min(last + 1, (b + 1) * BS);
    const int64_t nt = t1 - t0;
    const T* kblk = kc + (phys * BS + (t0 - b * BS)) * row_stride + kvh * D;
    const T* vblk = vc + (phys * BS + (t0 - b * BS)) * row_stride + kvh * D;
    // Scores: with many rows (a prefill chunk) the keys are transposed ([d][t]), so a
    // row's scores over the block are D vector FMAs across tokens with no horizontal sum;
    // with few (a decode: the KV head's group of query heads) the transpose would cost
    // more than it saves, and each score is one dot product over a converted key row.
    // bf16 on a CPU with AVX512-BF16, few rows: the dot products run on the bf16 query
    // and key rows as stored (vdpbf16ps: exact products, float32 sums), no key conversion.
    const bool transposed = rows >= 8;
    const bool bf16_dots = kBf16Dots<T, HD> && !transposed;
    for (int64_t t = 0; t < nt; ++t) {
      if (transposed) {
        load_row(krow, kblk + t * row_stride, D);
        for (int64_t d = 0; d < D; ++d) kt[d * BS + t] = krow[d];
      } else if (!bf16_dots) {
        load_row(kt + t * D, kblk + t * row_stride, D);  // [t][d]
      }
      load_row(vb + t * D, vblk + t * row_stride, D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = static_cast<int64_t>(pos[r]);
      // Keys this row may see inside [t0, t1): p - window < k <= p.
      const int64_t k_lo = window > 0 ? std::max(t0, p - window + 1) : t0;
      const int64_t k_hi = std::min(t1, p + 1);
      if (k_hi <= k_lo) continue;
      float* sr = sc + r * BS;  // scores of the block's tokens t = 0..nt
      const float* qr = qf + r * D;
      if (transposed) {
        std::fill(sr, sr + nt, 0.f);
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qr[d];
          const float* kd = kt + d * BS;
#pragma omp simd
          for (int64_t t = 0; t < nt; ++t) sr[t] += qd * kd[t];
        }
      } else {
        bool done = false;
        if constexpr (kBf16Dots<T, HD>) {
          if (bf16_dots) {
            const int64_t i = i0 + r / g, j = r % g;
            const T* qraw = q + ((q_start + i) * H + kvh * g + j) * D;
            for (int64_t k = k_lo; k < k_hi; ++k) sr[k - t0] = scale * dot_bf16(qraw, kblk + (k - t0) * row_stride, D);
            done = true;
          }
        }
        if (!done) {
          for (int64_t k = k_lo; k < k_hi; ++k) sr[k - t0] = dot(qr, kt + (k - t0) * D, D);
        }
      }
      float* s = sr - t0;  // s[k] for k in [k_lo, k_hi)
      float bmax = -std::numeric_limits<float>::infinity();
      for (int64_t k = k_lo; k < k_hi; ++k) bmax = std::max(bmax, s[k]);
      const float m_new = std::max(mx[r], bmax);
      // Rescale what was accumulated under the old max (nothing on the first block: mx = -inf).
      const float corr = mx[r] == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(mx[r] - m_new);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = k_lo; k < k_hi; ++k) {
        s[k] = exp_nonpositive(s[k] - m_new);
        sum += s[k];
      }
      float* a = acc + r * D;
      if constexpr (HD > 0) {
        // The row's accumulator in a local array the compiler keeps in registers over
        // the block's keys (HD / 16 AVX-512 registers), instead of a load and a store per key.
        float ar[HD];
        for (int64_t d = 0; d < HD; ++d) ar[d] = a[d] * corr;
        for (int64_t k = k_lo; k < k_hi; ++k) {
          const float w = s[k];
          const float* __restrict vr = vb + (k - t0) * HD;
          for (int64_t d = 0; d < HD; ++d) ar[d] += w * vr[d];
        }
        for (int64_t d = 0; d < HD; ++d) a[d] = ar[d];
      } else {
        if (corr != 1.f) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= corr;
        }
        for (int64_t k = k_lo; k < k_hi; ++k) {
          const float w = s[k];
          const float* vr = vb + (k - t0) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
        }
      }
      sm[r] = sm[r] * corr + sum;
      mx[r] = m_new;
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = (i - i0) * g + j;
      const float inv = 1.f / sm[r];
      T* o = out + ((q_start + i) * H + kvh * g + j) * D;
      for (int64_t d = 0; d < D; ++d) store(o, d, acc[r * D + d] * inv);
    }
  }
}

#if defined(__AVX512BF16__)
// The 16 lanes of the result hold the sums of v[0..15]'s 16 lanes each: a transpose-and-add
// tree of 45 instructions, where 16 _mm512_reduce_add_ps take ~140.
inline __m512 sum16(const __m512* v) {
  __m512 pair[8];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
  for (int i = 0; i < 8; ++i)
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quad[4];  // per 128-bit lane L: the lane-L partial sums of v[4i], .., v[4i+3]
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pair[2 * i]), b = _mm512_castps_pd(pair[2 * i + 1]);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across the 128-bit lanes: [x0+x1, x2+x3, y0+y1, y2+y3], then the four totals in order.
  const __m512 xy = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88), _mm512_shuffle_f32x4(quad[0], quad[1], 0xDD));
  const __m512 zw = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88), _mm512_shuffle_f32x4(quad[2], quad[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(xy, zw, 0x88), _mm512_shuffle_f32x4(xy, zw, 0xDD));
}

// Walks the keys of one KV head in position order through the block table, from key k:
// the cache row of each, without a division per key. `take` hands out the rows of the
// next keys in groups, `count` keys in all.
struct KeyCursor {
  const uint16_t* cache;
  const int32_t* table;
  int64_t BS, row_stride, head_offset, block, offset, left;
  const uint16_t* base;
  KeyCursor(const uint16_t* cache_, const int32_t* table_, int64_t BS_, int64_t row_stride_, int64_t head_offset_, int64_t k,
            int64_t count = 0)
      : cache(cache_), table(table_), BS(BS_), row_stride(row_stride_), head_offset(head_offset_), block(k / BS_),
        offset(k % BS_), left(count) {
    base = cache + table[block] * BS * row_stride + head_offset;
  }
  const uint16_t* row() const { return base + offset * row_stride; }
  void next() {  // call only while another key follows: the next block's entry is read here
    if (++offset == BS) {
      offset = 0;
      base = cache + table[++block] * BS * row_stride + head_offset;
    }
  }
  // The rows of the next up-to-`most` keys into dst[0, most), the slots past the last key
  // padded with its row (a loop over whole groups then reads only real rows); how many keys.
  int64_t take(const uint16_t** dst, int64_t most) {
    const int64_t count = std::min(most, left);
    for (int64_t t = 0; t < count; ++t) {
      dst[t] = row();
      if (--left > 0) next();
    }
    for (int64_t t = count; t < most && count > 0; ++t) dst[t] = dst[count - 1];
    return count;
  }
};

constexpr int64_t kFewRows = 8;         // items of up to this many query rows take attend_rows_bf16
constexpr int64_t kPrefetchAheadKeys = 32;  // key rows in flight ahead of the 16 being scored (KeyPrefetch)

// The keys a few-row item (query tokens [i0, i1) of a chunk of q_len new tokens at the end
// of ctx) attends: positions [lo, lo + n), its window's start to its newest token.
struct ItemKeys { int64_t lo, n; };
inline ItemKeys item_keys(int64_t ctx, int64_t q_len, int64_t i0, int64_t i1, int64_t window) {
  const int64_t first_pos = ctx - q_len;  // position of new token 0
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + i0 - window + 1) : 0;
  return {lo, first_pos + i1 - lo};
}

// Index (in rows of the head dim) of query row r of an item (token i0 + r / g of the chunk
// starting at q_start, query head kvh * g + r % g): the same index in the output.
inline int64_t item_row(int64_t q_start, int64_t i0, int64_t r, int64_t g, int64_t H, int64_t kvh) {
  return (q_start + i0 + r / g) * H + kvh * g + r % g;
}

// The key rows of one KV head for keys [k0, k0 + n) pulled into L2 ahead of their use:
// `ahead(count)` prefetches the next `count` of them. The rows lie scattered over the cache in
// blocks, between the other heads' rows, and the hardware prefetcher does not follow them.
// They used to be prefetched all at once when an item or part started (up to 1024 rows), but
// a software prefetch waits for a free miss buffer, so that burst stalled the core and the
// first rows came no sooner. Kept kPrefetchAheadKeys ahead of the group being scored, 16
// more with each group, they stream in behind the arithmetic. The 32-sequence decode's
// attention then took 0.60-0.74x the time on the default route (loadtest/bench_cpu_attention.py
// --baseline-rev) and 0.68-0.72x on the few-row loop (development A/B); 16 rows ahead
// 0.67-0.73x, 64 ahead 0.74-0.78x, into L1 instead 1.03x (2026-12-07).
struct KeyPrefetch {
  KeyCursor cursor;
  int64_t left, lines;
  KeyPrefetch(const uint16_t* kb, const int32_t* table, int64_t BS, int64_t row_stride, int64_t head_offset, int64_t k0,
              int64_t n, int64_t lines_)
      : cursor(kb, table, BS, row_stride, head_offset, n > 0 ? k0 : 0), left(n), lines(lines_) {}
  void ahead(int64_t count) {
    for (count = std::min(count, left); count > 0; --count) {
      for (int64_t c = 0; c < lines; ++c) _mm_prefetch(reinterpret_cast<const char*>(cursor.row() + 32 * c), _MM_HINT_T1);
      if (--left > 0) cursor.next();  // the next block's table entry only while a key follows
    }
  }
};

// The scores of 16 keys (rows kp[0..16)) for query rows [0, rows) (q_row(r): row r's bf16
// query): per key an HD/32-long vdpbf16ps chain on the query and key as stored (exact
// products, float32 sums), the 16 keys' lanes summed together (sum16), times the scale;
// row r's into s[r * stride, + 16). Not inlined: inside attend_part_pairs_bf16, whose other
// phases keep many vectors live, GCC 12 sent every key vector through a stack slot (a store
// and a reload before each vdpbf16ps); on its own its 16 chains stay in registers, and the
// 32-sequence decode's attention took 0.92x the time (loadtest/bench_cpu_attention.py
// --baseline-rev).
template <int64_t HD, typename QRow>
__attribute__((noinline)) void score_16_keys(const QRow& q_row, int64_t rows, const uint16_t* const* kp, float* s, int64_t stride,
                          __m512 vscale) {
  constexpr int64_t NQ = HD / 32;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* qr = q_row(r);
    __m512bh qv[NQ];
    for (int64_t c = 0; c < NQ; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
    __m512 dots[16];
    for (int t = 0; t < 16; ++t) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < NQ; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(kp[t] + 32 * c));
      dots[t] = a;
    }
    _mm512_storeu_ps(s + r * stride, _mm512_mul_ps(sum16(dots), vscale));
  }
}

// The weighted sums of the values of keys [lo, lo + n) of one KV head for query rows
// [0, rows), weights w[r * stride + k]: kTile rows' float32 accumulators (HD/16 vectors
// each) in registers, one FMA chain per dimension in key order, each value row converted
// bf16 -> float once per tile; then done(r, acc) with row r's HD/16 vectors.
template <int64_t HD, typename Done>
inline void weigh_values(const float* w, int64_t stride, int64_t rows, int64_t n, const uint16_t* vb,
                         const int32_t* table, int64_t BS, int64_t row_stride, int64_t head_offset, int64_t lo,
                         const Done& done) {
  constexpr int64_t NV = HD / 16;
  constexpr int64_t kTile = HD >= 256 ? 1 : 256 / HD;  // kTile * NV = 16 accumulators
  constexpr int64_t kLines = HD * 2 / 64;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t rt = std::min(kTile, rows - r0);
    __m512 acc[kTile][NV];
    for (int64_t r = 0; r < kTile; ++r)
      for (int64_t c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    KeyCursor values(vb, table, BS, row_stride, head_offset, lo);
    for (int64_t k = 0; k < n; ++k) {
      const uint16_t* vr = values.row();
      if (k + 1 < n) values.next();
      for (int64_t c = 0; c < kLines; ++c) _mm_prefetch(reinterpret_cast<const char*>(values.row() + 32 * c), _MM_HINT_T0);
      __m512 vf[NV];
      for (int64_t c = 0; c < NV; ++c)
        vf[c] = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * c))), 16));
      for (int64_t r = 0; r < kTile; ++r) {
        if (r < rt) {
          const __m512 wk = _mm512_set1_ps(w[(r0 + r) * stride + k]);
          for (int64_t c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(wk, vf[c], acc[r][c]);
        }
      }
    }
    for (int64_t r = 0; r < rt; ++r) done(r0 + r, acc[r]);
  }
}


// One work item (as attend_item) of bf16 attention with few query rows: a decode (the KV
// head's group of query heads) or a short chunk. attend_item's one online-softmax pass per
// block spends most of its time on per-key horizontal sums and per-block rescaling; here
// two passes over the item's keys:
//  1. scores: 16 keys at a time, per row HD/32 vdpbf16ps per key on the bf16 query and key
//     as stored (exact products, float32 sums), the 16 keys' sums reduced together (sum16);
//     then each row's max, exp and sum over all its keys, vectorised;
//  2. values: the probability-weighted sum with the rows' float32 accumulators in registers
//     (kTile rows x HD/16 vectors), each value row converted bf16 -> float once per tile.
// The scores of every key are held (rows x keys floats: 96 KB at 3 rows x 8k keys).
// With `partial` (attention_parts) it attends keys [key0, key0 + key_count) of the item's
// only, and writes each row's unnormalised sums [HD], maximum score and softmax sum there
// (rows x (HD + 2) floats) instead of the output.
template <int64_t HD>
void attend_rows_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table,
                      c10::BFloat16* out, int64_t ctx, int64_t q_len, int64_t i0, int64_t i1, int64_t q_start,
                      int64_t kvh, int64_t H, int64_t Hkv, int64_t BS, float scale, int64_t window,
                      std::vector<float>& scratch, int64_t key0 = 0, int64_t key_count = -1, float* partial = nullptr) {
  static_assert(HD % 32 == 0, "head dim: a multiple of 32");
  constexpr int64_t NV = HD / 16;  // float vectors per row
  const int64_t g = H / Hkv;
  const int64_t rows = (i1 - i0) * g;
  const int64_t first_pos = ctx - q_len;  // position of new token 0
  const ItemKeys item = item_keys(ctx, q_len, i0, i1, window);
  // a part (key_count >= 0: attention_parts) takes the item's keys key0.. only
  const int64_t lo = item.lo + key0;
  const int64_t n = key_count >= 0 ? key_count : item.n;
  const int64_t stride = (n + 15) / 16 * 16;
  scratch.resize(rows * stride + rows);
  float* s = scratch.data();                // [rows][stride]: scores, then probabilities
  float* inv = s + rows * stride;           // [rows]: 1 / the row's softmax sum
  const int64_t row_stride = Hkv * HD;
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(q);
  auto q_row = [&](int64_t r) { return qb + item_row(q_start, i0, r, g, H, kvh) * HD; };
  const __m512 vscale = _mm512_set1_ps(scale);

  // The keys are scattered over the cache in blocks of BS tokens, each row a short stretch
  // (HD bf16) between the other heads' rows: the hardware prefetcher does not follow that
  // (measured: attention at a third of the copy bandwidth, bound by the misses). So the
  // key rows stream into L2 kPrefetchAheadKeys ahead of the next group (KeyPrefetch), the
  // next 16 keys' rows into L1 while these are scored, these keys' value rows into L2 for
  // pass 2, and in pass 2 the next value row into L1. Same run, 30 layers' caches
  // (DRAM-resident), 2 threads: 1.7-1.8x the speed without (with the item's keys then
  // prefetched all at once; paced, 0.68-0.72x that time).
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(kc);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(vc);
  constexpr int64_t kLines = HD * 2 / 64;  // cache lines per row
  KeyPrefetch prefetch(kb, table, BS, row_stride, kvh * HD, lo, n, kLines);
  prefetch.ahead(16 + kPrefetchAheadKeys);  // the loop reads the next group's rows as it scores one
  KeyCursor keys(kb, table, BS, row_stride, kvh * HD, lo, n);
  const uint16_t* kp[16];  // padding: scores past n are never read
  const uint16_t* kn[16];
  int64_t nk = keys.take(kp, 16);
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    prefetch.ahead(16);
    const int64_t nn = keys.take(kn, 16);
    for (int64_t t = 0; t < nn; ++t)
      for (int64_t c = 0; c < kLines; ++c) _mm_prefetch(reinterpret_cast<const char*>(kn[t] + 32 * c), _MM_HINT_T0);
    for (int64_t t = 0; t < nk; ++t)
      for (int64_t c = 0; c < kLines; ++c) _mm_prefetch(reinterpret_cast<const char*>(vb + (kp[t] - kb) + 32 * c), _MM_HINT_T1);
    score_16_keys<HD>(q_row, rows, kp, s + k0, stride, vscale);
    std::copy(kn, kn + 16, kp);
    nk = nn;
  }
  for (int64_t r = 0; r < rows; ++r) {
    // This row's keys: p - window < k <= p, as indices into its scores.
    const int64_t p = first_pos + i0 + r / g;
    const int64_t a = std::max<int64_t>(0, (window > 0 ? std::max(item.lo, p - window + 1) : item.lo) - lo);
    const int64_t b = std::min<int64_t>(n, p + 1 - lo);  // a >= b: none of this part's keys
    float* sr = s + r * stride;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t k = a; k < b; ++k) m = std::max(m, sr[k]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; ++k) {
      const float e = (k >= a && k < b) ? exp_nonpositive(sr[k] - m) : 0.f;
      sr[k] = e;
      sum += e;
    }
    inv[r] = 1.f / sum;
    if (partial) {
      partial[r * (HD + 2) + HD] = m;
      partial[r * (HD + 2) + HD + 1] = sum;
    }
  }
  weigh_values<HD>(s, stride, rows, n, vb, table, BS, row_stride, kvh * HD, lo, [&](int64_t r, const __m512* acc) {
    if (partial) {  // a part: its unnormalised sums
      for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(partial + r * (HD + 2) + 16 * c, acc[c]);
      return;
    }
    uint16_t* o = reinterpret_cast<uint16_t*>(out) + (q_row(r) - qb);  // same index as the query row
    const __m512 iv = _mm512_set1_ps(inv[r]);
    for (int64_t c = 0; c < NV; ++c) {
      alignas(64) float x[16];
      _mm512_store_ps(x, _mm512_mul_ps(acc[c], iv));
      for (int d = 0; d < 16; ++d) o[16 * c + d] = bf16_bits(x[d]);
    }
  });
}

// 2^x for x <= 0 on 16 lanes: exp_nonpositive's polynomial, by hand (the blocked loop's
// softmax runs on registers, not on rows the compiler vectorises). Below -126 it gives
// ~1e-38, not 0: a weight that small contributes nothing either way.
inline __m512 exp2_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

constexpr int64_t kBlockRows = 128;  // query rows (tokens x the KV head's group) per blocked-loop item
constexpr int64_t kKeyBlock = 32;    // keys per step of the blocked loop

// One work item (as attend_item) of bf16 attention with many query rows: a prefill chunk,
// causal, no window. A flash-attention loop of small matrix products on vdpbf16ps,
// reading K and V where the block table says they lie:
//  - the item's rows (up to kBlockRows, padded to tiles of 32) are packed once with the
//    query's bf16 pairs of one tile's rows side by side, so the scores come out with 16
//    rows in a vector's lanes: S^T = K Q^T, each key's pair of dims broadcast against 2
//    row vectors, 8 keys at a time (16 accumulators). No transpose of K is needed, and the
//    softmax (max, exp, sum per row) is lane-wise over keys, with no horizontal reduction;
//  - per 32 keys: scores, the online-softmax update of each row's max and sum, the
//    probabilities rounded to bf16 in key pairs (as torch's flash kernel rounds them before
//    its second GEMM), and O += P V with V's key pairs interleaved (vdpbf16ps again: 16
//    dims per vector, the output's dims in the interleave's lane order, put back at the end);
//  - the accumulators O (rows x HD float), rescaled as each row's max grows, stay in L1/L2;
//    the key block's K and V rows are read from the cache once per item and reused by all
//    its rows; the next block's rows are prefetched while this one computes.
// Tiles whose rows all lie before a key block are skipped (causal), so a chunk's cost is
// the keys each row sees, rounded to blocks of 32.
template <int64_t HD>
void attend_block_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table,
                       c10::BFloat16* out, int64_t ctx, int64_t q_len, int64_t i0, int64_t i1, int64_t q_start,
                       int64_t kvh, int64_t H, int64_t Hkv, int64_t BS, float scale, int64_t window,
                       std::vector<float>& scratch) {
  static_assert(HD % 32 == 0, "head dim: a multiple of 32");
  constexpr int64_t NP = HD / 2;                    // bf16 pairs per row
  constexpr int64_t NV = HD / 16;                   // float vectors per row
  constexpr int64_t PR = NV >= 16 ? 1 : 16 / NV;    // rows per P V register tile (PR * NV = 16 accumulators)
  const int64_t g = H / Hkv;
  const int64_t rows = (i1 - i0) * g;
  const int64_t tiles = (rows + 31) / 32;
  const int64_t rp = tiles * 32;  // rows padded to whole tiles
  const int64_t first_pos = ctx - q_len;
  const int64_t n = first_pos + i1;  // keys [lo, n): up to the last row's position
  // With a sliding window a row at position p sees keys (p - window, p]; the first row's
  // window starts the item's keys.
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + i0 - window + 1) : 0;
  // Scratch, in floats: packed Q [NP][rp], O [rp][HD], max/sum/alpha/pos [rp] each,
  // scores [32 keys][32 rows], P pairs [16][32], V pairs [16][HD].
  const int64_t need = NP * rp + rp * HD + 4 * rp + kKeyBlock * 32 + 16 * 32 + 16 * HD;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  uint32_t* qp = reinterpret_cast<uint32_t*>(scratch.data());
  float* o = scratch.data() + NP * rp;
  float* mx = o + rp * HD;
  float* sum = mx + rp;
  float* alpha = sum + rp;
  int32_t* pos = reinterpret_cast<int32_t*>(alpha + rp);
  float* s = reinterpret_cast<float*>(pos + rp);
  uint32_t* pp = reinterpret_cast<uint32_t*>(s + kKeyBlock * 32);
  uint32_t* vp = pp + 16 * 32;

  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
  for (int64_t r = 0; r < rp; ++r) {
    if (r < rows) {
      const uint32_t* qr = q32 + ((q_start + i0 + r / g) * H + kvh * g + r % g) * NP;
      for (int64_t j = 0; j < NP; ++j) qp[j * rp + r] = qr[j];
      pos[r] = static_cast<int32_t>(first_pos + i0 + r / g);
    } else {  // padding rows: zero queries over every key (finite, never stored)
      for (int64_t j = 0; j < NP; ++j) qp[j * rp + r] = 0;
      pos[r] = static_cast<int32_t>(n - 1);
    }
    mx[r] = -std::numeric_limits<float>::infinity();
    sum[r] = 0.f;
  }
  std::fill(o, o + rp * HD, 0.f);

  const int64_t row_stride = Hkv * HD;
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(kc);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(vc);
  constexpr int64_t kLines = HD * 2 / 64;  // cache lines per row
  const float c = scale * 1.4426950408889634f;  // scores in log2 units: softmax by exp2
  const __m512 vc2 = _mm512_set1_ps(c);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Interleave of two bf16 vectors' lanes: [a0, b0, a1, b1, ...] from cvtne2ps_pbh's [a | b].
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);

  KeyCursor keys(kb, table, BS, row_stride, kvh * HD, lo, n - lo);
  const uint16_t* kr[kKeyBlock];  // padding keys: masked, their probabilities 0
  const uint16_t* kn[kKeyBlock];
  int64_t nk = keys.take(kr, kKeyBlock);
  for (int64_t k0 = lo; k0 < n; k0 += kKeyBlock) {
    const int64_t nn = keys.take(kn, kKeyBlock);
    for (int64_t t = 0; t < nn; ++t)
      for (int64_t l = 0; l < kLines; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(kn[t] + 32 * l), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vb + (kn[t] - kb) + 32 * l), _MM_HINT_T0);
      }
    // V's key pairs interleaved: vp[t][32 c + lane] holds (V[2t][d], V[2t+1][d]) with
    // d = 32 c + the lane's dim in unpacklo/hi_epi16's order (see the store at the end).
    for (int64_t t = 0; t < 16; ++t) {
      const uint16_t* va = vb + (kr[2 * t] - kb);
      const uint16_t* vb2 = vb + (kr[2 * t + 1] - kb);
      for (int64_t cc = 0; cc < HD / 32; ++cc) {
        const __m512i a = _mm512_loadu_si512(va + 32 * cc), b = _mm512_loadu_si512(vb2 + 32 * cc);
        _mm512_storeu_si512(vp + t * HD + 32 * cc, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(vp + t * HD + 32 * cc + 16, _mm512_unpackhi_epi16(a, b));
      }
    }
    const int64_t last_key = k0 + nk - 1;
    for (int64_t r0 = 0; r0 < rp; r0 += 32) {
      if (pos[r0 + 31] < k0) continue;  // every row of the tile precedes these keys
      if (window > 0 && pos[r0] - window >= last_key) continue;  // every row's window starts after them
      const bool masked = nk < kKeyBlock || last_key > pos[r0] || (window > 0 && k0 <= pos[r0 + 31] - window);
      // Scores S^T [32 keys][32 rows], in log2 units.
      for (int64_t kk = 0; kk < kKeyBlock; kk += 8) {
        __m512 acc[8][2];
        for (int u = 0; u < 8; ++u) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < NP; ++j) {
          const __m512bh qa = (__m512bh)_mm512_loadu_si512(qp + j * rp + r0);
          const __m512bh qb = (__m512bh)_mm512_loadu_si512(qp + j * rp + r0 + 16);
          for (int u = 0; u < 8; ++u) {
            const __m512bh kv = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(kr[kk + u])[j]);
            acc[u][0] = _mm512_dpbf16_ps(acc[u][0], qa, kv);
            acc[u][1] = _mm512_dpbf16_ps(acc[u][1], qb, kv);
          }
        }
        for (int u = 0; u < 8; ++u) {
          _mm512_storeu_ps(s + (kk + u) * 32, _mm512_mul_ps(acc[u][0], vc2));
          _mm512_storeu_ps(s + (kk + u) * 32 + 16, _mm512_mul_ps(acc[u][1], vc2));
        }
      }
      // Online softmax, 16 rows per vector.
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t rh = r0 + 16 * h;
        const __m512i pv = _mm512_loadu_si512(pos + rh);
        const __m512 m_old = _mm512_loadu_ps(mx + rh);
        __m512 m_new = m_old;
        for (int64_t k = 0; k < kKeyBlock; ++k) {
          __m512 sv = _mm512_loadu_ps(s + k * 32 + 16 * h);
          if (masked) {  // keys past a row's position, and the padding keys, weigh nothing
            const __m512i key = _mm512_set1_epi32(int32_t(k0 + k));
            __mmask16 hidden = k >= nk ? __mmask16(0xFFFF) : _mm512_cmpgt_epi32_mask(key, pv);
            if (window > 0) hidden |= _mm512_cmple_epi32_mask(key, _mm512_sub_epi32(pv, _mm512_set1_epi32(int32_t(window))));
            sv = _mm512_mask_mov_ps(sv, hidden, neg_inf);
            _mm512_storeu_ps(s + k * 32 + 16 * h, sv);
          }
          m_new = _mm512_max_ps(m_new, sv);
        }
        // A row that has seen no key yet (a window starting past these keys) has m_new =
        // -inf: subtract 0 instead, so its weights are ~0 and not NaN.
        const __m512 m_sub = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
        const __m512 a = exp2_nonpositive16(_mm512_sub_ps(m_old, m_sub));
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < 16; ++t) {
          const __m512 p0 = exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + 2 * t * 32 + 16 * h), m_sub));
          const __m512 p1 = exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + (2 * t + 1) * 32 + 16 * h), m_sub));
          total = _mm512_add_ps(total, _mm512_add_ps(p0, p1));
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0 lanes | p1 lanes]
          _mm512_storeu_si512(pp + t * 32 + 16 * h, _mm512_permutexvar_epi16(interleave, both));
        }
        _mm512_storeu_ps(sum + rh, _mm512_fmadd_ps(_mm512_loadu_ps(sum + rh), a, total));
        _mm512_storeu_ps(mx + rh, m_new);
        _mm512_storeu_ps(alpha + rh, a);
      }
      // O = O * alpha + P V for the tile's rows, PR rows at a time.
      const int64_t pairs = (nk + 1) / 2;
      for (int64_t r = r0; r < r0 + 32; r += PR) {
        __m512 acc[PR][NV];
        for (int64_t i = 0; i < PR; ++i) {
          const __m512 a = _mm512_set1_ps(alpha[r + i]);
          for (int64_t v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(o + (r + i) * HD + 16 * v), a);
        }
        for (int64_t t = 0; t < pairs; ++t) {
          __m512bh pb[PR];
          for (int64_t i = 0; i < PR; ++i) pb[i] = (__m512bh)_mm512_set1_epi32(int32_t(pp[t * 32 + (r - r0) + i]));
          for (int64_t v = 0; v < NV; ++v) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + t * HD + 16 * v);
            for (int64_t i = 0; i < PR; ++i) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pb[i], vv);
          }
        }
        for (int64_t i = 0; i < PR; ++i)
          for (int64_t v = 0; v < NV; ++v) _mm512_storeu_ps(o + (r + i) * HD + 16 * v, acc[i][v]);
      }
    }
    std::copy(kn, kn + kKeyBlock, kr);
    nk = nn;
  }
  // out = O / sum, the dims put back in order: within each 32, float lane p came from
  // unpacklo (p < 16) or unpackhi (p >= 16) of 128-bit lane L = (p % 16) / 4.
  uint16_t* ob = reinterpret_cast<uint16_t*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = ob + ((q_start + i0 + r / g) * H + kvh * g + r % g) * HD;
    const float inv = 1.f / sum[r];
    const float* orow = o + r * HD;
    for (int64_t cc = 0; cc < HD; cc += 32)
      for (int64_t p = 0; p < 32; ++p) {
        const int64_t lane = p % 16;
        const int64_t d = 8 * (lane / 4) + lane % 4 + (p >= 16 ? 4 : 0);
        dst[cc + d] = bf16_bits(orow[cc + p] * inv);
      }
  }
}
#endif

struct Item {
  int64_t seq, h0, h1, i0, i1, cost;  // KV heads [h0, h1), query tokens [i0, i1)
  bool blocked;                        // takes attend_block_bf16
};

#if defined(__AVX512BF16__)
constexpr int64_t kPartKeys = 128;  // keys a part of a split item takes at least

// Merges one query row's split-key parts into its output (flash-decoding's split-K): part
// j's partial (`partial(j)`: HD floats of its exp-weighted value sum, then its running max m_j
// and its weight sum l_j; l_j = 0 where none of the part's keys is the row's) scaled by
// e^(m_j - M), M the largest m_j, summed in part order, divided by the scaled weight sum and
// rounded to bf16 once into `dst`. The one merge of attention_parts and attention_invariant.
template <int64_t HD, typename PartialOf>
inline void merge_row_parts(int64_t n_parts, PartialOf partial, uint16_t* dst) {
  float big = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n_parts; ++j) {
    const float* pr = partial(j);
    if (pr[HD + 1] > 0.f) big = std::max(big, pr[HD]);
  }
  float total = 0.f;
  float acc[HD] = {};
  for (int64_t j = 0; j < n_parts; ++j) {
    const float* pr = partial(j);
    if (!(pr[HD + 1] > 0.f)) continue;  // no key of this part is the row's
    const float f = std::exp(pr[HD] - big);
    total += pr[HD + 1] * f;
    for (int64_t d = 0; d < HD; ++d) acc[d] += pr[d] * f;
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < HD; ++d) dst[d] = bf16_bits(acc[d] * inv);
}

// A step of few decodes whose items (one per sequence and KV head) are fewer than twice the
// threads: at batch 1 of a model with 3 KV heads, 3 items on 2 threads, so one thread
// attends two heads while the other waits. Each item's keys are split into parts (enough
// for two per thread, each of at least kPartKeys keys), every part computes its rows'
// unnormalised sums, maximum and softmax sum (attend_rows_bf16 with `partial`), and the
// parts are merged (flash-decoding's split-K): out = sum_j acc_j e^(m_j - M) /
// sum_j l_j e^(m_j - M), M the largest m_j. The same float arithmetic as one pass up to the
// order of the sums; rounded to bf16 once. False (nothing done) where the step does not
// qualify: then the items run as they are.
template <int64_t HD>
bool attention_parts(const std::vector<Item>& items, const c10::BFloat16* q, const c10::BFloat16* kc,
                     const c10::BFloat16* vc, const int32_t* tables, int64_t max_blocks, c10::BFloat16* o,
                     const int32_t* lens, const int32_t* qsl, int64_t H, int64_t Hkv, int64_t BS, double scale,
                     int64_t window, int64_t few_rows) {
  const int threads = kernel_threads();
  const int64_t n_items = static_cast<int64_t>(items.size()), g = H / Hkv;
  if (threads < 2 || n_items == 0 || n_items >= 2 * threads) return false;
  struct Part { int64_t item, key0, keys, offset; };
  std::vector<Part> parts;
  int64_t floats = 0;
  const int64_t want = (2 * threads + n_items - 1) / n_items;
  for (int64_t it = 0; it < n_items; ++it) {
    const Item& w = items[it];
    const int64_t rows = (w.i1 - w.i0) * g;
    if (w.blocked || w.h1 - w.h0 != 1 || rows > std::min(few_rows, kFewRows)) return false;
    const int64_t n = item_keys(lens[w.seq], qsl[w.seq + 1] - qsl[w.seq], w.i0, w.i1, window).n;
    const int64_t p = std::max<int64_t>(1, std::min(want, n / kPartKeys));
    for (int64_t j = 0; j < p; ++j) {
      const int64_t k0 = n * j / p / 16 * 16, k1 = j + 1 == p ? n : n * (j + 1) / p / 16 * 16;
      parts.push_back({it, k0, k1 - k0, floats});
      floats += rows * (HD + 2);
    }
  }
  if (static_cast<int64_t>(parts.size()) == n_items) return false;  // too few keys to split
  std::vector<float> partials(floats);
  const int64_t n_parts = static_cast<int64_t>(parts.size());
  const float sc = static_cast<float>(scale);
  parallel_chunks(n_parts, [&](int64_t i) {
    thread_local std::vector<float> scratch;
    const Part& pt = parts[i];
    const Item& w = items[pt.item];
    attend_rows_bf16<HD>(q, kc, vc, tables + w.seq * max_blocks, o, lens[w.seq], qsl[w.seq + 1] - qsl[w.seq], w.i0,
                         w.i1, qsl[w.seq], w.h0, H, Hkv, BS, sc, window, scratch, pt.key0, pt.keys,
                         partials.data() + pt.offset);
  });
  // Merge each item's parts (they are adjacent in `parts`), row by row.
  uint16_t* ob = reinterpret_cast<uint16_t*>(o);
  for (int64_t i = 0; i < n_parts;) {
    int64_t e = i;
    while (e < n_parts && parts[e].item == parts[i].item) ++e;
    const Item& w = items[parts[i].item];
    const int64_t rows = (w.i1 - w.i0) * g, q_start = qsl[w.seq];
    for (int64_t r = 0; r < rows; ++r) {
      merge_row_parts<HD>(e - i, [&](int64_t j) { return partials.data() + parts[i + j].offset + r * (HD + 2); },
                          ob + item_row(q_start, w.i0, r, g, H, w.h0) * HD);
    }
    i = e;
  }
  return true;
}
#endif

// ---------------------------------------------------------------------------------------
// Batch-, chunk- and cache-invariant bf16 attention (the default route: `key_part` > 0).
// A query row's output is one fixed function of its query, its keys and values, and their
// absolute positions, whatever else the step holds: how many sequences, how long its chunk
// is, which of its keys came from the prefix cache or an earlier chunk, how many threads.
// So a request's tokens do not depend on the server's load (docs/ARCHITECTURE.md, "Same
// request, same tokens"). That function:
//  - the keys are cut into parts at fixed absolute positions [j P, (j + 1) P) (P =
//    key_part, a multiple of 16), and within a part into groups of 16 at absolute
//    positions too;
//  - a key's score: the bf16 query and key as stored, HD/32 vdpbf16ps in one chain (lane j
//    holding the dims' pairs j, 16 + j, ...), the 16 lanes summed by sum16's tree, times the
//    scale; computed per row as dot products (few rows: a decode) or, for many rows, with
//    the group's keys transposed and the keys in the lanes (one vector per lane j, then
//    tree16: the same adds in the same order), the same bits either way;
//  - per part, the row's maximum score m_j over its keys there, e = 2^((s - m_j) log2 e)
//    (exp2_nonpositive16), the sum l_j of e in 16 lanes by key position mod 16 over the
//    part's groups in order, then _mm512_reduce_add_ps; the weighted values acc_j: e
//    rounded to bf16 and taken in key pairs (2i, 2i + 1) from the part's start, one float32
//    vdpbf16ps chain per dimension over the pairs in order;
//  - the parts merged in order: M the largest m_j of the parts holding a key of the row,
//    out = sum_j acc_j e^(m_j - M) / sum_j l_j e^(m_j - M), rounded to bf16 once.
// Keys a row does not see (after it, or before its window) are computed and then weighted
// by exactly 0, which adds nothing to any sum; so rows sharing a work item with other rows
// get the bits they would get alone. Work items (a sequence's tokens [i0, i1) and one KV
// head) and their parts are what the threads share, so a batch-1 decode still spreads over
// every thread; how items are cut changes no result.
#if defined(__AVX512BF16__)
struct PartWork {
  int64_t item, key_lo, key_hi, offset;  // absolute key range [key_lo, key_hi); partials at offset
};


// One item's part on the invariant route (see above): the keys [key_lo, key_hi) (key_lo a
// multiple of 16 or the part's start) for query tokens [i0, i1) of the chunk of q_len new
// tokens at the end of ctx; writes each row's acc [HD], m, l to partial (rows x (HD + 2)
// floats; l = 0 where no key is the row's). The part's K (for many rows) and V are prepared
// once for all of the item's rows, in the pair layout vdpbf16ps wants:
//  - scores: few rows (a decode's group of query heads), score_16_keys's dot products;
//    many, each group of 16 keys transposed once to [HD/2 pairs][16 keys] and each row's
//    scores with the keys in the lanes (transposed_scores);
//  - V interleaved once by key pairs to [HD/16][pairs][16 dims][2]; a row's weights rounded
//    to bf16 and paired the same way; its value sums: per 16 dims one vdpbf16ps chain over
//    the pairs, rows in tiles sharing the V loads.
// Every step is per row, so a row's partials do not depend on the item's other rows.
// Items of at least this many query rows transpose each group of keys for their scores.
constexpr int64_t kTransposeRows = 8;

template <int64_t HD>
struct PartScratch {
  std::vector<float> scores;     // [rows][stride]: scores, then e
  std::vector<uint16_t> weights; // [rows][stride]: e rounded to bf16 (an int8 cache: e x the value's scale)
  std::vector<uint32_t> keys;    // [HD/2][16]: one group of keys, transposed
  std::vector<uint32_t> values;  // [HD/16][pairs][16]
  std::vector<const uint16_t*> value_rows;  // a decode's: each key's value row, nullptr past the part's last
  std::vector<float> value_scales;  // an int8 cache: [stride], each key's value scale
  std::vector<uint16_t> value_scale_bits;  // the same as bf16 bits, as read
};

// An item's query rows as int8, for the scores against an int8 cache (quantize_query_rows).
struct QueryCodes {
  const int8_t* codes = nullptr;     // [rows][HD]
  const float* scales = nullptr;     // [rows]: each row's q_scale x the softmax scale
  const int32_t* offsets = nullptr;  // [rows]: 128 x the sum of the row's codes (the key codes' u8 offset)
};

// A cache row's geometry on the invariant route, in the uint16 units KeyCursor walks: a bf16
// cache's row is HD values; an int8 cache's (`--kv-cache-dtype int8`, kernels/kv_quant.py)
// is HD one-byte codes and the row's scale, a bf16, in its last two bytes (HD/2 + 1 units).
template <int64_t HD, bool Q8>
struct CacheRow {
  static constexpr int64_t units = Q8 ? HD / 2 + 1 : HD;
  static constexpr int64_t lines = (2 * units + 63) / 64;  // 64-byte lines from its start (2-byte aligned)
};

// sum16 on int32 lanes: lane j of the result is the sum of v[j]'s 16 lanes (exact).
inline __m512i sum16_epi32(const __m512i* v) {
  __m512i pair[8];
  for (int i = 0; i < 8; ++i)
    pair[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  __m512i quad[4];
  for (int i = 0; i < 4; ++i)
    quad[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pair[2 * i], pair[2 * i + 1]),
                               _mm512_unpackhi_epi64(pair[2 * i], pair[2 * i + 1]));
  const __m512i xy = _mm512_add_epi32(_mm512_shuffle_i32x4(quad[0], quad[1], 0x88), _mm512_shuffle_i32x4(quad[0], quad[1], 0xDD));
  const __m512i zw = _mm512_add_epi32(_mm512_shuffle_i32x4(quad[2], quad[3], 0x88), _mm512_shuffle_i32x4(quad[2], quad[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(xy, zw, 0x88), _mm512_shuffle_i32x4(xy, zw, 0xDD));
}

// The scores of 16 keys of an int8 cache for one int8 query row: per key the exact integer
// dot of the row's codes and the key's (vpdpbusd takes the key codes as u8, flipped by 128:
// `offset` = 128 x the row's code sum takes that back), then, as floats,
// (dot x (q_scale x scale)) x k_scale. Integer sums are exact, so the transposed form below
// gives the same bits.
template <int64_t HD>
inline __m512 q8_scores_16_keys(const int8_t* q, const int8_t* const* keys, __m512 row_scale, __m512i offset,
                                __m512 key_scales) {
  constexpr int64_t NC = HD / 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i qv[NC];
  for (int64_t c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(q + 64 * c);
  __m512i dots[16];
  for (int t = 0; t < 16; ++t) {
    __m512i a = _mm512_setzero_si512();
    for (int64_t c = 0; c < NC; ++c)
      a = _mm512_dpbusd_epi32(a, _mm512_xor_si512(_mm512_loadu_si512(keys[t] + 64 * c), flip), qv[c]);
    dots[t] = a;
  }
  const __m512i sums = _mm512_sub_epi32(sum16_epi32(dots), offset);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), row_scale), key_scales);
}

// The same scores with the 16 keys' code quads transposed (kt: [HD/4][16], flipped to u8):
// one vpdpbusd per quad, the keys in the lanes.
template <int64_t HD>
inline __m512 q8_transposed_scores(const int8_t* q, const uint32_t* kt, __m512 row_scale, __m512i offset,
                                   __m512 key_scales) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t p = 0; p < HD / 4; ++p) {
    int32_t quad;
    std::memcpy(&quad, q + 4 * p, sizeof(quad));
    acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(kt + 16 * p), _mm512_set1_epi32(quad));
  }
  const __m512i sums = _mm512_sub_epi32(acc, offset);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), row_scale), key_scales);
}

// An item's query rows as int8 for the scores against an int8 cache: per row, symmetric,
// q_scale = absmax / 127 (float), codes = clamp(round_half_even(x / q_scale)); kept: the
// codes, q_scale x scale, and 128 x the code sum. A row's codes depend on the row alone.
template <int64_t HD, typename QRow>
inline void quantize_query_rows(int8_t* all_codes, float* scales, int32_t* offsets, int64_t rows, float scale,
                                const QRow& q_row) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* x = q_row(r);
    float amax = 0.f;
    for (int64_t d = 0; d < HD; ++d) amax = std::max(amax, std::fabs(bf16_to_float_bits(x[d])));
    const float qs = amax / 127.f;
    int8_t* codes = all_codes + r * HD;
    int32_t sum = 0;
    for (int64_t d = 0; d < HD; ++d) sum += codes[d] = int8_code(bf16_to_float_bits(x[d]), qs);
    scales[r] = qs * scale;
    offsets[r] = 128 * sum;
  }
}

// sum16's tree, on 16 vectors whose lanes are keys: out = sum over j of L[j], added in the
// order sum16 adds the 16 lanes of one key's vector (its unpack and shuffle stages, worked
// out: lanes 4c..4c+3 as (L4c + L4c+2) + (L4c+1 + L4c+3), then (c0 + c1) + (c2 + c3)), so
// a score computed with the keys in the lanes is the same bits as score_16_keys's.
inline __m512 tree16(const __m512* L) {
  __m512 P[4];
  for (int c = 0; c < 4; ++c)
    P[c] = _mm512_add_ps(_mm512_add_ps(L[4 * c], L[4 * c + 2]), _mm512_add_ps(L[4 * c + 1], L[4 * c + 3]));
  return _mm512_add_ps(_mm512_add_ps(P[0], P[1]), _mm512_add_ps(P[2], P[3]));
}

// score_16_keys's scores for one query row q (its 32-bit pairs) and the 16 keys of group
// kt ([HD/2 pairs][16 keys]), keys in the lanes: lane value j of score_16_keys's chain is
// the chain over the pairs j, 16 + j, ... (HD/32 of them, in order), here one vector per j;
// then tree16 and the scale.
template <int64_t HD>
inline __m512 transposed_scores(const uint32_t* q, const uint32_t* kt, __m512 vscale) {
  constexpr int64_t NQ = HD / 32;
  __m512 L[16];
  for (int j = 0; j < 16; ++j) L[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < NQ; ++c)
    for (int j = 0; j < 16; ++j)
      L[j] = _mm512_dpbf16_ps(L[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[16 * c + j])),
                              (__m512bh)_mm512_loadu_si512(kt + (16 * c + j) * 16));
  return _mm512_mul_ps(tree16(L), vscale);
}

// Value sums of RT rows: per dimension block c, one chain over the key pairs in order.
template <int64_t HD, int RT, typename Done>
inline void pair_values(const uint32_t* const* w, const uint32_t* vt, int64_t pairs, int64_t r0, const Done& done) {
  constexpr int64_t NV = HD / 16;
  __m512 acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int64_t c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh wp[RT];
    for (int r = 0; r < RT; ++r) wp[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r][j]));
    for (int64_t c = 0; c < NV; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(vt + (c * pairs + j) * 16);
      for (int r = 0; r < RT; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wp[r], v);
    }
  }
  for (int r = 0; r < RT; ++r) done(r0 + r, acc[r]);
}

// pair_values for a decode's few rows, from the cache rows themselves: pair j's vector for
// dims [16c, 16c + 16) is (v[2j][d], v[2j + 1][d]) per lane, the layout the interleaved copy
// holds, built in registers (one vpermt2w per 16 dims from the two rows' 32) instead of
// written to the part's scratch and read back; `vrows[k]`: key k's value row, nullptr past
// the part's last key (zeros, as the copy has). The same chains on the same vectors: the
// same bits. RT * HD / 16 accumulators must fit beside the pair vectors (RT * HD <= 256).
template <int64_t HD, int RT, typename Done>
inline void pair_values_from_rows(const uint32_t* const* w, const uint16_t* const* vrows, int64_t pairs, int64_t r0,
                                  const Done& done) {
  constexpr int64_t NV = HD / 16;
  static_assert(RT * NV <= 16, "pair_values_from_rows: at most 16 accumulators");
  // Words 2i, 2i + 1 of the pair vector: dim i of the first row (a), of the second (b);
  // `low` takes dims 0-15 of a 32-dim slice, `high` dims 16-31 (vpermt2w: b's words at 32 +).
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  __m512 acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int64_t c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh wp[RT];
    for (int r = 0; r < RT; ++r) wp[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r][j]));
    const uint16_t* v0 = vrows[2 * j];
    const uint16_t* v1 = vrows[2 * j + 1];
    for (int64_t c = 0; c < NV; c += 2) {
      const __m512i a = v0 ? _mm512_loadu_si512(v0 + 16 * c) : _mm512_setzero_si512();
      const __m512i b = v1 ? _mm512_loadu_si512(v1 + 16 * c) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(a, low, b);
      const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(a, high, b);
      for (int r = 0; r < RT; ++r) {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wp[r], lo);
        acc[r][c + 1] = _mm512_dpbf16_ps(acc[r][c + 1], wp[r], hi);
      }
    }
  }
  for (int r = 0; r < RT; ++r) done(r0 + r, acc[r]);
}

// An int8 cache (Q8): the scores are integer dot products, as llama.cpp scores its q8_0
// cache: the item's query rows quantized to int8 once per part (per row, absmax / 127:
// quantize_query_rows), each key's codes against them with vpdpbusd (AVX512-VNNI: 64 code
// products per instruction, exact int32 sums, no widening of the keys), then as floats
// (dot x (q_scale x scale)) x k_scale. Integer sums are exact in any order, so the decode
// path (q8_scores_16_keys) and the transposed one (q8_transposed_scores) give the same bits.
// A value's scale goes into its weight (e x v_scale, rounded to bf16 as e alone would be),
// the sum l stays over e: the value sums are sum(bf16(e v_scale) x code), the codes widened
// to bf16 exactly as the part's values are interleaved. No dequantized copy of the cache is
// made.
template <int64_t HD, bool Q8>
void attend_part_pairs_bf16(const c10::BFloat16* q, const uint16_t* kb, const uint16_t* vb, const int32_t* table,
                            int64_t ctx, int64_t q_len, int64_t i0, int64_t i1, int64_t q_start, int64_t kvh, int64_t H,
                            int64_t Hkv, int64_t BS, float scale, int64_t window, int64_t key_lo, int64_t key_hi,
                            float* partial, PartScratch<HD>& scratch, const QueryCodes& query_codes) {
  static_assert(HD % 32 == 0, "head dim: a multiple of 32");
  constexpr int64_t NV = HD / 16, NP = HD / 2;
  constexpr int64_t kUnits = CacheRow<HD, Q8>::units, kLines = CacheRow<HD, Q8>::lines;
  const int64_t g = H / Hkv, rows = (i1 - i0) * g, first_pos = ctx - q_len;
  const int64_t n = key_hi - key_lo, groups = (n + 15) / 16, stride = groups * 16, pairs = stride / 2;
  scratch.scores.resize(rows * stride);
  scratch.weights.resize(rows * stride);
  scratch.keys.resize(NP * 16);
  // A decode's few rows (no int8 cache) weigh the value rows where they lie
  // (pair_values_from_rows); others, an interleaved copy of the part's values.
  const bool values_in_place = !Q8 && rows <= 4 && rows * NV <= 16;
  if (values_in_place) {
    scratch.value_rows.resize(stride);
  } else {
    scratch.values.resize(NV * pairs * 16);
  }
  float* s = scratch.scores.data();
  const int64_t row_stride = Hkv * kUnits, head_offset = kvh * kUnits;
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(q);
  if constexpr (Q8) {
    scratch.value_scales.resize(stride);
    scratch.value_scale_bits.resize(stride);
  }
  KeyPrefetch prefetch(kb, table, BS, row_stride, head_offset, key_lo, n, kLines);  // see there
  prefetch.ahead(kPrefetchAheadKeys);
  const __m512 vscale = _mm512_set1_ps(scale);
  auto q_row = [&](int64_t r) { return qb + item_row(q_start, i0, r, g, H, kvh) * HD; };
  KeyCursor cursor(kb, table, BS, row_stride, head_offset, key_lo, n);
  const uint16_t* kp[16];  // slots past the part's last key repeat it (their scores are never used)
  uint32_t* kt = scratch.keys.data();
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t got = cursor.take(kp, 16);
    prefetch.ahead(16);
    for (int64_t t = 0; t < 16; ++t)
      for (int64_t c = 0; c < kLines; ++c) _mm_prefetch(reinterpret_cast<const char*>(vb + (kp[t] - kb) + 32 * c), _MM_HINT_T1);
    if (values_in_place)
      for (int64_t t = 0; t < 16; ++t) scratch.value_rows[gi * 16 + t] = t < got ? vb + (kp[t] - kb) : nullptr;
    if constexpr (Q8) {  // integer dots of the int8 query rows and the key codes (see above)
      alignas(32) uint16_t key_scale_bits[16];
      for (int64_t t = 0; t < 16; ++t) key_scale_bits[t] = kp[t][HD / 2];
      const __m512 key_scales = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(key_scale_bits))), 16));
      const int8_t* codes[16];
      for (int64_t t = 0; t < 16; ++t) codes[t] = reinterpret_cast<const int8_t*>(kp[t]);
      if (rows >= kTransposeRows) {  // the group's code quads transposed once, the keys in the lanes
        for (int64_t t = 0; t < 16; ++t) {
          const uint32_t* src = reinterpret_cast<const uint32_t*>(codes[t]);
          for (int64_t p = 0; p < HD / 4; ++p) kt[p * 16 + t] = src[p] ^ 0x80808080u;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* qr = query_codes.codes + r * HD;
        const __m512 row_scale_v = _mm512_set1_ps(query_codes.scales[r]);
        const __m512i offset = _mm512_set1_epi32(query_codes.offsets[r]);
        _mm512_storeu_ps(s + r * stride + gi * 16,
                         rows < kTransposeRows ? q8_scores_16_keys<HD>(qr, codes, row_scale_v, offset, key_scales)
                                               : q8_transposed_scores<HD>(qr, kt, row_scale_v, offset, key_scales));
      }
      continue;
    }
    if (rows < kTransposeRows) {  // a decode: each row's dot products, reduced by sum16
      score_16_keys<HD>(q_row, rows, kp, s + gi * 16, stride, vscale);
    } else {
      // Many rows: the group's keys transposed once, the rows' scores with the keys in the lanes.
      for (int64_t t = 0; t < 16; ++t) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(kp[t]);
        for (int64_t p = 0; p < NP; ++p) kt[p * 16 + t] = src[p];
      }
      for (int64_t r = 0; r < rows; ++r)
        _mm512_storeu_ps(s + r * stride + gi * 16,
                         transposed_scores<HD>(reinterpret_cast<const uint32_t*>(q_row(r)), kt, vscale));
    }
  }
  // V interleaved by key pairs (a pair past the part's last key: zeros); an int8 cache's
  // codes widened to bf16, each key's scale kept for its weight.
  if (!values_in_place) {
    KeyCursor cursor(vb, table, BS, row_stride, head_offset, key_lo, n);
    uint32_t* vt = scratch.values.data();
    float* value_scales = Q8 ? scratch.value_scales.data() : nullptr;
    uint16_t* value_scale_bits = Q8 ? scratch.value_scale_bits.data() : nullptr;
    const __m256i zero = _mm256_setzero_si256();
    auto dims = [&](const uint16_t* row, int64_t c) {
      if (!row) return zero;
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c));
    };
    auto int8x16_to_float = [&](const uint16_t* row, int64_t c) {  // an int8 row's codes [16c, 16c + 16)
      if (!row) return _mm512_setzero_ps();
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const int8_t*>(row) + 16 * c))));
    };
    for (int64_t j = 0; j < pairs; ++j) {
      const uint16_t* v0 = nullptr;
      const uint16_t* v1 = nullptr;
      if (2 * j < n) {
        v0 = cursor.row();
        if (2 * j + 1 < n) cursor.next();
      }
      if (2 * j + 1 < n) {
        v1 = cursor.row();
        if (2 * j + 2 < n) cursor.next();
      }
      if constexpr (Q8) {  // the scales' bits, widened below
        value_scale_bits[2 * j] = v0 ? v0[HD / 2] : 0;
        value_scale_bits[2 * j + 1] = v1 ? v1[HD / 2] : 0;
      }
      for (int64_t c = 0; c < NV; ++c) {
        __m512i pair;
        if constexpr (Q8) {
          // An int8 code as a float has 16 zero low bits: its bf16 is its float's high half,
          // so the pair is v1's float bits with v0's high half shifted into the low half.
          pair = _mm512_or_si512(_mm512_castps_si512(int8x16_to_float(v1, c)),
                                 _mm512_srli_epi32(_mm512_castps_si512(int8x16_to_float(v0, c)), 16));
        } else {
          pair = _mm512_or_si512(_mm512_cvtepu16_epi32(dims(v0, c)), _mm512_slli_epi32(_mm512_cvtepu16_epi32(dims(v1, c)), 16));
        }
        _mm512_storeu_si512(vt + (c * pairs + j) * 16, pair);
      }
    }
    if constexpr (Q8) {
      for (int64_t k0 = 0; k0 < stride; k0 += 16)
        _mm512_storeu_ps(value_scales + k0, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value_scale_bits + k0))), 16)));
    }
  }
  // Per row: max, e (0 outside the row's keys), its sum; e rounded to bf16 for the values.
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = first_pos + i0 + r / g;
    const int64_t a = std::max<int64_t>(0, (window > 0 ? p - window + 1 : 0) - key_lo);
    const int64_t b = std::min<int64_t>(n, p + 1 - key_lo);
    float* sr = s + r * stride;
    uint16_t* wr = scratch.weights.data() + r * stride;
    float* pr = partial + r * (HD + 2);
    if (a >= b) {  // none of the part's keys is this row's
      for (int64_t c = 0; c < HD + 2; ++c) pr[c] = 0.f;
      std::memset(wr, 0, stride * sizeof(uint16_t));
      continue;
    }
    // The row's largest score over its keys, 16 at a time (a maximum is exact in any order).
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k0 = a; k0 < b; k0 += 16) {
      const __mmask16 mk = b - k0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (b - k0)) - 1);
      vmax = _mm512_mask_max_ps(vmax, mk, vmax, _mm512_maskz_loadu_ps(mk, sr + k0));
    }
    const float m = _mm512_reduce_max_ps(vmax);
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < stride; k0 += 16) {
      const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(k0)));
      const __mmask16 in = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(static_cast<int>(a))) &
                           _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(static_cast<int>(b)));
      const __m512 e = _mm512_maskz_mov_ps(
          in, exp2_nonpositive16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, sr + k0), vm), log2e)));
      sum = _mm512_add_ps(sum, e);
      __m512 weight = e;
      if constexpr (Q8) weight = _mm512_mul_ps(e, _mm512_loadu_ps(scratch.value_scales.data() + k0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wr + k0), (__m256i)_mm512_cvtneps_pbh(weight));
    }
    pr[HD] = m;
    pr[HD + 1] = _mm512_reduce_add_ps(sum);
  }
  // Value sums, rows in tiles (24 accumulators at head dim 64).
  constexpr int kRows = HD >= 256 ? 1 : static_cast<int>(384 / HD);
  auto done = [&](int64_t r, const __m512* acc) {
    float* pr = partial + r * (HD + 2);
    if (!(pr[HD + 1] > 0.f)) return;  // zeroed above
    for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(pr + 16 * c, acc[c]);
  };
  const uint32_t* weights = reinterpret_cast<const uint32_t*>(scratch.weights.data());
  if (values_in_place) {  // rows * NV <= 16: one tile
    if constexpr (!Q8) {
      const uint32_t* w[4];
      for (int64_t r = 0; r < rows; ++r) w[r] = weights + r * pairs;
      const uint16_t* const* vrows = scratch.value_rows.data();
      switch (rows) {
        case 1: pair_values_from_rows<HD, 1>(w, vrows, pairs, 0, done); break;
        case 2: if constexpr (2 * NV <= 16) pair_values_from_rows<HD, 2>(w, vrows, pairs, 0, done); break;
        case 3: if constexpr (3 * NV <= 16) pair_values_from_rows<HD, 3>(w, vrows, pairs, 0, done); break;
        default: if constexpr (4 * NV <= 16) pair_values_from_rows<HD, 4>(w, vrows, pairs, 0, done); break;
      }
    }
    return;
  }
  int64_t r0 = 0;
  for (; r0 + kRows <= rows; r0 += kRows) {
    const uint32_t* w[kRows];
    for (int r = 0; r < kRows; ++r) w[r] = weights + (r0 + r) * pairs;
    pair_values<HD, kRows>(w, scratch.values.data(), pairs, r0, done);
  }
  if (r0 < rows) {  // the last rows (a decode's whole group of query heads) in one tile
    const uint32_t* w[kRows];
    for (int64_t r = 0; r < rows - r0; ++r) w[r] = weights + (r0 + r) * pairs;
    switch (rows - r0) {
      case 1: pair_values<HD, 1>(w, scratch.values.data(), pairs, r0, done); break;
      case 2: pair_values<HD, 2>(w, scratch.values.data(), pairs, r0, done); break;
      case 3: pair_values<HD, 3>(w, scratch.values.data(), pairs, r0, done); break;
      case 4: pair_values<HD, 4>(w, scratch.values.data(), pairs, r0, done); break;
      default: pair_values<HD, 5>(w, scratch.values.data(), pairs, r0, done); break;
    }
  }
}

// The invariant route for a step's bf16 chunks (see above): items of up to `q_chunk` query
// tokens per KV head, their parts at multiples of key_part, parts on the threads, then each
// item's rows merged.
template <int64_t HD, bool Q8>
void attention_invariant(const c10::BFloat16* q, const uint16_t* kc, const uint16_t* vc,
                         const int32_t* tables, int64_t max_blocks, c10::BFloat16* o, const int32_t* lens,
                         const int32_t* qsl, int64_t S, int64_t H, int64_t Hkv, int64_t BS, double scale,
                         int64_t window, int64_t q_chunk, int64_t key_part) {
  const int64_t g = H / Hkv;
  std::vector<Item> items;
  std::vector<PartWork> parts;
  std::vector<int64_t> first_part;  // items[i]'s parts: [first_part[i], first_part[i + 1])
  int64_t floats = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s], ctx = lens[s];
    for (int64_t i0 = 0; i0 < q_len; i0 += q_chunk) {
      const int64_t i1 = std::min(q_len, i0 + q_chunk);
      const ItemKeys keys = item_keys(ctx, q_len, i0, i1, window);
      for (int64_t h = 0; h < Hkv; ++h) {
        first_part.push_back(static_cast<int64_t>(parts.size()));
        const int64_t it = static_cast<int64_t>(items.size());
        items.push_back({s, h, h + 1, i0, i1, 0, false});
        const int64_t end = keys.lo + keys.n;
        for (int64_t j0 = keys.lo / key_part * key_part; j0 < end; j0 += key_part) {
          const int64_t lo = std::max(j0, keys.lo / 16 * 16), hi = std::min(end, j0 + key_part);
          parts.push_back({it, lo, hi, floats});
          floats += (i1 - i0) * g * (HD + 2);
        }
      }
    }
  }
  first_part.push_back(static_cast<int64_t>(parts.size()));
  // An int8 cache: each item's query rows quantized once (first, on the threads), read by its parts.
  std::vector<int64_t> item_rows;  // items[i]'s rows start at row item_rows[i] of the codes
  int64_t total_rows = 0;
  for (const Item& w : items) {
    item_rows.push_back(total_rows);
    total_rows += (w.i1 - w.i0) * g;
  }
  thread_local std::vector<int8_t> query_codes;
  thread_local std::vector<float> query_scales;
  thread_local std::vector<int32_t> query_offsets;
  if (Q8) {
    query_codes.resize(total_rows * HD);
    query_scales.resize(total_rows);
    query_offsets.resize(total_rows);
  }
  // The calling thread's buffers, by pointer: inside the parallel region the names would
  // be each thread's own thread_local.
  int8_t* const q_codes = query_codes.data();
  float* const q_scales = query_scales.data();
  int32_t* const q_offsets = query_offsets.data();
  // Every part writes all of its rows' partials, so the buffer needs no clearing; kept per
  // thread across calls: a long prompt's partials (tens of MB per layer) would otherwise be
  // zero-filled and page-faulted in afresh at every layer.
  thread_local std::vector<float> partial_buffer;
  if (static_cast<int64_t>(partial_buffer.size()) < floats) partial_buffer.resize(floats);
  float* const partials = partial_buffer.data();
  const int64_t n_parts = static_cast<int64_t>(parts.size()), n_items = static_cast<int64_t>(items.size());
  const float sc = static_cast<float>(scale);
  if (Q8) {
    parallel_chunks(n_items, [&](int64_t it) {
      const Item& w = items[it];
      const int64_t r0 = item_rows[it];
      const uint16_t* qb = reinterpret_cast<const uint16_t*>(q);
      quantize_query_rows<HD>(q_codes + r0 * HD, q_scales + r0, q_offsets + r0, (w.i1 - w.i0) * g, sc,
                              [&](int64_t r) { return qb + item_row(qsl[w.seq], w.i0, r, g, H, w.h0) * HD; });
    });
  }
  parallel_chunks(n_parts, [&](int64_t i) {
    // Per thread and kept across calls (the pool's threads persist): a step's every layer
    // would otherwise allocate the four buffers afresh on each thread.
    thread_local PartScratch<HD> scratch;
    const PartWork& pt = parts[i];
    const Item& w = items[pt.item];
    QueryCodes codes;
    if (Q8) {
      const int64_t r0 = item_rows[pt.item];
      codes = {q_codes + r0 * HD, q_scales + r0, q_offsets + r0};
    }
    attend_part_pairs_bf16<HD, Q8>(q, kc, vc, tables + w.seq * max_blocks, lens[w.seq], qsl[w.seq + 1] - qsl[w.seq],
                                   w.i0, w.i1, qsl[w.seq], w.h0, H, Hkv, BS, sc, window, pt.key_lo, pt.key_hi,
                                   partials + pt.offset, scratch, codes);
  });
  parallel_chunks(n_items, [&](int64_t it) {
    const Item& w = items[it];
    const int64_t rows = (w.i1 - w.i0) * g, q_start = qsl[w.seq];
    uint16_t* ob = reinterpret_cast<uint16_t*>(o);
    const int64_t first = first_part[it];
    for (int64_t r = 0; r < rows; ++r) {
      merge_row_parts<HD>(first_part[it + 1] - first,
                          [&](int64_t j) { return partials + parts[first + j].offset + r * (HD + 2); },
                          ob + item_row(q_start, w.i0, r, g, H, w.h0) * HD);
    }
  });
}
#endif

// attention_invariant at the head dims it is compiled for (64, 128, 256); false for another.
template <bool Q8>
bool attention_invariant_dims(int64_t D, const c10::BFloat16* q, const uint16_t* kc, const uint16_t* vc,
                              const int32_t* tables, int64_t max_blocks, c10::BFloat16* o, const int32_t* lens,
                              const int32_t* qsl, int64_t S, int64_t H, int64_t Hkv, int64_t BS, double scale,
                              int64_t window, int64_t q_chunk, int64_t key_part) {
  switch (D) {
    case 64: attention_invariant<64, Q8>(q, kc, vc, tables, max_blocks, o, lens, qsl, S, H, Hkv, BS, scale, window, q_chunk, key_part); return true;
    case 128: attention_invariant<128, Q8>(q, kc, vc, tables, max_blocks, o, lens, qsl, S, H, Hkv, BS, scale, window, q_chunk, key_part); return true;
    case 256: attention_invariant<256, Q8>(q, kc, vc, tables, max_blocks, o, lens, qsl, S, H, Hkv, BS, scale, window, q_chunk, key_part); return true;
    default: return false;
  }
}

template <typename T>
void paged_attention_impl(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                          const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                          int64_t window, int64_t q_chunk, int64_t skip_over, int64_t few_rows,
                          int64_t block_over, int64_t key_part) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t S = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (key_part > 0 && S > 0) {  // the invariant route (attention_invariant): every chunk, decode or prefill
      TORCH_CHECK(key_part % 16 == 0 && q_chunk > 0, "paged_attention: key_part a positive multiple of 16 expected");
      const auto* qp = query.data_ptr<c10::BFloat16>();
      const auto* kp = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<c10::BFloat16>());
      const auto* vp = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<c10::BFloat16>());
      auto* op = out.data_ptr<c10::BFloat16>();
      if (attention_invariant_dims<false>(D, qp, kp, vp, tables, max_blocks, op, lens, qsl, S, H, Hkv, BS, scale, window,
                                          q_chunk, key_part))
        return;
    }
  }
#endif
  // A chunk of more than skip_over new tokens (skip_over > 0) is the caller's (torch's
  // flash kernel: float32).
  auto skipped = [&](int64_t q_len) { return skip_over > 0 && q_len > skip_over; };
  // Work items: a sequence's chunk of query tokens, for one KV head, or for all of them
  // when there are items enough to keep every thread busy (4 per thread): one thread then
  // reads each cached token's K/V rows of every head, adjacent in memory, in one go.
  // bf16 chunks of more than block_over query rows (new tokens x the KV head's group;
  // block_over > 0) take the blocked loop, in items of up to kBlockRows rows.
  bool block_ok = false;
#if defined(__AVX512BF16__)
  block_ok = std::is_same_v<T, c10::BFloat16> && block_over > 0 && (D == 64 || D == 128 || D == 256);
#endif
  auto blocked = [&](int64_t q_len) { return block_ok && q_len * (H / Hkv) > block_over; };
  const int64_t block_chunk = std::max<int64_t>(1, kBlockRows / (H / Hkv));
  auto chunk_of = [&](int64_t q_len) { return blocked(q_len) ? block_chunk : q_chunk; };
  int64_t chunks = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    if (!skipped(q_len)) chunks += (q_len + chunk_of(q_len) - 1) / chunk_of(q_len);
  }
  const bool whole_heads = chunks >= 4 * kernel_threads();
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    if (skipped(q_len)) continue;  // the caller attends this chunk
    const bool b = blocked(q_len);
    const int64_t step = chunk_of(q_len);
    for (int64_t i0 = 0; i0 < q_len; i0 += step) {
      const int64_t i1 = std::min(q_len, i0 + step);
      // Cost: the rows times the keys they see (causal: the chunk's keys up to its last row).
      const int64_t keys = lens[s] - q_len + i1;
      if (whole_heads) {
        items.push_back({s, 0, Hkv, i0, i1, (i1 - i0) * keys * Hkv, b});
      } else {
        for (int64_t h = 0; h < Hkv; ++h) items.push_back({s, h, h + 1, i0, i1, (i1 - i0) * keys, b});
      }
    }
  }
  // Largest items first, then dynamic scheduling: a long prefill chunk and many decodes
  // in one step balance over the threads.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const T* q = query.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (D == 64 && attention_parts<64>(items, q, kc, vc, tables, max_blocks, o, lens, qsl, H, Hkv, BS, scale, window, few_rows)) return;
    if (D == 128 && attention_parts<128>(items, q, kc, vc, tables, max_blocks, o, lens, qsl, H, Hkv, BS, scale, window, few_rows)) return;
    if (D == 256 && attention_parts<256>(items, q, kc, vc, tables, max_blocks, o, lens, qsl, H, Hkv, BS, scale, window, few_rows)) return;
  }
#endif
  parallel_chunks(static_cast<int64_t>(items.size()), [&](int64_t it) {
      thread_local std::vector<float> scratch;
      const Item& w = items[it];
      const int64_t q_len = qsl[w.seq + 1] - qsl[w.seq];
      const int32_t* table = tables + w.seq * max_blocks;
      const float sc = static_cast<float>(scale);
      for (int64_t kvh = w.h0; kvh < w.h1; ++kvh) {
#define PAGODA_ATTEND(HD) \
  attend_item<T, HD>(q, kc, vc, table, o, lens[w.seq], q_len, w.i0, w.i1, qsl[w.seq], kvh, H, Hkv, D, BS, sc, window, scratch)
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
#define PAGODA_BLOCK(HD) \
  attend_block_bf16<HD>(q, kc, vc, table, o, lens[w.seq], q_len, w.i0, w.i1, qsl[w.seq], kvh, H, Hkv, BS, sc, window, \
                        scratch)
        if (w.blocked && D == 64) { PAGODA_BLOCK(64); continue; }
        if (w.blocked && D == 128) { PAGODA_BLOCK(128); continue; }
        if (w.blocked && D == 256) { PAGODA_BLOCK(256); continue; }
#undef PAGODA_BLOCK
        const bool few = (w.i1 - w.i0) * (H / Hkv) <= std::min(few_rows, kFewRows);
#define PAGODA_ROWS(HD) \
  attend_rows_bf16<HD>(q, kc, vc, table, o, lens[w.seq], q_len, w.i0, w.i1, qsl[w.seq], kvh, H, Hkv, BS, sc, window, scratch)
        if (few && D == 64) { PAGODA_ROWS(64); continue; }
        if (few && D == 128) { PAGODA_ROWS(128); continue; }
        if (few && D == 256) { PAGODA_ROWS(256); continue; }
#undef PAGODA_ROWS
      }
#endif
      if (D == 64) {
        PAGODA_ATTEND(64);
      } else if (D == 128) {
        PAGODA_ATTEND(128);
      } else if (D == 256) {
        PAGODA_ATTEND(256);
      } else {
        PAGODA_ATTEND(0);
      }
      }
#undef PAGODA_ATTEND
  });
}

// An int8 KV cache (`--kv-cache-dtype int8`: rows of HD codes and a bf16 scale,
// kernels/kv_quant.py) is read by the invariant route only, its codes widened as they load
// (attend_part_pairs_bf16<HD, true>): bf16 queries, head dims 64/128/256, AVX512-BF16.
void paged_attention_int8(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                          const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                          int64_t window, int64_t q_chunk, int64_t key_part) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), Hkv = key_cache.size(2);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && value_cache.scalar_type() == at::kChar &&
                  key_cache.size(3) == D + 2 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention: an int8 KV cache [blocks, block_size, Hkv, head_dim + 2] is read with bfloat16 queries");
  TORCH_CHECK(key_part > 0 && key_part % 16 == 0 && q_chunk > 0,
              "paged_attention: an int8 KV cache takes the invariant route (key_part a positive multiple of 16)");
#if defined(__AVX512BF16__)
  const int64_t S = seq_lens.size(0);
  if (S == 0) return;
  const auto* qp = query.data_ptr<c10::BFloat16>();
  const auto* kp = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<int8_t>());
  const auto* vp = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<int8_t>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  if (attention_invariant_dims<true>(D, qp, kp, vp, tables, max_blocks, op, lens, qsl, S, H, Hkv, BS, scale, window,
                                     q_chunk, key_part))
    return;
  TORCH_CHECK(false, "paged_attention: an int8 KV cache needs head dim 64, 128 or 256, got ", D);
#else
  TORCH_CHECK(false, "paged_attention: an int8 KV cache needs a CPU with AVX512-BF16 (this build has none)");
#endif
}

}  // namespace

// Attention of a batch of decodes and prefill chunks, K/V read in place through the block
// tables. q_chunk: query tokens per work item; a chunk of more than skip_over new tokens
// (when > 0) is skipped (the caller attends it). bf16 on AVX512-BF16 builds: a chunk of
// more than block_over query rows (tokens x the KV head's group; 0: none) takes
// attend_block_bf16 in items of up to kBlockRows rows; items of up to few_rows query rows
// (at most kFewRows; 0: none) take attend_rows_bf16; the rest attend_item. A step of only
// few-row items, fewer than twice the threads (a batch-1 decode), splits each item's keys
// across the threads and merges the parts (attention_parts).
void paged_attention(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                     const torch::Tensor& value_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                     const torch::Tensor& query_start_loc, double scale,
                     int64_t sliding_window, int64_t q_chunk, int64_t skip_over, int64_t few_rows,
                     int64_t block_over, int64_t key_part) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() && out.is_contiguous(),
              "paged_attention: contiguous query, caches and out expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_attention: int32 block_tables, seq_lens and query_start_loc expected");
  auto bt = block_tables.contiguous();
  if (key_cache.scalar_type() == at::kChar) {  // an int8 KV cache: its own route (see paged_attention_int8)
    TORCH_CHECK(out.scalar_type() == query.scalar_type(), "paged_attention: query and out must share a dtype");
    paged_attention_int8(out, query, key_cache, value_cache, bt, seq_lens, query_start_loc, scale, sliding_window,
                         q_chunk, key_part);
    return;
  }
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_attention: query, caches and out must share a dtype");
  if (query.scalar_type() == at::kFloat) {
    paged_attention_impl<float>(out, query, key_cache, value_cache, bt, seq_lens, query_start_loc, scale,
                                sliding_window, q_chunk, skip_over, few_rows, block_over, key_part);
  } else if (query.scalar_type() == at::kBFloat16) {
    paged_attention_impl<c10::BFloat16>(out, query, key_cache, value_cache, bt, seq_lens, query_start_loc, scale,
                                        sliding_window, q_chunk, skip_over, few_rows, block_over, key_part);
  } else {
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16 expected, got ", query.scalar_type());
  }
}

namespace {

// One (token, head) row of D values as an int8 cache row (kernels/kv_quant.py `quantize`,
// bit for bit): scale = bf16(absmax / 127), rounded before the codes are computed with it,
// codes = clamp(round_half_even(x / scale), -127, 127) (a true division, as torch's), the
// scale's bf16 bits after the D codes; an all-zero row gets scale 0 and codes 0.
template <typename T>
void quantize_row_int8(const T* __restrict x, int8_t* __restrict dst, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const uint16_t bits = bf16_bits(amax / 127.f);
  const float scale = bf16_to_float_bits(bits);
  for (int64_t d = 0; d < D; ++d) dst[d] = int8_code(static_cast<float>(x[d]), scale);
  std::memcpy(dst + D, &bits, sizeof(bits));
}

template <typename T>
void cache_int8_rows(const torch::Tensor& src, const torch::Tensor& cache, const int64_t* slots, int64_t t) {
  const int64_t Hkv = src.size(1), D = src.size(2);
  const T* x = src.data_ptr<T>() + t * src.stride(0);
  int8_t* dst = cache.data_ptr<int8_t>() + slots[t] * Hkv * (D + 2);
  for (int64_t h = 0; h < Hkv; ++h) quantize_row_int8(x + h * D, dst + h * (D + 2), D);
}

// T tokens' key and value rows of `bytes` each (k + t * ks, v + t * vs) into their cache
// slots (slot * bytes into kc, vc); a negative slot is skipped (padding).
void copy_kv_rows(const char* k, int64_t ks, const char* v, int64_t vs, int64_t bytes, char* kc, char* vc,
                  const int64_t* slots, int64_t T) {
  parallel_ranges(T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(kc + slots[t] * bytes, k + t * ks, bytes);
      std::memcpy(vc + slots[t] * bytes, v + t * vs, bytes);
    }
  });
}

}  // namespace

// key/value [T, Hkv, D] (rows may be strided views of the fused QKV output) into their
// cache slots; a negative slot is skipped (padding). An int8 cache ([.., Hkv, D + 2]:
// `--kv-cache-dtype int8`) gets each (token, head) row quantized (quantize_row_int8).
void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& key_cache,
                       const torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key.stride(1) == key.size(2) &&
                  value.stride(1) == value.size(2),
              "reshape_and_cache: each token's heads must be contiguous");
  if (key_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(value_cache.scalar_type() == at::kChar && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                    key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2) + 2 &&
                    value_cache.sizes() == key_cache.sizes() && value.scalar_type() == key.scalar_type(),
                "reshape_and_cache: int8 caches [blocks, block_size, Hkv, head_dim + 2] expected");
    const bool bf16 = key.scalar_type() == at::kBFloat16;
    TORCH_CHECK(bf16 || key.scalar_type() == at::kFloat, "reshape_and_cache: bfloat16 or float32 K/V expected");
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    parallel_ranges(key.size(0), 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        if (slots[t] < 0) continue;
        if (bf16) {
          cache_int8_rows<c10::BFloat16>(key, key_cache, slots, t);
          cache_int8_rows<c10::BFloat16>(value, value_cache, slots, t);
        } else {
          cache_int8_rows<float>(key, key_cache, slots, t);
          cache_int8_rows<float>(value, value_cache, slots, t);
        }
      }
    });
    return;
  }
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(), "reshape_and_cache: dtype mismatch");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  const int64_t bytes = row * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  copy_kv_rows(static_cast<const char*>(key.data_ptr()), key.stride(0) * key.element_size(),
               static_cast<const char*>(value.data_ptr()), value.stride(0) * value.element_size(), bytes,
               static_cast<char*>(key_cache.data_ptr()), static_cast<char*>(value_cache.data_ptr()), slots, T);
}

namespace {

// RMSNorm of one row, as the model's RMSNorm computes it: in float, rounded to the dtype,
// then times the weight (a second rounding in bf16, as torch's `weight * h.to(dtype)`).
template <typename T>
inline void rms_norm_row(T* __restrict dst, const float* __restrict x, const T* __restrict w, int64_t n, float eps,
                         float* __restrict wf) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  load_row(wf, w, n);
  for (int64_t i = 0; i < n; ++i) {
    store(dst, i, wf[i] * round_to<T>(x[i] * inv));
  }
}

template <typename T>
void add_rms_norm_impl(const torch::Tensor& out, const torch::Tensor& residual, const torch::Tensor& x,
                       const torch::Tensor* add, const torch::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* ap = add ? add->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  parallel_ranges(rows, 16, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> buf, tmp, wf;
    buf.resize(n), tmp.resize(n), wf.resize(n);
    for (int64_t r = b; r < e; ++r) {
      load_row(buf.data(), xp + r * n, n);
      if (ap) {
        // residual = x + add, rounded to the dtype as torch's `x + add` is.
        load_row(tmp.data(), ap + r * n, n);
        for (int64_t i = 0; i < n; ++i) {
          const float s = round_to<T>(buf[i] + tmp[i]);
          store(rp + r * n, i, s);  // exact: s is already representable
          buf[i] = s;
        }
      }
      rms_norm_row<T>(op + r * n, buf.data(), wp, n, static_cast<float>(eps), wf.data());
    }
  });
}

}  // namespace

// out = RMSNorm(x + add) * weight, and residual = x + add (residual may alias x). With no
// `add`, out = RMSNorm(x) * weight and residual is untouched.
void add_rms_norm(const torch::Tensor& out, const torch::Tensor& residual, const torch::Tensor& x,
                  const c10::optional<torch::Tensor>& add, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm: contiguous tensors expected");
  const torch::Tensor* a = add.has_value() ? &add.value() : nullptr;
  if (a) TORCH_CHECK(a->is_contiguous(), "add_rms_norm: contiguous add expected");
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(out, residual, x, a, weight, eps);
  } else if (x.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16>(out, residual, x, a, weight, eps);
  } else {
    TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16 expected");
  }
}

namespace {

// T_ tokens' `heads` rows of D values (token t's at p + t * token_stride, its heads
// adjacent) rotated in place by the float32 tables c, s [positions, D / 2] at pos[t].
template <typename T>
void rotary_rows(T* p, int64_t T_, int64_t heads, int64_t D, int64_t token_stride, const float* c, const float* s,
                 const int64_t* pos) {
  const int64_t half = D / 2;
  parallel_ranges(T_, 16, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> x;
    x.resize(D);
    for (int64_t t = b; t < e; ++t) {
      const float* ct = c + pos[t] * half;
      const float* st = s + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = p + t * token_stride + h * D;
        load_row(x.data(), row, D);
        for (int64_t i = 0; i < half; ++i) {
          store(row, i, x[i] * ct[i] - x[i + half] * st[i]);
          store(row, i + half, x[i + half] * ct[i] + x[i] * st[i]);
        }
      }
    }
  });
}

template <typename T>
void rotary_impl(const torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin,
                 const torch::Tensor& positions) {
  rotary_rows<T>(qk.data_ptr<T>(), qk.size(0), qk.size(1), qk.size(2), qk.stride(0), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), positions.data_ptr<int64_t>());
}

}  // namespace

// Rotate qk [T, heads, D] in place (rotate-half RoPE) by float32 tables cos/sin
// [max_positions, D/2] at `positions` [T] int64. qk may be a strided view whose heads are
// contiguous (the q and k columns of the fused QKV output).
void rotary(const torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin,
            const torch::Tensor& positions) {
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "rotary: each token's heads must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "rotary: contiguous float32 tables expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "rotary: int64 positions expected");
  if (qk.scalar_type() == at::kFloat) {
    rotary_impl<float>(qk, cos, sin, positions);
  } else if (qk.scalar_type() == at::kBFloat16) {
    rotary_impl<c10::BFloat16>(qk, cos, sin, positions);
  } else {
    TORCH_CHECK(false, "rotary: float32 or bfloat16 expected");
  }
}

namespace {

// ---------------------------------------------------------------------------------------
// bf16 linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), one kernel for every row count, so
// a row's outputs are the same bits however many rows share the call (batch invariance:
// docs/ARCHITECTURE.md, "Same request, same tokens") at about oneDNN's speed: it runs at
// 0.87-1.06x oneDNN's packed GEMM on prefill-sized calls and 1.15-1.76x its GEMV at decode
// (`python -m loadtest.bench_linear`, docs/BENCHMARKS.md).
//
// The weight is packed once (`pack_bf16_weight`) into vdpbf16ps's pair layout, in groups
// of 32 outputs: group g, then K's pairs in order, then the 32 outputs, then the pair,
//   packed[((g * Kp + kp) * 32 + l) * 2 + j] = W[32 g + l][2 kp + j]   (Kp = ceil(K / 2)),
// zeros past N and K. A group's pair kp is then one 64-byte line per 16 outputs, and the
// kernel is an outer product: x's pair (x[2kp], x[2kp+1]) broadcast to every lane, one
// vdpbf16ps per 16 outputs, so output n's lane accumulates the exact pair products
// W[n][2kp]x[2kp] + W[n][2kp+1]x[2kp+1] for kp = 0, 1, ... in order into one float32
// chain, with no horizontal reduction at all. That chain, the bias added in float and one
// rounding to bf16 (nearest even) is each output's whole arithmetic, whatever the tile:
// tiles of up to 11 x rows x one group (22 chains in registers) for many rows, one or two
// groups per x row (2-4 chains, one sequential weight stream per thread) for few. Each
// thread takes a contiguous range of groups, so its part of the weight is one stretch read
// in order: at a decode step it is the weight stream that bounds the call.
// The int4 kernel's block of one input group of gk for 32 outputs (int4_linear_impl):
// scales and offsets, then a line of nibbles per input pair.
constexpr int64_t kInt4Line = 64;     // bytes of two input pairs' nibbles for a group of 32 outputs
constexpr int64_t kInt4Header = 128;  // bytes of a block's scales and offsets (bf16 x 32 each)

inline int64_t int4_block_bytes(int64_t gk) { return kInt4Header + gk / 4 * kInt4Line; }

// The 12-bit bf16 layout's group (c12_linear_impl): its exponent vectors, then a line per input pair.
constexpr int64_t kC12Header = 128;  // bytes of a group's two exponent vectors
constexpr int64_t kC12Line = 96;     // bytes of a pair line: 64 sign-mantissa bytes, 32 of codes

inline int64_t c12_group_bytes(int64_t K) { return kC12Header + (K + 1) / 2 * kC12Line; }
// Rows up to which the fused call reads a linear's 12-bit copy: beyond, the decode's extra
// vector work per weight is no longer hidden behind the weight stream.
constexpr int64_t kC12MaxRows = 2;
// The 12-bit kernel's decode needs AVX512-VBMI2 (vpshrdw, vpexpandw) beside AVX512-BF16
// (Cooper Lake has the one without the other).
#if defined(__AVX512BF16__) && defined(__AVX512VBMI2__)
constexpr bool kHaveC12 = true;
#else
constexpr bool kHaveC12 = false;
#endif

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Gemv = true;
constexpr int64_t kPrefetchL2Ahead = 4096;  // bf16 elements: 8 KB, past the next page boundary
constexpr int64_t kGroup = 32;               // outputs per packed group
constexpr int64_t kPairLine = 2 * kGroup;    // bf16 elements of one group's pair: 128 bytes

// x's pair kp of a row of K (K odd: the last pair's second element is 0), in every lane.
inline __m512bh x_pair(const uint16_t* x, int64_t kp, int64_t K) {
  uint32_t v;
  if (2 * kp + 1 < K) {
    std::memcpy(&v, x + 2 * kp, sizeof(v));
  } else {
    v = x[2 * kp];
  }
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
}

// Widens 32 int8 weights to bf16 in order (exact: |q| <= 128 needs 8 bits of mantissa).
inline __m512bh int8x32_to_bf16(const int8_t* w) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // [lo's 16, hi's 16]: the weights in order
}

// A group's pair kp as two bf16 vectors (outputs 0-15, 16-31): bf16 weights as stored, int8
// ones (W8A16: q - 128 with a scale per output) widened.
inline void load_pair_line(const uint16_t* p, __m512bh& a, __m512bh& b) {
  a = (__m512bh)_mm512_loadu_si512(p);
  b = (__m512bh)_mm512_loadu_si512(p + 32);
}
inline void load_pair_line(const int8_t* p, __m512bh& a, __m512bh& b) {
  a = int8x32_to_bf16(p);
  b = int8x32_to_bf16(p + 32);
}

// 32 bf16 values [n0, n0 + 32) (masked past N) as two float vectors.
inline void load_bf16x32(const uint16_t* v, __mmask32 mask, __m512& lo, __m512& hi) {
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask), v)), 16));
  hi = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask >> 16), v + 16)), 16));
}

// Finishes one x row's outputs [n0, n0 + 32) of a group: times the per-output scale (bf16,
// int8 weights; nullptr: none), plus the bias (bf16; nullptr: none), both in float, rounded
// to bf16 once, stored (masked past N).
inline void store_group(__m512 lo, __m512 hi, const uint16_t* bias, const uint16_t* scale, uint16_t* y, int64_t n0,
                        int64_t N) {
  const int64_t left = N - n0;
  const __mmask32 mask = left >= kGroup ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << left) - 1);
  __m512 a, b;
  if (scale) {
    load_bf16x32(scale + n0, mask, a, b);
    lo = _mm512_mul_ps(lo, a);
    hi = _mm512_mul_ps(hi, b);
  }
  if (bias) {
    load_bf16x32(bias + n0, mask, a, b);
    lo = _mm512_add_ps(lo, a);
    hi = _mm512_add_ps(hi, b);
  }
  _mm512_mask_storeu_epi16(y + n0, mask, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Weight bytes [next, end) that a many-row tile pulls into L2 while it computes from lines
// already there (schedule_packed_linear: its share of the next group), a few lines per
// input pair, spread evenly over the tile's loop; empty: none. Where data is read from never
// changes the arithmetic.
struct L2Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
};

// A tile's share of K when a group is too large to stay in L2 beside its next one: input
// pairs [kp0, kp1) only, its float32 sums carried between the shares in `carry` (MR x 2G
// vectors, row stride 32 floats: each of the tile's rows' 32 outputs), zeros before the
// first share, rounded and stored after the last. Each output's chain still runs over K's
// pairs in order, and a float32 value stored and reloaded is the same value, so the result
// has the bits of one pass over K. The default: all of K in one pass, nothing carried.
struct KShare {
  int64_t kp0 = 0;
  int64_t kp1 = -1;  // -1: to K's end
  float* carry = nullptr;
  bool first = true, last = true;
};

// x rows [0, MR) (row stride ldx >= K) against G adjacent groups starting at `pg`, outputs from n0.
template <int MR, int G, typename T>
inline void linear_tile(const uint16_t* __restrict x, int64_t ldx, const T* __restrict pg,
                        const uint16_t* __restrict bias, const uint16_t* __restrict scale, uint16_t* __restrict y,
                        int64_t K, int64_t N, int64_t n0, L2Prefetch pf = {}, KShare share = {}) {
  const int64_t Kp = (K + 1) / 2, full = K / 2, group_stride = Kp * kPairLine;
  const int64_t kp0 = share.kp0, kp1 = share.kp1 < 0 ? Kp : share.kp1;
  const int64_t pf_per_kp = MR > 4 ? (((pf.end - pf.next) + 63) / 64 + (kp1 - kp0) - 1) / std::max<int64_t>(1, kp1 - kp0) : 0;
  __m512 acc[MR][2 * G];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 2 * G; ++j) acc[m][j] = share.first ? _mm512_setzero_ps() : _mm512_loadu_ps(share.carry + m * 32 + j * 16);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    if constexpr (MR > 4) {  // the next group's share (L2Prefetch)
      for (int64_t i = 0; i < pf_per_kp && pf.next < pf.end; ++i, pf.next += 64) _mm_prefetch(pf.next, _MM_HINT_T1);
    } else {  // a weight stream: keep lines in flight past what the prefetcher does alone
      for (int g = 0; g < G; ++g) {
        _mm_prefetch(reinterpret_cast<const char*>(pg + g * group_stride + kp * kPairLine + kPrefetchL2Ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(pg + g * group_stride + kp * kPairLine + kPrefetchL2Ahead + 32), _MM_HINT_T1);
      }
    }
    __m512bh w[2 * G];
    for (int g = 0; g < G; ++g) load_pair_line(pg + g * group_stride + kp * kPairLine, w[2 * g], w[2 * g + 1]);
    for (int m = 0; m < MR; ++m) {
      __m512bh xv;
      if (kp < full) {
        uint32_t v;
        std::memcpy(&v, x + m * ldx + 2 * kp, sizeof(v));
        xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
      } else {
        xv = x_pair(x + m * ldx, kp, K);
      }
      for (int j = 0; j < 2 * G; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, w[j]);
    }
  }
  if (!share.last) {
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 2 * G; ++j) _mm512_storeu_ps(share.carry + m * 32 + j * 16, acc[m][j]);
    return;
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g) store_group(acc[m][2 * g], acc[m][2 * g + 1], bias, scale, y + m * N, n0 + g * kGroup, N);
}

// Calls f(std::integral_constant<int, R>{}) with R = mb for mb in 1..Max (Max for more): the
// tiles take their height as a template argument, so their accumulators stay in registers.
template <int Max, typename F>
inline void with_tile_rows(int64_t mb, const F& f) {
  if constexpr (Max > 1) {
    if (mb < Max) {
      with_tile_rows<Max - 1>(mb, f);
      return;
    }
  }
  f(std::integral_constant<int, Max>{});
}

// x rows [0, mb) (mb in 1..11) against one group.
template <typename T>
inline void linear_rows(int64_t mb, const uint16_t* x, int64_t ldx, const T* pg, const uint16_t* bias,
                        const uint16_t* scale, uint16_t* y, int64_t K, int64_t N, int64_t n0, L2Prefetch pf = {},
                        KShare share = {}) {
  with_tile_rows<11>(mb, [&](auto rows) {
    linear_tile<decltype(rows)::value, 1>(x, ldx, pg, bias, scale, y, K, N, n0, pf, share);
  });
}

// x rows [0, mb) (mb in 1..4) against two adjacent groups: four chains per row.
template <typename T>
inline void linear_rows_two_groups(int64_t mb, const uint16_t* x, int64_t ldx, const T* pg, const uint16_t* bias,
                                   const uint16_t* scale, uint16_t* y, int64_t K, int64_t N, int64_t n0) {
  with_tile_rows<4>(mb, [&](auto rows) { linear_tile<decltype(rows)::value, 2>(x, ldx, pg, bias, scale, y, K, N, n0); });
}

constexpr int64_t kTileRows = 11;            // x rows per register tile (22 accumulators)
constexpr int64_t kPassRows = 64;            // x rows per pass over a chunk of groups, at most (they stay in L2)
constexpr int64_t kChunkBytes = 256 * 1024;  // weight bytes per chunk of groups (it stays in L2 for every pass)
constexpr int64_t kPieceBytes = 128 * 1024;  // few rows: weight bytes per piece the threads claim (~10 us each)
constexpr int64_t kL2Budget = 768 * 1024;    // bytes a thread's tiles may keep in L2 (1-2 MB a core)
constexpr int64_t kPrefetchPieceBytes = 512 * 1024;  // 5-64 rows, prefetching: weight bytes per piece

// x's rows as the many-row tiles read them. Rows 2 KB apart (or a multiple: K = 2048, 4096, ...)
// put the same pair of every row in the same few of L1's 64 sets of 64 bytes, so a tile's 11
// rows evict each other's lines before the 16 pairs of each are used. Such rows (M > 4) are
// copied, once per call, into a per-thread buffer with a row stride 64 bytes longer; `ldx` is
// set to the stride the tiles then use. The arithmetic is unchanged (only where the inputs
// are read from); what it gains: docs/BENCHMARKS.md, "32 streams on the 1B-class model".
inline const uint16_t* unaliased_rows(const uint16_t* x, int64_t M, int64_t K, int64_t& ldx) {
  ldx = K;
  if (M <= 4 || (K * 2) % 2048 != 0) return x;
  ldx = K + 32;
  thread_local std::vector<uint16_t> rows;
  if (static_cast<int64_t>(rows.size()) < M * ldx) rows.resize(M * ldx);
  for (int64_t m = 0; m < M; ++m) std::memcpy(rows.data() + m * ldx, x + m * K, K * sizeof(uint16_t));
  return rows.data();
}

// The threads' schedule of a linear over packed groups of 32 outputs (bf16 and int8 pairs,
// int4 nibbles): they claim contiguous pieces of groups (parallel_ranges: a descheduled
// thread holds up one piece, not half the weight). Few rows (M <= 4: a decode step): pieces
// of ~128 KB of weight (at least 4 per thread), one pass, two groups at a time where the
// tile has registers for them (M <= pair_rows: `two(g)` computes groups g and g + 1), the
// weight streamed once. More rows: pieces of ~256 KB, and for each piece every pass of 64 x
// rows in tiles of up to `tile_rows` (`one(g, m, mb)`: rows [m, m + mb) of group g), so the
// piece is read from memory once and served from L2 to the passes after the first (reading
// the weight once per pass instead was 0.7-0.8x oneDNN at 256 rows on the MLP's and the
// head's shapes). Which tile computes an output never changes its arithmetic.
template <typename One, typename Two>
void schedule_packed_linear(int64_t M, int64_t N, int64_t group_bytes, int64_t tile_rows, int64_t pair_rows,
                            const One& one, const Two& two, const char* prefetch_base = nullptr, int64_t x_bytes = 0,
                            int64_t k_pairs = 0) {
  const int64_t groups = (N + kGroup - 1) / kGroup;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / group_bytes);
  // One pass over each group in two or more tiles (12 to kPassRows rows: a decode step of
  // many sequences): the group's first tile reads it from memory, the others from L2, so the
  // weight came in bursts at up to `tiles` times the average rate (32 rows: 3x, about what
  // the machine's memory gives two cores) and the first tile waited on it. With `prefetch_base` (the
  // packed weight) each tile of group g also pulls its share of group g + 1 into L2
  // (L2Prefetch), so the weight streams in at an even rate behind the arithmetic. Only where
  // the two groups and x's rows fit the L2 budget (the 1B-class model's down projection, 352
  // KB groups beside 360 KB of x at 32 rows, does not: it lost 3-5% to the evictions).
  // 2-6% on the 1B-class shapes at 32-64 rows, streaming from memory (docs/BENCHMARKS.md,
  // "An even weight stream at 12-64 rows"); one tile (up to 11 rows, a weight stream already)
  // lost 13% to it, so it needs two. A piece's last group prefetches the first group of the
  // piece its thread runs next, which it claims then (parallel_claimed_ahead): with pieces
  // claimed only when started, every piece's first group (a quarter of the 1B-class qkv's)
  // was read at the rate its first tile's misses drew; prefetched, the 32-row linears took
  // 0.96-0.97x the time and the 1B-class 32-row step 0.965x (docs/BENCHMARKS.md, "The next
  // piece's first group").
  // Where two groups and x's rows do not fit (the 1B-class down projection: 352 KB groups
  // beside 360 KB of x at 32 rows), a caller that gives `k_pairs` (its tiles take a KShare)
  // has each group computed in `shares` equal parts of K, every tile of the group over the
  // first part, then over the next, its sums carried between the parts (KShare: the same
  // bits), and each part's tiles prefetch the next part (of this group or the next): a part
  // of two groups and of x's rows fits.
  // Only tiles that take a KShare prefetch (packed_linear_impl's; the 12-bit and int4 linears
  // pass no `prefetch_base`).
  constexpr bool kShareable = std::is_invocable_v<One, int64_t, int64_t, int64_t, L2Prefetch, KShare>;
  const int64_t held = 2 * group_bytes + x_bytes;  // what a prefetching tile keeps in L2 in one part
  int64_t shares = 1;
  while (kShareable && k_pairs >= 64 * (shares + 1) && shares < 8 && held / shares > kL2Budget) ++shares;
  const bool prefetch = kShareable && prefetch_base && k_pairs > 0 && M > tile_rows && M <= kPassRows &&
                        held / shares <= kL2Budget;
  // x rows per pass over a chunk (the passes of a prefill's rows): kPassRows, or fewer
  // (whole tiles) where a pass of them and the chunk would not fit the L2 budget together, so
  // the chunk stays in L2 over every pass. The 1B-class down projection's 352 KB group beside
  // 64 rows of 11 KB (1.06 MB, more than L2) now takes passes of 33 rows: 0.98-0.99x the
  // time at 877 rows, the same bits (docs/BENCHMARKS.md, "Prefill passes that fit L2").
  int64_t pass_rows = kPassRows;
  if (M > 0 && x_bytes > 0) {  // x_bytes / M: a row's bytes
    const int64_t room = (kL2Budget - std::min(kL2Budget, chunk * group_bytes)) / (x_bytes / M);
    pass_rows = std::min(kPassRows, std::max(tile_rows, room / tile_rows * tile_rows));
  }
  auto run = [&](int64_t g_lo, int64_t g_hi) {
    if (M <= 4) {
      for (int64_t g = g_lo; g < g_hi; ++g) {
        if (M <= pair_rows && g + 1 < g_hi) {  // two groups at a time: twice the chains in flight
          two(g);
          ++g;
        } else {
          one(g, 0, M, L2Prefetch{});
        }
      }
      return;
    }
    for (int64_t c0 = g_lo; c0 < g_hi; c0 += chunk) {
      const int64_t c1 = std::min(g_hi, c0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
        const int64_t m1 = std::min(M, m0 + pass_rows);
        for (int64_t g = c0; g < c1; ++g)
          for (int64_t m = m0; m < m1; m += tile_rows) one(g, m, std::min(tile_rows, m1 - m), L2Prefetch{});
      }
    }
  };
  if (prefetch) {
    // Pieces several groups long, but still at least 4 a thread, or a short call's last
    // piece leaves a thread idle. M <= kPassRows: one pass, group by group.
    const int64_t piece = std::max<int64_t>(chunk, std::min(kPrefetchPieceBytes / group_bytes,
                                                           groups / (4 * kernel_threads())));
    if constexpr (kShareable) {
      const int64_t pair_bytes = group_bytes / k_pairs;
      auto part_end = [&](int64_t part) { return k_pairs * (part + 1) / shares; };  // parts' input pairs
      parallel_claimed_ahead(groups, piece, [&](int64_t g_lo, int64_t g_hi, const auto& claim_next) {
        thread_local std::vector<float> carry;  // the group's M x 32 sums between its parts
        if (static_cast<int64_t>(carry.size()) < M * kGroup) carry.resize(M * kGroup);
        for (int64_t g = g_lo; g < g_hi; ++g) {
          // Past its last part, group g's tiles pull in the next group: g + 1, or past the
          // piece's end the first group of the piece claimed now (none: -1, every piece is
          // claimed or running).
          const int64_t next = g + 1 < g_hi ? g + 1 : claim_next();
          for (int64_t part = 0; part < shares; ++part) {
            const int64_t kp0 = part ? part_end(part - 1) : 0, kp1 = part_end(part);
            // What this part's tiles pull in: the group's next part, or the next group's first.
            const char* lo = nullptr;
            const char* hi = nullptr;
            if (part + 1 < shares) {
              lo = prefetch_base + g * group_bytes + kp1 * pair_bytes;
              hi = prefetch_base + g * group_bytes + part_end(part + 1) * pair_bytes;
            } else if (next >= 0) {
              lo = prefetch_base + next * group_bytes;
              hi = lo + part_end(0) * pair_bytes;
            }
            for (int64_t m = 0; m < M; m += tile_rows) {
              const int64_t mb = std::min(tile_rows, M - m);
              L2Prefetch pf;  // rows [m, m + mb)'s share of it, in proportion to their rows
              if (lo) {
                pf.next = lo + (hi - lo) * m / M / 64 * 64;
                pf.end = lo + (hi - lo) * (m + mb) / M / 64 * 64;
              }
              one(g, m, mb, pf, KShare{kp0, kp1, carry.data() + m * kGroup, part == 0, part + 1 == shares});
            }
          }
        }
      });
    }
    return;
  }
  if (M > 4) {
    parallel_ranges(groups, chunk, run);
    return;
  }
  // Few rows: ranges of whole pairs of groups (two at a time), at least 4 ranges a thread.
  const int64_t pairs = (groups + 1) / 2;
  const int64_t most = std::max<int64_t>(1, std::min(kPieceBytes / (2 * group_bytes), pairs / (4 * kernel_threads())));
  parallel_ranges(pairs, most, [&](int64_t lo, int64_t hi) { run(2 * lo, std::min(groups, 2 * hi)); });
}

// y [M, N] = x [M, K] @ W^T + bias, W packed by pack_bf16_weight (see above), on
// schedule_packed_linear's pieces: tiles of up to 11 x rows x one group, or 1-4 rows x two.
template <typename T>
void packed_linear_impl(const uint16_t* x, const T* packed, const uint16_t* bias, const uint16_t* scale, uint16_t* y,
                        int64_t M, int64_t K, int64_t N) {
  const int64_t group_stride = (K + 1) / 2 * kPairLine;
  int64_t ldx = K;
  x = unaliased_rows(x, M, K, ldx);
  schedule_packed_linear(
      M, N, group_stride * static_cast<int64_t>(sizeof(T)), kTileRows, 4,
      [&](int64_t g, int64_t m, int64_t mb, L2Prefetch pf, KShare share = {}) {
        linear_rows(mb, x + m * ldx, ldx, packed + g * group_stride, bias, scale, y + m * N, K, N, g * kGroup, pf, share);
      },
      [&](int64_t g) {
        linear_rows_two_groups(M, x, ldx, packed + g * group_stride, bias, scale, y, K, N, g * kGroup);
      }, reinterpret_cast<const char*>(packed), M * ldx * static_cast<int64_t>(sizeof(uint16_t)), (K + 1) / 2);
}

void bf16_linear_impl(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y, int64_t M, int64_t K,
                      int64_t N) {
  packed_linear_impl(x, packed, bias, nullptr, y, M, K, N);
}

// The int8 weight-only (W8A16) linear: y = (x @ W^T) * scale, W int8 packed by
// pack_int8_weight in the same pair layout, each 32 weights widened to bf16 as loaded; the
// same loops and per-output arithmetic (one float32 chain over K's pairs in order, times the
// row's scale, one rounding), so it is batch-invariant too. At half the bytes of bf16 a
// decode streams the bundled model's INT8 LM head at ~30 GB/s here (torch's
// `_weight_int8pack_mm`: ~17); torch's rounds the same sum in another order (results may
// differ from it by 1 bf16 ulp).
void int8_linear_impl(const uint16_t* x, const int8_t* packed, const uint16_t* scale, uint16_t* y, int64_t M, int64_t K,
                      int64_t N) {
  packed_linear_impl(x, packed, nullptr, scale, y, M, K, N);
}

// ---- bf16 weights in 12 bits, lossless: a few-row decode step reads 3/4 of the bytes ----------
// A trained (or randomly initialised) bf16 weight uses few of its 256 exponents: the weights
// of an output row lie within a few binades of its largest. So each weight is held as its
// sign and 7 mantissa bits (a byte) plus a 4-bit code: the row's largest exponent minus its
// own (0-14), or 15 for an exception (zero, a subnormal, or more than 14 binades below the
// row's largest), whose whole bf16 is kept in a per-group list in the order the kernel meets
// them. Decoding rebuilds every weight's exact bits in registers, so the kernel's arithmetic is
// the bf16 kernel's (the same chains in the same order: the same output bits), from 96 bytes a
// pair line instead of 128.
//
// Layout (pack_c12_weight), per group of 32 outputs: the row exponents shifted into place,
// as two vectors of 32 words (word i of vector v: output 16 v + i / 2's exponent << 7, the
// pair line's lane order), then per input pair kp 96 bytes: the 64 weights' (mantissa << 1 |
// sign) bytes in the pair line's order (vector 0's 32 words, then vector 1's), and 32
// bytes of codes, byte i holding vector 0's word i (low nibble) and vector 1's (high).

#if defined(__AVX512VBMI2__)
// How far ahead of its line the 12-bit tile prefetches into L2: 4 KB (~43 lines). The bf16
// kernel's 8 KB made the batch-1 step 3.5% (1B-class) to 6% (bundled) slower in an in-process
// A/B of the distance (development script, 2026-12-07: 2-32 KB and none; 4 KB and none were
// best on the 1B-class model, 4 KB on the bundled one, at both of this VM's memory paces).
constexpr int64_t kC12PrefetchAhead = 4096;

// One vector of a 12-bit pair line: 32 weights' exact bf16 bits. `code7`: the codes shifted
// left by 7 (masked to bits 7-10); escape lanes are filled from `*exceptions` in lane order.
inline __m512bh c12_vector(__m512i mantissa_sign, __m512i code7, __m512i exponent7, const uint16_t*& exceptions) {
  // The byte (mantissa << 1 | sign) rotated right by one within its word: sign at bit 15,
  // mantissa at bits 0-6, bits 7-14 clear for the exponent.
  __m512i w = _mm512_or_si512(_mm512_shrdi_epi16(mantissa_sign, mantissa_sign, 1), _mm512_sub_epi16(exponent7, code7));
  const __mmask32 escape = _mm512_cmpeq_epi16_mask(code7, _mm512_set1_epi16(15 << 7));
  if (escape) {
    w = _mm512_mask_expandloadu_epi16(w, escape, exceptions);
    exceptions += _mm_popcnt_u32(escape);
  }
  return (__m512bh)w;
}

// x rows [0, MR) against G adjacent 12-bit groups from `pg` (group stride c12_group_bytes),
// their exception lists from `exc[g]`: linear_tile's chains on the decoded weights.
template <int MR, int G>
inline void c12_tile(const uint16_t* __restrict x, const uint8_t* __restrict pg, const uint16_t* const* exc,
                     uint16_t* __restrict y, int64_t K, int64_t N, int64_t n0) {
  const int64_t Kp = (K + 1) / 2, full = K / 2, gs = c12_group_bytes(K);
  const uint16_t* ex[G];
  __m512i e7[2 * G];
  for (int g = 0; g < G; ++g) {
    ex[g] = exc[g];
    e7[2 * g] = _mm512_loadu_si512(pg + g * gs);
    e7[2 * g + 1] = _mm512_loadu_si512(pg + g * gs + 64);
  }
  __m512 acc[MR][2 * G];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 2 * G; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < Kp; ++kp) {
    __m512bh w[2 * G];
    for (int g = 0; g < G; ++g) {
      const uint8_t* line = pg + g * gs + kC12Header + kp * kC12Line;
      _mm_prefetch(reinterpret_cast<const char*>(line + kC12PrefetchAhead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(line + kC12PrefetchAhead + 64), _MM_HINT_T1);
      const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 64)));
      const __m512i nib_mask = _mm512_set1_epi16(0x0F << 7);
      const __m512i c0 = _mm512_and_si512(_mm512_slli_epi16(codes, 7), nib_mask);
      const __m512i c1 = _mm512_and_si512(_mm512_slli_epi16(codes, 3), nib_mask);
      const __m512i ms0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
      const __m512i ms1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32)));
      w[2 * g] = c12_vector(ms0, c0, e7[2 * g], ex[g]);
      w[2 * g + 1] = c12_vector(ms1, c1, e7[2 * g + 1], ex[g]);
    }
    for (int m = 0; m < MR; ++m) {
      __m512bh xv;
      if (kp < full) {
        uint32_t v;
        std::memcpy(&v, x + m * K + 2 * kp, sizeof(v));
        xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
      } else {
        xv = x_pair(x + m * K, kp, K);
      }
      for (int j = 0; j < 2 * G; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, w[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g) store_group(acc[m][2 * g], acc[m][2 * g + 1], nullptr, nullptr, y + m * N, n0 + g * kGroup, N);
}

// y [M, N] = x [M, K] @ W^T, W held in 12 bits (pack_c12_weight): 1-4 rows at a time on the
// few-row schedule (a weight stream), the same output bits as bf16_linear_impl on W.
void c12_linear_impl(const uint16_t* x, const uint8_t* packed, const uint16_t* exceptions, const int64_t* offsets,
                     uint16_t* y, int64_t M, int64_t K, int64_t N) {
  const int64_t gs = c12_group_bytes(K);
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mb = std::min<int64_t>(4, M - m0);
    const uint16_t* xm = x + m0 * K;
    uint16_t* ym = y + m0 * N;
    schedule_packed_linear(
        mb, N, gs, 4, 2,
        [&](int64_t g, int64_t, int64_t rows, L2Prefetch) {
          const uint16_t* exc[1] = {exceptions + offsets[g]};
          with_tile_rows<4>(rows, [&](auto r) { c12_tile<decltype(r)::value, 1>(xm, packed + g * gs, exc, ym, K, N, g * kGroup); });
        },
        [&](int64_t g) {
          const uint16_t* exc[2] = {exceptions + offsets[g], exceptions + offsets[g + 1]};
          with_tile_rows<4>(mb, [&](auto r) { c12_tile<decltype(r)::value, 2>(xm, packed + g * gs, exc, ym, K, N, g * kGroup); });
        });
  }
}

#endif  // __AVX512VBMI2__

// ---- The LM head of a greedy step: exact logits only where the argmax can be ----------------
// At a decode step of a row or a few the LM head is a large share of the weight bytes read
// (the bundled model's 49,152 x 576 bf16, 57 MB of ~270), and a greedy row with nothing else
// asked of its logits (no logprobs, penalties, bias, grammar) needs only their argmax. With
// an int8 copy of the head (kernels/greedy_head.py: per output row n, q = round(w / s_n) with
// s_n >= max |w| / 127 in bf16, and e_n = max |w - s_n q| measured when the copy is made),
// the int8 kernel's logit a_n = bf16(chain(x q) s_n) of every token differs from the one the
// head's own kernel gives, E_n = bf16(chain(x w)), by at most
//     B_n = 1.02 (Q_n + 2^-7 (|a_n| + Q_n)) + 1e-30,   Q_n = 1.001 |x|_1 (e_n + 254 s_n K 2^-24):
// e_n |x|_1 bounds the quantization's part; each float32 chain of K products rounds at most
// K times by 2^-24 of a sum bounded by 127 s_n |x|_1 (|w| <= 127 s_n too); each bf16
// rounding moves a value by at most 2^-8 of it; the factors leave room for the rounding of
// the bound's own arithmetic. A token with a_n + B_n < L = max_m (a_m - B_m) therefore has
// E_n < E_m for the m that attains L: it is not the argmax, nor tied with it. The exact logits
// of the 32-token groups holding the others are computed by the head's own tiles (the same
// bits as the whole head: which tile computes an output never changes its arithmetic), every
// other logit is -inf, and the row's argmax (first index of its maximum) is the whole head's.
// The head is then read at half its bytes plus the groups in the race (a few, where a token
// stands out as a trained model's usually does; every group where all tie). A row whose
// approximate logits are not all finite takes the whole head (its NaN and infinities as
// the head gives them).
constexpr int64_t kArgmaxHeadRows = 4;  // up to this many rows (a weight stream: bytes bound the head)

inline float argmax_head_bound(float a, float q) { return 1.02f * (q + 0x1p-7f * (std::fabs(a) + q)) + 1e-30f; }

// logits [R, V] float32 of the rows x [R, K] bf16 (see above): `head` packed bf16, `q8` its
// int8 copy packed by pack_int8_weight with bf16 row scales `scales` and float32 `errors`.
void argmax_head_logits_impl(const uint16_t* x, int64_t R, int64_t K, const uint16_t* head, const int8_t* q8,
                             const uint16_t* scales, const float* errors, int64_t V, float* logits) {
  if (R <= 0) return;  // a step with no sampled row (a prefill chunk short of its prompt's end)
  const int64_t groups = (V + kGroup - 1) / kGroup, group_stride = (K + 1) / 2 * kPairLine;
  // The caller's buffers, by pointer: a thread_local named inside the loops' bodies would be
  // each worker's own.
  thread_local std::vector<uint16_t> approx_buffer, exact_buffer;
  thread_local std::vector<uint8_t> race_buffer;
  approx_buffer.resize(R * V);
  exact_buffer.resize(V);
  race_buffer.resize(groups);
  uint16_t* const approx = approx_buffer.data();
  uint16_t* const exact = exact_buffer.data();
  uint8_t* const in_race = race_buffer.data();
  int8_linear_impl(x, q8, scales, approx, R, K, V);
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(64, groups / 8));
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* xr = x + r * K;
    const uint16_t* a = approx + r * V;
    float* out = logits + r * V;
    double x1 = 0.0;
    for (int64_t k = 0; k < K; ++k) x1 += std::fabs(bf16_to_float_bits(xr[k]));
    const float chain = static_cast<float>(254.0 * static_cast<double>(K) * 0x1p-24);
    auto q_of = [&](int64_t n) {
      return 1.001f * static_cast<float>(x1) * (errors[n] + chain * bf16_to_float_bits(scales[n]));
    };
    // The largest lower bound, a piece of the vocabulary per chunk; -inf on a value that is
    // not finite (the row then takes the whole head).
    std::vector<float> piece_max(pieces, -std::numeric_limits<float>::infinity());
    std::atomic<bool> finite{std::isfinite(x1)};
    parallel_chunks(pieces, [&](int64_t c) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t n = V * c / pieces; n < V * (c + 1) / pieces; ++n) {
        const float an = bf16_to_float_bits(a[n]);
        if (!std::isfinite(an)) finite.store(false, std::memory_order_relaxed);
        best = std::max(best, an - argmax_head_bound(an, q_of(n)));
      }
      piece_max[c] = best;
    });
    const float L = *std::max_element(piece_max.begin(), piece_max.end());
    int64_t racing = 0;
    if (finite.load() && std::isfinite(L)) {
      std::atomic<int64_t> count{0};
      parallel_chunks(pieces, [&](int64_t c) {
        int64_t here = 0;
        for (int64_t g = groups * c / pieces; g < groups * (c + 1) / pieces; ++g) {
          bool any = false;
          for (int64_t n = g * kGroup; n < std::min(V, (g + 1) * kGroup) && !any; ++n) {
            const float an = bf16_to_float_bits(a[n]);
            any = an + argmax_head_bound(an, q_of(n)) >= L;
          }
          in_race[g] = any;
          here += any;
        }
        count.fetch_add(here, std::memory_order_relaxed);
      });
      racing = count.load();
    }
    if (racing == 0) {  // not finite: the whole head (a finite row always has a group in the race)
      std::fill(in_race, in_race + groups, uint8_t{1});
    }
    std::vector<int64_t> race;
    for (int64_t g = 0; g < groups; ++g)
      if (in_race[g]) race.push_back(g);
    // The exact logits of the groups in the race (the head's own one-row tile), the rest -inf.
    parallel_chunks(static_cast<int64_t>(race.size()), [&](int64_t i) {
      const int64_t g = race[i];
      linear_rows(1, xr, K, head + g * group_stride, nullptr, nullptr, exact, K, V, g * kGroup);
    });
    parallel_ranges(groups, 256, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t n = g * kGroup; n < std::min(V, (g + 1) * kGroup); ++n)
          out[n] = in_race[g] ? bf16_to_float_bits(exact[n]) : -std::numeric_limits<float>::infinity();
    });
  }
}

// The int4 weight-only (W4A16) linear, per group of `gk` inputs (K a multiple of gk, gk a
// multiple of 16): w = (q - 8) * scale + offset for q in [0, 15] with a bf16 scale and offset
// per (input group, output), torch's CPU int4 semantics (kernels/quant_linear.py
// `int4_scale_offset`: offset = scale * (8 - zero)). Each nibble is read as the bf16
// 1 + q / 16 (exponent 0, q in the mantissa's top bits: exact, and one bit operation from
// the packed bits), so per input group a chain of vdpbf16ps gives c = sum(x) + dot(x, q) / 16,
// and the output is
//     y = sum over input groups of  (16 scale) * c  +  (offset - 24 scale) * sum(x)
//       = sum over input groups of  scale * dot(x, q - 8) + offset * sum(x),
// computed in float32 in this order for every row count: per group y = fma(c, 16 scale, y),
// then y = fma(sum(x), fma(scale, -24, offset), y); rounded to bf16 once. The group sums of
// x are computed once per call per row (int4_group_sums), so a row's result depends on its
// own inputs only (batch-invariant). No dequantized copy of the weight exists: a decode step
// streams ~0.56 bytes per weight (at 128 inputs a group), a quarter of bf16's.
//
// Layout (pack_int4_weight): groups of 32 outputs as pack_bf16_weight's, and within a group
// one block per input group: the 32 scales (bf16), the 32 offsets (bf16), then gk / 4 lines
// of 64 bytes, each two input pairs' nibbles: 16 lanes of 32 bits, lane i holding four
// (even, odd) input pairs, vector t = 0..3 being (pair 0, outputs 0-15), (pair 0, outputs
// 16-31), (pair 1, outputs 0-15), (pair 1, outputs 16-31). Pair t's even nibble sits at lane
// bits [3 + 4t, 7 + 4t), its odd nibble at bits [19 + 4t, 23 + 4t) (mod 32: t = 3's wraps to
// bits 31, 0-2), so rotating the lane right by 4t puts them at [3, 7) and [19, 23), the top
// mantissa bits of the lane's two bf16 halves, and one vpternlogd keeps those bits and sets
// the exponent: (lane & 0x00780078) | 0x3F803F80. A line costs a load, three rotates and four
// ternary-logic ops for its four vdpbf16ps (a vpermw lookup per vector was ~2x slower here).
constexpr int kInt4LanesMask = 0x00780078;  // the top 4 mantissa bits of both bf16 halves
constexpr int kInt4One = 0x3F803F80;        // bf16 1.0 in both halves

// Vector t of a line (see above) as bf16 (1 + q / 16), pairs in vdpbf16ps's order.
template <int T>
inline __m512bh int4_vector(__m512i line) {
  const __m512i rotated = T == 0 ? line : _mm512_ror_epi32(line, 4 * T);
  return (__m512bh)_mm512_ternarylogic_epi32(rotated, _mm512_set1_epi32(kInt4LanesMask), _mm512_set1_epi32(kInt4One),
                                             0xEA);  // (a & b) | c
}

// x rows [0, MR) (row stride K; xs: their group sums, row stride K / gk) against G adjacent
// groups of 32 outputs starting at `pg` (group stride `gs` bytes), outputs from n0.
template <int MR, int G>
inline void int4_tile(const uint16_t* __restrict x, const float* __restrict xs, const uint8_t* __restrict pg, int64_t gs,
                      uint16_t* __restrict y, int64_t K, int64_t N, int64_t n0, int64_t gk) {
  const int64_t groups_k = K / gk, block = int4_block_bytes(gk), lines = gk / 4;
  // A weight stream (few rows): one prefetch per line read, `ahead` bytes on: the same line
  // of the groups this tile's next call reads (G groups on) where those are near (a short K:
  // each group's stretch is a few KB, and a fixed distance would land in the other stream's
  // lines), else 8 KB on in the same stream.
  const int64_t ahead = G * gs <= 4 * kPrefetchL2Ahead ? G * gs : 2 * kPrefetchL2Ahead;
  __m512 total[MR][2 * G];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 2 * G; ++j) total[m][j] = _mm512_setzero_ps();
  for (int64_t kg = 0; kg < groups_k; ++kg) {
    const uint8_t* blk[G];
    for (int g = 0; g < G; ++g) {
      blk[g] = pg + g * gs + kg * block;
      if (MR <= 4) {  // the block's scales and offsets
        _mm_prefetch(reinterpret_cast<const char*>(blk[g] + ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(blk[g] + ahead + 64), _MM_HINT_T1);
      }
    }
    __m512 acc[MR][2 * G];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 2 * G; ++j) acc[m][j] = _mm512_setzero_ps();
    const uint16_t* xk = x + kg * gk;
    for (int64_t l = 0; l < lines; ++l) {
      __m512bh w[4 * G];
      for (int g = 0; g < G; ++g) {
        const uint8_t* at = blk[g] + kInt4Header + l * kInt4Line;
        if (MR <= 4) _mm_prefetch(reinterpret_cast<const char*>(at + ahead), _MM_HINT_T1);
        const __m512i line = _mm512_loadu_si512(at);
        w[4 * g] = int4_vector<0>(line);
        w[4 * g + 1] = int4_vector<1>(line);
        w[4 * g + 2] = int4_vector<2>(line);
        w[4 * g + 3] = int4_vector<3>(line);
      }
      for (int m = 0; m < MR; ++m) {
        uint32_t v0, v1;
        std::memcpy(&v0, xk + m * K + 4 * l, sizeof(v0));
        std::memcpy(&v1, xk + m * K + 4 * l + 2, sizeof(v1));
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(v0));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(v1));
        for (int g = 0; g < G; ++g) {
          acc[m][2 * g] = _mm512_dpbf16_ps(acc[m][2 * g], x0, w[4 * g]);
          acc[m][2 * g + 1] = _mm512_dpbf16_ps(acc[m][2 * g + 1], x0, w[4 * g + 1]);
          acc[m][2 * g] = _mm512_dpbf16_ps(acc[m][2 * g], x1, w[4 * g + 2]);
          acc[m][2 * g + 1] = _mm512_dpbf16_ps(acc[m][2 * g + 1], x1, w[4 * g + 3]);
        }
      }
    }
    const __m512 sixteen = _mm512_set1_ps(16.f), minus_24 = _mm512_set1_ps(-24.f);
    for (int g = 0; g < G; ++g) {
      __m512 s_lo, s_hi, o_lo, o_hi;
      const uint16_t* head = reinterpret_cast<const uint16_t*>(blk[g]);
      load_bf16x32(head, ~__mmask32{0}, s_lo, s_hi);
      load_bf16x32(head + kGroup, ~__mmask32{0}, o_lo, o_hi);
      const __m512 a_lo = _mm512_mul_ps(s_lo, sixteen), a_hi = _mm512_mul_ps(s_hi, sixteen);  // exact
      const __m512 c_lo = _mm512_fmadd_ps(s_lo, minus_24, o_lo), c_hi = _mm512_fmadd_ps(s_hi, minus_24, o_hi);
      for (int m = 0; m < MR; ++m) {
        const __m512 sum = _mm512_set1_ps(xs[m * groups_k + kg]);
        total[m][2 * g] = _mm512_fmadd_ps(sum, c_lo, _mm512_fmadd_ps(acc[m][2 * g], a_lo, total[m][2 * g]));
        total[m][2 * g + 1] = _mm512_fmadd_ps(sum, c_hi, _mm512_fmadd_ps(acc[m][2 * g + 1], a_hi, total[m][2 * g + 1]));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g)
      store_group(total[m][2 * g], total[m][2 * g + 1], nullptr, nullptr, y + m * N, n0 + g * kGroup, N);
}

// x rows [0, mb) (mb in 1..6) against one group of 32 outputs.
inline void int4_rows(int64_t mb, const uint16_t* x, const float* xs, const uint8_t* pg, int64_t gs, uint16_t* y,
                      int64_t K, int64_t N, int64_t n0, int64_t gk) {
  with_tile_rows<6>(mb, [&](auto rows) { int4_tile<decltype(rows)::value, 1>(x, xs, pg, gs, y, K, N, n0, gk); });
}

// Each x row's sums over its input groups of gk, in float32 in one fixed order (16 lanes,
// then their reduction): xs [M, K / gk].
void int4_group_sums(const uint16_t* x, float* xs, int64_t M, int64_t K, int64_t gk) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kg = 0; kg < K / gk; ++kg) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = kg * gk; k < (kg + 1) * gk; k += 16)
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + k))), 16)));
      xs[m * (K / gk) + kg] = _mm512_reduce_add_ps(acc);
    }
}

// y [M, N] = x [M, K] @ W^T, W int4 packed by pack_int4_weight with input groups of gk (see
// above), on schedule_packed_linear's pieces: tiles of up to 6 x rows x one group, or 1-2
// rows x two (the registers: a chain and a total per 16 outputs and row).
void int4_linear_impl(const uint16_t* x, const uint8_t* packed, uint16_t* y, int64_t M, int64_t K, int64_t N,
                      int64_t gk) {
  thread_local std::vector<float> sums;  // the caller's: a decode step calls this 4x per layer
  sums.resize(static_cast<size_t>(M * (K / gk)));
  int4_group_sums(x, sums.data(), M, K, gk);
  const float* xs = sums.data();
  const int64_t gs = K / gk * int4_block_bytes(gk);
  // x read in place (no unaliased_rows): 6-row tiles fit in L1's 8 ways, and the copy did not pay.
  schedule_packed_linear(
      M, N, gs, 6, 2,
      [&](int64_t g, int64_t m, int64_t mb, L2Prefetch) {
        int4_rows(mb, x + m * K, xs + m * (K / gk), packed + g * gs, gs, y + m * N, K, N, g * kGroup, gk);
      },
      [&](int64_t g) {
        if (M == 1)
          int4_tile<1, 2>(x, xs, packed + g * gs, gs, y, K, N, g * kGroup, gk);
        else
          int4_tile<2, 2>(x, xs, packed + g * gs, gs, y, K, N, g * kGroup, gk);
      });
}

#else
constexpr bool kHaveBf16Gemv = false;
#endif

}  // namespace

// Whether this build has the bf16 GEMV (compiled with AVX512-BF16: -march=native on a CPU
// that has it). Python checks it before routing (kernels/cpu_kernels.py).
bool has_bf16_gemv() { return kHaveBf16Gemv; }

// This machine's ceiling for the bf16 kernels' arithmetic, measured: every kernel thread
// issues `iterations` x 24 vdpbf16ps on registers only (24 independent chains: no memory
// operand, no chain waiting on its own latency), 2 x 32 FLOPs each. GFLOP/s over all the
// threads, from the first thread's start to the last one's end; 0 in a build without
// AVX512-BF16. The linears' GFLOP/s are a fraction of it (loadtest/bench_decode_paths.py
// --phases): what no tile can pass, whatever it does with memory.
double bf16_dot_peak_gflops(int64_t iterations) {
#if defined(__AVX512BF16__)
  const int64_t threads = kernel_threads();
  std::vector<float> sink(threads, 0.f);
  const auto start = std::chrono::steady_clock::now();
  parallel_chunks(threads, [&](int64_t t) {
    __m512 acc[24];
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));  // distinct: not one chain
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3F803F80), w = (__m512bh)_mm512_set1_epi32(0x3C003C00);
    for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 24  // the chains in registers (a loop over the array kept them in memory)
      for (int j = 0; j < 24; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], x, w);
      __asm__ volatile("" : "+v"(x));  // x may change: the products are not hoisted out of the loop
    }
    __m512 total = _mm512_setzero_ps();
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) total = _mm512_add_ps(total, acc[j]);
    sink[t] = _mm512_reduce_add_ps(total);
  }, threads);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];  // the sums are used
  (void)keep;
  return 2.0 * 32 * 24 * static_cast<double>(iterations) * static_cast<double>(threads) / seconds / 1e9;
#else
  (void)iterations;
  return 0.0;
#endif
}

namespace {

// pack_bf16_weight's and pack_int8_weight's tensors: the packed groups (see
// bf16_linear_impl), then a marker of kPackedMarkerBytes, behind a [N, K] view of the first
// N x K elements, so a packed weight has the dense one's shape (every shape check and the
// fused decode call's plumbing stay as they are) and cannot be mistaken for a dense one
// (whose storage holds exactly N x K elements): is_packed checks the storage's size and the
// marker.
constexpr int64_t kPackedMarkerBytes = 64;
constexpr uint8_t kPackedMarker = 0xB1;

int64_t packed_elems(int64_t N, int64_t K) { return (N + 31) / 32 * ((K + 1) / 2) * 64; }

// Whether w's storage is `bytes` of packed weight and the marker.
bool has_packed_storage(const torch::Tensor& w, at::ScalarType dtype, int64_t bytes) {
  if (w.dim() != 2 || w.scalar_type() != dtype || !w.is_contiguous() || w.storage_offset() != 0) return false;
  if (static_cast<int64_t>(w.storage().nbytes()) != bytes + kPackedMarkerBytes) return false;
  const uint8_t* tail = reinterpret_cast<const uint8_t*>(w.storage().data()) + bytes;
  for (int64_t i = 0; i < kPackedMarkerBytes; ++i)
    if (tail[i] != kPackedMarker) return false;
  return true;
}

bool is_packed(const torch::Tensor& w, at::ScalarType dtype) {
  return w.dim() == 2 &&
         has_packed_storage(w, dtype, packed_elems(w.size(0), w.size(1)) * static_cast<int64_t>(w.element_size()));
}

bool is_packed_bf16(const torch::Tensor& w) { return is_packed(w, at::kBFloat16); }
bool is_packed_int8(const torch::Tensor& w) { return is_packed(w, at::kChar); }

// pack_int4_weight's tensor: a [N, K / 2] uint8 view over the blocks (see int4_linear_impl)
// of groups of gk inputs, then the marker.
int64_t packed_int4_bytes(int64_t N, int64_t K, int64_t gk) { return (N + 31) / 32 * (K / gk) * int4_block_bytes(gk); }

bool is_packed_int4(const torch::Tensor& w, int64_t gk) {
  return w.dim() == 2 && gk > 0 && gk % 16 == 0 && (2 * w.size(1)) % gk == 0 &&
         has_packed_storage(w, at::kByte, packed_int4_bytes(w.size(0), 2 * w.size(1), gk));
}

// The pair layout of a dense [N, K] weight of element T (see bf16_linear_impl).
template <typename T>
torch::Tensor pack_pairs(const torch::Tensor& weight) {
  const torch::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 1) / 2, elems = packed_elems(N, K);
  const int64_t marker_elems = kPackedMarkerBytes / static_cast<int64_t>(sizeof(T));
  torch::Tensor storage = torch::empty({elems + marker_elems}, w.options());
  const T* src = reinterpret_cast<const T*>(w.data_ptr());
  T* dst = reinterpret_cast<T*>(storage.data_ptr());
  const int64_t groups = (N + 31) / 32;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t kp = 0; kp < Kp; ++kp)
        for (int64_t l = 0; l < 32; ++l)
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t n = g * 32 + l, k = 2 * kp + j;
            dst[((g * Kp + kp) * 32 + l) * 2 + j] = (n < N && k < K) ? src[n * K + k] : T{0};
          }
  });
  std::memset(dst + elems, kPackedMarker, kPackedMarkerBytes);
  return storage.as_strided({N, K}, {K, 1});
}

}  // namespace

// The bf16 linear kernel's copy of a dense bf16 weight [N, K] (any N, K): its pair layout
// (bf16_linear_impl), as a tensor of the weight's shape (see is_packed). Only bf16_gemv,
// bf16_silu_mlp and bf16_decode_layers read it; it is not a dense weight.
torch::Tensor pack_bf16_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "pack_bf16_weight: a 2-D bfloat16 CPU weight expected");
  return pack_pairs<uint16_t>(weight);
}

// The same for an int8 W8A16 weight [N, K] (int8_linear_impl): read by int8_gemv and
// bf16_decode_layers only.
torch::Tensor pack_int8_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "pack_int8_weight: a 2-D int8 CPU weight expected");
  return pack_pairs<int8_t>(weight);
}

// The int4 kernel's copy of a W4A16 weight (int4_linear_impl): q [N, K] uint8 in [0, 15],
// scale_offset [K / gk, N, 2] bf16 (scale, offset) per input group of gk and output, as
// torch's CPU int4 layout holds them (w = (q - 8) * scale + offset). Read by int4_gemv and
// bf16_decode_layers only.
torch::Tensor pack_int4_weight(const torch::Tensor& q, const torch::Tensor& scale_offset, int64_t gk) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.device().is_cpu(),
              "pack_int4_weight: a 2-D uint8 CPU weight of int4 values expected");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(gk > 0 && gk % 16 == 0 && K % gk == 0, "pack_int4_weight: the group size must be a multiple of 16 ",
              "that divides K (", K, "), got ", gk);
  TORCH_CHECK(scale_offset.scalar_type() == at::kBFloat16 && scale_offset.dim() == 3 && scale_offset.size(0) == K / gk &&
                  scale_offset.size(1) == N && scale_offset.size(2) == 2,
              "pack_int4_weight: bfloat16 scale_offset [K / group size, N, 2] expected");
  TORCH_CHECK(N == 0 || K == 0 || q.max().item<uint8_t>() <= 15, "pack_int4_weight: int4 values in [0, 15] expected");
  const torch::Tensor qc = q.contiguous(), so = scale_offset.contiguous();
  const uint8_t* src = qc.data_ptr<uint8_t>();
  const uint16_t* sop = reinterpret_cast<const uint16_t*>(so.data_ptr());
  const int64_t groups_k = K / gk, block = int4_block_bytes(gk), bytes = packed_int4_bytes(N, K, gk);
  torch::Tensor storage = torch::zeros({bytes + kPackedMarkerBytes}, qc.options());
  uint8_t* dst = storage.data_ptr<uint8_t>();
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t kg = 0; kg < groups_k; ++kg) {
        uint8_t* blk = dst + (g * groups_k + kg) * block;
        uint16_t* head = reinterpret_cast<uint16_t*>(blk);  // scales then offsets; 0 past N
        for (int64_t l = 0; l < 32 && 32 * g + l < N; ++l) {
          head[l] = sop[(kg * N + 32 * g + l) * 2];
          head[32 + l] = sop[(kg * N + 32 * g + l) * 2 + 1];
        }
        for (int64_t l = 0; l < gk / 4; ++l)
          for (int64_t i = 0; i < 16; ++i) {  // lane i of the line (see int4_linear_impl)
            uint32_t lane = 0;
            for (int64_t t = 0; t < 4; ++t) {
              const int64_t n = 32 * g + 16 * (t % 2) + i, k = kg * gk + 4 * l + 2 * (t / 2);
              const uint32_t even = n < N ? src[n * K + k] : 8, odd = n < N ? src[n * K + k + 1] : 8;  // past N: 8
              const int odd_at = (19 + 4 * t) % 32;
              lane |= even << (3 + 4 * t) | odd << odd_at | (odd_at > 28 ? odd >> (32 - odd_at) : 0u);
            }
            std::memcpy(blk + kInt4Header + l * kInt4Line + 4 * i, &lane, sizeof(lane));
          }
      }
  });
  std::memset(dst + bytes, kPackedMarker, kPackedMarkerBytes);
  return storage.as_strided({N, K / 2}, {K / 2, 1});
}

// out [M, N] = x [M, K] @ weight^T + bias [N]: x, bias, out bfloat16 and contiguous, weight
// packed by pack_bf16_weight. Every row count through the one kernel (bf16_linear_impl).
void bf16_gemv(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(kHaveBf16Gemv, "bf16_gemv: this build has no AVX512-BF16 (the CPU lacks it)");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "bf16_gemv: 2-D x and out expected");
  TORCH_CHECK(is_packed_bf16(weight), "bf16_gemv: a weight packed by pack_bf16_weight expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "bf16_gemv: bfloat16 x and out expected");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "bf16_gemv: contiguous tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N, "bf16_gemv: shape mismatch");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bf16_gemv: contiguous bfloat16 bias [N] expected");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
#if defined(__AVX512BF16__)
  if (M == 0 || N == 0) return;
  bf16_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                   b, reinterpret_cast<uint16_t*>(out.data_ptr()), M, K, N);
#endif
}

// out [M, N] = (x [M, K] @ weight^T) * scales [N]: x, scales, out bfloat16 and contiguous,
// weight int8 packed by pack_int8_weight (see int8_linear_impl).
void int8_gemv(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
               const torch::Tensor& scales) {
  TORCH_CHECK(kHaveBf16Gemv, "int8_gemv: this build has no AVX512-BF16 (the CPU lacks it)");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "int8_gemv: 2-D x and out expected");
  TORCH_CHECK(is_packed_int8(weight), "int8_gemv: an int8 weight packed by pack_int8_weight expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && scales.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "int8_gemv: bfloat16 x, scales and out expected");
  TORCH_CHECK(x.is_contiguous() && scales.is_contiguous() && out.is_contiguous(), "int8_gemv: contiguous tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && scales.numel() == N && out.size(0) == M && out.size(1) == N,
              "int8_gemv: shape mismatch");
#if defined(__AVX512BF16__)
  if (M == 0 || N == 0) return;
  int8_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), weight.data_ptr<int8_t>(),
                   reinterpret_cast<const uint16_t*>(scales.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()), M,
                   K, N);
#endif
}

// out [M, N] = x [M, K] @ W^T: x, out bfloat16 and contiguous, W int4 packed by
// pack_int4_weight with input groups of group_size (see int4_linear_impl).
void int4_gemv(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight, int64_t group_size) {
  TORCH_CHECK(kHaveBf16Gemv, "int4_gemv: this build has no AVX512-BF16 (the CPU lacks it)");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "int4_gemv: 2-D x and out expected");
  TORCH_CHECK(is_packed_int4(weight, group_size), "int4_gemv: an int4 weight packed by pack_int4_weight with groups of ",
              group_size, " expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "int4_gemv: bfloat16 x and out expected");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "int4_gemv: contiguous tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(2 * weight.size(1) == K && out.size(0) == M && out.size(1) == N, "int4_gemv: shape mismatch");
#if defined(__AVX512BF16__)
  if (M == 0 || N == 0) return;
  int4_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), weight.data_ptr<uint8_t>(),
                   reinterpret_cast<uint16_t*>(out.data_ptr()), M, K, N, group_size);
#endif
}

namespace {

// silu(g) * u for bf16 rows, each op rounded to bf16 as torch's eager `F.silu(gate) * up`
// rounds (silu in float, rounded; the product in float, rounded), 16 elements at a time.
// With e = 2^(-|g| log2 e) <= 1 (exp2_nonpositive16), sigmoid(g) = 1 / (1 + e) for g >= 0
// and e / (1 + e) below. Every bf16 MLP on the C++ kernels runs it, at any row count, so an
// element's result does not depend on the call's rows (its float exp is not torch's: a
// result can differ from torch's eager ops by 1 bf16 ulp).
#if defined(__AVX512BF16__)
inline __m512 bf16x16_to_float(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// bf16_bits on 16 lanes: rounded to nearest even, a NaN kept quiet.
inline __m256i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

inline __m512 round_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits16(v)), 16));
}

void silu_mul_rows(const uint16_t* gate_up, uint16_t* h, int64_t M, int64_t I) {
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f), one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* g = gate_up + m * 2 * I;
      const uint16_t* u = g + I;
      uint16_t* o = h + m * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 mask = I - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (I - i)) - 1);
        const __m512 gf = bf16x16_to_float(g + i, mask), uf = bf16x16_to_float(u + i, mask);
        const __m512 neg_abs = _mm512_min_ps(gf, _mm512_sub_ps(zero, gf));
        const __m512 e = exp2_nonpositive16(_mm512_mul_ps(neg_abs, log2e));
        const __mmask16 nonneg = _mm512_cmp_ps_mask(gf, zero, _CMP_GE_OQ);
        const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(nonneg, e, one), _mm512_add_ps(one, e));
        const __m512 silu = round_bf16x16(_mm512_mul_ps(gf, sig));
        _mm256_mask_storeu_epi16(o + i, mask, bf16_bits16(_mm512_mul_ps(silu, uf)));
      }
    }
  };
  if (M * I >= 32768) {
    parallel_ranges(M, std::max<int64_t>(1, 16384 / I), rows);
  } else {
    rows(0, M);
  }
}

constexpr int64_t kMaxLoraColumns = 4096;  // rank columns of one adapter at one linear (its shards' ranks summed)

// x . y over n bf16 elements: one float32 vdpbf16ps chain over pairs in order, the tail
// masked, the 16 lanes summed at the end (the same order for a row whatever else is computed).
inline float dot_bf16_any(const uint16_t* x, const uint16_t* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(y + k));
  if (k < n) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (n - k)) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k),
                           (__m512bh)_mm512_maskz_loadu_epi16(mask, y + k));
  }
  return _mm512_reduce_add_ps(acc);
}

// LoRA deltas added into a linear's bf16 outputs (engine/lora.py), every adapter of the
// step at once: row m of adapter group g = row_group[m] (-1: a base row, left as it is)
// takes the group's rank columns [o0, o1) = [offsets[g], offsets[g + 1]) (even: each
// adapter's rank padded to pairs) of the stacked a [R, K] and bp [R/2, 2N] (each adapter's
// B, its scale folded in, in vdpbf16ps's pair layout: bp[j][2n + i] = B[n][2j + i]):
//   t_j = x_m . a_j  (dot_bf16_any, float32),
//   out[m, n] = bf16(out[m, n] + sum over pairs j of (bf16(t_2j), bf16(t_2j+1)) . bp[j][2n..2n+1])
// one vdpbf16ps chain per output over the pairs in order, rounded once. A row's result
// depends on its own x, out and adapter only: batch-invariant, and the per-op hook and the
// fused decode call (bf16_decode_layers) run this same function.
void lora_add_rows(uint16_t* out, const uint16_t* x, const uint16_t* a, const uint16_t* bp, const int64_t* row_group,
                   const int64_t* offsets, int64_t M, int64_t K, int64_t N) {
  auto columns = [&](int64_t m) {  // row m's rank columns [o0, o0 + r); r = 0: a base row
    const int64_t g = row_group[m];
    if (g < 0) return std::pair<int64_t, int64_t>{0, 0};
    return std::pair<int64_t, int64_t>{offsets[g], std::max<int64_t>(0, offsets[g + 1] - offsets[g])};
  };
  // The shrink: t[j] = x_m . a_(o0 + j) for j in [j0, j1).
  auto shrink = [&](int64_t m, int64_t j0, int64_t j1, float* t) {
    const int64_t o0 = columns(m).first;
    const uint16_t* xm = x + m * K;
    for (int64_t j = j0; j < j1; ++j) t[j] = dot_bf16_any(xm, a + (o0 + j) * K, K);
  };
  // The expand of row m's outputs [n_lo, n_hi) (n_lo a multiple of 64) from its t.
  auto expand = [&](int64_t m, int64_t n_lo, int64_t n_hi, const float* t) {
    const auto [o0, r] = columns(m);
    uint16_t* om = out + m * N;
    const uint16_t* b0 = bp + o0 * N;  // pair j = o0 / 2 starts at j * 2N
    uint32_t tp[kMaxLoraColumns / 2];  // t's pairs as bf16
    for (int64_t j = 0; j < r / 2; ++j)
      tp[j] = static_cast<uint32_t>(bf16_bits(t[2 * j])) | (static_cast<uint32_t>(bf16_bits(t[2 * j + 1])) << 16);
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += 64) {
      __m512 acc[4];
      __mmask16 mask[4];
      __mmask32 pair_mask[4];
      for (int c = 0; c < 4; ++c) {
        const int64_t left = n_hi - n0 - 16 * c;
        mask[c] = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                             : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : static_cast<__mmask16>(0);
        pair_mask[c] = left >= 16 ? static_cast<__mmask32>(0xFFFFFFFFu)
                                  : left > 0 ? static_cast<__mmask32>((1ull << (2 * left)) - 1) : static_cast<__mmask32>(0);
        acc[c] = bf16x16_to_float(om + n0 + 16 * c, mask[c]);
      }
      for (int64_t j = 0; j < r / 2; ++j) {
        const __m512bh tj = (__m512bh)_mm512_set1_epi32(static_cast<int>(tp[j]));
        const uint16_t* row = b0 + j * 2 * N + 2 * n0;
        for (int c = 0; c < 4; ++c)
          acc[c] = _mm512_dpbf16_ps(acc[c], tj, (__m512bh)_mm512_maskz_loadu_epi16(pair_mask[c], row + 32 * c));
      }
      for (int c = 0; c < 4; ++c)
        if (mask[c]) _mm256_mask_storeu_epi16(om + n0 + 16 * c, mask[c], bf16_bits16(acc[c]));
    }
  };
  auto one_row = [&](int64_t m) {
    const int64_t r = columns(m).second;
    if (r <= 0) return;
    float t[kMaxLoraColumns];
    shrink(m, 0, r, t);
    expand(m, 0, N, t);
  };
  // A row per chunk. Few rows (a decode step) run on the caller alone: a row's adapter
  // weights at one linear are ~0.1-0.2 MB, and splitting its shrink and expand over the
  // threads (two pool loops a linear) was no faster at batch 1 in this session's runs.
  if (M >= 4) {
    parallel_chunks(M, one_row);
  } else {
    for (int64_t m = 0; m < M; ++m) one_row(m);
  }
}
#endif

}  // namespace

// The gated SiLU MLP of a few bf16 rows in one call: out = (silu(x W_gu[:I]^T) *
// (x W_gu[I:]^T)) W_down^T, no biases, every intermediate rounded to bf16 as the eager
// ops round. Both linears run bf16_linear_impl, the activation silu_mul_rows, at any row
// count (so the MLP is batch-invariant); one call instead of two linear calls and three
// eager ops (split, silu, mul) also saves their Python and dispatch at decode, where a
// layer's ops each cost more in overhead than in arithmetic.
void bf16_silu_mlp(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate_up_weight,
                   const torch::Tensor& down_weight) {
  TORCH_CHECK(kHaveBf16Gemv, "bf16_silu_mlp: this build has no AVX512-BF16 (the CPU lacks it)");
  for (const torch::Tensor* t : {&out, &x}) {
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                "bf16_silu_mlp: 2-D contiguous bfloat16 x and out expected");
  }
  TORCH_CHECK(is_packed_bf16(gate_up_weight) && is_packed_bf16(down_weight),
              "bf16_silu_mlp: weights packed by pack_bf16_weight expected");
  const int64_t M = x.size(0), K = x.size(1), I = gate_up_weight.size(0) / 2, N = down_weight.size(0);
  TORCH_CHECK(gate_up_weight.size(0) == 2 * I && gate_up_weight.size(1) == K && down_weight.size(1) == I &&
                  out.size(0) == M && out.size(1) == N,
              "bf16_silu_mlp: shape mismatch");
#if defined(__AVX512BF16__)
  if (M == 0) return;
  // The intermediates in a buffer kept by the calling thread, grown as needed: every element
  // is written before it is read, where a fresh zero-filled pair per call (the fused decode
  // call makes one a layer) cost a memset and the allocator's page faults every layer.
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < 3 * M * I) buffer.resize(3 * M * I);
  uint16_t* gate_up = buffer.data();
  uint16_t* h = gate_up + 2 * M * I;
  bf16_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                   reinterpret_cast<const uint16_t*>(gate_up_weight.data_ptr()), nullptr, gate_up, M, K, 2 * I);
  silu_mul_rows(gate_up, h, M, I);
  bf16_linear_impl(h, reinterpret_cast<const uint16_t*>(down_weight.data_ptr()), nullptr,
                   reinterpret_cast<uint16_t*>(out.data_ptr()), M, I, N);
#endif
}

// out [M, N] += the LoRA deltas of its rows (lora_add_rows): x [M, K], a [R, K] and bp
// [R/2, 2N] (B in pairs) bfloat16, row_group [M] and offsets [G + 1] int64 (even).
void lora_add(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
              const torch::Tensor& row_group, const torch::Tensor& offsets) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 2 && bt.dim() == 2 && out.size(0) == x.size(0) &&
                  a.size(1) == x.size(1) && bt.size(1) == 2 * out.size(1) && 2 * bt.size(0) == a.size(0),
              "lora_add: out [M, N], x [M, K], a [R, K] and b in pairs [R/2, 2N] expected");
  for (const torch::Tensor* t : {&out, &x, &a, &bt}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous(), "lora_add: contiguous bfloat16 tensors expected");
  }
  TORCH_CHECK(row_group.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && row_group.is_contiguous() &&
                  offsets.is_contiguous() && row_group.numel() == x.size(0) && offsets.numel() >= 1,
              "lora_add: int64 row_group [M] and offsets [G + 1] expected");
  const int64_t G = offsets.numel() - 1, R = a.size(0);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* groups = row_group.data_ptr<int64_t>();
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(0 <= off[g] && off[g] <= off[g + 1] && off[g + 1] <= R && off[g + 1] - off[g] <= 4096 &&
                    off[g] % 2 == 0 && off[g + 1] % 2 == 0,
                "lora_add: offsets must rise within [0, R] in pairs (even), at most 4096 columns a group");
  }
  for (int64_t m = 0; m < row_group.numel(); ++m) {
    TORCH_CHECK(groups[m] >= -1 && groups[m] < G, "lora_add: row_group ", groups[m], " not in [-1, ", G, ")");
  }
#if defined(__AVX512BF16__)
  lora_add_rows(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                reinterpret_cast<const uint16_t*>(a.data_ptr()), reinterpret_cast<const uint16_t*>(bt.data_ptr()),
                groups, off, x.size(0), x.size(1), out.size(1));
#else
  TORCH_CHECK(false, "lora_add: this build has no AVX512-BF16");
#endif
}

// gate_up [M, 2I] bf16 -> silu(gate_up[:, :I]) * gate_up[:, I:] [M, I], as bf16_silu_mlp
// computes its activation (silu_mul_rows): the per-op MLP of a step with LoRA rows, whose
// linears take their deltas between the two GEMMs.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: a contiguous bfloat16 [M, 2I] expected");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  torch::Tensor h = torch::empty({M, I}, gate_up.options());
#if defined(__AVX512BF16__)
  silu_mul_rows(reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), reinterpret_cast<uint16_t*>(h.data_ptr()), M, I);
#else
  TORCH_CHECK(false, "silu_mul: this build has no AVX512-BF16");
#endif
  return h;
}

// The 12-bit copy of a dense bf16 weight [N, K] (c12_linear_impl's layout, see there):
// [packed uint8 [groups * c12_group_bytes(K)], exceptions int16 [E] (each group's in the
// order the kernel meets them), offsets int64 [groups + 1] (group g's from offsets[g])].
std::vector<torch::Tensor> pack_c12_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "pack_c12_weight: a 2-D bfloat16 CPU weight expected");
  const torch::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 1) / 2, groups = (N + 31) / 32, gs = c12_group_bytes(K);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto bits = [&](int64_t n, int64_t k) -> uint16_t { return (n < N && k < K) ? src[n * K + k] : uint16_t{0}; };
  // Each row's largest exponent field (zeros, subnormals, infinities and NaN included).
  std::vector<int> emax(groups * 32, 0);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      int e = 0;
      for (int64_t k = 0; k < K; ++k) e = std::max(e, (src[n * K + k] >> 7) & 0xFF);
      emax[n] = e;
    }
  });
  auto escapes = [&](int64_t n, int64_t k) { return emax[n] - ((bits(n, k) >> 7) & 0xFF) > 14; };
  // The pair line's lane order: vector v, word i -> output 16 v + i / 2, input 2 kp + i % 2.
  torch::Tensor offsets = torch::empty({groups + 1}, torch::kInt64);
  int64_t* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  std::vector<int64_t> counts(groups, 0);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t c = 0;
      for (int64_t kp = 0; kp < Kp; ++kp)
        for (int64_t l = 0; l < 32; ++l) c += escapes(32 * g + l, 2 * kp) + escapes(32 * g + l, 2 * kp + 1);
      counts[g] = c;
    }
  });
  for (int64_t g = 0; g < groups; ++g) off[g + 1] = off[g] + counts[g];
  torch::Tensor packed = torch::empty({groups * gs}, torch::kUInt8);
  torch::Tensor exceptions = torch::empty({std::max<int64_t>(off[groups], 1)}, torch::kInt16);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  uint16_t* exc = reinterpret_cast<uint16_t*>(exceptions.data_ptr<int16_t>());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* base = dst + g * gs;
      uint16_t* header = reinterpret_cast<uint16_t*>(base);
      for (int v = 0; v < 2; ++v)
        for (int i = 0; i < 32; ++i) header[32 * v + i] = static_cast<uint16_t>(emax[32 * g + 16 * v + i / 2] << 7);
      uint16_t* e = exc + off[g];
      for (int64_t kp = 0; kp < Kp; ++kp) {
        uint8_t* line = base + kC12Header + kp * kC12Line;
        std::memset(line + 64, 0, 32);
        for (int v = 0; v < 2; ++v)
          for (int i = 0; i < 32; ++i) {
            const int64_t n = 32 * g + 16 * v + i / 2, k = 2 * kp + i % 2;
            const uint16_t b = bits(n, k);
            int code = emax[n] - ((b >> 7) & 0xFF);
            if (code > 14) {
              code = 15;
              *e++ = b;
            }
            line[32 * v + i] = static_cast<uint8_t>(((b & 0x7F) << 1) | (b >> 15));
            line[64 + i] |= static_cast<uint8_t>(code << (4 * v));
          }
      }
    }
  });
  return {packed, exceptions, offsets};
}

// y [M, N] = x [M, K] @ W^T for bf16 x and W's 12-bit copy `c12` (pack_c12_weight, N = the
// weight's rows): the bits bf16_gemv gives with W packed by pack_bf16_weight.
torch::Tensor c12_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& c12, int64_t N) {
  TORCH_CHECK(kHaveC12, "c12_linear: this build has no AVX512-BF16 and AVX512-VBMI2 (the CPU lacks one)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "c12_linear: contiguous bfloat16 x [M, K] expected");
  const int64_t M = x.size(0), K = x.size(1), groups = (N + 31) / 32;
  TORCH_CHECK(c12.size() == 3 && c12[0].scalar_type() == at::kByte && c12[0].numel() == groups * c12_group_bytes(K) &&
                  c12[1].scalar_type() == at::kShort && c12[2].scalar_type() == at::kLong &&
                  c12[2].numel() == groups + 1 && c12[2].data_ptr<int64_t>()[groups] <= c12[1].numel(),
              "c12_linear: [packed, exceptions, offsets] of pack_c12_weight for K = ", K, ", N = ", N, " expected");
  torch::Tensor y = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512VBMI2__)
  if (M > 0 && N > 0)
    c12_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), c12[0].data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t*>(c12[1].data_ptr<int16_t>()), c12[2].data_ptr<int64_t>(),
                    reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N);
#endif
  return y;
}

namespace {

// An LM head's int8 copy for greedy steps (kernels/greedy_head.py): [q8 packed by
// pack_int8_weight, bf16 row scales, float32 row errors], each over the head's rows.
void check_argmax_head(const std::vector<torch::Tensor>& argmax_head, const torch::Tensor& head) {
  TORCH_CHECK(argmax_head.size() == 3 && is_packed_int8(argmax_head[0]) && argmax_head[0].size(0) == head.size(0) &&
                  argmax_head[0].size(1) == head.size(1) && argmax_head[1].scalar_type() == at::kBFloat16 &&
                  argmax_head[1].is_contiguous() && argmax_head[1].numel() == head.size(0) &&
                  argmax_head[2].scalar_type() == at::kFloat && argmax_head[2].is_contiguous() &&
                  argmax_head[2].numel() == head.size(0),
              "argmax head: [int8 weight packed by pack_int8_weight, bfloat16 scales [V], float32 errors [V]] of the "
              "head's shape expected");
}

// The float32 logits [R, V] a greedy step reads of x [R, K] (bf16) through the head `head`
// (bf16 packed by pack_bf16_weight) with its int8 copy `argmax_head` (check_argmax_head):
// exact where a token can be the argmax, -inf elsewhere (argmax_head_logits_impl). The
// fused decode call's greedy head, as a kernel of its own for tests and benchmarks.
torch::Tensor argmax_head_logits(const torch::Tensor& x, const torch::Tensor& head,
                                 const std::vector<torch::Tensor>& argmax_head) {
  TORCH_CHECK(kHaveBf16Gemv, "argmax_head_logits: this build has no AVX512-BF16 (the CPU lacks it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && is_packed_bf16(head) &&
                  head.size(1) == x.size(1),
              "argmax_head_logits: contiguous bfloat16 x [R, K] and a head packed by pack_bf16_weight [V, K] expected");
  check_argmax_head(argmax_head, head);
  torch::Tensor logits = torch::empty({x.size(0), head.size(0)}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__)
  if (x.size(0) > 0)
    argmax_head_logits_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), x.size(1),
                            reinterpret_cast<const uint16_t*>(head.data_ptr()), argmax_head[0].data_ptr<int8_t>(),
                            reinterpret_cast<const uint16_t*>(argmax_head[1].data_ptr()),
                            argmax_head[2].data_ptr<float>(), head.size(0), logits.data_ptr<float>());
#endif
  return logits;
}

// Rows `index[r]` (index nullptr: rows 0..R) of a [*, n] bf16 matrix `src` with row stride
// `stride`, into a new contiguous [R, n] one, on the calling thread. The fused decode call's
// few copies (the embeddings' rows, a step's queries, the rows that sample) were ATen ops
// (index_select, contiguous), which run on OpenMP's team from ~32K elements (16 rows of the
// 1B-class model): where OpenMP's idle threads spin (OMP_WAIT_POLICY unset or active: a
// program that imported torch before the engine) they then took the cores the work pool's
// next loops needed (a 32-row step of the 1B-class model: docs/BENCHMARKS.md, "The in-step gap
// was the development script's OpenMP policy").
// These copies are a few hundred KB at most: a thread does them in microseconds.
// The copy itself, into rows of n at `to`: src row index[r] (or r) of stride `stride`.
void copy_rows(uint16_t* to, const uint16_t* from, int64_t stride, const int64_t* index, int64_t R, int64_t n) {
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(to + r * n, from + (index ? index[r] : r) * stride, n * sizeof(uint16_t));
}

torch::Tensor gather_rows(const torch::Tensor& src, int64_t stride, const int64_t* index, int64_t R, int64_t n) {
  torch::Tensor out = torch::empty({R, n}, src.options());
  copy_rows(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(src.data_ptr()), stride,
            index, R, n);
  return out;
}

// Where a fused decode call's time goes (loadtest/bench_decode_paths.py --phases): off
// unless decode_phase_times_start() turned it on; then each phase's wall time (on the
// calling thread, which takes part in every parallel loop) is added to its total, one clock
// read per phase boundary (~20 ns; a step has ~10 a layer). One fused call runs at a time
// (the engine loop's), so the totals are plain doubles.
enum DecodePhase : int {
  kPhaseSetup,      // argument checks, the embeddings' rows
  kPhaseNorms,      // the two add_rms_norms of each layer
  kPhaseQkv,        // the QKV linear (and its LoRA delta)
  kPhaseRopeCache,  // rotary, the KV cache write, the queries' copy
  kPhaseAttention,  // paged attention
  kPhaseO,          // the output projection
  kPhaseGateUp,     // the MLP's gate_up linear
  kPhaseSilu,       // SiLU-and-multiply
  kPhaseDown,       // the MLP's down linear
  kPhaseMlp,        // gate_up, SiLU and down in one kernel (bf16_silu_mlp: steps of 3+ rows)
  kPhaseHead,       // the final norm and the LM head (greedy route or whole head)
  kPhaseCount
};
constexpr const char* kPhaseNames[kPhaseCount] = {"setup", "norms", "qkv", "rope_cache", "attention", "o_proj",
                                                  "gate_up", "silu", "down", "mlp", "head"};
bool g_phase_on = false;
double g_phase_ns[kPhaseCount] = {};
int64_t g_phase_marks[kPhaseCount] = {};
int64_t g_phase_calls = 0;

struct PhaseClock {
  std::chrono::steady_clock::time_point last;
  PhaseClock() {
    if (g_phase_on) last = std::chrono::steady_clock::now();
  }
  // The time since the last mark goes to `phase`.
  void mark(DecodePhase phase) {
    if (!g_phase_on) return;
    const auto now = std::chrono::steady_clock::now();
    g_phase_ns[phase] += std::chrono::duration<double, std::nano>(now - last).count();
    ++g_phase_marks[phase];
    last = now;
  }
};

// One linear of a fused decode layer (bf16_decode_layers): its weight and how to apply it.
// kind 0: a bf16 weight [N, K] packed by pack_bf16_weight, through bf16_linear_impl; kind > 0:
// int4 packed by pack_int4_weight with input groups of `kind`, through int4_linear_impl;
// kind -1: int8 [N, K] packed by pack_int8_weight with bf16 per-row scales through
// int8_linear_impl. Each as the per-op Int4Linear / Int8Linear runs it. Bias: an empty
// tensor for none.
struct DecodeLinear {
  const torch::Tensor* weight;
  const torch::Tensor* bias;
  const torch::Tensor* scales;
  int64_t kind;
  // A bf16 weight's 12-bit copy (pack_c12_weight: 3 tensors from here), read for steps of
  // up to kC12MaxRows rows; nullptr: none.
  const torch::Tensor* c12 = nullptr;

  int64_t out_features() const { return weight->size(0); }
  int64_t in_features() const { return kind > 0 ? weight->size(1) * 2 : weight->size(1); }

  void check(int64_t K, const char* what) const {
    TORCH_CHECK(weight->dim() == 2 && weight->is_contiguous() && in_features() == K,
                "bf16_decode_layers: ", what, ": a contiguous 2-D weight with ", K, " inputs expected");
    if (kind == 0) TORCH_CHECK(is_packed_bf16(*weight), "bf16_decode_layers: ", what, ": a bf16 weight packed by pack_bf16_weight expected");
    if (kind > 0)
      TORCH_CHECK(is_packed_int4(*weight, kind), "bf16_decode_layers: ", what,
                  ": an int4 weight packed by pack_int4_weight with groups of ", kind, " expected");
    if (kind < 0) {
      TORCH_CHECK(is_packed_int8(*weight) && scales->scalar_type() == at::kBFloat16 &&
                      scales->numel() == out_features(),
                  "bf16_decode_layers: ", what, ": int8 weight packed by pack_int8_weight with bf16 row scales expected");
    }
    TORCH_CHECK(bias->numel() == 0 || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                                       bias->numel() == out_features()),
                "bf16_decode_layers: ", what, ": a bias is a contiguous bfloat16 [N] or empty");
    if (c12) {
      TORCH_CHECK(kHaveC12, "bf16_decode_layers: ", what, ": 12-bit copies need AVX512-VBMI2 (the CPU lacks it)");
      const int64_t groups = (out_features() + 31) / 32;
      TORCH_CHECK(kind == 0 && bias->numel() == 0 && c12[0].scalar_type() == at::kByte &&
                      c12[0].numel() == groups * c12_group_bytes(K) && c12[1].scalar_type() == at::kShort &&
                      c12[2].scalar_type() == at::kLong && c12[2].numel() == groups + 1 &&
                      c12[2].data_ptr<int64_t>()[groups] <= c12[1].numel(),
                  "bf16_decode_layers: ", what, ": a 12-bit copy is pack_c12_weight's of a bf16 weight with no bias");
    }
  }

  // x [M, K] bf16 contiguous -> [M, N], as the model's per-op forward computes it: the GEMV
  // adds the bias in float before its one rounding; after the quantized kernels the bias
  // is a separate bf16 add, as in kernels/quant_linear.py.
  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor out = torch::empty({x.size(0), out_features()}, x.options());
    // No rows: a step none of whose rows samples (a prompt's chunk that is not its last) has an
    // empty head input, and the tiles' few-row path would read rows that are not there.
    if (x.size(0) == 0) return out;
    if (kind == 0) {
#if defined(__AVX512BF16__)
#if defined(__AVX512VBMI2__)
      if (c12 && x.size(0) <= kC12MaxRows) {  // the same bits from 3/4 of the bytes (c12_linear_impl)
        c12_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), c12[0].data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(c12[1].data_ptr<int16_t>()), c12[2].data_ptr<int64_t>(),
                        reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), out_features());
        return out;
      }
#endif
      bf16_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(weight->data_ptr()),
                       bias->numel() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                       reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), out_features());
#endif
      return out;
    }
#if defined(__AVX512BF16__)
    if (kind > 0) {
      int4_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), weight->data_ptr<uint8_t>(),
                       reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), out_features(), kind);
    } else {
      int8_linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), weight->data_ptr<int8_t>(),
                       reinterpret_cast<const uint16_t*>(scales->data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                       x.size(0), x.size(1), out_features());
    }
#endif
    return bias->numel() ? out + *bias : out;
  }
};

// The model's side of a fused decode call: what stays the same from step to step
// (bf16_decode_layers' arguments of those names). DecodeModel holds them and checks them
// once; bf16_decode_layers checks them at every call.
struct DecodeModelArgs {
  const torch::Tensor& embedding;
  const std::vector<torch::Tensor>& layer_tensors;
  const std::vector<int64_t>& kinds;
  const std::vector<torch::Tensor>& kv_caches;
  const std::vector<int64_t>& windows;
  int64_t num_heads, num_kv_heads;
  double scale, eps;
  const torch::Tensor& final_norm;
  const torch::Tensor& lm_head;
  const torch::Tensor& lm_head_scales;
  const std::vector<torch::Tensor>& argmax_head;
  const std::vector<torch::Tensor>& c12_weights;
};

constexpr size_t kDecodeTensorsPerLayer = 14;

// The layer's linear i (0 qkv, 1 o, 2 gate_up, 3 down) as DecodeLinear runs it.
DecodeLinear decode_linear(const DecodeModelArgs& a, size_t l, int i) {
  const torch::Tensor* t = &a.layer_tensors[kDecodeTensorsPerLayer * l + (i < 2 ? 1 + 3 * i : 8 + 3 * (i - 2))];
  DecodeLinear linear{t, t + 1, t + 2, a.kinds[4 * l + i]};
  if (!a.c12_weights.empty() && a.c12_weights[12 * l + 3 * i].numel() > 0) linear.c12 = &a.c12_weights[12 * l + 3 * i];
  return linear;
}

// The model side's checks (every layer's norms, linears and caches against one another and
// against layer 0's head size, which run_decode_layers' buffers take for all layers).
void check_decode_model(const DecodeModelArgs& a) {
  const size_t L = a.windows.size();
  const int64_t H = a.num_heads, Hkv = a.num_kv_heads;
  TORCH_CHECK(a.c12_weights.empty() || a.c12_weights.size() == 12 * L,
              "bf16_decode_layers: 12-bit copies: 3 tensors per linear and layer (empty: none), or none");
  TORCH_CHECK(a.layer_tensors.size() == kDecodeTensorsPerLayer * L && a.kinds.size() == 4 * L &&
                  a.kv_caches.size() == 2 * L && L > 0 && H > 0 && Hkv > 0 && H % Hkv == 0,
              "bf16_decode_layers: 14 tensors, 4 linear kinds and 2 caches per layer expected");
  TORCH_CHECK(a.embedding.dim() == 2 && a.embedding.scalar_type() == at::kBFloat16 && a.embedding.is_contiguous(),
              "bf16_decode_layers: a contiguous bfloat16 embedding [vocab, hidden] expected");
  const int64_t hidden = a.embedding.size(1);
  TORCH_CHECK(a.final_norm.scalar_type() == at::kBFloat16 && a.final_norm.is_contiguous() && a.final_norm.numel() == hidden,
              "bf16_decode_layers: a bfloat16 final norm [hidden] expected");
  const bool int8_head = a.lm_head_scales.numel() > 0;
  TORCH_CHECK(a.lm_head.numel() == 0 || (kHaveBf16Gemv && a.lm_head.size(1) == hidden &&
                                         (int8_head ? is_packed_int8(a.lm_head) && a.lm_head_scales.scalar_type() == at::kBFloat16 &&
                                                          a.lm_head_scales.is_contiguous() &&
                                                          a.lm_head_scales.numel() == a.lm_head.size(0)
                                                    : is_packed_bf16(a.lm_head))),
              "bf16_decode_layers: an LM head is a bfloat16 [vocab, hidden] packed by pack_bf16_weight, or an int8 one ",
              "packed by pack_int8_weight with bfloat16 row scales (and needs the GEMV)");
  const at::ScalarType cache_type = a.kv_caches[0].scalar_type();
  const int64_t D0 = decode_linear(a, 0, 0).out_features() / (H + 2 * Hkv);
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* t = &a.layer_tensors[kDecodeTensorsPerLayer * l];
    for (int i : {0, 7}) {
      TORCH_CHECK(t[i].scalar_type() == at::kBFloat16 && t[i].is_contiguous() && t[i].numel() == hidden,
                  "bf16_decode_layers: contiguous bfloat16 norm weights [hidden] expected");
    }
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(a.kinds[4 * l + i] > 0 || kHaveBf16Gemv,
                  "bf16_decode_layers: this build has no AVX512-BF16 GEMV (bf16 and int8 linears)");
    }
    const DecodeLinear qkv = decode_linear(a, l, 0), o = decode_linear(a, l, 1), gate_up = decode_linear(a, l, 2),
                       down = decode_linear(a, l, 3);
    const int64_t D = qkv.out_features() / (H + 2 * Hkv), I = down.in_features();
    TORCH_CHECK(qkv.out_features() == (H + 2 * Hkv) * D && gate_up.out_features() == 2 * I &&
                    o.out_features() == hidden && down.out_features() == hidden &&
                    D == D0,
                "bf16_decode_layers: layer ", l, ": linear shapes do not fit one another (or layer 0's head size)");
    qkv.check(hidden, "qkv");
    o.check(H * D, "o");
    gate_up.check(hidden, "gate_up");
    down.check(I, "down");
    for (int c = 0; c < 2; ++c) {
      const torch::Tensor& cache = a.kv_caches[2 * l + c];
      const bool int8 = cache.scalar_type() == at::kChar;
      TORCH_CHECK((cache.scalar_type() == at::kBFloat16 || int8) && cache.scalar_type() == cache_type &&
                      cache.is_contiguous() && cache.dim() == 4 && cache.size(2) == Hkv &&
                      cache.size(3) == (int8 ? D + 2 : D),
                  "bf16_decode_layers: contiguous bfloat16 caches [blocks, block_size, Hkv, D] or int8 ones "
                  "[.., D + 2] expected, all of one dtype");
    }
  }
}

// One step through a checked model (check_decode_model): the step's arguments as
// bf16_decode_layers takes them; `want_logits`: the head's logits (the model must have a
// head), `argmax`: the greedy head's route where the step's rows allow it.
torch::Tensor run_decode_layers(const DecodeModelArgs& a, const torch::Tensor& input_ids, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& positions,
                                const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, int64_t q_chunk,
                                int64_t few_rows, int64_t block_over, int64_t key_part, const torch::Tensor& out_rows,
                                bool want_logits, bool argmax, const std::vector<torch::Tensor>& lora,
                                const torch::Tensor& lora_rows) {
  PhaseClock clock;
  if (g_phase_on) ++g_phase_calls;
  const torch::Tensor& embedding = a.embedding;
  const std::vector<torch::Tensor>& layer_tensors = a.layer_tensors;
  const std::vector<torch::Tensor>& kv_caches = a.kv_caches;
  const std::vector<int64_t>& windows = a.windows;
  const torch::Tensor& final_norm = a.final_norm;
  const torch::Tensor& lm_head = a.lm_head;
  const torch::Tensor& lm_head_scales = a.lm_head_scales;
  const std::vector<torch::Tensor> no_argmax_head;
  const std::vector<torch::Tensor>& argmax_head = argmax ? a.argmax_head : no_argmax_head;
  const double scale = a.scale, eps = a.eps;
  constexpr size_t kPerLayer = kDecodeTensorsPerLayer;
  const size_t L = windows.size();
  TORCH_CHECK(lora.empty() || (lora.size() == 12 * L && lora_rows.numel() == input_ids.numel()),
              "bf16_decode_layers: LoRA takes a, bt, offsets per linear (12 per layer) and a row group per row");
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && input_ids.is_contiguous(),
              "bf16_decode_layers: int64 input_ids [M] expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && positions.scalar_type() == at::kLong &&
                  slot_mapping.scalar_type() == at::kLong && positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == input_ids.numel() && slot_mapping.numel() == input_ids.numel(),
              "bf16_decode_layers: int32 attention metadata and int64 positions and slots (one a token) expected");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "bf16_decode_layers: contiguous float32 rotary tables expected");
  TORCH_CHECK(kv_caches[0].scalar_type() != at::kChar || key_part > 0,
              "bf16_decode_layers: int8 caches are read on the invariant route (a key_part expected)");
  TORCH_CHECK(!want_logits || lm_head.numel() > 0, "bf16_decode_layers: logits asked of a model with no LM head");
  const int64_t M = input_ids.numel(), vocab = embedding.size(0), hidden = embedding.size(1);
  const int64_t H = a.num_heads, Hkv = a.num_kv_heads;
  const int64_t R = out_rows.numel();
  TORCH_CHECK(out_rows.scalar_type() == at::kLong && out_rows.dim() == 1 && out_rows.is_contiguous(),
              "bf16_decode_layers: int64 out_rows [R] expected");
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(ids[m] >= 0 && ids[m] < vocab, "bf16_decode_layers: token id ", ids[m], " not in [0, ", vocab, ")");
  }
  const int64_t* out_row = out_rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(out_row[r] >= 0 && out_row[r] < M, "bf16_decode_layers: out_rows index ", out_row[r], " not in [0, ", M, ")");
  }
  const bool logits = want_logits, int8_head = lm_head_scales.numel() > 0;
  auto linear_of = [&](size_t l, int i) { return decode_linear(a, l, i); };
  const auto opts = embedding.options();
  torch::Tensor out = torch::empty({R, hidden}, opts);
  if (M == 0) return logits ? torch::empty({0, lm_head.size(0)}, opts.dtype(at::kFloat)) : out;
  torch::Tensor x = gather_rows(embedding, hidden, ids, M, hidden);  // the residual stream: the embeddings first
  auto bt = block_tables.contiguous();
  torch::Tensor h = torch::empty({M, hidden}, opts);
  torch::Tensor mlp_out;  // the previous layer's MLP output: added to x by the next norm
  // The queries (copied out of the QKV output: attention reads them contiguous) and the
  // attention's output, one buffer each for every layer (check_decode_model: every layer has
  // layer 0's head size).
  const int64_t D0 = linear_of(0, 0).out_features() / (H + 2 * Hkv);
  torch::Tensor q = torch::empty({M, H, D0}, opts), o = torch::empty({M, H, D0}, opts);
  const torch::Tensor attn_in = o.view({M, H * D0});
  clock.mark(kPhaseSetup);
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* t = &layer_tensors[kPerLayer * l];
    const DecodeLinear qkv_proj = linear_of(l, 0), o_proj = linear_of(l, 1), gate_up = linear_of(l, 2),
                       down = linear_of(l, 3);
    const int64_t D = qkv_proj.out_features() / (H + 2 * Hkv), I = down.in_features();
    // h = norm(x + previous MLP output), x = that sum: the model's `x + mlp(h)` then the
    // next layer's input norm, with the sum rounded to bf16 as torch's add rounds it.
    add_rms_norm_impl<c10::BFloat16>(h, x, x, mlp_out.defined() ? &mlp_out : nullptr, t[0], eps);
    clock.mark(kPhaseNorms);
    // A step with LoRA rows: after each linear, its rows' adapter deltas (lora_add, as the
    // per-op forward's hooks add them): `lora` holds a, bt, offsets per linear and layer
    // (12 per layer; a linear no adapter of the step targets has an empty a).
    auto has_lora = [&](int i) { return !lora.empty() && lora[12 * l + 3 * i].size(0) > 0; };
    auto add_lora = [&](int i, torch::Tensor& y, const torch::Tensor& in) {
      if (!has_lora(i)) return;
      const torch::Tensor* t = &lora[12 * l + 3 * i];
      lora_add(y, in, t[0], t[1], lora_rows, t[2]);
    };
    torch::Tensor qkv = qkv_proj(h);
    add_lora(0, qkv, h);
    clock.mark(kPhaseQkv);
    // Rotary on q and k in place, k and v into the cache, q out: on the row pointers (the
    // ATen views of the per-op forward's `rotary` and `reshape_and_cache` cost ~5 us a layer).
    auto* qkv_rows = qkv.data_ptr<c10::BFloat16>();
    const int64_t qkv_stride = qkv.size(1);
    rotary_rows<c10::BFloat16>(qkv_rows, M, H + Hkv, D, qkv_stride, cos.data_ptr<float>(), sin.data_ptr<float>(),
                               positions.data_ptr<int64_t>());
    if (kv_caches[2 * l].scalar_type() == at::kChar) {
      reshape_and_cache(qkv.narrow(1, H * D, Hkv * D).view({M, Hkv, D}),
                        qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({M, Hkv, D}), kv_caches[2 * l],
                        kv_caches[2 * l + 1], slot_mapping);
    } else {
      const char* rows = reinterpret_cast<const char*>(qkv_rows);
      const int64_t row_bytes = qkv_stride * sizeof(uint16_t), kv_bytes = Hkv * D * sizeof(uint16_t);
      copy_kv_rows(rows + H * D * sizeof(uint16_t), row_bytes, rows + (H + Hkv) * D * sizeof(uint16_t), row_bytes,
                   kv_bytes, static_cast<char*>(kv_caches[2 * l].data_ptr()),
                   static_cast<char*>(kv_caches[2 * l + 1].data_ptr()), slot_mapping.data_ptr<int64_t>(), M);
    }
    copy_rows(reinterpret_cast<uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(qkv_rows), qkv_stride,
              nullptr, M, H * D);
    clock.mark(kPhaseRopeCache);
    if (kv_caches[2 * l].scalar_type() == at::kChar) {
      paged_attention_int8(o, q, kv_caches[2 * l], kv_caches[2 * l + 1], bt, seq_lens, query_start_loc, scale,
                           windows[l], q_chunk, key_part);
    } else {
      paged_attention_impl<c10::BFloat16>(o, q, kv_caches[2 * l], kv_caches[2 * l + 1], bt, seq_lens, query_start_loc,
                                          scale, windows[l], q_chunk, /*skip_over=*/0, few_rows, block_over, key_part);
    }
    clock.mark(kPhaseAttention);
    torch::Tensor attn = o_proj(attn_in);
    add_lora(1, attn, attn_in);
    clock.mark(kPhaseO);
    add_rms_norm_impl<c10::BFloat16>(h, x, x, &attn, t[7], eps);
    clock.mark(kPhaseNorms);
    const bool kernel_mlp = gate_up.kind == 0 && down.kind == 0 && gate_up.bias->numel() == 0 && down.bias->numel() == 0;
    if (kernel_mlp && !has_lora(2) && !has_lora(3) && gate_up.c12 && down.c12 && M <= kC12MaxRows) {
      // bf16_silu_mlp's three steps on the 12-bit copies: the same bits.
      torch::Tensor gu = gate_up(h);
      clock.mark(kPhaseGateUp);
      torch::Tensor act = silu_mul(gu);
      clock.mark(kPhaseSilu);
      mlp_out = down(act);
      clock.mark(kPhaseDown);
    } else if (kernel_mlp && !has_lora(2) && !has_lora(3)) {
      // Both GEMVs, no biases: the model's bf16_silu_mlp, its SiLU-and-multiply included.
      if (!mlp_out.defined() || mlp_out.size(0) != M) mlp_out = torch::empty({M, hidden}, opts);
      bf16_silu_mlp(mlp_out, h, *gate_up.weight, *down.weight);
      clock.mark(kPhaseMlp);
    } else if (kernel_mlp) {
      // LoRA deltas between the GEMMs: the model's per-op MLP with adapters (the same
      // kernels: silu_mul is bf16_silu_mlp's activation).
      torch::Tensor gu = gate_up(h);
      add_lora(2, gu, h);
      clock.mark(kPhaseGateUp);
      torch::Tensor act = silu_mul(gu);
      clock.mark(kPhaseSilu);
      mlp_out = down(act);
      add_lora(3, mlp_out, act);
      clock.mark(kPhaseDown);
    } else {
      // The model's eager `down(F.silu(gate) * up)`, through the same ATen ops.
      torch::Tensor gu = gate_up(h);
      add_lora(2, gu, h);
      clock.mark(kPhaseGateUp);
      torch::Tensor act = at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
      clock.mark(kPhaseSilu);
      mlp_out = down(act);
      add_lora(3, mlp_out, act);
      clock.mark(kPhaseDown);
    }
  }
  // The last layer's `x + mlp(h)`, then the final norm of the rows that sample: the
  // model's `norm(x[rows])` through add_rms_norm with no add, the per-op forward's kernel
  // on this backend (LlamaForCausalLM.final_norm).
  // (Only the rows that sample: their sum, rounded as torch's add rounds it, then the norm.)
  torch::Tensor rows = gather_rows(x, hidden, out_row, R, hidden), last;
  if (mlp_out.defined()) last = gather_rows(mlp_out, hidden, out_row, R, hidden);
  add_rms_norm_impl<c10::BFloat16>(out, rows, rows, last.defined() ? &last : nullptr, final_norm, eps);
  if (!logits) {
    clock.mark(kPhaseHead);
    return out;
  }
#if defined(__AVX512BF16__)
  if (!argmax_head.empty() && !int8_head && R <= kArgmaxHeadRows) {
    // A greedy step: the exact logits only where the argmax can be (argmax_head_logits_impl).
    check_argmax_head(argmax_head, lm_head);
    torch::Tensor float_logits = torch::empty({R, lm_head.size(0)}, opts.dtype(at::kFloat));
    argmax_head_logits_impl(reinterpret_cast<const uint16_t*>(out.data_ptr()), R, hidden,
                            reinterpret_cast<const uint16_t*>(lm_head.data_ptr()), argmax_head[0].data_ptr<int8_t>(),
                            reinterpret_cast<const uint16_t*>(argmax_head[1].data_ptr()),
                            argmax_head[2].data_ptr<float>(), lm_head.size(0), float_logits.data_ptr<float>());
    clock.mark(kPhaseHead);
    return float_logits;
  }
#endif
  // The head as the model's GEMV `Linear` computes it (bf16 out), widened as the sampler widens it.
  const torch::Tensor none = torch::empty({0}, opts);
  // The widening on the work pool, not torch's `.to(float)`: that copy (49,152 logits a
  // row) is an OpenMP parallel op, the one of a decode step, and waking torch's team costs
  // more than the copy (and stalls when a neighbour holds a core).
  const torch::Tensor bf16_logits = DecodeLinear{&lm_head, &none, &lm_head_scales, int8_head ? -1 : 0}(out);
  torch::Tensor float_logits = torch::empty(bf16_logits.sizes(), opts.dtype(at::kFloat));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(bf16_logits.data_ptr());
  float* dst = float_logits.data_ptr<float>();
  parallel_ranges(bf16_logits.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = bf16_to_float_bits(src[i]);
  });
  clock.mark(kPhaseHead);
  return float_logits;
}

}  // namespace

// A decode step's decoder layers for a few bf16 rows in one call: for each Llama-style
// layer (pre-norm attention with fused QKV and RoPE, pre-norm gated SiLU MLP) the same
// kernels the model's eager forward calls one by one (add_rms_norm, the linears' kernels,
// rotary, reshape_and_cache, paged_attention, the MLP's activation), in the same order and
// with the same rounding, so the result is bit-identical to that forward. At batch 1 the
// model's Python per layer (~10 calls, each a pybind or dispatcher call and new tensor
// objects) cost ~30% of the step on top of the weight stream; here a layer costs its
// kernels only.
//
// input_ids [M] (int64): the step's tokens, looked up in `embedding` [vocab, hidden] (the
// model's `embed`: its rows as they are) into the residual stream x [M, hidden].
// layer_tensors: per layer, in this order, input_norm [hidden]; qkv, o: weight, bias,
// scales each (DecodeLinear); post_norm [hidden]; gate_up, down: weight, bias, scales
// each: 14 per layer. kinds: each layer's four linears' DecodeLinear kinds.
// kv_caches: key, value per layer (bf16, or int8 rows: paged_attention_int8). lora (empty:
// none): a step's LoRA deltas, a, bt, offsets per linear and layer, with lora_rows [M] each
// row's adapter group (lora_add). windows: each layer's sliding window (0: none). The
// attention arguments after them are paged_attention's (its bf16 routing: q_chunk,
// few_rows, block_over), the metadata shared by every layer. Returns [R, hidden]: the
// model's final norm (`final_norm`) of the last layer's output rows `out_rows` [R] (the
// rows that sample); with a non-empty `lm_head` [vocab, hidden] (bf16, no bias; or int8 with
// bf16 row scales `lm_head_scales`, an Int8Linear's packed copy: the INT4 model's head) instead
// their logits, float32 [R, vocab]: the head through the GEMV (each logit rounded to bf16
// once, as the model's head computes it) and widened to float32, as the sampler widens
// them. The lookup, the norm and the head were the eager ops around the call, each several
// times slower there than alone (the weight stream evicts their working set).
torch::Tensor bf16_decode_layers(const torch::Tensor& input_ids, const torch::Tensor& embedding,
                                 const std::vector<torch::Tensor>& layer_tensors, const std::vector<int64_t>& kinds,
                                 const std::vector<torch::Tensor>& kv_caches, const std::vector<int64_t>& windows,
                                 const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                                 const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                 const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                                 int64_t num_heads, int64_t num_kv_heads, double scale, double eps, int64_t q_chunk,
                                 int64_t few_rows, int64_t block_over, int64_t key_part, const torch::Tensor& final_norm,
                                 const torch::Tensor& out_rows, const torch::Tensor& lm_head,
                                 const torch::Tensor& lm_head_scales, const std::vector<torch::Tensor>& argmax_head,
                                 const std::vector<torch::Tensor>& c12_weights, const std::vector<torch::Tensor>& lora,
                                 const torch::Tensor& lora_rows) {
  const DecodeModelArgs model{embedding, layer_tensors, kinds,      kv_caches,      windows,     num_heads,  num_kv_heads,
                              scale,     eps,           final_norm, lm_head,        lm_head_scales, argmax_head, c12_weights};
  check_decode_model(model);
  return run_decode_layers(model, input_ids, cos, sin, positions, slot_mapping, block_tables, seq_lens,
                           query_start_loc, q_chunk, few_rows, block_over, key_part, out_rows, lm_head.numel() > 0,
                           !argmax_head.empty(), lora, lora_rows);
}

// bf16_decode_layers' model side held across steps (pybind `DecodeModel`): the tensors are
// checked once, when it is made, and a step passes only its own arguments. Passing the
// model's ~900 tensors to every call (each converted by pybind11, its TensorImpl touched
// after the weight stream evicted it) and checking them again cost ~0.35 ms a step, ~4% of
// a batch-1 step of the bundled model (docs/BENCHMARKS.md, "Where a batch-1 step's time goes").
class DecodeModel {
 public:
  DecodeModel(torch::Tensor embedding, std::vector<torch::Tensor> layer_tensors, std::vector<int64_t> kinds,
              std::vector<torch::Tensor> kv_caches, std::vector<int64_t> windows, int64_t num_heads,
              int64_t num_kv_heads, double scale, double eps, torch::Tensor final_norm, torch::Tensor lm_head,
              torch::Tensor lm_head_scales, std::vector<torch::Tensor> argmax_head,
              std::vector<torch::Tensor> c12_weights)
      : embedding_(std::move(embedding)), layer_tensors_(std::move(layer_tensors)), kinds_(std::move(kinds)),
        kv_caches_(std::move(kv_caches)), windows_(std::move(windows)), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), scale_(scale), eps_(eps), final_norm_(std::move(final_norm)),
        lm_head_(std::move(lm_head)), lm_head_scales_(std::move(lm_head_scales)),
        argmax_head_(std::move(argmax_head)), c12_weights_(std::move(c12_weights)) {
    check_decode_model(args());
  }

  // One step (bf16_decode_layers' arguments of these names); `logits`: the head's logits,
  // `argmax`: the greedy head's route (where the model has its copy and the rows allow it).
  torch::Tensor run(const torch::Tensor& input_ids, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& positions, const torch::Tensor& slot_mapping,
                    const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                    const torch::Tensor& query_start_loc, int64_t q_chunk, int64_t few_rows, int64_t block_over,
                    int64_t key_part, const torch::Tensor& out_rows, bool logits, bool argmax,
                    const std::vector<torch::Tensor>& lora, const torch::Tensor& lora_rows) const {
    return run_decode_layers(args(), input_ids, cos, sin, positions, slot_mapping, block_tables, seq_lens,
                             query_start_loc, q_chunk, few_rows, block_over, key_part, out_rows, logits, argmax, lora,
                             lora_rows);
  }

 private:
  DecodeModelArgs args() const {
    return {embedding_, layer_tensors_, kinds_, kv_caches_, windows_, num_heads_, num_kv_heads_, scale_, eps_,
            final_norm_, lm_head_, lm_head_scales_, argmax_head_, c12_weights_};
  }

  torch::Tensor embedding_;
  std::vector<torch::Tensor> layer_tensors_;
  std::vector<int64_t> kinds_;
  std::vector<torch::Tensor> kv_caches_;
  std::vector<int64_t> windows_;
  int64_t num_heads_, num_kv_heads_;
  double scale_, eps_;
  torch::Tensor final_norm_, lm_head_, lm_head_scales_;
  std::vector<torch::Tensor> argmax_head_, c12_weights_;
};

// The index of each row's largest value, as torch.argmax(dim=-1) gives it: the first
// index of the maximum; a row holding a NaN gives its first NaN (NaN compares greatest).
// torch's CPU argmax runs a scalar loop at ~1 ns an element, ~45 us for a 49,152-token
// vocabulary: a greedy decode step's sampling. Here two vector passes over the row (its
// maximum, then the first lane equal to it) take a few microseconds.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: a contiguous float32 [rows, n > 0] expected");
  const int64_t rows = logits.size(0), n = logits.size(1);
  torch::Tensor out = torch::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* idx = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits.data_ptr<float>() + r * n;
    int64_t best = -1;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmax = _mm512_max_ps(vmax, v);
    }
    float m = _mm512_reduce_max_ps(vmax);
    bool has_nan = nan != 0;
    for (int64_t j = i; j < n; ++j) {
      has_nan |= std::isnan(x[j]);
      m = std::max(m, x[j]);
    }
    if (!has_nan) {
      const __m512 vm = _mm512_set1_ps(m);
      for (i = 0; i + 16 <= n && best < 0; i += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
        if (eq) best = i + __builtin_ctz(static_cast<unsigned>(eq));
      }
      for (int64_t j = i; j < n && best < 0; ++j) {
        if (x[j] == m) best = j;
      }
    }
#endif
    if (best < 0) {  // a NaN in the row (or no AVX-512): the scalar rule
      best = 0;
      for (int64_t j = 1; j < n && !std::isnan(x[best]); ++j) {
        if (std::isnan(x[j]) || x[j] > x[best]) best = j;
      }
    }
    idx[r] = best;
  }
  return out;
}

// Whether the parallel loops run on OpenMP's team (true) or the work pool (false, the
// default); for A/B benchmarks of the two. Returns the previous setting.
bool set_openmp_loops(bool openmp) { return g_openmp_loops.exchange(openmp); }

// The kernels' thread count (0: follow torch's); returns the previous setting.
int64_t set_kernel_threads(int64_t threads) { return g_kernel_threads.exchange(static_cast<int>(std::max<int64_t>(0, threads))); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL, as torch's own ops do: a server's event loop (the
  // HTTP streams) runs on another thread while the engine thread is in here. The fused
  // decode call is most of a decode step (~10 ms at batch 1); holding the GIL through it
  // left the event loop only the gaps between steps, and the one-stream HTTP ITL rose from
  // 0.9x to 1.2-1.3x the offline step (`python -m loadtest.bench_http --concurrency 1`).
  // The arguments are converted before the release and the result after the re-acquire.
  // Every tensor argument is a const reference, never a by-value at::Tensor: torch keeps
  // a Python tensor's object alive while C++ holds a second reference, and dropping that
  // reference (a by-value argument destroyed as the function returns, still without the
  // GIL) takes the GIL back, once per tensor: ~280 times at the end of each fused decode
  // call, each waiting on the event loop. By reference, pybind11's casters drop them after
  // the re-acquire.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, release());
  m.def("reshape_and_cache", &reshape_and_cache, release());
  m.def("add_rms_norm", &add_rms_norm, release());
  m.def("rotary", &rotary, release());
  m.def("has_bf16_gemv", &has_bf16_gemv);
  m.def("bf16_dot_peak_gflops", &bf16_dot_peak_gflops, release());
  m.def("pack_bf16_weight", &pack_bf16_weight, release());
  m.def("pack_int8_weight", &pack_int8_weight, release());
  m.def("bf16_gemv", &bf16_gemv, release());
  m.def("int8_gemv", &int8_gemv, release());
  m.def("pack_int4_weight", &pack_int4_weight, release());
  m.def("int4_gemv", &int4_gemv, release());
  m.def("bf16_silu_mlp", &bf16_silu_mlp, release());
  m.def("bf16_decode_layers", &bf16_decode_layers, release());
  // Local to this module: another revision's build of these kernels, loaded beside this one
  // for an A/B (loadtest/bench_decode_paths.py and bench_linear.py --baseline-rev), registers
  // its own DecodeModel (two global registrations of the class would refuse the second import).
  py::class_<DecodeModel>(m, "DecodeModel", py::module_local())
      .def(py::init<torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor, torch::Tensor,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>>())
      .def("run", &DecodeModel::run, release());
  m.def("argmax_head_logits", &argmax_head_logits, release());
  m.def("pack_c12_weight", &pack_c12_weight, release());
  m.def("c12_linear", &c12_linear, release());
  m.def("c12_available", []() { return kHaveC12; });
  m.def("lora_add", &lora_add, release());
  m.def("silu_mul", &silu_mul, release());
  m.def("argmax_rows", &argmax_rows, release());
  m.def("set_openmp_loops", &set_openmp_loops);
  // The fused decode call's phase clock (PhaseClock): start zeroes and turns it on; stop
  // turns it off and returns (calls, {phase: (total seconds, times it ran)}).
  m.def("decode_phase_times_start", []() {
    std::fill(std::begin(g_phase_ns), std::end(g_phase_ns), 0.0);
    std::fill(std::begin(g_phase_marks), std::end(g_phase_marks), 0);
    g_phase_calls = 0;
    g_phase_on = true;
  });
  m.def("decode_phase_times_stop", []() {
    g_phase_on = false;
    std::map<std::string, std::pair<double, int64_t>> phases;
    for (int p = 0; p < kPhaseCount; ++p) phases[kPhaseNames[p]] = {g_phase_ns[p] * 1e-9, g_phase_marks[p]};
    return std::make_pair(g_phase_calls, phases);
  });
  m.def("set_kernel_threads", &set_kernel_threads);
}
