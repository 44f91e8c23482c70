// y = x @ w for a few rows of x (a decode pass: 1 to 16 tokens) against a large row-major weight,
// a pass's attention over the KV cache (`CacheScores`, `CacheValues`, at the end), the draft head's
// context columns (`ContextLogits`) and a 16-bit table's token columns (`TableColumns`), as XLA FFI
// handlers for the CPU (s3d_jax/kernel/ builds and registers them). The weight is float32,
// bfloat16, float16, int8 in groups of 32 or 16 rows with one float32 scale (and optional minimum)
// per group and column (GGUF's Q8_0, Q5_0, Q5_1, Q6_K and mixed stacks), or int4 in such groups with
// a float16 or float32 scale and minimum (GGUF's Q4_0, Q4_1, Q4_K; s3d_jax/quant.py has the layouts).
//
// XLA's CPU dot streams the weight once for one row, but for 2-16 rows it packs the weight into
// panels first, so a pass over 5 tokens costs about 2x a one-token step. Here the weight is read
// once, 8 rows of it at a time, for all of x's rows together; x's row t is accumulated in y's row t,
// which stays in the L1 cache. A bfloat16 or float16 weight is widened to float32 in registers
// (exactly), so it sums the same way as its float32 value would; a quantized one is summed as codes
// and scaled once per group (`AccumulateCodes`); with int8 activations, a quantized weight's codes
// are multiplied by each row's int8 codes in integers (`Int8Rows`). Each output element is
// summed over k in the same order whatever the number of rows or threads, so a token's logits do
// not depend on how many tokens share its pass.
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
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

#if defined(__AVX__)
// Two AVX registers of 8 floats as one 16-float vector.
inline Lanes Join(__m256 low, __m256 high) {
  Lanes out;
  std::memcpy(&out, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(low), &high, sizeof(high));
  return out;
}
#endif

// The vector a quantized weight's codes are summed in: 16 floats with AVX-512; 8 otherwise. With
// AVX2's 16 registers of 8 floats, GCC kept 16-float sums of a few rows in memory, moved in 8-byte
// pieces, and int4 products of 4 rows cost 5x one row's (docs/cpu.md, "Quantized sums in registers of 8").
#if defined(__AVX512F__)
typedef Lanes CodeLanes;
#else
typedef float CodeLanes __attribute__((vector_size(32), aligned(4), may_alias));
#endif
constexpr int kCodeLanes = sizeof(CodeLanes) / sizeof(float);

// kCodeLanes int8s as float32. The compiler leaves a generic int8 -> float vector conversion scalar.
inline CodeLanes WidenBytes(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<CodeLanes>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<CodeLanes>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  CodeLanes out;
  for (int i = 0; i < kCodeLanes; ++i) out[i] = float(p[i]);
  return out;
#endif
}

// kCodeLanes codes 0..15 as float32: the low nibbles of as many bytes, or their high ones.
inline CodeLanes WidenNibbles(const uint8_t* p, bool high) {
#if defined(__AVX512F__)
  // A permutation reads the low 4 bits of each index: the nibble's value from a table of 0..15.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<CodeLanes>(_mm512_permutexvar_ps(high ? _mm512_srli_epi32(bytes, 4) : bytes, values));
#elif defined(__AVX2__)
  // The compiler leaves the scalar loop below scalar: on an AVX2 EPYC, int4 products ran slower than XLA's.
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i codes = _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(15));
  return reinterpret_cast<CodeLanes>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
#else
  CodeLanes out;
  for (int i = 0; i < kCodeLanes; ++i) out[i] = float(high ? p[i] >> 4 : p[i] & 15);
  return out;
#endif
}

