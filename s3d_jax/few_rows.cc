// y = x @ w for a few rows of x (a decode pass: 1 to 16 tokens) against a large row-major weight, and
// a pass's attention over the KV cache (`CacheScores`, `CacheValues`, at the end), as XLA FFI
// handlers for the CPU (s3d_jax/few_rows.py builds and registers them). The weight is float32,
// bfloat16, float16, int8 in groups of 32 rows with one float32 scale per group and column (GGUF's
// Q8_0), or int4 in such groups with a float16 scale and minimum (GGUF's Q4_1; s3d_jax/quant.py has
// the layouts).
//
// XLA's CPU dot streams the weight once for one row, but for 2-16 rows it packs the weight into
// panels first, so a pass over 5 tokens costs about 2x a one-token step. Here the weight is read
// once, 8 rows of it at a time, for all of x's rows together; x's row t is accumulated in y's row t,
// which stays in the L1 cache. A bfloat16 or float16 weight is widened to float32 in registers
// (exactly), so it sums the same way as its float32 value would; a quantized one is summed as codes
// and scaled once per group (`AccumulateCodes`). Each output element is
// summed over k in the same order whatever the number of rows or threads, so a token's logits do
// not depend on how many tokens share its pass.
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float Lanes __attribute__((vector_size(64), aligned(4), may_alias));  // 16 floats, unaligned loads
typedef uint16_t Halves __attribute__((vector_size(32), aligned(2), may_alias));  // 16 bfloat16s
typedef uint32_t Words __attribute__((vector_size(64)));

