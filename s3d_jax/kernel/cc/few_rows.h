// y = x @ w for a few rows of x (a decode pass: 1 to 16 tokens) against a large row-major weight,
// a pass's attention over the KV cache (`CacheAttention`), the draft head's
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
//
// The kernel's files, built side by side and linked into one library (s3d_jax/kernel/build.py):
// threads.cc (the helper threads that share a product), float_products.cc, int8_products.cc and
// int4_products.cc (the products by each kind of weight), attention.cc and lookups.cc (the context
// columns and the table columns). This header holds what they share; int8_rows.h, the int8-activation
// paths of the quantized products.
#pragma once

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

// Defined once, in threads.cc and float_products.cc.
namespace s3d {

// One product's columns in parts that threads claim: `columns(n0, n1)` computes y's columns [n0, n1)
// for every row of x.
struct Product {
  std::function<void(int64_t, int64_t)> columns;
  int64_t N, part_columns, parts;
};

// Runs parts 0 .. parts - 1 of `part` over the calling thread and the helpers, and returns when all are done.
void Share(int64_t parts, std::function<void(int64_t)> part);
// Every part of the products, over the calling thread and the helpers.
void Run(const std::vector<Product>& products);
// The threads that share a product: the helpers and the calling thread.
int64_t Threads();
// Runs `products` (the first weight's) with those of the same x by further float weights [L_i, K, N_i]
// (`beside`, entry i + 1 of `at`) into further results [M, N_i], in one job: a draft adapter's A factor
// beside its projection, so that the two share one hand-off to the threads instead of one each.
ffi::Error RunWithBeside(std::vector<Product> products, const ffi::RemainingArgs& beside, const ffi::RemainingRets& results,
                         const float* x, int64_t M, int64_t K, ffi::Buffer<ffi::S32>& at);

}  // namespace s3d

// The rest is compiled by each file for itself (an unnamed namespace), so that each instantiates and
// optimises what it uses exactly as when the kernel was one file.
namespace {

using s3d::Product;
using s3d::Run;
using s3d::RunWithBeside;
using s3d::Share;
using s3d::Threads;

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

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// Which of a stack's L entries an operation reads: the layer that the decode passes' loop over the
// layers is at. Every weight and cache reaches the kernel whole, `[L, ...]`, and the entry is an
// offset into it, so that no layer's slice is ever copied out of the stack. `at` is one entry, or
// one per weight where weights sit beside the first (a draft adapter's stack holds the draft layers
// only, so its entry is not the projection's); `Entry(at, i, ...)` is weight i's.
inline bool Entry(ffi::Buffer<ffi::S32>& at, size_t i, int64_t L, int64_t* entry) {
  const auto d = at.dimensions();
  if (d.size() > 1 || (d.size() == 0 ? i != 0 : int64_t(i) >= d[0])) return false;
  *entry = at.typed_data()[i];
  return 0 <= *entry && *entry < L;
}

// The group of a quantized weight with K inputs and `groups` scales along them, as its log2: 32 or 16.
inline bool GroupShift(int64_t K, int64_t groups, int* shift) {
  for (int s : {5, 4})
    if (groups << s == K) return *shift = s, true;
  return false;
}

// Calls `head(b * K + k, n)` for every row b and KV head k, n being row b's bound clamped to [0, S].
template <typename Head>
void EachHead(ffi::Buffer<ffi::S32>& bound, int64_t K, int64_t S, Head head) {
  for (int64_t b = 0; b < bound.dimensions()[0]; ++b) {
    const int64_t n = std::clamp<int64_t>(bound.typed_data()[b], 0, S);
    for (int64_t k = 0; k < K; ++k) head(b * K + k, n);
  }
}

}  // namespace
