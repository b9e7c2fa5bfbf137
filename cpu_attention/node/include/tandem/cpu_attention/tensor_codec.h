// Checks and conversions between tandem.v1.Tensor and host arrays. Every size is validated
// against the expected shape before anything is allocated, so a request cannot make the node
// allocate more than the shape its geometry allows.
#pragma once

#include <cstdint>
#include <span>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "tandem/v1/common.pb.h"

namespace tandem::cpu_attention {

// Bytes of one element of `dtype`; 0 for DTYPE_UNSPECIFIED or an unknown value.
size_t DTypeSize(v1::DType dtype);

// OK iff t.dtype() == dtype, t.shape() == shape and len(t.data()) matches. The error names
// `what` (e.g. "queries[2].q") and both shapes.
absl::Status CheckTensor(const v1::Tensor& t, absl::string_view what, v1::DType dtype,
                         std::span<const int64_t> shape);

// Decodes an F32 or BF16 tensor of `shape` into floats; INVALID_ARGUMENT for another dtype, a
// shape mismatch, or (if require_finite) a NaN/Inf element, naming its flat index.
absl::Status DecodeFloats(const v1::Tensor& t, absl::string_view what,
                          std::span<const int64_t> shape, bool require_finite,
                          std::vector<float>* dst);

// INVALID_ARGUMENT naming `what` and the flat index of the first NaN/Inf element.
absl::Status CheckFinite(std::span<const float> values, absl::string_view what);

// Sets t to an F32 tensor of `shape` with uninitialised data and returns its element pointer.
float* InitF32(v1::Tensor* t, std::span<const int64_t> shape);

// Encodes floats as an F32 or BF16 tensor of `shape` (src.size() must equal its product).
void EncodeF32(std::span<const float> src, std::span<const int64_t> shape, v1::Tensor* t);
void EncodeBf16(std::span<const float> src, std::span<const int64_t> shape, v1::Tensor* t);

}  // namespace tandem::cpu_attention