// 16 int8s as float32. The compiler leaves a generic int8 -> float vector conversion scalar.
inline Lanes WidenBytes(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  Lanes out;
  std::memcpy(&out, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
  return out;
#else
  Lanes out;
  for (int i = 0; i < 16; ++i) out[i] = float(p[i]);
  return out;
#endif
}

// 16 codes 0..15 as float32: the low nibbles of 16 bytes, or their high ones.
inline Lanes WidenNibbles(const uint8_t* p, bool high) {
#if defined(__AVX512F__)
  // A permutation reads the low 4 bits of each index: the nibble's value from a table of 0..15.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<Lanes>(_mm512_permutexvar_ps(high ? _mm512_srli_epi32(bytes, 4) : bytes, values));
#else
  Lanes out;
  for (int i = 0; i < 16; ++i) out[i] = float(high ? p[i] >> 4 : p[i] & 15);
  return out;
#endif
}

// 16 float16s as float32 (exactly).
inline Lanes WidenHalves(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  Lanes out;
  for (int i = 0; i < 16; ++i) out[i] = float(std::bit_cast<_Float16>(p[i]));
  return out;
#endif
}

inline float Half(uint16_t bits) { return float(std::bit_cast<_Float16>(bits)); }

constexpr int64_t kGroup = 32;  // rows of an int8 weight sharing a scale (few_rows.py's GROUP)

// Readers of a weight [K, N] as float32: 16 columns of row k from n, or one. `Group` is what a run
// of rows in one group shares (an int8 weight's scales), loaded once for those rows.
struct Float32Weight {
  const float* w;
  int64_t N;
  struct Group {};
  Group GroupAt(int64_t, int64_t) const { return {}; }
  Lanes Load16(int64_t k, int64_t n, Group) const { return *reinterpret_cast<const Lanes*>(w + k * N + n); }
  float Load1(int64_t k, int64_t n) const { return w[k * N + n]; }
  const char* Row(int64_t k) const { return reinterpret_cast<const char*>(w + k * N); }
};

struct Bfloat16Weight {
  const uint16_t* w;
  int64_t N;
  struct Group {};
  Group GroupAt(int64_t, int64_t) const { return {}; }
  Lanes Load16(int64_t k, int64_t n, Group) const {
    return reinterpret_cast<Lanes>(__builtin_convertvector(*reinterpret_cast<const Halves*>(w + k * N + n), Words) << 16);
  }
  float Load1(int64_t k, int64_t n) const {
    const uint32_t bits = uint32_t{w[k * N + n]} << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  const char* Row(int64_t k) const { return reinterpret_cast<const char*>(w + k * N); }
};
struct Float16Weight {
  const uint16_t* w;
  int64_t N;
  struct Group {};
  Group GroupAt(int64_t, int64_t) const { return {}; }
  Lanes Load16(int64_t k, int64_t n, Group) const { return WidenHalves(w + k * N + n); }
  float Load1(int64_t k, int64_t n) const { return float(std::bit_cast<_Float16>(w[k * N + n])); }
  const char* Row(int64_t k) const { return reinterpret_cast<const char*>(w + k * N); }
};
// A float weight's columns per cache line.
template <typename W>
constexpr int64_t kLineColumns = 64 / sizeof(*std::declval<W>().w);

// The quantized weights' readers give codes (16 columns of one or two rows, or one entry) and scale
// a sum of codes over rows of one group: `Scaled(sum of x * code, sum of x, ...)`.
struct Int8Weight {
  const int8_t* w;
  const float* scale;  // [K / kGroup, N]
  int64_t N;
  static constexpr int kRowsPerLoad = 1;
  static constexpr int kRows = 8;  // per block: as many memory streams as a float weight's
  void Codes16(int64_t k, int64_t n, Lanes* codes) const { codes[0] = WidenBytes(w + k * N + n); }
  const void* Row(int64_t k) const { return w + k * N; }  // a row's codes, one byte per column
  float Code1(int64_t k, int64_t n) const { return float(w[k * N + n]); }
  Lanes Scaled(Lanes sum, Lanes, int64_t k, int64_t n) const {
    return sum * *reinterpret_cast<const Lanes*>(scale + k / kGroup * N + n);
  }
  float Scaled1(float sum, float, int64_t k, int64_t n) const { return sum * scale[k / kGroup * N + n]; }
};

struct Int4Weight {
  const uint8_t* w;  // [K / 2, N]: row k in the low nibbles of row k / 2 for an even k, the high ones for an odd
  const uint16_t* scale;  // [K / kGroup, N] float16
  const uint16_t* min;    // [K / kGroup, N] float16
  int64_t N;
  static constexpr int kRowsPerLoad = 2;  // k even
  static constexpr int kRows = 16;  // per block: 8 rows of bytes
  void Codes16(int64_t k, int64_t n, Lanes* codes) const {
    codes[0] = WidenNibbles(w + k / 2 * N + n, false);
    codes[1] = WidenNibbles(w + k / 2 * N + n, true);
  }
  float Code1(int64_t k, int64_t n) const { return float(k & 1 ? w[k / 2 * N + n] >> 4 : w[k / 2 * N + n] & 15); }
  const void* Row(int64_t k) const { return w + k / 2 * N; }  // a pair of rows' codes, one byte per column
  Lanes Scaled(Lanes sum, Lanes x_sum, int64_t k, int64_t n) const {
    const int64_t at = k / kGroup * N + n;
    return sum * WidenHalves(scale + at) + x_sum * WidenHalves(min + at);
  }
  float Scaled1(float sum, float x_sum, int64_t k, int64_t n) const {
    const int64_t at = k / kGroup * N + n;
    return sum * Half(scale[at]) + x_sum * Half(min[at]);
  }
};

constexpr int64_t kWeightRows = 8;    // weight rows read together
// A block of weight rows is prefetched this many blocks before its use. A block reads short runs of
// 8 rows (a thread's share of each), which the hardware prefetcher finds too late; one block ahead
// is too close to hide the memory's latency. Two made verify of 5 tokens, a draft of 4 and a tree
// of 4 each 5-9% faster, and left a one-row step as it was (docs/cpu.md, "Prefetch").
constexpr int64_t kPrefetchBlocks = 2;
// Rows of x per sweep over a float weight. With AVX-512's 32 vector registers the accumulators of 16
// rows fit, and a 9-row pass (a tree of 4 with the context branch's 4 slots, and the root) reads each
// weight once rather than in sweeps of 8 and 1: verifying that tree cost 2.0 plain steps, now 1.8.
// Without AVX-512 (16 vector registers of 8 floats), 16 lanes of 8 rows' accumulators spilled, so
// a float weight's 16 columns are two halves swept one after the other for passes of more than 4
// rows (up to 4 the 16-lane accumulators fit), one register per row, up to 12 rows: on an AVX2
// EPYC 8 rows of a 576 x 4608 product went from 1.55 to about 0.8 ms (docs/cpu.md, "Without AVX-512").
#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 16;
constexpr bool kHalfSweeps = false;
#else
constexpr int64_t kMaxRows = 12;
constexpr bool kHalfSweeps = true;
#endif
constexpr int64_t kColumnAlign = 16;  // a thread's columns start on a whole vector
// The most bytes of one weight row that a part of the columns reads. A part of half the head's 49,280
// columns (96 KiB per row) prefetched 1.5 MiB ahead of its use, past L2, so lines came from memory
// twice: in runs of at most 16 KiB, a one-row product of SmolLM2's 576 x 49,280 head took 3.8-4.6 ms
// instead of 6.1-7.0 (docs/cpu.md, "Parts of a wide weight").
constexpr int64_t kPartBytes = 16 << 10;

typedef float HalfLanes __attribute__((vector_size(32), aligned(4), may_alias));  // 8 floats, unaligned loads

// Columns [n + 8 * kHalf, n + 8 * kHalf + 8) of a 16-column step: each entry is summed over k in the
// same order as a whole step's, so a row's result does not depend on the sweep that computed it.
template <int T, int KB, int kHalf, typename W>
inline void SweepHalf(const float (&xs)[T][KB], const W& w, const typename W::Group& group, float* y, int64_t N, int64_t k0, int64_t n) {
  float* out = y + n + 8 * kHalf;
  HalfLanes acc[T];
  for (int t = 0; t < T; ++t) acc[t] = *reinterpret_cast<const HalfLanes*>(out + t * N);
  for (int kk = 0; kk < KB; ++kk) {
    const Lanes whole = w.Load16(k0 + kk, n, group);
    const HalfLanes wv = __builtin_shufflevector(whole, whole, 8 * kHalf, 8 * kHalf + 1, 8 * kHalf + 2, 8 * kHalf + 3,
                                                 8 * kHalf + 4, 8 * kHalf + 5, 8 * kHalf + 6, 8 * kHalf + 7);
    for (int t = 0; t < T; ++t) acc[t] += xs[t][kk] * wv;
  }
  for (int t = 0; t < T; ++t) *reinterpret_cast<HalfLanes*>(out + t * N) = acc[t];
}

// y[t, n0:n1] += sum over k in [k0, k0+KB) of x[t, k] * w[k, n0:n1], for T rows. The KB rows lie
// in one group (k0 is a multiple of KB, which divides kGroup).
template <int T, int KB, typename W>
inline void Accumulate(const float* x, const W& w, float* y, int64_t K, int64_t k0, int64_t n0, int64_t n1) {
  const int64_t N = w.N;
  float xs[T][KB];
  for (int t = 0; t < T; ++t)
    for (int kk = 0; kk < KB; ++kk) xs[t][kk] = x[t * K + k0 + kk];
  const int64_t ahead = k0 + kPrefetchBlocks * KB;
  const bool prefetch = KB > 1 && ahead + KB <= K;
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    if (prefetch && n % kLineColumns<W> == 0)
      for (int kk = 0; kk < KB; ++kk) __builtin_prefetch(w.Row(ahead + kk) + n * sizeof(*w.w));
    const typename W::Group group = w.GroupAt(k0, n);
    if constexpr (kHalfSweeps && T > 4) {
      SweepHalf<T, KB, 0>(xs, w, group, y, N, k0, n);
      SweepHalf<T, KB, 1>(xs, w, group, y, N, k0, n);
    } else {
      Lanes acc[T];
      for (int t = 0; t < T; ++t) acc[t] = *reinterpret_cast<const Lanes*>(y + t * N + n);
      for (int kk = 0; kk < KB; ++kk) {
        const Lanes wv = w.Load16(k0 + kk, n, group);
        for (int t = 0; t < T; ++t) acc[t] += xs[t][kk] * wv;
      }
      for (int t = 0; t < T; ++t) *reinterpret_cast<Lanes*>(y + t * N + n) = acc[t];
    }
  }
  for (; n < n1; ++n)
    for (int t = 0; t < T; ++t) {
      float s = y[t * N + n];
      for (int kk = 0; kk < KB; ++kk) s += xs[t][kk] * w.Load1(k0 + kk, n);
      y[t * N + n] = s;
    }
}

// A quantized weight's rows [k0, k0 + W::kRows), within one group: y[t, n] += scale * sum_k x[t, k]
// code[k, n] (+ min * sum_k x[t, k]). Summing codes and scaling once per group takes a third fewer
// instructions than dequantizing each entry, and the kernel is compute-bound on quantized weights.
// The result differs from a product with the dequantized weight by float32 rounding, and is the
// same whatever the number of rows.
template <int T, typename W>
inline void AccumulateCodes(const float* x, const W& w, float* y, int64_t K, int64_t k0, int64_t n0, int64_t n1) {
  const int64_t N = w.N;
  constexpr int kRows = W::kRows;
  float xs[T][kRows], sums[T];
  for (int t = 0; t < T; ++t) {
    sums[t] = 0;
    for (int kk = 0; kk < kRows; ++kk) sums[t] += xs[t][kk] = x[t * K + k0 + kk];
  }
  const bool next = k0 + kRows < K;
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    // The next block's rows, a cache line (64 columns) ahead of their use: a block reads short runs
    // of many rows, too short for the hardware prefetcher to find, and a quantized weight leaves
    // the kernel waiting on memory rather than on arithmetic.
    if (next && n % 64 == 0)
      for (int kk = 0; kk < kRows; kk += W::kRowsPerLoad) __builtin_prefetch(static_cast<const char*>(w.Row(k0 + kRows + kk)) + n);
    Lanes acc[T] = {};
    for (int kk = 0; kk < kRows; kk += W::kRowsPerLoad) {
      Lanes codes[W::kRowsPerLoad];
      w.Codes16(k0 + kk, n, codes);
      for (int i = 0; i < W::kRowsPerLoad; ++i)
        for (int t = 0; t < T; ++t) acc[t] += xs[t][kk + i] * codes[i];
    }
    for (int t = 0; t < T; ++t) {
      Lanes x_sum = {};
      x_sum += sums[t];
      *reinterpret_cast<Lanes*>(y + t * N + n) += w.Scaled(acc[t], x_sum, k0, n);
    }
  }
  for (; n < n1; ++n)
    for (int t = 0; t < T; ++t) {
      float acc = 0;
      for (int kk = 0; kk < kRows; ++kk) acc += xs[t][kk] * w.Code1(k0 + kk, n);
      y[t * N + n] += w.Scaled1(acc, sums[t], k0, n);
    }
}

