// Products by an int4 weight in groups of 32 or 16 rows (GGUF's Q4_0, Q4_1, Q4_K).
#include "int8_rows.h"

namespace {

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

}  // namespace

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
