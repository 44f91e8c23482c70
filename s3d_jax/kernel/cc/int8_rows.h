// The quantized products' int8-activation paths (`activations="int8"`), for int8_products.cc and
// int4_products.cc.
#pragma once

#include "few_rows.h"

namespace {

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

inline Int8Rows QuantizeRows(const float* x, int64_t M, int64_t K) {
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

}  // namespace