template <int T, typename W>
void Columns(const float* x, const void* weight, float* y, int64_t K, int64_t n0, int64_t n1) {
  const W& w = *static_cast<const W*>(weight);
  for (int t = 0; t < T; ++t) std::memset(y + t * w.N + n0, 0, sizeof(float) * (n1 - n0));
  if constexpr (std::is_same_v<W, Int4Weight> || std::is_same_v<W, Int8Weight>) {
    for (int64_t k = 0; k < K; k += W::kRows) AccumulateCodes<T>(x, w, y, K, k, n0, n1);  // K is whole groups
  } else {
    int64_t k = 0;
    for (; k + kWeightRows <= K; k += kWeightRows) Accumulate<T, kWeightRows>(x, w, y, K, k, n0, n1);
    for (; k < K; ++k) Accumulate<T, 1>(x, w, y, K, k, n0, n1);
  }
}

using ColumnsFn = void (*)(const float*, const void*, float*, int64_t, int64_t, int64_t);

// Rows of x per sweep: a quantized weight's codes are widened once per sweep, which costs more than
// a float weight's loads, so its sweeps take up to 16 rows (a tree of 15 and its root in one).
template <typename W>
constexpr int64_t kSweepRows = std::is_same_v<W, Int8Weight> || std::is_same_v<W, Int4Weight> ? 16 : kMaxRows;

