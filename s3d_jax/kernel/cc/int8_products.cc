// Products by an int8 weight in groups of 32 or 16 rows (GGUF's Q8_0, Q5_0, Q5_1, Q6_K).
#include "int8_rows.h"

namespace {

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

}  // namespace

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
