// Element types of model tensors and backend buffers, shared by the model loader and the
// backends (the proto's DType is the wire type; this one is the in-memory type).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tandem::gpu_worker {

enum class DType : uint8_t {
  kF32,
  kBF16,
  kF16,
  kI32,
};

constexpr size_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
  }
  return 0;
}

constexpr std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
  }
  return "?";
}

}  // namespace tandem::gpu_worker
