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
// How a GEMV launch spreads a column's reduction: warps_per_column warps split its k (their
// sums added in shared memory, fixed order), each lane keeping `unroll` 16-byte weight loads in
// flight. More loads in flight per column help long k (fewer serial chunks per warp).
struct GemvVariant {
  int warps_per_column = 1;  // 1, 2, 4 or 8 (8: one column per block)
  int unroll = 4;            // 4 or 8
};
// Every variant LaunchGemv instantiates (tandem-kernel-bench's sweep times each).
inline constexpr GemvVariant kGemvVariants[] = {{1, 4}, {1, 8}, {2, 4}, {2, 8},
                                                {4, 4}, {4, 8}, {8, 4}};
// The variant for k <= kGemvLongK: {1, 4} is the kernel measured on an H100 below (issue 15).
// Set from the tandem-kernel-bench gemv sweep (scripts/gpu_host_decode.sh) at the best variant
// of the 6144x4096, 4096x4096, 28672x4096 and 128256x4096 shapes.
inline constexpr GemvVariant kGemvVariant = {1, 4};
// The variant for k > kGemvLongK (the down projection, k = 14336): not measured yet (issue 15
// item 3); set from the sweep's 4096x14336 rows.
inline constexpr int64_t kGemvLongK = 8192;
inline constexpr GemvVariant kGemvLongKVariant = {2, 8};
// Reduction length up to which Backend::MatMul takes the GEMV (GemvPreferred). NOTE: on an H100
// (ncu, Llama-3-8B decode) the {1, 4} GEMV beat conversion + cuBLAS for k = 4096 (qkv 22.2 vs
// 24.1 µs, o_proj 18.0 vs 22.1, gate_up 83.8 vs 88.5, lm_head 340 vs 371) but not for the down
// projection, k = 14336 (54.0 vs 50.5 µs): its 4096 warps of 56 serial chunks keep too few loads
// in flight. Raise to 16384 when the sweep shows kGemvLongKVariant beating cuBLAS at 4096x14336.
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
// k a multiple of 8, x and w 16-byte aligned (any k: the kernel has no length bound).
bool GemvSupports(const GemvArgs& a);
// True when Backend::MatMul should take the GEMV: GemvSupports and k <= kGemvMaxK.
bool GemvPreferred(const GemvArgs& a);
// True for a variant of kGemvVariants.
bool GemvVariantValid(GemvVariant v);
// The variant LaunchGemv(a, stream) uses for reduction length k.
GemvVariant GemvDefaultVariant(int64_t k);

// cudaErrorInvalidValue when !GemvSupports(a) or !GemvVariantValid(v).
cudaError_t LaunchGemv(const GemvArgs& a, GemvVariant v, cudaStream_t stream);
// With GemvDefaultVariant(a.k).
cudaError_t LaunchGemv(const GemvArgs& a, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