// 16 float16s as float32 (exactly).
inline Lanes WidenHalves(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return Join(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
  Lanes out;
  for (int i = 0; i < 16; ++i) out[i] = float(std::bit_cast<_Float16>(p[i]));
  return out;
#endif
}

inline float Half(uint16_t bits) { return float(std::bit_cast<_Float16>(bits)); }

constexpr int64_t kGroup = 32;  // rows of a quantized weight sharing a scale, or 16 (quant.py's Format.group)

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
// A group's kCodeLanes scales (or minimums) from `p`, as float32: float16 ones widen exactly.
inline CodeLanes LoadScales(const float* p) { return *reinterpret_cast<const CodeLanes*>(p); }
inline CodeLanes LoadScales(const uint16_t* p) {
#if defined(__AVX512F__)
  return WidenHalves(p);
#elif defined(__F16C__)
  return reinterpret_cast<CodeLanes>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  CodeLanes out;
  for (int i = 0; i < kCodeLanes; ++i) out[i] = float(std::bit_cast<_Float16>(p[i]));
  return out;
#endif
}
inline float Scale1(float s) { return s; }
inline float Scale1(uint16_t s) { return Half(s); }

struct Int8Weight {
  const int8_t* w;
  const float* scale;  // [K / group, N]
  const float* min;    // [K / group, N], or null: no minimum
  int64_t N;
  int group_shift;     // log2 of the group: 5 or 4
  static constexpr bool kQuantized = true;
  static constexpr int kRowsPerLoad = 1;
  static constexpr int kRows = 16;  // per block: scaled once per 16 rows (per 8, 8 rows of a product cost 2x int4's)
  void Codes(int64_t k, int64_t n, CodeLanes* codes) const { codes[0] = WidenBytes(w + k * N + n); }
  const void* Row(int64_t k) const { return w + k * N; }  // a row's codes, one byte per column
  float Code1(int64_t k, int64_t n) const { return float(w[k * N + n]); }
  CodeLanes Scales(int64_t k, int64_t n) const { return LoadScales(scale + (k >> group_shift) * N + n); }
  CodeLanes Mins(int64_t k, int64_t n) const { return min ? LoadScales(min + (k >> group_shift) * N + n) : CodeLanes{}; }
  float Scaled1(float sum, float x_sum, int64_t k, int64_t n) const {
    const int64_t at = (k >> group_shift) * N + n;
    return min ? sum * scale[at] + x_sum * min[at] : sum * scale[at];
  }
};

template <typename Scale>  // float16 (uint16_t) or float32 scales and minimums
struct Int4Weight {
  const uint8_t* w;  // [K / 2, N]: row k in the low nibbles of row k / 2 for an even k, the high ones for an odd
  const Scale* scale;  // [K / group, N]
  const Scale* min;    // [K / group, N]
  int64_t N;
  int group_shift;
  static constexpr bool kQuantized = true;
  static constexpr int kRowsPerLoad = 2;  // k even
  static constexpr int kRows = 16;  // per block: 8 rows of bytes
  void Codes(int64_t k, int64_t n, CodeLanes* codes) const {
    codes[0] = WidenNibbles(w + k / 2 * N + n, false);
    codes[1] = WidenNibbles(w + k / 2 * N + n, true);
  }
  float Code1(int64_t k, int64_t n) const { return float(k & 1 ? w[k / 2 * N + n] >> 4 : w[k / 2 * N + n] & 15); }
  const void* Row(int64_t k) const { return w + k / 2 * N; }  // a pair of rows' codes, one byte per column
  CodeLanes Scales(int64_t k, int64_t n) const { return LoadScales(scale + (k >> group_shift) * N + n); }
  CodeLanes Mins(int64_t k, int64_t n) const { return LoadScales(min + (k >> group_shift) * N + n); }
  float Scaled1(float sum, float x_sum, int64_t k, int64_t n) const {
    const int64_t at = (k >> group_shift) * N + n;
    return sum * Scale1(scale[at]) + x_sum * Scale1(min[at]);
  }
};

template <typename W>
constexpr bool IsQuantized() {
  if constexpr (requires { W::kQuantized; }) return W::kQuantized;
  return false;
}

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
// The fewest columns a part takes: a narrow weight's rows are runs of a few cache lines, and a part
// of fewer is not worth a thread's hand-off.
constexpr int64_t kMinPartColumns = 32;
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
  // Vectors of columns per broadcast of an x: two of 8 where their T rows' sums and codes fit in
  // AVX2's 16 registers, which halves the broadcasts (a load each); else one.
  constexpr int kVectors = 2 * T + 2 * W::kRowsPerLoad + 1 <= 16 ? 16 / kCodeLanes : 1;
  const bool next = k0 + kRows < K;
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    // The next block's rows, a cache line (64 columns) ahead of their use: a block reads short runs
    // of many rows, too short for the hardware prefetcher to find, and a quantized weight leaves
    // the kernel waiting on memory rather than on arithmetic.
    if (next && n % 64 == 0)
      for (int kk = 0; kk < kRows; kk += W::kRowsPerLoad) __builtin_prefetch(static_cast<const char*>(w.Row(k0 + kRows + kk)) + n);
    for (int64_t c = n; c < n + 16; c += kVectors * kCodeLanes) {
      CodeLanes acc[T][kVectors] = {};
      for (int kk = 0; kk < kRows; kk += W::kRowsPerLoad) {
        CodeLanes codes[kVectors][W::kRowsPerLoad];
        for (int v = 0; v < kVectors; ++v) w.Codes(k0 + kk, c + v * kCodeLanes, codes[v]);
        for (int i = 0; i < W::kRowsPerLoad; ++i)
          for (int t = 0; t < T; ++t)
            for (int v = 0; v < kVectors; ++v) acc[t][v] += xs[t][kk + i] * codes[v][i];
      }
      for (int v = 0; v < kVectors; ++v) {
        // The group's scales and minimums are read once for the T rows (y may alias them for all the compiler knows).
        const CodeLanes scale = w.Scales(k0, c + v * kCodeLanes), min = w.Mins(k0, c + v * kCodeLanes);
        for (int t = 0; t < T; ++t) *reinterpret_cast<CodeLanes*>(y + t * N + c + v * kCodeLanes) += acc[t][v] * scale + sums[t] * min;
      }
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
  if constexpr (IsQuantized<W>()) {
    for (int64_t k = 0; k < K; k += W::kRows) AccumulateCodes<T>(x, w, y, K, k, n0, n1);  // K is whole groups
  } else {
    int64_t k = 0;
    for (; k + kWeightRows <= K; k += kWeightRows) Accumulate<T, kWeightRows>(x, w, y, K, k, n0, n1);
    for (; k < K; ++k) Accumulate<T, 1>(x, w, y, K, k, n0, n1);
  }
}

using ColumnsFn = void (*)(const float*, const void*, float*, int64_t, int64_t, int64_t);

// Rows of x per sweep: a quantized weight's codes are widened once per sweep, which costs more than
// a float weight's loads, so its sweeps take as many rows as fit in registers (kMaxRows): 16 with
// AVX-512 (a tree of 15 and its root in one), 12 with AVX2, where sweeps of 16 spilled their sums
// (16 rows of an int4 product cost 1.6x 12 rows', not 1.33x).
template <typename W>
constexpr int64_t kSweepRows = kMaxRows;

template <typename W, size_t... T>
constexpr std::array<ColumnsFn, sizeof...(T) + 1> ColumnsTable(std::index_sequence<T...>) {
  return {nullptr, Columns<T + 1, W>...};
}
template <typename W>
constexpr auto kColumns = ColumnsTable<W>(std::make_index_sequence<kSweepRows<W>>());

// Work split into parts that the calling thread and the helper threads claim one at a time (a
// product's columns, a layer's attention heads). A caller never waits for a part nobody has claimed,
// so concurrent calls cannot starve each other.
struct Job {
  std::function<void(int64_t)> part;  // runs part p; what it refers to outlives the job's last part
  int64_t parts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunParts() {
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      part(p);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Set by S3dFewRowConfigure before the first product (kernel/ffi.py does, when it loads the library).
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

// Runs parts 0 .. parts - 1 of `part` over the calling thread and the helpers, and returns when all are done.
template <typename Part>
void Share(int64_t parts, Part&& part) {
  auto job = std::make_shared<Job>();
  job->part = std::forward<Part>(part);
  job->parts = parts;
  if (parts > 1) Helpers::Get().Post(job);
  job->RunParts();
  while (job->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One product's columns in parts that threads claim: `columns(n0, n1)` computes y's columns [n0, n1)
// for every row of x.
struct Product {
  std::function<void(int64_t, int64_t)> columns;
  int64_t N, part_columns, parts;
};

// One weight's reader into y [M, N], `share` columns per thread, streamed in long contiguous runs of
// the weight's rows: in one part, or in as many equal parts as keep each run within kPartBytes, so
// that every thread claims the same number of parts. `sweep(m, rows, n0, n1)` computes y's columns
// [n0, n1) for rows [m, m + rows) of x.
template <typename W, typename Sweep>
Product PlanColumns(const W& reader, int64_t M, int64_t share, Sweep sweep) {
  const int64_t N = reader.N;
  const int64_t rounds = std::max<int64_t>(1, CeilDiv(share * int64_t{sizeof(*reader.w)}, kPartBytes));
  const int64_t part_columns = std::max<int64_t>(kMinPartColumns, CeilDiv(CeilDiv(share, rounds), kColumnAlign) * kColumnAlign);
  auto columns = [=](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kSweepRows<W>) sweep(m, std::min(kSweepRows<W>, M - m), n0, n1);
  };
  return {columns, N, part_columns, CeilDiv(N, part_columns)};
}

// x [M, K] by one weight's reader into y [M, N].
template <typename W>
Product Plan(const float* x, W reader, float* y, int64_t M, int64_t K, int64_t share) {
  return PlanColumns(reader, M, share, [=](int64_t m, int64_t rows, int64_t n0, int64_t n1) {
    kColumns<W>[rows](x + m * K, &reader, y + m * reader.N, K, n0, n1);
  });
}

typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));

// The 16 lanes' sum as a fixed tree of halves: the same order every time, in a few shuffles.
inline float SumLanes(Lanes v) {
  const Lanes8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Lanes4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

inline float MaxLanes(Lanes v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

// Activations as int8 (`activations="int8"`): each row of x is quantized per block of 16 inputs to
// int8 codes with one float32 scale (the block's largest magnitude / 127), so that a quantized
// weight's codes are summed with integer multiply-adds, exact in any order, as llama.cpp does. A
// row's codes depend on its own values alone, so its product is the same whatever rows share the pass.
constexpr int64_t kActivationBlock = 16;  // a quantized weight's block of rows (W::kRows), within one group

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define S3D_INT8_QUADS 1  // AVX512-VNNI's `vpdpbusd`: four code products summed into each int32 lane
#endif

struct Int8Rows {
  std::vector<int8_t> codes;  // [M, K]
  // With S3D_INT8_QUADS, [M, K / 4]: a block's codes as four int32s of four bytes, its entries 0, 2,
  // 4, 6; 1, 3, 5, 7; 8, 10, 12, 14; 9, 11, 13, 15 (the order of an int4 weight's `Operands`)
  std::vector<int32_t> quads;
  std::vector<int32_t> code_sum;  // with S3D_INT8_QUADS, [M, K / 16]: the block's codes summed (`Offset`)
  std::vector<float> scale;   // [M, K / 16]
  std::vector<float> sum;     // [M, K / 16]: x's own sum over the block (`SumLanes`), for the weight's minimum
};

Int8Rows QuantizeRows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = M * K / kActivationBlock;
  Int8Rows rows{std::vector<int8_t>(M * K), {}, {}, std::vector<float>(blocks), std::vector<float>(blocks)};
#if defined(S3D_INT8_QUADS)
  rows.quads.resize(M * K / 4);
  rows.code_sum.resize(blocks);
  const __m128i kQuadOrder = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const Lanes block = *reinterpret_cast<const Lanes*>(x + b * kActivationBlock);
    const float largest = MaxLanes(block < 0 ? -block : block), inverse = largest > 0 ? 127.0f / largest : 0.0f;
    rows.scale[b] = largest / 127.0f;
    rows.sum[b] = SumLanes(block);
    int8_t* codes = rows.codes.data() + b * kActivationBlock;
#if defined(__AVX512F__)
    // Rounded to the nearest, ties to even (the default rounding mode), as std::nearbyint rounds.
    const __m512i wide = _mm512_cvtps_epi32(_mm512_mul_ps(reinterpret_cast<__m512>(block), _mm512_set1_ps(inverse)));
    const __m128i block_codes = _mm512_cvtsepi32_epi8(wide);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), block_codes);
#if defined(S3D_INT8_QUADS)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows.quads.data() + 4 * b), _mm_shuffle_epi8(block_codes, kQuadOrder));
    rows.code_sum[b] = _mm512_reduce_add_epi32(wide);
#endif
#else
    for (int64_t i = 0; i < kActivationBlock; ++i) codes[i] = int8_t(std::nearbyint(block[i] * inverse));
#endif
  }
  return rows;
}

