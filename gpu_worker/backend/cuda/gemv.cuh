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
// The variants Backend::MatMul uses, from tandem-kernel-bench's gemv sweep on an H200
// (scripts/gpu_host_decode.sh, commit 97f2a43; µs at m = 1, best of the 7 variants, cuBLAS):
//   n ≤ kGemvNarrowN: {8, 4}  6144x4096 18.3 (cuBLAS 20.1), 4096x4096 14.0 (16.9),
//                              4096x14336 33.3 (35.7): few columns, so 8 warps split each k;
//   wider:            {4, 4}  28672x4096 59.2 (61.1), 128256x4096 235.4 (250.1).
// ({1, 4}, the kernel of the H100 ncu timing below, was 0.5-4 µs slower on each of them.)
inline constexpr int64_t kGemvNarrowN = 8192;
inline constexpr GemvVariant kGemvNarrowVariant = {8, 4};
inline constexpr GemvVariant kGemvWideVariant = {4, 4};
// Rows up to which Backend::MatMul takes the GEMV (GemvPreferred). At m = 2 the same sweep had
// cuBLAS as fast or faster on every shape (4096x4096 17.0 vs 17.2 µs, 6144x4096 21.0 vs 22.8,
// 28672x4096 61.3 vs 77.7, 4096x14336 36.1 vs 43.1): each weight byte then needs two rows of x
// from L1, and cuBLAS's tiles reuse them.
inline constexpr int64_t kGemvPreferredMaxRows = 1;
// Reduction length up to which Backend::MatMul takes the GEMV. NOTE: on an H100 (ncu, Llama-3-8B
// decode) the {1, 4} GEMV beat conversion + cuBLAS for k = 4096 (qkv 22.2 vs 24.1 µs, o_proj
// 18.0 vs 22.1, gate_up 83.8 vs 88.5, lm_head 340 vs 371) but not for the down projection,
// k = 14336 (54.0 vs 50.5 µs: 4096 warps of 56 serial chunks kept too few loads in flight);
// {8, 4} splits those chunks over 8 warps and beat cuBLAS there in the sweep above.
inline constexpr int64_t kGemvMaxK = 16384;

// y[r, j] = Σ_i bf16(x[r, i])·w[j, i] (+ y[r, j] when accumulate) (+ bias[j]), r < m, j < n: the
// numerics of Backend::MatMul (x rounded to the weight dtype, f32 products and sums). FP8
// weights have their own kernel (gemv_fp8.cuh).
struct GemvArgs {
  const float* x = nullptr;     // [m, k], 16-byte aligned
  const void* w = nullptr;      // [n, k] of w_dtype, 16-byte aligned
  DType w_dtype = DType::kBF16;  // kBF16 or kF16
  const float* bias = nullptr;  // optional [n]
  float* y = nullptr;           // [m, n]; must not alias x
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool accumulate = false;
};

// True when LaunchGemv takes these arguments: 1 <= m <= kGemvMaxRows, bf16 or f16 weights with
// k a multiple of 8, x and w 16-byte aligned (any k: the kernel has no length bound).
bool GemvSupports(const GemvArgs& a);
// True when Backend::MatMul should take the GEMV: GemvSupports, m <= kGemvPreferredMaxRows and
// k <= kGemvMaxK.
bool GemvPreferred(const GemvArgs& a);
// True for a variant of kGemvVariants.
bool GemvVariantValid(GemvVariant v);
// The variant LaunchGemv(a, stream) uses for n output columns.
GemvVariant GemvDefaultVariant(int64_t n);

// cudaErrorInvalidValue when !GemvSupports(a) or !GemvVariantValid(v).
cudaError_t LaunchGemv(const GemvArgs& a, GemvVariant v, cudaStream_t stream);
// With GemvDefaultVariant(a.n).
cudaError_t LaunchGemv(const GemvArgs& a, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
