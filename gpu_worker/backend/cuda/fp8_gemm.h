// The FP8 tensor-core GEMM of prefill and batch rows (cuBLASLt, Hopper):
//   y[r, j] = x_scale[r]·w_scale[j]·Σ_i x_codes[r, i]·w_codes[j, i] (+ y[r, j] when accumulate)
// with e4m3 operands, one f32 scale per row of each ("outer vector" scaling: per-token activation
// scales × per-channel weight scales, as FP8 checkpoints are served) applied by cuBLASLt, and f32
// accumulation and output. cuBLASLt's FP8 kernels take the TN layout only, which is MatMul's
// (both operands row-major with k innermost).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::gpu_worker::cuda_backend {

struct Fp8GemmArgs {
  const void* x_codes = nullptr;   // [m, k] e4m3, 16-byte aligned
  const float* x_scale = nullptr;  // [m]
  const void* w_codes = nullptr;   // [n, k] e4m3, 16-byte aligned
  const float* w_scale = nullptr;  // [n]
  float* y = nullptr;              // [m, n], 16-byte aligned
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool accumulate = false;
};

// cuBLASLt workspace the GEMM is given (Hopper's kernels use up to 32 MiB; 4 MiB covers the
// split-free tiles of these shapes).
inline constexpr size_t kFp8GemmWorkspaceBytes = size_t{4} << 20;

class Fp8Gemm {
 public:
  // UNIMPLEMENTED on a device below compute capability 9.0 (no FP8 outer-vector scaling there).
  static absl::StatusOr<Fp8Gemm> Create(int device);
  Fp8Gemm(Fp8Gemm&&) noexcept;
  Fp8Gemm& operator=(Fp8Gemm&&) noexcept;
  ~Fp8Gemm();

  // Shapes the GEMM takes: k a multiple of 16 (16-byte rows of codes), n a multiple of 4 (16-byte
  // rows of y), each dimension below 2^31.
  static bool Supports(int64_t m, int64_t n, int64_t k);

  // Chooses (once per shape and pointer alignment) the kernel Run will use for `a`, launching
  // nothing: UNIMPLEMENTED when cuBLASLt has none for it on this device (remembered: asked
  // again, it answers at once), INVALID_ARGUMENT for a shape Supports refuses or a null pointer.
  // A caller that splits a product into several calls prepares them all before running any, so
  // it can still take another path for the whole product.
  absl::Status Prepare(const Fp8GemmArgs& a);
  // Prepare, then the product on `stream`. `workspace` holds at least kFp8GemmWorkspaceBytes.
  absl::Status Run(const Fp8GemmArgs& a, void* workspace, cudaStream_t stream);

 private:
  // A matmul description, its three layouts and the algorithm cuBLASLt chose, per (m, n, k,
  // accumulate, the alignments of w, x and y): built once per shape (prefill chunks repeat
  // theirs); null when cuBLASLt has no kernel for it.
  struct Plan;
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, uint32_t, uint32_t, uint32_t>;
  struct HandleDeleter {
    void operator()(cublasLtContext* handle) const;
  };

  Fp8Gemm() = default;
  absl::StatusOr<Plan*> PlanFor(const Fp8GemmArgs& a);

  std::unique_ptr<cublasLtContext, HandleDeleter> handle_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace tandem::gpu_worker::cuda_backend