// Every path below sums a block's codes times x's codes in integers (exact, in any order) and then
// takes the same float epilogue, y = fma(sum, scale_x * scale, fma(sum_x, min, y)) with min 0 where
// the weight has none, so every machine's kernel gives the same bits.
#if defined(S3D_INT8_QUADS)
// 16 columns of byte rows p .. p + 3 (`stride` bytes apart) as 16 int32 lanes: lane j holds column
// j's byte of row i in its byte i.
inline __m512i ColumnQuads(const uint8_t* p, int64_t stride) {
  alignas(64) static constexpr auto kTranspose = [] {
    std::array<uint8_t, 64> index{};
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < 4; ++i) index[4 * j + i] = uint8_t(16 * i + j);
    return index;
  }();
  __m512i rows = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  for (int i = 1; i < 4; ++i)
    rows = _mm512_mask_broadcast_i32x4(rows, __mmask16(0xF << (4 * i)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * stride)));
  return _mm512_permutexvar_epi8(_mm512_load_si512(kTranspose.data()), rows);
}

// 16 columns' codes of weight rows k .. k + 7 as the two unsigned operands of `vpdpbusd`, and x's
// matching int32 of codes for operand i of half h of a block (`Activations`):
//  - int4, byte rows k / 2 .. k / 2 + 3: rows k, k + 2, k + 4, k + 6 (the low nibbles), then rows
//    k + 1, k + 3, k + 5, k + 7 (the high ones), against `Int8Rows::quads`;
//  - int8: rows k .. k + 3, then k + 4 .. k + 7, each code + 128 (its sign bit flipped, `Offset`
//    takes 128 times x's codes back), against x's codes as they lie.
template <typename Scale>
inline void Operands(const Int4Weight<Scale>& w, int64_t k, int64_t n, __m512i* first, __m512i* second) {
  const __m512i quads = ColumnQuads(w.w + k / 2 * w.N + n, w.N), nibble = _mm512_set1_epi8(0x0F);
  *first = _mm512_and_si512(quads, nibble);
  *second = _mm512_and_si512(_mm512_srli_epi32(quads, 4), nibble);
}
inline void Operands(const Int8Weight& w, int64_t k, int64_t n, __m512i* first, __m512i* second) {
  const auto* codes = reinterpret_cast<const uint8_t*>(w.w + k * w.N + n);
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  *first = _mm512_xor_si512(ColumnQuads(codes, w.N), sign);
  *second = _mm512_xor_si512(ColumnQuads(codes + 4 * w.N, w.N), sign);
}
typedef int32_t Quad __attribute__((may_alias));  // four int8 codes read as one
template <typename Scale>
inline const Quad* Activations(const Int8Rows& x, const Int4Weight<Scale>&) { return x.quads.data(); }
inline const Quad* Activations(const Int8Rows& x, const Int8Weight&) { return reinterpret_cast<const Quad*>(x.codes.data()); }
template <typename Scale>
inline int32_t Offset(const Int4Weight<Scale>&, int32_t) { return 0; }
inline int32_t Offset(const Int8Weight&, int32_t code_sum) { return 128 * code_sum; }

// Blocks of 16 rows whose sums stay in registers between loads of y: 4 for an int4 weight's few rows
// (32 byte rows), 1 for one row (bound by memory, whose prefetcher follows fewer runs better) and for
// an int8 weight (a chunk of 4, 64 runs, made its one-row product 2x slower).
template <typename W, int T>
constexpr int64_t kQuadChunk = W::kRowsPerLoad == 2 && T > 1 ? 4 : 1;

// `ColumnsInt8Rows` with `vpdpbusd`, over whole vectors of 16 columns from n0, y kept in registers
// over a chunk of blocks; returns the first column it left.
template <int T, typename W>
int64_t VectorsInt8Quads(const Int8Rows& x, int64_t m, const W& w, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t N = w.N, blocks = K / kActivationBlock, n_end = n0 + (n1 - n0) / 16 * 16;
  const Quad* quads = Activations(x, w) + m * (K / 4);
  const float* scale_x = x.scale.data() + m * blocks;
  const float* sum_x = x.sum.data() + m * blocks;
  const int32_t* code_sum = x.code_sum.data() + m * blocks;
  for (int64_t first = 0; first < blocks; first += kQuadChunk<W, T>) {
    const int64_t last = std::min(blocks, first + kQuadChunk<W, T>);
    const bool next = last < blocks;
    for (int64_t n = n0; n < n_end; n += 16) {
      // The next chunk's rows, a cache line (64 columns) ahead of their use.
      if (next && n % 64 == 0)
        for (int64_t k = last * kActivationBlock; k < std::min(blocks, last + kQuadChunk<W, T>) * kActivationBlock; k += W::kRowsPerLoad)
          __builtin_prefetch(static_cast<const char*>(w.Row(k)) + n);
      __m512 out[T];
      for (int t = 0; t < T; ++t) out[t] = first == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + t * N + n);
      for (int64_t block = first; block < last; ++block) {
        const int64_t k0 = block * kActivationBlock;
        __m512i acc[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm512_set1_epi32(-Offset(w, code_sum[t * blocks + block]));
        for (int h = 0; h < 2; ++h) {
          __m512i even, odd;
          Operands(w, k0 + 8 * h, n, &even, &odd);
          for (int t = 0; t < T; ++t) {
            const Quad* quad = quads + t * (K / 4) + 4 * block + 2 * h;
            acc[t] = _mm512_dpbusd_epi32(acc[t], even, _mm512_set1_epi32(quad[0]));
            acc[t] = _mm512_dpbusd_epi32(acc[t], odd, _mm512_set1_epi32(quad[1]));
          }
        }
        const __m512 scale = reinterpret_cast<__m512>(w.Scales(k0, n)), min = reinterpret_cast<__m512>(w.Mins(k0, n));
        for (int t = 0; t < T; ++t)
          out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), _mm512_mul_ps(_mm512_set1_ps(scale_x[t * blocks + block]), scale),
                                   _mm512_fmadd_ps(_mm512_set1_ps(sum_x[t * blocks + block]), min, out[t]));
      }
      for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * N + n, out[t]);
    }
  }
  return n_end;
}
#endif

