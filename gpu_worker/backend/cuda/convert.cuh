// Small elementwise kernels around the GEMMs and buffers: f32 -> bf16/f16 conversion of GEMM
// inputs, Fill, RandomFill, and the bias add after a GEMM.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// dst[i] = round_to_nearest_even(src[i]) in dst_dtype (kBF16 or kF16).
struct ConvertArgs {
  const float* src = nullptr;  // [count]
  void* dst = nullptr;         // [count] of dst_dtype
  DType dst_dtype = DType::kBF16;
  int64_t count = 0;
};
cudaError_t LaunchConvertFromF32(const ConvertArgs& args, cudaStream_t stream);

// dst[i] = value.
struct FillArgs {
  float* dst = nullptr;  // [count]
  float value = 0.0f;
  int64_t count = 0;
};
cudaError_t LaunchFill(const FillArgs& args, cudaStream_t stream);

// dst[i] = RandomSigned(seed, i, scale) (random_values.h) as dtype (kF32, kBF16 or kF16).
struct RandomFillArgs {
  void* dst = nullptr;
  DType dtype = DType::kF32;
  int64_t count = 0;
  uint64_t seed = 0;
  float scale = 1.0f;
};
cudaError_t LaunchRandomFill(const RandomFillArgs& args, cudaStream_t stream);

// dst[r, c] = bf16(float(codes[r, c]) · scale[r]) for r < rows, c < cols: rows of an FP8 (e4m3)
// matrix as the bf16 matrix Backend::MatMul defines its product by.
struct DequantizeF8Args {
  const uint8_t* codes = nullptr;  // [rows, cols] e4m3
  const float* scale = nullptr;    // [rows]
  void* dst = nullptr;             // [rows, cols] bf16
  int64_t rows = 0;
  int64_t cols = 0;
};
cudaError_t LaunchDequantizeF8Rows(const DequantizeF8Args& args, cudaStream_t stream);

// Per-row ("per-token") FP8 quantization of activations for the FP8 tensor-core GEMM:
// scale[r] = max_c |x[r, c]| / 448, or 1 where that is 0 (an all-zero row, or one whose maximum is
// below ~2e-43), codes[r, c] = e4m3(x[r, c] / scale[r]) (nearest even, saturating:
// FloatToF8E4M3's rule), so x[r, c] ≈ codes[r, c]·scale[r] within 2^-4 of |x| (e4m3's half ulp;
// 2^-10·scale[r] absolute for the subnormal codes). A NaN element becomes a NaN code and a row
// holding ±inf gets scale NaN: the row's outputs are NaN (f32 would give ±inf or NaN).
struct QuantizeRowsF8Args {
  const float* x = nullptr;  // [rows, cols]
  uint8_t* codes = nullptr;  // [rows, cols] e4m3
  float* scale = nullptr;    // [rows]
  int64_t rows = 0;
  int64_t cols = 0;
};
cudaError_t LaunchQuantizeRowsF8(const QuantizeRowsF8Args& args, cudaStream_t stream);

// y[r, c] += bias[c].
struct AddBiasArgs {
  float* y = nullptr;           // [rows, cols]
  const float* bias = nullptr;  // [cols]
  int64_t rows = 0;
  int64_t cols = 0;
};
cudaError_t LaunchAddBias(const AddBiasArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
