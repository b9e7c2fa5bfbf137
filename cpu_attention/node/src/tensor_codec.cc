#include "tandem/cpu_attention/tensor_codec.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/common/bf16.h"

namespace tandem::cpu_attention {
namespace {

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Product of dims, or -1 if a dim is negative or the product passes 2^40 elements.
int64_t Elements(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > (int64_t{1} << 40) / d)) return -1;
    n *= d;
  }
  return n;
}

}  // namespace

size_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return 4;
    case v1::DTYPE_BF16:
    case v1::DTYPE_F16:
      return 2;
    default:
      return 0;
  }
}

absl::Status CheckTensor(const v1::Tensor& t, absl::string_view what, v1::DType dtype,
                         std::span<const int64_t> shape) {
  if (t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ", v1::DType_Name(t.dtype()),
                                                   ", expected ", v1::DType_Name(dtype)));
  }
  const std::span<const int64_t> got(t.shape().data(), t.shape().size());
  if (!std::equal(got.begin(), got.end(), shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape ", ShapeString(got),
                                                   ", expected ", ShapeString(shape)));
  }
  const int64_t n = Elements(shape);
  if (n < 0 || t.data().size() != static_cast<size_t>(n) * DTypeSize(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", t.data().size(),
                                                   " data bytes for shape ", ShapeString(shape),
                                                   " of ", v1::DType_Name(dtype)));
  }
  return absl::OkStatus();
}

absl::Status DecodeFloats(const v1::Tensor& t, absl::string_view what,
                          std::span<const int64_t> shape, bool require_finite,
                          std::vector<float>* dst) {
  if (t.dtype() != v1::DTYPE_F32 && t.dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": dtype ", v1::DType_Name(t.dtype()), ", expected DTYPE_F32 or DTYPE_BF16"));
  }
  if (absl::Status s = CheckTensor(t, what, t.dtype(), shape); !s.ok()) return s;
  const size_t n = static_cast<size_t>(Elements(shape));
  dst->resize(n);
  if (t.dtype() == v1::DTYPE_F32) {
    std::memcpy(dst->data(), t.data().data(), n * sizeof(float));
  } else {
    const char* src = t.data().data();
    for (size_t i = 0; i < n; ++i) {
      bf16_t bits;
      std::memcpy(&bits, src + 2 * i, 2);
      (*dst)[i] = Bf16ToFloat(bits);
    }
  }
  if (require_finite) return CheckFinite(*dst, what);
  return absl::OkStatus();
}

absl::Status CheckFinite(std::span<const float> values, absl::string_view what) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": element ", i, " is ", values[i], " (must be finite)"));
    }
  }
  return absl::OkStatus();
}

float* InitF32(v1::Tensor* t, std::span<const int64_t> shape) {
  t->set_dtype(v1::DTYPE_F32);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  const int64_t n = Elements(shape);
  std::string* data = t->mutable_data();
  data->resize(static_cast<size_t>(n) * sizeof(float));
  return reinterpret_cast<float*>(data->data());
}

void EncodeF32(std::span<const float> src, std::span<const int64_t> shape, v1::Tensor* t) {
  float* dst = InitF32(t, shape);
  std::memcpy(dst, src.data(), src.size() * sizeof(float));
}

void EncodeBf16(std::span<const float> src, std::span<const int64_t> shape, v1::Tensor* t) {
  t->set_dtype(v1::DTYPE_BF16);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = t->mutable_data();
  data->resize(src.size() * 2);
  for (size_t i = 0; i < src.size(); ++i) {
    const bf16_t bits = FloatToBf16(src[i]);
    std::memcpy(data->data() + 2 * i, &bits, 2);
  }
}

}  // namespace tandem::cpu_attention
