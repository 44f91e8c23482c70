#include "few_rows.h"

namespace {

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

}  // namespace

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
