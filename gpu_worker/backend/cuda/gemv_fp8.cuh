// Matrix-vector products of decode rows against FP8 (e4m3) weights with per-row scales:
//   y[r, j] = w_scale[j]·Σ_i bf16(x[r, i])·code[j, i] (+ y[r, j] when accumulate) (+ bias[j])
// for r < m <= kGemvFp8MaxRows: the numerics of Backend::MatMul's FP8 decode rows (f32 products
// and sums of exact operands). Each block owns `columns` output columns and splits k over all its
// 256 threads: a thread reads its 16 activations of a k-chunk once (f32, rounded to bf16 in
// registers: no conversion launch) and multiplies them with that chunk of every column (codes to
// f32 through cvt e4m3x2 -> f16x2, exact), its `columns` 16-byte weight loads in flight together.
// The FP8 bytes are all a column costs HBM; gemv.cu's one-warp-per-column form re-read its x from
// L1/L2 for every column (2 bytes of x per weight byte) and reached ~2.3 TB/s on an H200.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::gpu_worker::cuda_backend {

// Rows up to which LaunchGemvFp8 runs (x held in registers: 16 floats per row per thread).
// Longer m goes to the FP8 tensor-core GEMM (fp8_gemm.h).
inline constexpr int64_t kGemvFp8MaxRows = 4;

struct GemvFp8Args {
  const float* x = nullptr;        // [m, k] f32, 16-byte aligned
  const void* w = nullptr;         // [n, k] e4m3 codes, 16-byte aligned
  const float* w_scale = nullptr;  // [n]
  const float* bias = nullptr;     // optional [n]
  float* y = nullptr;              // [m, n]; must not alias x
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool accumulate = false;
};

// Columns a block owns: more columns reuse each thread's x registers more, fewer keep more blocks
// (and their loads) per SM. tandem-kernel-bench's FP8 sweep on an H200 (scripts/gpu_host_fp8.sh;
// µs; the same shape in bf16 on cuBLAS in brackets):
//   m = 1: 8192x28672 c4 67.2 / c8 65.8 (126.4); 57344x8192 c4 119.4 / c8 134.4 (225.1, 3.9 TB/s
//          of codes: 92% of a device copy); 10240x8192 c4 30.2 / c8 31.2; 4096x14336 c4 24.5 /
//          c8 22.0 (36.3);
//   m = 2: c16 best or within 3% on those four;
//   m = 4: c16 beat c4/c8 everywhere, and the FP8 GEMM on n <= 10240 (35.0 vs 56.6 µs at
//          4096x14336) but not on the wide ones (57344x8192: 276 vs 180 µs).
// An earlier form converted codes with integer ops (code·2^-120 placed at f32 bit 20) to spare
// the conversion unit; it was 5-20% slower on every shape.
struct GemvFp8Variant {
  int columns = 8;  // 4, 8 or 16
};
// Every variant LaunchGemvFp8 instantiates (the sweep times each).
inline constexpr GemvFp8Variant kGemvFp8Variants[] = {{4}, {8}, {16}};
// Output columns from which one row takes 4 columns per block, and past which 3-4 rows go to the
// FP8 GEMM (GemvFp8Preferred).
inline constexpr int64_t kGemvFp8WideN = 8192;
inline constexpr int64_t kGemvFp8GemmN = 16384;

// True when LaunchGemvFp8 takes `a`: 1 <= m <= kGemvFp8MaxRows, k a multiple of 16, x and w
// 16-byte aligned, non-null x, w, w_scale, y.
bool GemvFp8Supports(const GemvFp8Args& a);
// The variant LaunchGemvFp8(a, stream) uses for m rows and n columns.
GemvFp8Variant GemvFp8DefaultVariant(int64_t m, int64_t n);
// True when Backend::MatMul should take the GEMV: GemvFp8Supports and (m <= 2 or n <=
// kGemvFp8GemmN).
bool GemvFp8Preferred(const GemvFp8Args& a);

// cudaErrorInvalidValue when !GemvFp8Supports(a) or v is none of kGemvFp8Variants.
cudaError_t LaunchGemvFp8(const GemvFp8Args& a, GemvFp8Variant v, cudaStream_t stream);
cudaError_t LaunchGemvFp8(const GemvFp8Args& a, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
