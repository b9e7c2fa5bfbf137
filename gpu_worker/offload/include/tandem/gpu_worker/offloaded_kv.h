// OffloadedKv: the `offload` mode's KV beyond the device window, in page-locked host memory
// (HeadInfer / FlexGen: exact attention, all offloaded KV crosses PCIe at every step).
//
// Per layer the entries are kept in pages of `page_tokens` tokens; one page holds
//   K [num_kv_heads, page_tokens, head_dim] then V [num_kv_heads, page_tokens, head_dim]
// in the window's dtype, so one page of one layer uploads as one copy (a strided copy of
// num_kv_heads rows while the page is partly filled). Pages come from Backend::AllocateHost as
// they are needed; a page is never moved, so uploads queued earlier stay valid.
//
// Not thread-safe; used by the engine's executor thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

class OffloadedKv {
 public:
  // INVALID_ARGUMENT for a bad geometry or page size (1..1M tokens).
  static absl::StatusOr<std::unique_ptr<OffloadedKv>> Create(Backend& backend,
                                                             const WindowGeometry& geometry,
                                                             int64_t page_tokens);

  // Host bytes the pages of `tokens` entries per (layer, kv head) take (whole pages, every
  // layer): what Append allocates for them (the memory estimator's; no allocation).
  static size_t HostBytesFor(const WindowGeometry& geometry, int64_t page_tokens, int64_t tokens);

  // A copy in pages of its own (a forked sequence's): RESOURCE_EXHAUSTED as Append when the
  // host memory does not suffice.
  absl::StatusOr<std::unique_ptr<OffloadedKv>> Clone() const;

  // Appends `n` entries of every kv head of `layer`, head-major: k, v [num_kv_heads, n, head_dim]
  // of the window dtype, in host memory (Append) or backend memory (AppendFromDevice).
  absl::Status Append(int64_t layer, const void* k_host, const void* v_host, int64_t n);
  absl::Status AppendFromDevice(int64_t layer, const void* k, const void* v, int64_t n);

  // One page of a layer: host pointers to its K and V blocks and the tokens filled.
  struct Page {
    const void* k = nullptr;   // [num_kv_heads, page_tokens, head_dim]
    const void* v = nullptr;
    int64_t tokens = 0;
  };
  int64_t num_pages(int64_t layer) const { return static_cast<int64_t>(layers_[layer].size()); }
  Page page(int64_t layer, int64_t index) const;

  int64_t tokens(int64_t layer) const { return tokens_[layer]; }   // entries per kv head
  int64_t page_tokens() const { return page_tokens_; }
  const WindowGeometry& geometry() const { return geometry_; }
  size_t host_bytes() const { return host_bytes_; }
  size_t page_bytes() const { return 2 * half_page_bytes_; }

 private:
  OffloadedKv(Backend& backend, const WindowGeometry& geometry, int64_t page_tokens);
  // K (or V) of one page: num_kv_heads · page_tokens · head_dim · dtype bytes.
  static size_t HalfPageBytes(const WindowGeometry& geometry, int64_t page_tokens);
  absl::Status AppendImpl(int64_t layer, const void* k, const void* v, int64_t n,
                          bool from_device);

  Backend& backend_;
  WindowGeometry geometry_;
  int64_t page_tokens_;
  size_t row_bytes_;         // head_dim · dtype bytes
  size_t half_page_bytes_;   // K (or V) of one page: num_kv_heads · page_tokens · row_bytes_
  std::vector<std::vector<DeviceBuffer>> layers_;   // [layer][page] host pages
  std::vector<int64_t> tokens_;                     // [layer]
  size_t host_bytes_ = 0;
};

}  // namespace tandem::gpu_worker