template <typename W, size_t... T>
constexpr std::array<ColumnsFn, sizeof...(T) + 1> ColumnsTable(std::index_sequence<T...>) {
  return {nullptr, Columns<T + 1, W>...};
}
template <typename W>
constexpr auto kColumns = ColumnsTable<W>(std::make_index_sequence<kSweepRows<W>>());

// The columns split into parts that the calling thread and the helper threads claim one at a time.
// A caller never waits for a part nobody has claimed, so concurrent calls cannot starve each other.
struct Job {
  const float* x;
  const void* w;             // the weight's reader (Float32Weight, ...), alive until the job is done
  const ColumnsFn* columns;  // kColumns of the reader's type
  int64_t sweep_rows;        // and its kSweepRows
  float* y;
  int64_t M, K, N, part_columns, parts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunParts() {
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      const int64_t n0 = p * part_columns, n1 = std::min(N, n0 + part_columns);
      for (int64_t m = 0; m < M; m += sweep_rows) {
        const int64_t rows = std::min(sweep_rows, M - m);
        columns[rows](x + m * K, w, y + m * N, K, n0, n1);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Set by S3dFewRowConfigure before the first product (few_rows.py does, when it loads the library).
std::atomic<int64_t> configured_threads{1};
std::atomic<int64_t> configured_spin_us{0};

// Helper threads wait for the next product on a futex. After a product they first spin for
// `spin_us`: the products of one decode pass come a few microseconds apart, and waking a sleeping
// thread for each would cost more than its share of the work. Between passes, and after the decode,
// they sleep, so that they take no core from the rest of the pass.
class Helpers {
 public:
  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: its threads live as long as the process
    return *helpers;
  }
  int64_t size() const { return size_; }

  void Post(std::shared_ptr<Job> job) {
    std::atomic_store_explicit(&job_, std::move(job), std::memory_order_release);
    posted_.fetch_add(1, std::memory_order_release);
    posted_.notify_all();
  }

 private:
  Helpers() : size_(configured_threads.load() - 1), spin_(std::chrono::microseconds(configured_spin_us.load())) {
    for (int64_t i = 0; i < size_; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    uint64_t seen = posted_.load(std::memory_order_acquire);
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t now;
      while ((now = posted_.load(std::memory_order_acquire)) == seen) {
        if (std::chrono::steady_clock::now() - start < spin_) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        } else {
          posted_.wait(seen, std::memory_order_acquire);
        }
      }
      seen = now;
      if (auto job = std::atomic_load_explicit(&job_, std::memory_order_acquire)) job->RunParts();
    }
  }

  const int64_t size_;
  const std::chrono::microseconds spin_;
  std::atomic<uint64_t> posted_{0};
  std::shared_ptr<Job> job_;
};

// Runs the product over the calling thread and the helpers; `reader` outlives the job, which ends
// before this returns.
template <typename W>
void Run(const float* x, const W& reader, float* y, int64_t M, int64_t K) {
  auto job = std::make_shared<Job>();
  job->columns = kColumns<W>.data();
  job->sweep_rows = kSweepRows<W>;
  job->x = x;
  job->w = &reader;
  job->y = y;
  job->M = M;
  job->K = K;
  job->N = reader.N;
  Helpers& helpers = Helpers::Get();
  // Each thread's share of the columns, streamed in long contiguous runs of the weight's rows: in one
  // part, or in as many equal parts as keep each run within kPartBytes, so that every thread claims
  // the same number of parts.
  const int64_t threads = helpers.size() + 1;
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t share = ceil_div(job->N, threads);
  const int64_t rounds = std::max<int64_t>(1, ceil_div(share * int64_t{sizeof(*reader.w)}, kPartBytes));
  job->part_columns = std::max<int64_t>(256, ceil_div(ceil_div(share, rounds), kColumnAlign) * kColumnAlign);
  job->parts = ceil_div(job->N, job->part_columns);
  if (job->parts > 1) helpers.Post(job);
  job->RunParts();
  while (job->done.load(std::memory_order_acquire) < job->parts) std::this_thread::yield();
}

// Which of a stack's L entries an operation reads: the layer that the decode passes' loop over the
// layers is at. Every weight and cache reaches the kernel whole, `[L, ...]`, and the entry is an
// offset into it, so that no layer's slice is ever copied out of the stack.
bool Entry(ffi::Buffer<ffi::S32>& at, int64_t L, int64_t* entry) {
  if (at.dimensions().size() != 0) return false;
  *entry = at.typed_data()[0];
  return 0 <= *entry && *entry < L;
}

// x [M, K] by entry `at` of w [L, K, N], or a batch of them: x [S, M, K] by w [L, S, K, N], one
// product after another (the fused draft adapters' B factors, a few small weights in one call).
ffi::Error FewRowMatmul(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> at, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const size_t rank = xd.size();
  int64_t entry;
  if ((rank != 2 && rank != 3) || wd.size() != rank + 1 || xd[rank - 1] != wd[rank - 1] || (rank == 3 && xd[0] != wd[1]) ||
      !Entry(at, wd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul: expected x [M, K] and w [L, K, N], or x [S, M, K] and w [L, S, K, N], and an entry 0 <= at < L");
  }
  const int64_t S = rank == 3 ? xd[0] : 1, M = xd[rank - 2], K = xd[rank - 1], N = wd[rank];
  const int64_t first = entry * S * K * N;
  const auto each = [&](auto reader_at) {
    for (int64_t s = 0; s < S; ++s) Run(x.typed_data() + s * M * K, reader_at(first + s * K * N), y->typed_data() + s * M * N, M, K);
  };
  const char* base = static_cast<const char*>(w.untyped_data());
  if (w.element_type() == ffi::DataType::F32) {
    each([&](int64_t offset) { return Float32Weight{reinterpret_cast<const float*>(base) + offset, N}; });
  } else if (w.element_type() == ffi::DataType::BF16) {
    each([&](int64_t offset) { return Bfloat16Weight{reinterpret_cast<const uint16_t*>(base) + offset, N}; });
  } else if (w.element_type() == ffi::DataType::F16) {
    each([&](int64_t offset) { return Float16Weight{reinterpret_cast<const uint16_t*>(base) + offset, N}; });
  } else {
    return ffi::Error::InvalidArgument("few_row_matmul: the weight must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

ffi::Error FewRowMatmulInt8(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::S32> at, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  int64_t entry;
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || xd[1] != wd[1] || wd[1] % kGroup || sd[0] != wd[0] ||
      sd[1] != wd[1] / kGroup || sd[2] != wd[2] || !Entry(at, wd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul_int8: expected x [M, K], w [L, K, N], scale [L, K/32, N] and an entry 0 <= at < L");
  }
  const int64_t K = wd[1], N = wd[2];
  Run(x.typed_data(), Int8Weight{w.typed_data() + entry * K * N, scale.typed_data() + entry * K / kGroup * N, N}, y->typed_data(),
      xd[0], K);
  return ffi::Error::Success();
}

ffi::Error FewRowMatmulInt4(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F16> scale,
                            ffi::Buffer<ffi::F16> min, ffi::Buffer<ffi::S32> at, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), md = min.dimensions();
  int64_t entry;
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || md.size() != 3 || xd[1] % kGroup || xd[1] != 2 * wd[1] ||
      sd[0] != wd[0] || sd[1] != xd[1] / kGroup || sd[2] != wd[2] || md[0] != sd[0] || md[1] != sd[1] || md[2] != sd[2] ||
      !Entry(at, wd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul_int4: expected x [M, K], w [L, K/2, N], scale and min [L, K/32, N] and an entry 0 <= at < L");
  }
  const int64_t K = xd[1], N = wd[2], groups = entry * K / kGroup * N;
  Run(x.typed_data(),
      Int4Weight{w.typed_data() + entry * K / 2 * N, reinterpret_cast<const uint16_t*>(scale.untyped_data()) + groups,
                 reinterpret_cast<const uint16_t*>(min.untyped_data()) + groups, N},
      y->typed_data(), xd[0], K);
  return ffi::Error::Success();
}

// Attention of a pass's few query rows over the cache: only slots below a row's `bound` (its cached
// length) are read. XLA's dot reads every allocated slot, masked or not, so a step's attention cost
// the allocation rather than the context. Every sum runs in a fixed order from slot 0 (or over E),
// the same whatever the bound, the rows or the thread: a slot past a row's context has probability
// exactly 0, so adding it would change nothing.
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));
// The 16 lanes' sum as a fixed tree of halves: the same order every time, in a few shuffles.
inline float SumLanes(Lanes v) {
  const Lanes8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Lanes4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// scores [B, K, R, S] = q [B, K, R, E] . keys [B, K, S, E] over E, for s < bound[b]; 0 beyond.
// The lanes are 16 query rows, so a score is summed over e in order, one product at a time, whatever
// the rows, slots or tiles around it; 8 slots at a time share each load of the queries.
template <int kSlots>
void ScoreSlots(const float* q_t, const float* keys, float* scores, int64_t rows, int64_t S, int64_t E, int64_t s) {
  Lanes acc[kSlots] = {};
  for (int64_t e = 0; e < E; ++e) {
    const Lanes q = *reinterpret_cast<const Lanes*>(q_t + e * 16);
    for (int j = 0; j < kSlots; ++j) acc[j] += q * keys[(s + j) * E + e];
  }
  for (int j = 0; j < kSlots; ++j)
    for (int64_t i = 0; i < rows; ++i) scores[i * S + s + j] = acc[j][i];
}

void CacheScoresHead(const float* q, const float* keys, float* scores, int64_t R, int64_t S, int64_t E, int64_t n) {
  thread_local std::vector<float> q_t;  // 16 rows' queries, transposed: [E, 16]
  q_t.resize(E * 16);
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, R - r0);
    std::fill(q_t.begin(), q_t.end(), 0.0f);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t e = 0; e < E; ++e) q_t[e * 16 + i] = q[(r0 + i) * E + e];
    float* out = scores + r0 * S;
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) ScoreSlots<8>(q_t.data(), keys, out, rows, S, E, s);
    for (; s < n; ++s) ScoreSlots<1>(q_t.data(), keys, out, rows, S, E, s);
  }
  for (int64_t r = 0; r < R; ++r) std::memset(scores + r * S + n, 0, sizeof(float) * (S - n));
}

