// Matrix-vector products for decode steps (a few rows of activations against a bf16/f16 weight):
// one warp per output column streams the weight row once in 16-byte loads and multiplies it
// with every activation row, so the weights move at HBM speed with no split-K reduction, no
// separate conversion of x and the bias and residual add in the same launch. At m = 1 cuBLAS
// ran these shapes as a conversion kernel + GEMV + split-K reduction (3 launches, 2.2–2.7 TB/s).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// Activation rows up to which LaunchGemv is used (beyond, the x loads from L1 per weight byte
// grow with m and cuBLAS's tiled GEMM wins).
inline constexpr int64_t kGemvMaxRows = 2;
// Reduction length up to which LaunchGemv is used. NOTE: on an H100 (ncu, Llama-3-8B decode) the
// GEMV beat conversion + cuBLAS for k = 4096 (qkv 22.2 vs 24.1 µs, o_proj 18.0 vs 22.1, gate_up
// 83.8 vs 88.5, lm_head 340 vs 371) but not for the down projection, k = 14336 (54.0 vs 50.5 µs):
// its 4096 warps of 56 serial chunks keep too few loads in flight.
inline constexpr int64_t kGemvMaxK = 8192;

// y[r, j] = Σ_i bf16(x[r, i])·w[j, i] (+ y[r, j] when accumulate) (+ bias[j]), r < m, j < n: the
// numerics of Backend::MatMul (x rounded to the weight dtype, f32 products and sums).
struct GemvArgs {
  const float* x = nullptr;     // [m, k], 16-byte aligned
  const void* w = nullptr;      // [n, k] of w_dtype, 16-byte aligned
  DType w_dtype = DType::kBF16; // kBF16 or kF16
  const float* bias = nullptr;  // optional [n]
  float* y = nullptr;           // [m, n]; must not alias x
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool accumulate = false;
};

// True when LaunchGemv takes these arguments: 1 <= m <= kGemvMaxRows, bf16 or f16 weights,
// k a multiple of 8 and at most kGemvMaxK, x and w 16-byte aligned.
bool GemvSupports(const GemvArgs& a);

// cudaErrorInvalidValue when !GemvSupports(a).
cudaError_t LaunchGemv(const GemvArgs& a, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
