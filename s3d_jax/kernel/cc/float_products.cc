// Products by a float32, bfloat16 or float16 weight, and further float weights beside any product.
#include "few_rows.h"

namespace {

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

}  // namespace

namespace s3d {

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

}  // namespace s3d

namespace {

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(S3dFewRowMatmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets());