// out [B, K, R, E] = sum over s < bound[b] of probs [B, K, R, S] * values [B, K, E, S]. A lane holds
// the slots s = lane (mod 16), summed from slot 0 on and then over the lanes by `SumLanes`, whatever
// the bound (the last 16 slots padded with zeros) or the rows beside it.
template <int kRows>
void WeighValues(const float* probs, const Lanes* probs_tail, const float* values, float* out, int64_t S, int64_t E, int64_t n) {
  const int64_t whole = n / 16 * 16;
  for (int64_t e = 0; e < E; ++e) {
    const float* v = values + e * S;
    Lanes acc[kRows] = {};
    for (int64_t s = 0; s < whole; s += 16) {
      const Lanes vs = *reinterpret_cast<const Lanes*>(v + s);
      for (int i = 0; i < kRows; ++i) acc[i] += *reinterpret_cast<const Lanes*>(probs + i * S + s) * vs;
    }
    if (whole < n) {
      Lanes v_tail = {};
      for (int64_t s = whole; s < n; ++s) v_tail[s - whole] = v[s];
      for (int i = 0; i < kRows; ++i) acc[i] += probs_tail[i] * v_tail;
    }
    for (int i = 0; i < kRows; ++i) out[i * E + e] = SumLanes(acc[i]);
  }
}