#if defined(__AVX2__)
inline __m256 Scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Scales8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// y[t, n0 ..] for whole vectors of 16 columns, rows k0 .. k0 + 15, and the block's epilogue;
// returns the first column it left.
// An int4 weight: 16 columns' codes of rows k and k + 1 (a byte row) as 16 int16 lanes, row k's
// code in the low byte, row k + 1's in the high one, by x's pair of codes with `vpmaddubsw`: a
// block's sum fits int16 (at most 8 * 2 * 127 * 15).
template <int T, typename Scale>
int64_t BlockAvx2(const Int8Rows& x, int64_t m, const Int4Weight<Scale>& w, float* y, int64_t K, int64_t k0, int64_t n0, int64_t n1,
                  const float* scale_x, const float* sum_x) {
  const int64_t N = w.N;
  __m256i broadcast[T][kActivationBlock / 2];  // loaded in the loop: a broadcast there cost a shuffle per multiply
  for (int t = 0; t < T; ++t)
    for (int p = 0; p < kActivationBlock / 2; ++p) {
      int16_t pair;  // row t's codes of rows 2p and 2p + 1, as the bytes of one int16
      std::memcpy(&pair, x.codes.data() + (m + t) * K + k0 + 2 * p, sizeof(pair));
      broadcast[t][p] = _mm256_set1_epi16(pair);
    }
  const bool next = k0 + kActivationBlock < K;
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    if (next && n % 64 == 0)
      for (int p = 0; p < kActivationBlock / 2; ++p) __builtin_prefetch(w.w + ((k0 + kActivationBlock) / 2 + p) * N + n);
    __m256i acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_si256();
    for (int p = 0; p < kActivationBlock / 2; ++p) {
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.w + (k0 / 2 + p) * N + n)));
      const __m256i codes = _mm256_or_si256(_mm256_and_si256(bytes, _mm256_set1_epi16(0x000F)),
                                            _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x00F0)), 4));
      for (int t = 0; t < T; ++t) acc[t] = _mm256_add_epi16(acc[t], _mm256_maddubs_epi16(codes, broadcast[t][p]));
    }
    const int64_t at = (k0 >> w.group_shift) * N + n;
    const __m256 scale[2] = {Scales8(w.scale + at), Scales8(w.scale + at + 8)}, min[2] = {Scales8(w.min + at), Scales8(w.min + at + 8)};
    for (int t = 0; t < T; ++t) {
      const __m256i sums[2] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[t])), _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[t], 1))};
      for (int v = 0; v < 2; ++v) {
        float* out = y + t * N + n + 8 * v;
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[v]), _mm256_mul_ps(_mm256_set1_ps(scale_x[t]), scale[v]),
                                              _mm256_fmadd_ps(_mm256_set1_ps(sum_x[t]), min[v], _mm256_loadu_ps(out))));
      }
    }
  }
  return n;
}

// An int8 weight: 16 columns' codes of rows k and k + 1 as int16 pairs (8 columns to a register) by
// x's pair of codes with `vpmaddwd`, in int32 lanes.
template <int T>
int64_t BlockAvx2(const Int8Rows& x, int64_t m, const Int8Weight& w, float* y, int64_t K, int64_t k0, int64_t n0, int64_t n1,
                  const float* scale_x, const float* sum_x) {
  const int64_t N = w.N;
  __m256i broadcast[T][kActivationBlock / 2];  // row t's codes of rows 2p and 2p + 1 as two int16s
  for (int t = 0; t < T; ++t)
    for (int p = 0; p < kActivationBlock / 2; ++p) {
      const int8_t* codes = x.codes.data() + (m + t) * K + k0 + 2 * p;
      broadcast[t][p] = _mm256_set1_epi32(int32_t(uint16_t(int16_t(codes[0])) | uint32_t(uint16_t(int16_t(codes[1]))) << 16));
    }
  const bool next = k0 + kActivationBlock < K;
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    if (next && n % 64 == 0)
      for (int kk = 0; kk < kActivationBlock; ++kk) __builtin_prefetch(w.w + (k0 + kActivationBlock + kk) * N + n);
    __m256i acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    for (int p = 0; p < kActivationBlock / 2; ++p) {
      const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.w + (k0 + 2 * p) * N + n));
      const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.w + (k0 + 2 * p + 1) * N + n));
      const __m256i pairs[2] = {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(even, odd)), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(even, odd))};
      for (int t = 0; t < T; ++t)
        for (int v = 0; v < 2; ++v) acc[t][v] = _mm256_add_epi32(acc[t][v], _mm256_madd_epi16(pairs[v], broadcast[t][p]));
    }
    const __m256 zero = _mm256_setzero_ps();
    const int64_t at = (k0 >> w.group_shift) * N + n;
    const __m256 scale[2] = {Scales8(w.scale + at), Scales8(w.scale + at + 8)};
    const __m256 min[2] = {w.min ? Scales8(w.min + at) : zero, w.min ? Scales8(w.min + at + 8) : zero};
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < 2; ++v) {
        float* out = y + t * N + n + 8 * v;
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][v]), _mm256_mul_ps(_mm256_set1_ps(scale_x[t]), scale[v]),
                                              _mm256_fmadd_ps(_mm256_set1_ps(sum_x[t]), min[v], _mm256_loadu_ps(out))));
      }
  }
  return n;
}
#endif

inline float Min1(const Int8Weight& w, int64_t at) { return w.min ? w.min[at] : 0.0f; }
template <typename Scale>
inline float Min1(const Int4Weight<Scale>& w, int64_t at) { return Scale1(w.min[at]); }

// y[t, n] = sum over blocks of 16 rows k of (scale_x * sum_k code_x[t, k] * code[k, n]) * scale[n] +
// sum_x * min[n], for a quantized weight W (int4 or int8).
template <int T, typename W>
void ColumnsInt8Rows(const Int8Rows& x, int64_t m, const W& w, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t N = w.N, blocks = K / kActivationBlock;
#if defined(S3D_INT8_QUADS)
  n0 = VectorsInt8Quads<T>(x, m, w, y, K, n0, n1);
  if (n0 == n1) return;  // no columns past the last whole vector
#endif
  for (int t = 0; t < T; ++t) std::memset(y + t * N + n0, 0, sizeof(float) * (n1 - n0));
  for (int64_t k0 = 0; k0 < K; k0 += kActivationBlock) {
    const int64_t block = k0 / kActivationBlock;
    float scale_x[T], sum_x[T];
    for (int t = 0; t < T; ++t) scale_x[t] = x.scale[(m + t) * blocks + block], sum_x[t] = x.sum[(m + t) * blocks + block];
    int64_t n = n0;
#if defined(__AVX2__)
    n = BlockAvx2<T>(x, m, w, y, K, k0, n0, n1, scale_x, sum_x);
#endif
    for (; n < n1; ++n)
      for (int t = 0; t < T; ++t) {
        const int8_t* codes = x.codes.data() + (m + t) * K + k0;
        int32_t acc = 0;
        for (int64_t kk = 0; kk < kActivationBlock; ++kk) acc += int32_t(codes[kk]) * int32_t(w.Code1(k0 + kk, n));
        const int64_t at = (k0 >> w.group_shift) * N + n;
        y[t * N + n] = std::fma(float(acc), scale_x[t] * Scale1(w.scale[at]), std::fma(sum_x[t], Min1(w, at), y[t * N + n]));
      }
  }
}

template <typename W, size_t... T>
constexpr auto Int8RowsTable(std::index_sequence<T...>) {
  return std::array<void (*)(const Int8Rows&, int64_t, const W&, float*, int64_t, int64_t, int64_t), sizeof...(T) + 1>{
      nullptr, ColumnsInt8Rows<T + 1, W>...};
}

// x (quantized) [M, K] by a quantized weight's reader into y [M, N].
template <typename W>
Product PlanInt8Rows(const Int8Rows& x, W reader, float* y, int64_t M, int64_t K, int64_t share) {
  static constexpr auto kSweeps = Int8RowsTable<W>(std::make_index_sequence<kSweepRows<W>>());
  const Int8Rows* rows = &x;  // outlives the products: they run inside the call that made it
  return PlanColumns(reader, M, share, [=](int64_t m, int64_t count, int64_t n0, int64_t n1) {
    kSweeps[count](*rows, m, reader, y + m * reader.N, K, n0, n1);
  });
}

// Every part of the products, over the calling thread and the helpers.
void Run(const std::vector<Product>& products) {
  int64_t parts = 0;
  for (const Product& product : products) parts += product.parts;
  Share(parts, [&](int64_t part) {
    size_t i = 0;
    for (; part >= products[i].parts; ++i) part -= products[i].parts;
    const Product& product = products[i];
    const int64_t n0 = part * product.part_columns;
    product.columns(n0, std::min(product.N, n0 + product.part_columns));
  });
}

int64_t Threads() { return Helpers::Get().size() + 1; }

