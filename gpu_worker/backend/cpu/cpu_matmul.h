// MatMul of the cpu backend (private to backend/cpu): y = x · wᵀ (+ bias) (+ y) with oneDNN
// matmul primitives cached by shape.
//
// Numerics (backend.h): bf16 weights: x is rounded to bf16 and oneDNN multiplies bf16 · bf16
// into f32 sums (AMX / AVX512_BF16 where present); where oneDNN has no bf16 matmul (CPUs without
// AVX-512, or TANDEM_CPU_ISA below avx512) the same products run on widened weight panels
// (cpu_bf16_panel_gemm.h); f32 weights: f32 · f32; f16 weights: oneDNN
// 2.6 has no f16 matmul on CPUs, so x is rounded to f16 and both operands run as f32 (products of
// two f16 values are exact in f32, so only the summation order differs from an f16 GEMM).
//
// The weights stay in place: w [n, k] row-major is given to oneDNN as the [k, n] matrix with
// strides {1, k} (its transposed view), so no call repacks them in tandem code.
//
// Not thread-safe: one owner (the backend) calls it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <dnnl.hpp>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cpu_bf16_panel_gemm.h"
#include "cpu_scratch.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cpu {

class CpuMatmul {
 public:
  // oneDNN primitives are compiled per m. Continuous batching changes m every step (decode
  // rows + prefill tokens), so m is split into a multiple of kRowGranule and a remainder below
  // it: at most (max m / kRowGranule) + kRowGranule - 1 distinct m per weight shape, each
  // compiled once. Rows are independent, so the split gives the same result.
  static constexpr int64_t kRowGranule = 64;
  // Primitives kept; the least recently used one is dropped beyond this.
  static constexpr size_t kCapacity = 1024;

  // INTERNAL when oneDNN cannot create its CPU engine.
  static absl::StatusOr<std::unique_ptr<CpuMatmul>> Create(int threads);

  // Runs p (already validated by ValidateMatMul) and waits for it.
  absl::Status Run(const MatMulParams& p);

  // A start-up check: small bf16, f16 and f32 products (with bias and accumulate) against a
  // double-precision reference. FAILED_PRECONDITION saying which failed on this CPU and what to
  // do, so a worker that cannot compute refuses to start instead of failing every request.
  absl::Status SelfCheck();

  size_t cached() const { return lru_.size(); }

  // Whether bf16 weights run on oneDNN's bf16 matmul (else on Bf16PanelGemm): AVX-512 active
  // and oneDNN creates one. Start-up logs say which.
  static bool Bf16OnOneDnn();
  // "oneDNN bf16" or "f32 panels (...)": the bf16 path, for the backend's description.
  static std::string Bf16PathName();

 private:
  // One primitive call over all p.m rows.
  absl::Status RunRows(const MatMulParams& p);
  // bf16 weights where oneDNN has no bf16 matmul: all rows through bf16_panels_.
  absl::Status RunBf16Panels(const MatMulParams& p);
  struct Key {
    int64_t m = 0, n = 0, k = 0;
    bool bf16 = false;  // bf16 src and weights; else f32
    bool bias = false;
    bool accumulate = false;
    int threads = 1;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& key) const;
  };
  struct Entry {
    Key key;
    dnnl::matmul prim;
    dnnl::memory src, wei, bias, dst, scratch;
    size_t scratch_bytes = 0;
  };
  using Lru = std::list<Entry>;

  CpuMatmul(dnnl::engine engine, dnnl::stream stream, int threads);
  absl::Status Lookup(const Key& key, Entry** entry);

  dnnl::engine engine_;
  dnnl::stream stream_;
  int threads_;
  Lru lru_;  // most recently used first
  std::unordered_map<Key, Lru::iterator, KeyHash> index_;
  ScratchBuffer src_;      // x converted: bf16 [m, k], or f16-rounded f32 [m, k]
  ScratchBuffer weights_;  // f16 weights as f32 [n, k]
  ScratchBuffer scratchpad_;
  Bf16PanelGemm bf16_panels_;
};

// INVALID_ARGUMENT when p breaks the MatMulParams contract (null pointers, non-positive sizes,
// an unsupported weight dtype, y overlapping x).
absl::Status ValidateMatMul(const MatMulParams& p);

}  // namespace tandem::gpu_worker::cpu