constexpr int kValueRows = 8;
using WeighValuesFn = void (*)(const float*, const Lanes*, const float*, float*, int64_t, int64_t, int64_t);
template <size_t... I>
constexpr std::array<WeighValuesFn, sizeof...(I) + 1> WeighValuesTable(std::index_sequence<I...>) {
  return {nullptr, WeighValues<I + 1>...};
}
constexpr auto kWeighValues = WeighValuesTable(std::make_index_sequence<kValueRows>());

void CacheValuesHead(const float* probs, const float* values, float* out, int64_t R, int64_t S, int64_t E, int64_t n) {
  const int64_t whole = n / 16 * 16;
  for (int64_t r0 = 0; r0 < R; r0 += kValueRows) {
    const int64_t rows = std::min<int64_t>(kValueRows, R - r0);
    Lanes probs_tail[kValueRows] = {};
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t s = whole; s < n; ++s) probs_tail[i][s - whole] = probs[(r0 + i) * S + s];
    kWeighValues[rows](probs + r0 * S, probs_tail, values, out + r0 * E, S, E, n);
  }
}

// Calls `head(b * K + k, n)` for every row b and KV head k, n being row b's bound clamped to [0, S].
template <typename Head>
void EachHead(ffi::Buffer<ffi::S32>& bound, int64_t K, int64_t S, Head head) {
  for (int64_t b = 0; b < bound.dimensions()[0]; ++b) {
    const int64_t n = std::clamp<int64_t>(bound.typed_data()[b], 0, S);
    for (int64_t k = 0; k < K; ++k) head(b * K + k, n);
  }
}