// Which of a stack's L entries an operation reads: the layer that the decode passes' loop over the
// layers is at. Every weight and cache reaches the kernel whole, `[L, ...]`, and the entry is an
// offset into it, so that no layer's slice is ever copied out of the stack. `at` is one entry, or
// one per weight where weights sit beside the first (a draft adapter's stack holds the draft layers
// only, so its entry is not the projection's); `Entry(at, i, ...)` is weight i's.
bool Entry(ffi::Buffer<ffi::S32>& at, size_t i, int64_t L, int64_t* entry) {
  const auto d = at.dimensions();
  if (d.size() > 1 || (d.size() == 0 ? i != 0 : int64_t(i) >= d[0])) return false;
  *entry = at.typed_data()[i];
  return 0 <= *entry && *entry < L;
}

// `plan(reader)` with a reader of a float weight's [K, N] from element `offset` of its buffer; false
// for a weight of another type.
template <typename PlanFn>
bool WithFloatReader(const ffi::AnyBuffer& w, int64_t offset, int64_t N, PlanFn&& plan) {
  const char* base = static_cast<const char*>(w.untyped_data());
  switch (w.element_type()) {
    case ffi::DataType::F32:
      plan(Float32Weight{reinterpret_cast<const float*>(base) + offset, N});
      return true;
    case ffi::DataType::BF16:
      plan(Bfloat16Weight{reinterpret_cast<const uint16_t*>(base) + offset, N});
      return true;
    case ffi::DataType::F16:
      plan(Float16Weight{reinterpret_cast<const uint16_t*>(base) + offset, N});
      return true;
    default:
      return false;
  }
}

// Runs `products` (the first weight's) with those of the same x by further float weights [L_i, K, N_i]
// (`beside`, entry i + 1 of `at`) into further results [M, N_i], in one job: a draft adapter's A factor
// beside its projection, so that the two share one hand-off to the threads instead of one each.
ffi::Error RunWithBeside(std::vector<Product> products, const ffi::RemainingArgs& beside, const ffi::RemainingRets& results,
                         const float* x, int64_t M, int64_t K, ffi::Buffer<ffi::S32>& at) {
  const auto invalid = ffi::Error::InvalidArgument(
      "few_row_matmul: each further weight must be float32, bfloat16 or float16 [L_i, K, N_i] with the first's K, "
      "have a float32 result [M, N_i] and an entry of its own in `at`");
  if (beside.size() != results.size()) return invalid;
  for (size_t i = 0; i < beside.size(); ++i) {
    const auto w = beside.get<ffi::AnyBuffer>(i);
    auto y = results.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return invalid;
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    int64_t entry;
    if (wd.size() != 3 || wd[1] != K || yd.size() != 2 || yd[0] != M || yd[1] != wd[2] || !Entry(at, i + 1, wd[0], &entry)) return invalid;
    const int64_t N = wd[2];
    float* out = (*y)->typed_data();
    if (!WithFloatReader(*w, entry * K * N, N, [&](auto reader) { products.push_back(Plan(x, reader, out, M, K, CeilDiv(N, Threads()))); }))
      return invalid;
  }
  Run(products);
  return ffi::Error::Success();
}

// x [M, K] by entry `at` of w [L, K, N], and of any further float weights beside it; or a batch:
// x [S, M, K] by w [L, S, K, N] (the fused draft adapters' B factors, a few small weights in one call).
ffi::Error FewRowMatmul(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> at, ffi::RemainingArgs beside,
                        ffi::ResultBuffer<ffi::F32> y, ffi::RemainingRets beside_results) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const size_t rank = xd.size();
  int64_t entry;
  if ((rank != 2 && rank != 3) || wd.size() != rank + 1 || xd[rank - 1] != wd[rank - 1] || (rank == 3 && xd[0] != wd[1]) ||
      (rank == 3 && beside.size() != 0) || !Entry(at, 0, wd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul: expected x [M, K] and w [L, K, N], or x [S, M, K] and w [L, S, K, N] alone, and an entry 0 <= at < L");
  }
  const int64_t S = rank == 3 ? xd[0] : 1, M = xd[rank - 2], K = xd[rank - 1], N = wd[rank];
  // A batch of at least as many products as threads is shared whole products at a time; a narrow
  // product (a draft adapter's) is still split, so that no thread reads it alone.
  const int64_t share = S >= Threads() ? N : CeilDiv(N, Threads());
  std::vector<Product> products;
  for (int64_t s = 0; s < S; ++s) {
    const auto plan = [&](auto reader) {
      products.push_back(Plan(x.typed_data() + s * M * K, reader, y->typed_data() + s * M * N, M, K, share));
    };
    if (!WithFloatReader(w, (entry * S + s) * K * N, N, plan))
      return ffi::Error::InvalidArgument("few_row_matmul: the weight must be float32, bfloat16 or float16");
  }
  return RunWithBeside(std::move(products), beside, beside_results, x.typed_data(), M, K, at);
}

// The group of a quantized weight with K inputs and `groups` scales along them, as its log2: 32 or 16.
bool GroupShift(int64_t K, int64_t groups, int* shift) {
  for (int s : {5, 4})
    if (groups << s == K) return *shift = s, true;
  return false;
}

ffi::Error FewRowMatmulInt8(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> min,
                            ffi::Buffer<ffi::S32> at, ffi::RemainingArgs beside, ffi::ResultBuffer<ffi::F32> y,
                            ffi::RemainingRets beside_results, bool int8_activations) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), md = min.dimensions();
  const bool has_min = min.element_count() != 0;  // an empty minimum: none
  int64_t entry;
  int shift;
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || xd[1] != wd[1] || sd[0] != wd[0] || !GroupShift(wd[1], sd[1], &shift) ||
      sd[2] != wd[2] || (has_min && (md.size() != 3 || md[0] != sd[0] || md[1] != sd[1] || md[2] != sd[2])) ||
      !Entry(at, 0, wd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul_int8: expected x [M, K], w [L, K, N], scale (and min, or an empty min) [L, K/32 or K/16, N] and an entry "
        "0 <= at < L");
  }
  const int64_t M = xd[0], K = wd[1], N = wd[2], groups = entry * sd[1] * N;
  const Int8Weight reader{w.typed_data() + entry * K * N, scale.typed_data() + groups, has_min ? min.typed_data() + groups : nullptr,
                          N, shift};
  const Int8Rows rows = int8_activations ? QuantizeRows(x.typed_data(), M, K) : Int8Rows{};
  std::vector<Product> products{int8_activations ? PlanInt8Rows(rows, reader, y->typed_data(), M, K, CeilDiv(N, Threads()))
                                                 : Plan(x.typed_data(), reader, y->typed_data(), M, K, CeilDiv(N, Threads()))};
  return RunWithBeside(std::move(products), beside, beside_results, x.typed_data(), M, K, at);
}

ffi::Error FewRowMatmulInt4(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::AnyBuffer scale, ffi::AnyBuffer min,
                            ffi::Buffer<ffi::S32> at, ffi::RemainingArgs beside, ffi::ResultBuffer<ffi::F32> y,
                            ffi::RemainingRets beside_results, bool int8_activations) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), md = min.dimensions();
  const auto type = scale.element_type();
  int64_t entry;
  int shift;
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || md.size() != 3 || xd[1] != 2 * wd[1] || sd[0] != wd[0] ||
      !GroupShift(xd[1], sd[1], &shift) || sd[2] != wd[2] || md[0] != sd[0] || md[1] != sd[1] || md[2] != sd[2] ||
      (type != ffi::DataType::F16 && type != ffi::DataType::F32) || min.element_type() != type || !Entry(at, 0, wd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul_int4: expected x [M, K], w [L, K/2, N], scale and min of one type, float16 or float32, "
        "[L, K/32 or K/16, N] and an entry 0 <= at < L");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[2], groups = entry * sd[1] * N;
  const uint8_t* codes = w.typed_data() + entry * K / 2 * N;
  const Int8Rows rows = int8_activations ? QuantizeRows(x.typed_data(), M, K) : Int8Rows{};
  const auto plan = [&](auto reader) {
    return int8_activations ? PlanInt8Rows(rows, reader, y->typed_data(), M, K, CeilDiv(N, Threads()))
                            : Plan(x.typed_data(), reader, y->typed_data(), M, K, CeilDiv(N, Threads()));
  };
  std::vector<Product> products;
  if (type == ffi::DataType::F16) {
    const auto* s = static_cast<const uint16_t*>(scale.untyped_data()) + groups;
    const auto* m = static_cast<const uint16_t*>(min.untyped_data()) + groups;
    products.push_back(plan(Int4Weight<uint16_t>{codes, s, m, N, shift}));
  } else {
    const auto* s = static_cast<const float*>(scale.untyped_data()) + groups;
    const auto* m = static_cast<const float*>(min.untyped_data()) + groups;
    products.push_back(plan(Int4Weight<float>{codes, s, m, N, shift}));
  }
  return RunWithBeside(std::move(products), beside, beside_results, x.typed_data(), M, K, at);
}

