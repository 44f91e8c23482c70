// The draft head's context columns and a 16-bit table's token columns.
#include "few_rows.h"

namespace {

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