ffi::Error CacheScores(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::S32> bound, ffi::Buffer<ffi::S32> at,
                       ffi::ResultBuffer<ffi::F32> scores) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), bd = bound.dimensions();
  int64_t entry;
  if (qd.size() != 4 || kd.size() != 5 || bd.size() != 1 || qd[0] != kd[1] || qd[1] != kd[2] || qd[3] != kd[4] || bd[0] != qd[0] ||
      !Entry(at, kd[0], &entry)) {
    return ffi::Error::InvalidArgument("cache_scores: expected q [B, K, R, E], keys [L, B, K, S, E], bound [B] and an entry 0 <= at < L");
  }
  const int64_t K = qd[1], R = qd[2], E = qd[3], S = kd[3];
  const float* layer_keys = keys.typed_data() + entry * qd[0] * K * S * E;
  EachHead(bound, K, S, [&](int64_t head, int64_t n) {
    CacheScoresHead(q.typed_data() + head * R * E, layer_keys + head * S * E, scores->typed_data() + head * R * S, R, S, E, n);
  });
  return ffi::Error::Success();
}

ffi::Error CacheValues(ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> bound, ffi::Buffer<ffi::S32> at,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto pd = probs.dimensions(), vd = values.dimensions(), bd = bound.dimensions();
  int64_t entry;
  if (pd.size() != 4 || vd.size() != 5 || bd.size() != 1 || pd[0] != vd[1] || pd[1] != vd[2] || pd[3] != vd[4] || bd[0] != pd[0] ||
      !Entry(at, vd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "cache_values: expected probs [B, K, R, S], values [L, B, K, E, S], bound [B] and an entry 0 <= at < L");
  }
  const int64_t K = pd[1], R = pd[2], S = pd[3], E = vd[3];
  const float* layer_values = values.typed_data() + entry * pd[0] * K * E * S;
  EachHead(bound, K, S, [&](int64_t head, int64_t n) {
    CacheValuesHead(probs.typed_data() + head * R * S, layer_values + head * E * S, out->typed_data() + head * R * E, R, S, E, n);
  });
  return ffi::Error::Success();
}

