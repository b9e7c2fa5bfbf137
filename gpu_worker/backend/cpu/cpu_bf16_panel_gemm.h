// bf16 weights on CPUs where oneDNN has no bf16 matmul (private to backend/cpu). oneDNN 2.6
// creates bf16 matmuls only with AVX-512; on AVX2-only hosts (AMD EPYC Rome/Milan, Intel client
// parts) and under TANDEM_CPU_ISA below avx512, CpuMatmul runs its bf16 weights here instead.
//
// y [m, n] = x [m, k] · w [n, k]ᵀ (+ bias [n]) (+ y). Decode-sized products (m <= 4) on AVX2
// CPUs widen each weight row in registers and dot it with every x row (a GEMV: the bf16 weights
// are read once). Larger ones go by panels of weight rows: each task widens
// one panel of w (kPanelBytes of f32, L2-resident) and multiplies it with oneDNN's f32 sgemm
// (AVX2/FMA kernels on such a host). x must already hold bf16-rounded values (CpuMatmul rounds
// it as for the oneDNN bf16 path), so every product is of two bf16 values, exact in f32, and the
// result equals a bf16 GEMM with f32 sums up to summation order.
//
// Memory: no widened copy of the weights is kept (the model's resident size is unchanged); the
// scratch is one panel per thread (threads x kPanelBytes).
//
// Not thread-safe: one owner (CpuMatmul).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "cpu_scratch.h"

namespace tandem::gpu_worker::cpu {

class Bf16PanelGemm {
 public:
  // f32 bytes of one widened panel: 512 KiB fits a core's L2 on the hosts measured.
  static constexpr int64_t kPanelBytes = int64_t{512} << 10;

  explicit Bf16PanelGemm(int threads) : threads_(threads < 1 ? 1 : threads) {}

  // x: [m, k] f32 holding bf16 values; w: [n, k] bf16 bits, row-major; bias: [n] or null.
  // accumulate: y += the product (+ bias); else y = it. `threads`: at most this many (1 for a
  // small product). RESOURCE_EXHAUSTED when the scratch cannot be allocated; INTERNAL naming the
  // shapes when oneDNN's sgemm fails.
  absl::Status Run(const float* x, const uint16_t* w, const float* bias, float* y, int64_t m,
                   int64_t n, int64_t k, bool accumulate, int threads);

 private:
  int threads_;
  ScratchBuffer panels_;  // [threads, panel rows, k] f32
};

}  // namespace tandem::gpu_worker::cpu