// A decode pass's attention, fused: its few query rows against the cache's live slots (those below
// a row's `bound`, its cached length) and the pass's own block of keys, softmax and the weighted
// values in one call per layer. XLA read every allocated slot, masked or not, and spent more on the
// softmax and the block's small products around two kernels than the kernels spent on the cache.
// Each row's result is computed alone, in a fixed order (each score over E in order, the sums over
// slots lane by lane from slot 0), whatever the rows beside it or the slots past its bound.
typedef int32_t Ints __attribute__((vector_size(64)));
constexpr Ints kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// exp(x) for x <= 0 (a score less the row's maximum), within 1.01 ulp of the exact value over [-87, 0]; below -87, 0.
// exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by Cephes's polynomial for expf.
inline Lanes ExpNonPositive(Lanes x) {
  const Lanes floor_x = x < -87.0f ? Lanes{} - 87.0f : x;
  const Lanes n = (floor_x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const Lanes r = (floor_x - n * 0.693359375f) - n * -2.12194440e-4f;
  Lanes p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  const Lanes scaled = p * reinterpret_cast<const Lanes&>(bits);
  return x < -87.0f ? Lanes{} : scaled;
}

// 16 vectors transposed in place: v[d][j] becomes v[j][d]. Stage M swaps bit M of the row index with
// bit M of the lane index.
#define S3D_UNPAREN(...) __VA_ARGS__
#define S3D_TRANSPOSE_STAGE(M, KEEP, SWAP)                  \
  for (int r = 0; r < 16; ++r)                              \
    if (!(r & M)) {                                         \
      const Lanes a = v[r], b = v[r | M];                   \
      v[r] = __builtin_shufflevector(a, b, S3D_UNPAREN KEEP); \
      v[r | M] = __builtin_shufflevector(a, b, S3D_UNPAREN SWAP); \
    }
inline void Transpose16(Lanes (&v)[16]) {
  S3D_TRANSPOSE_STAGE(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30), (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
  S3D_TRANSPOSE_STAGE(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29), (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
  S3D_TRANSPOSE_STAGE(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27), (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  S3D_TRANSPOSE_STAGE(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23), (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
}
#undef S3D_TRANSPOSE_STAGE
#undef S3D_UNPAREN

// Scores of T query rows with the `live` (<= 16) cached keys from slot s, lanes over the slots: 16
// keys' dimensions are transposed in registers, so a step's 3 query rows do not fill 16 lanes with
// zeros. Slots past `live` are not read. The next 16 slots are prefetched: short runs of keys, which
// the hardware prefetcher finds late.
template <int T>
void ScoreSlots(const float* q, const float* keys, float* scores, int64_t stride, int64_t E, int64_t s, int64_t live, float scale) {
  Lanes acc[T] = {};
  for (int64_t e0 = 0; e0 < E; e0 += 16) {
    Lanes k[16];
    for (int j = 0; j < 16; ++j) k[j] = j < live ? *reinterpret_cast<const Lanes*>(keys + (s + j) * E + e0) : Lanes{};
    for (int j = 0; j < 16; ++j) __builtin_prefetch(keys + (s + 16 + j) * E + e0);
    Transpose16(k);
    for (int d = 0; d < 16; ++d)
      for (int t = 0; t < T; ++t) acc[t] += q[t * E + e0 + d] * k[d];
  }
  for (int t = 0; t < T; ++t) *reinterpret_cast<Lanes*>(scores + t * stride + s) = acc[t] * scale;
}

// A pass's rows see, besides the cache's n slots, earlier tokens of their own block (a chain's or a
// tree path's ancestors). A one-token step for the same token has those tokens in the cache, at slots
// n, n + 1, ... So each row places its ancestors' scores and values at those slots: its sums then run
// over the same lanes in the same order as that step's, and a pass's row equals the step bit for bit
// (what lets rounded activations, int8 or 16-bit, keep S3D token-exact).
struct Ancestors {
  const int32_t* index;  // [rows, block]: row t's ancestors' block positions, in order of depth
  const int32_t* count;  // [rows]
  const float* values;   // the block's values [block, E]
  int64_t block;
};

// out[t, e0 + x] = sum over slots s < n + a_t of p[t, s] v[e0 + x, s], for T rows and kE dimensions,
// a_t being row t's ancestors, whose values stand at slots n.. (`Ancestors`): lane l sums the slots
// s = l (mod 16) from slot 0, then `SumLanes`. p is 0 past n + a_t; v's rows are read up to n.
template <int T, int kE>
void WeighValues(const float* p, int64_t stride, const float* values, int64_t S, int64_t n, int64_t e0, float* out, int64_t E,
                 const Ancestors& before) {
  const int64_t whole = n / 16 * 16;
  Lanes acc[kE][T] = {};
  for (int64_t s = 0; s < whole; s += 16) {
    Lanes v[kE];
    for (int x = 0; x < kE; ++x) v[x] = *reinterpret_cast<const Lanes*>(values + (e0 + x) * S + s);
    if (e0 + kE < E)
      for (int x = 0; x < kE; ++x) __builtin_prefetch(values + (e0 + kE + x) * S + s);
    for (int t = 0; t < T; ++t) {
      const Lanes pt = *reinterpret_cast<const Lanes*>(p + t * stride + s);
      for (int x = 0; x < kE; ++x) acc[x][t] += pt * v[x];
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t live = n + before.count[t];
    const int32_t* index = before.index + t * before.block;
    for (int64_t s = whole; s < live; s += 16) {
      const Lanes pt = *reinterpret_cast<const Lanes*>(p + t * stride + s);
      for (int x = 0; x < kE; ++x) {
        Lanes v = {};
        for (int64_t slot = s; slot < std::min(s + 16, live); ++slot)
          v[slot - s] = slot < n ? values[(e0 + x) * S + slot] : before.values[index[slot - n] * E + e0 + x];
        acc[x][t] += pt * v;
      }
    }
  }
  for (int x = 0; x < kE; ++x)
    for (int t = 0; t < T; ++t) out[t * E + e0 + x] = SumLanes(acc[x][t]);
}

constexpr int kScoreRows = 8;   // rows per sweep of the scores: 8 accumulators beside 16 transposed keys
constexpr int kAttendRows = 16;  // rows per sweep of the values
using ScoreSlotsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, float);
using WeighValuesFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, const Ancestors&);
template <size_t... I>
constexpr std::array<ScoreSlotsFn, sizeof...(I) + 1> ScoreSlotsTable(std::index_sequence<I...>) {
  return {nullptr, ScoreSlots<I + 1>...};
}
// Dimensions per sweep of the values: few rows share each load of their probabilities among more.
constexpr int64_t ValueDims(int64_t rows) { return rows <= 4 ? 4 : rows <= 8 ? 2 : 1; }
template <size_t... I>
constexpr std::array<WeighValuesFn, sizeof...(I) + 1> WeighValuesTable(std::index_sequence<I...>) {
  return {nullptr, WeighValues<I + 1, ValueDims(I + 1)>...};
}
constexpr auto kScoreSlots = ScoreSlotsTable(std::make_index_sequence<kScoreRows>());
constexpr auto kWeighValues = WeighValuesTable(std::make_index_sequence<kAttendRows>());

// One KV head's share of a pass's attention: rows q [R, E] (row r is the block's token r % T) over
// the cache's keys [S, E] and values [E, S] at slots s < n, and the block's keys and values [T, E]
// where mask [T, T] allows. In three steps, each split among threads: the scores of a range of
// slots, the softmax of a range of rows, the weighted values of a range of dimensions.
struct Head {
  const float *q, *keys, *values, *block_keys, *block_values;
  const bool* mask;
  float* out;
  int64_t R, T, S, E, n, width, block_width;  // widths: n + T and T rounded up to whole 16-slot vectors
  float scale;
  float *scores, *block, *sums;  // [R, width], [R, block_width], [R]: probabilities once normalized, unscaled
  int32_t *ancestors, *counts;   // [R, T], [R]: each row's ancestors in the block (`Ancestors`)

  void Score(int64_t s0, int64_t s1) const {
    for (int64_t s = s0; s < s1; s += 16)
      for (int64_t r = 0; r < R; r += kScoreRows)
        kScoreSlots[std::min<int64_t>(kScoreRows, R - r)](q + r * E, keys, scores + r * width, width, E, s, std::min<int64_t>(16, n - s),
                                                          scale);
  }

  // Each row's probabilities, exp(score - its maximum), and their sum, over its live slots and the
  // block's keys it sees; 0 elsewhere.
  void Normalize(int64_t r0, int64_t r1) const {
    // The block's keys are scored as the cache's are, each score the same sum over E in order.
    for (int64_t s = 0; s < T; s += 16)
      for (int64_t r = r0; r < r1; r += kScoreRows)
        kScoreSlots[std::min<int64_t>(kScoreRows, r1 - r)](q + r * E, block_keys, block + r * block_width, block_width, E, s,
                                                           std::min<int64_t>(16, T - s), scale);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t self = r % T;
      const bool* sees = mask + self * T;
      float *row = scores + r * width, *own = block + r * block_width;
      int32_t* before = ancestors + r * T;
      int64_t count = 0;  // the keys it sees before its own stand at slots n, n + 1, ... (`Ancestors`)
      for (int64_t j = 0; j < self; ++j)
        if (sees[j]) row[n + count] = own[j], before[count++] = int32_t(j);
      counts[r] = int32_t(count);
      const int64_t live = n + count;
      float top = -INFINITY;  // over the keys it sees from its own on, and the slots
      for (int64_t j = self; j < T; ++j)
        if (sees[j]) top = std::max(top, own[j]);
      Lanes top_lanes = Lanes{} - INFINITY;
      for (int64_t s = 0; s < width; s += 16) {
        const Lanes x = *reinterpret_cast<const Lanes*>(row + s);
        top_lanes = (kLaneIndex + int32_t(s) < int32_t(live)) & (x > top_lanes) ? x : top_lanes;
      }
      top = std::max(top, MaxLanes(top_lanes));
      Lanes total = {};
      for (int64_t s = 0; s < width; s += 16) {
        const Lanes p = ExpNonPositive(*reinterpret_cast<const Lanes*>(row + s) - top);
        const Lanes kept = kLaneIndex + int32_t(s) < int32_t(live) ? p : Lanes{};
        *reinterpret_cast<Lanes*>(row + s) = kept;
        total += kept;
      }
      float sum = SumLanes(total);
      for (int64_t j = 0; j < T; ++j) {
        own[j] = j >= self && sees[j] ? ExpNonPositive(Lanes{} + (own[j] - top))[0] : 0.0f;
        sum += own[j];
      }
      sums[r] = sum;
    }
  }

  void Weigh(int64_t e0, int64_t e1) const {
    for (int64_t r0 = 0; r0 < R; r0 += kAttendRows) {
      const int64_t rows = std::min<int64_t>(kAttendRows, R - r0), dims = ValueDims(rows);
      const Ancestors before{ancestors + r0 * T, counts + r0, block_values, T};
      for (int64_t e = e0; e < e1; e += dims) kWeighValues[rows](scores + r0 * width, width, values, S, n, e, out + r0 * E, E, before);
    }
    for (int64_t r = 0; r < R; ++r) {
      float* o = out + r * E;
      const float* own = block + r * block_width;
      for (int64_t j = 0; j < T; ++j)
        if (own[j] != 0)
          for (int64_t e = e0; e < e1; ++e) o[e] += own[j] * block_values[j * E + e];
      const float inverse = sums[r] > 0 ? 1.0f / sums[r] : 0.0f;  // a row that sees nothing gives 0
      for (int64_t e = e0; e < e1; ++e) o[e] *= inverse;
    }
  }
};

// Slots per part of the scores and dimensions per part of the values: enough work to be worth a
// thread's hand-off, and whole vectors (the values' sweeps take up to 4 dimensions at a time).
constexpr int64_t kSlotsPerPart = 256;
constexpr int64_t kDimsPerPart = 16;

// Calls `head(b * K + k, n)` for every row b and KV head k, n being row b's bound clamped to [0, S].
template <typename Head>
void EachHead(ffi::Buffer<ffi::S32>& bound, int64_t K, int64_t S, Head head) {
  for (int64_t b = 0; b < bound.dimensions()[0]; ++b) {
    const int64_t n = std::clamp<int64_t>(bound.typed_data()[b], 0, S);
    for (int64_t k = 0; k < K; ++k) head(b * K + k, n);
  }
}

// out [B, K, R, E]: rows q [B, K, R, E] (R = G query heads x T tokens, row r the token r % T) attend
// to layer `at` of the cache, keys [L, B, K, S, E] and values [L, B, K, E, S], at the slots below
// bound[b], and to the block's keys and values [B, K, T, E] where mask [B, T, T] allows.
ffi::Error CacheAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                          ffi::Buffer<ffi::F32> block_keys, ffi::Buffer<ffi::F32> block_values, ffi::Buffer<ffi::PRED> mask,
                          ffi::Buffer<ffi::S32> bound, ffi::Buffer<ffi::S32> at, float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), bk = block_keys.dimensions(),
             md = mask.dimensions();
  int64_t entry;
  const bool shapes = qd.size() == 4 && kd.size() == 5 && vd.size() == 5 && bk.size() == 4 && md.size() == 3 &&
                      block_values.dimensions().size() == 4 && bound.dimensions().size() == 1;
  if (!shapes || kd[1] != qd[0] || kd[2] != qd[1] || kd[4] != qd[3] || vd[0] != kd[0] || vd[1] != qd[0] || vd[2] != qd[1] ||
      vd[3] != qd[3] || vd[4] != kd[3] || bk[0] != qd[0] || bk[1] != qd[1] || bk[3] != qd[3] || qd[3] % 16 || qd[2] % bk[2] ||
      md[0] != qd[0] || md[1] != bk[2] || md[2] != bk[2] || bound.dimensions()[0] != qd[0] || !Entry(at, 0, kd[0], &entry)) {
    return ffi::Error::InvalidArgument(
        "cache_attention: expected q [B, K, R, E], keys [L, B, K, S, E], values [L, B, K, E, S], block keys and values "
        "[B, K, T, E] with T dividing R and 16 dividing E, mask [B, T, T], bound [B] and an entry 0 <= at < L");
  }
  const int64_t B = qd[0], K = qd[1], R = qd[2], E = qd[3], S = kd[3], T = bk[2];
  const int64_t layer = entry * B * K * S * E;
  const int64_t block_width = CeilDiv(T, 16) * 16;
  std::vector<Head> heads;
  int64_t scratch = 0;  // each head's scores, block probabilities and sums, sized by its live slots
  EachHead(bound, K, S, [&](int64_t head, int64_t n) {
    const int64_t width = CeilDiv(n + T, 16) * 16;
    heads.push_back(Head{q.typed_data() + head * R * E, keys.typed_data() + layer + head * S * E,
                         values.typed_data() + layer + head * E * S, block_keys.typed_data() + head * T * E,
                         block_values.typed_data() + head * T * E, mask.typed_data() + head / K * T * T, out->typed_data() + head * R * E,
                         R, T, S, E, n, width, block_width, scale, nullptr, nullptr, nullptr});
    scratch += R * (width + block_width + 1);
  });
  thread_local std::vector<float> workspace;
  thread_local std::vector<int32_t> ancestry;
  workspace.resize(scratch);
  ancestry.resize(heads.size() * R * (T + 1));
  float* free = workspace.data();
  int32_t* next = ancestry.data();
  for (Head& h : heads) {
    h.scores = free;
    h.block = h.scores + R * h.width;
    h.sums = h.block + R * block_width;
    free = h.sums + R;
    h.ancestors = next;
    h.counts = next + R * T;
    next = h.counts + R;
  }
  int64_t most = 0;
  for (const Head& h : heads) most = std::max(most, h.n);
  const int64_t H = heads.size(), slot_parts = std::max<int64_t>(1, CeilDiv(most, kSlotsPerPart)), dim_parts = CeilDiv(E, kDimsPerPart);
  Share(H * slot_parts, [&](int64_t p) {
    const Head& h = heads[p / slot_parts];
    const int64_t s0 = p % slot_parts * kSlotsPerPart;
    if (s0 < h.n) h.Score(s0, std::min(h.n, s0 + kSlotsPerPart));
  });
  const int64_t row_parts = std::min<int64_t>(R, Threads());
  Share(H * row_parts, [&](int64_t p) {
    const int64_t share = CeilDiv(R, row_parts), r0 = p % row_parts * share;
    heads[p / row_parts].Normalize(r0, std::min(R, r0 + share));
  });
  Share(H * dim_parts, [&](int64_t p) {
    const int64_t e0 = p % dim_parts * kDimsPerPart;
    heads[p / dim_parts].Weigh(e0, std::min(E, e0 + kDimsPerPart));
  });
  return ffi::Error::Success();
}

// logits [B, T, L] = hidden [B, T, D] . head [D, V] at each row's columns ids [B, L], for the first
// count[b] ids of row b that lie in [0, V); 0 elsewhere. The draft head's scores of a row's own
// context: only its live ids' columns are read, each distinct id's once, where XLA gathered every
// slot's column first; the caller passes the ids the reduced head does not score and -1 (or V) for
// the rest. Lanes hold 16 ids, one row d of the table at a time, so each logit is summed over d in
// order whatever the ids or rows beside it.
ffi::Error ContextLogits(ffi::Buffer<ffi::F32> hidden, ffi::Buffer<ffi::F32> head, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::S32> count, ffi::ResultBuffer<ffi::F32> logits) {
  const auto hd = hidden.dimensions(), wd = head.dimensions(), id = ids.dimensions(), cd = count.dimensions();
  if (hd.size() != 3 || wd.size() != 2 || id.size() != 2 || cd.size() != 1 || hd[2] != wd[0] || id[0] != hd[0] || cd[0] != hd[0]) {
    return ffi::Error::InvalidArgument("context_logits: expected hidden [B, T, D], head [D, V], ids [B, L] and count [B]");
  }
  const int64_t B = hd[0], T = hd[1], D = hd[2], V = wd[1], L = id[1];
  constexpr int kRows = 8;
  constexpr int64_t kAhead = 8;  // table rows prefetched ahead: each of a group's 16 columns is a line of its own
  thread_local std::vector<int64_t> first;  // [V]: the position that scores an id, or -1
  if (int64_t(first.size()) != V) first.assign(V, -1);
  // Each row's ids inside the table are scored once, at their first position, and copied to repeats.
  std::vector<std::vector<int64_t>> scored(B);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> repeats(B);  // (the position scored, a repeat's)
  std::vector<std::pair<int64_t, int64_t>> groups;  // (row, first of up to 16 scored positions)
  EachHead(count, 1, L, [&](int64_t b, int64_t n) {  // one "head" per row: its count clamped to [0, L]
    const int32_t* row_ids = ids.typed_data() + b * L;
    std::memset(logits->typed_data() + b * T * L, 0, sizeof(float) * T * L);
    for (int64_t l = 0; l < n; ++l) {
      const int32_t token = row_ids[l];
      if (token < 0 || token >= V) continue;
      if (first[token] < 0) {
        first[token] = l;
        scored[b].push_back(l);
      } else {
        repeats[b].emplace_back(first[token], l);
      }
    }
    for (const int64_t l : scored[b]) first[row_ids[l]] = -1;
    for (size_t j0 = 0; j0 < scored[b].size(); j0 += 16) groups.emplace_back(b, j0);
  });
  const std::vector<float> zeros(D, 0.0f);
  Share(groups.size(), [&](int64_t g) {
    const auto [b, j0] = groups[g];
    const int32_t* row_ids = ids.typed_data() + b * L;
    float* out = logits->typed_data() + b * T * L;
    const int64_t m = std::min<int64_t>(16, int64_t(scored[b].size()) - j0);
    int64_t columns[16] = {};
    for (int64_t j = 0; j < m; ++j) columns[j] = row_ids[scored[b][j0 + j]];
    for (int64_t j = m; j < 16; ++j) columns[j] = columns[0];
    for (int64_t t0 = 0; t0 < T; t0 += kRows) {
      const float* h[kRows];
      for (int i = 0; i < kRows; ++i) h[i] = t0 + i < T ? hidden.typed_data() + (b * T + t0 + i) * D : zeros.data();
      Lanes acc[kRows] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* table_row = head.typed_data() + d * V;
        if (d + kAhead < D)
          for (int j = 0; j < m; ++j) __builtin_prefetch(table_row + kAhead * V + columns[j]);
        Lanes w;
        for (int j = 0; j < 16; ++j) w[j] = table_row[columns[j]];
        for (int i = 0; i < kRows; ++i) acc[i] += h[i][d] * w;
      }
      for (int64_t i = 0; i < std::min<int64_t>(kRows, T - t0); ++i)
        for (int64_t j = 0; j < m; ++j) out[(t0 + i) * L + scored[b][j0 + j]] = acc[i][j];
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    float* out = logits->typed_data() + b * T * L;
    for (const auto [scored_at, l] : repeats[b])
      for (int64_t t = 0; t < T; ++t) out[t * L + l] = out[t * L + scored_at];
  }
  return ffi::Error::Success();
}

// Columns `ids` of a 16-bit vocabulary table [D, V] as float32 [D, N] (a bfloat16 or float16 model's
// token embeddings), widened by the weights' readers; a negative id counts from the end and one
// outside the table gives NaN, as `jnp.take` does. XLA's CPU widens the whole table before its
// gather and, in the decode loop, hoists that widening out of the loop: a float32 copy of the table
// held for as long as the loop runs.
template <typename W>
void CopyColumns(const W& table, const int32_t* ids, int64_t D, int64_t N, float* y) {
  const int64_t V = table.N;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t id = ids[n] < 0 ? int64_t{ids[n]} + V : ids[n];
    for (int64_t k = 0; k < D; ++k)
      y[k * N + n] = 0 <= id && id < V ? table.Load1(k, id) : std::numeric_limits<float>::quiet_NaN();
  }
}

ffi::Error TableColumns(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto d = table.dimensions();
  const auto type = table.element_type();
  if (d.size() != 2 || (type != ffi::DataType::BF16 && type != ffi::DataType::F16) || out->element_count() != d[0] * ids.element_count())
    return ffi::Error::InvalidArgument("table_columns: expected a bfloat16 or float16 table [D, V] and ids, giving float32 [D, ids]");
  const uint16_t* t = reinterpret_cast<const uint16_t*>(table.untyped_data());
  if (type == ffi::DataType::BF16)
    CopyColumns(Bfloat16Weight{t, d[1]}, ids.typed_data(), d[0], ids.element_count(), out->typed_data());
  else
    CopyColumns(Float16Weight{t, d[1]}, ids.typed_data(), d[0], ids.element_count(), out->typed_data());
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
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dFewRowMatmulInt8, FewRowMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<bool>("int8_activations"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dFewRowMatmulInt4, FewRowMatmulInt4,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<bool>("int8_activations"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dContextLogits, ContextLogits,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dTableColumns, TableColumns,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
