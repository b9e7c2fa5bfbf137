// oneDNN matmul primitives for the attention kernels (private to cpu_attention): a per-thread
// LRU cache of primitives keyed by shape, data types and strides, one engine and stream per
// thread, and a user-managed per-thread scratchpad (vLLM dnnl_helper.h).
//
// Callers run inside ThreadPool tasks, where OpenMP is limited to one thread, so every primitive
// is created and executed single-threaded.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <dnnl.hpp>
#include <exception>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "aligned_buffer.h"
#include "tandem/common/dnnl_call.h"

namespace tandem::cpu_attention::internal {

enum class MmType : uint8_t { kF32, kBf16 };

// A size given only at Run(): one primitive serves every value (oneDNN runtime dimension).
// NOTE: oneDNN 2.6 serves runtime sizes with its generic gemm kernels (1.5-2x slower than the
// shape-specialised brgemm ones, with a malloc per call); SparseAttention pads its tails to a
// few fixed sizes instead.
inline constexpr int64_t kRuntimeDim = DNNL_RUNTIME_DIM_VAL;

// dst[m, n] = src[m, k] · wei[k, n]. Element (i, j) of X lies at X + i * x_strides[0] +
// j * x_strides[1] (in elements). m, k, n may be kRuntimeDim; strides must be concrete.
struct MatmulDesc {
  int64_t m = 0, k = 0, n = 0;
  MmType src_type = MmType::kF32, wei_type = MmType::kF32, dst_type = MmType::kF32;
  std::array<int64_t, 2> src_strides{}, wei_strides{}, dst_strides{};

  bool operator==(const MatmulDesc&) const = default;
};

struct MatmulDescHash {
  size_t operator()(const MatmulDesc& d) const;
};

// "[m, k] bf16 · [k, n] bf16 -> f32" for error messages (runtime sizes print as "?").
std::string DescribeMatmul(const MatmulDesc& desc);

// The calling thread's primitives. Not thread-safe: use only through ForThisThread().
class ThreadMatmuls {
 public:
  // Primitives kept per thread; the least recently used one is dropped beyond this.
  static constexpr size_t kCapacity = 256;

  // This thread's instance (created on first use).
  static ThreadMatmuls& ForThisThread();

  // dst = src · wei with the sizes m, k, n (must equal desc's where desc's are not runtime).
  // INTERNAL naming the oneDNN call on failure.
  absl::Status Run(const MatmulDesc& desc, int64_t m, int64_t k, int64_t n, const void* src,
                   const void* wei, void* dst);

  size_t cached() const { return lru_.size(); }

 private:
  struct Entry {
    MatmulDesc desc;
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul prim;
    bool runtime = false;
    // Memory objects of fixed-shape entries, re-pointed at every Run (cheaper than creating).
    dnnl::memory src, wei, dst, scratch;
    std::unordered_map<int, dnnl::memory> args;  // the memory objects above, by DNNL_ARG_*
    size_t scratch_bytes = 0;
  };
  using Lru = std::list<Entry>;

  absl::Status Init();
  absl::Status Lookup(const MatmulDesc& desc, Entry** entry);

  std::optional<dnnl::engine> engine_;
  std::optional<dnnl::stream> stream_;
  Lru lru_;  // most recently used first
  std::unordered_map<MatmulDesc, Lru::iterator, MatmulDescHash> index_;
  AlignedBuffer scratch_;
};

}  // namespace tandem::cpu_attention::internal
