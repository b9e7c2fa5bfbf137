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
  // float8 e4m3fn (tandem/common/f8e4m3.h): FP8 checkpoints' weight matrices, each with a scale
  // (model_weights.h). Only MatMul takes it, where Backend::SupportsFp8Weights(); elsewhere
  // DeviceModel dequantizes on upload.
  kF8E4M3,
};

constexpr size_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF8E4M3:
      return 1;
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
    case DType::kF8E4M3:
      return "f8e4m3";
  }
  return "?";
}

}  // namespace tandem::gpu_worker