// logits [B, T, L] = hidden [B, T, D] . head [D, V] at each row's columns ids [B, L], for the first
// count[b] ids of row b; 0 beyond. The draft head's scores of a row's own context: only its live ids'
// columns are read, where XLA gathered every slot's column first. Lanes hold 16 ids, one row d of the
// table at a time, so each logit is summed over d in order whatever the ids or rows beside it.
ffi::Error ContextLogits(ffi::Buffer<ffi::F32> hidden, ffi::Buffer<ffi::F32> head, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::S32> count, ffi::ResultBuffer<ffi::F32> logits) {
  const auto hd = hidden.dimensions(), wd = head.dimensions(), id = ids.dimensions(), cd = count.dimensions();
  if (hd.size() != 3 || wd.size() != 2 || id.size() != 2 || cd.size() != 1 || hd[2] != wd[0] || id[0] != hd[0] || cd[0] != hd[0]) {
    return ffi::Error::InvalidArgument("context_logits: expected hidden [B, T, D], head [D, V], ids [B, L] and count [B]");
  }
  const int64_t T = hd[1], D = hd[2], V = wd[1], L = id[1];
  constexpr int kRows = 8;
  thread_local std::vector<float> zeros;
  zeros.assign(D, 0.0f);
  EachHead(count, 1, L, [&](int64_t b, int64_t n) {  // one "head" per row: its count clamped to [0, L]
    const int32_t* row_ids = ids.typed_data() + b * L;
    float* out = logits->typed_data() + b * T * L;
    std::memset(out, 0, sizeof(float) * T * L);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - l0);
      int64_t columns[16] = {};
      for (int64_t j = 0; j < m; ++j) columns[j] = std::clamp<int64_t>(row_ids[l0 + j], 0, V - 1);
      for (int64_t t0 = 0; t0 < T; t0 += kRows) {
        const float* h[kRows];
        for (int i = 0; i < kRows; ++i) h[i] = t0 + i < T ? hidden.typed_data() + (b * T + t0 + i) * D : zeros.data();
        Lanes acc[kRows] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float* table_row = head.typed_data() + d * V;
          Lanes w;
          for (int j = 0; j < 16; ++j) w[j] = table_row[columns[j]];
          for (int i = 0; i < kRows; ++i) acc[i] += h[i][d] * w;
        }
        for (int64_t i = 0; i < std::min<int64_t>(kRows, T - t0); ++i)
          for (int64_t j = 0; j < m; ++j) out[(t0 + i) * L + l0 + j] = acc[i][j];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// The threads sharing each product (the caller included) and the helpers' spin after a product, in
// microseconds. Only the first call before any product takes effect: the helpers start with it.
extern "C" void S3dFewRowConfigure(int64_t threads, int64_t spin_us) {
  configured_threads.store(std::max<int64_t>(1, threads));
  configured_spin_us.store(std::max<int64_t>(0, spin_us));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dFewRowMatmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dFewRowMatmulInt8, FewRowMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dFewRowMatmulInt4, FewRowMatmulInt4,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dCacheScores, CacheScores,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dCacheValues, CacheValues,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dContextLogits, ContextLogits,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
