// KvStreamer: the `offload` mode's attention over KV in host memory (HeadInfer's decode with
// ping-pong transfers). For one forward pass it walks the offloaded pages of every layer and
// sequence in the order the pass needs them — (layer, sequence, page) — and keeps up to
// `slots` uploads in flight on the backend's upload stream, so page i+1 (possibly of the next
// layer) crosses PCIe while the device attends over page i and runs the layer's GEMMs.
//
// Per page: the queries attend over the page's entries (all earlier than every query, so all
// visible), and the partial state is merged into the caller's (o, lse) by the exact LSE merge.
//
// Not thread-safe; owned by a ModelRunner.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/offloaded_kv.h"
#include "tandem/gpu_worker/staged_attention.h"

namespace tandem::gpu_worker {

class KvStreamer {
 public:
  // Device staging: `slots` (2..Backend::kUploadSlots) page buffers of `page_tokens` tokens of
  // `geometry`, and partial-state buffers for up to `max_rows` query rows of `num_q_heads`.
  static absl::StatusOr<std::unique_ptr<KvStreamer>> Create(Backend& backend,
                                                            const WindowGeometry& geometry,
                                                            int64_t page_tokens,
                                                            int64_t num_q_heads,
                                                            int64_t max_rows, int slots = 2);

  // Device bytes Create() allocates for these arguments (the memory estimator's; no allocation).
  static size_t DeviceBytesFor(const WindowGeometry& geometry, int64_t page_tokens,
                               int64_t num_q_heads, int64_t max_rows, int slots = 2);

  // Plans one forward pass over `kvs` (one per sequence of the pass, in the order the pass
  // attends them; nullptr for a sequence without offloaded KV) and queues the first uploads.
  absl::Status Begin(const std::vector<const OffloadedKv*>& kvs);

  // Attends `base` (q, q_pos, num_tokens and head counts set; the cache fields are filled
  // here) over every offloaded page of (layer, sequence index `seq`), merging into base.o and
  // base.lse, which must already hold the window's partial state. Must be called for the
  // (layer, sequence) pairs in the order Begin planned.
  absl::Status AttendLayer(int64_t layer, size_t seq, const WindowAttentionParams& base);

  // Drops what is left of the plan (a pass that failed midway). Uploads already queued still
  // run, in order, before those of the next Begin.
  void Abandon() { next_ = items_.size(); }

  int64_t page_tokens() const { return page_tokens_; }
  const WindowGeometry& geometry() const { return geometry_; }

  // Bytes uploaded since Create.
  uint64_t uploaded_bytes() const { return uploaded_bytes_; }

 private:
  struct Item {
    int64_t layer;
    size_t seq;
    int64_t page;
  };
  KvStreamer(Backend& backend, const WindowGeometry& geometry, int64_t page_tokens, int slots)
      : backend_(backend), geometry_(geometry), page_tokens_(page_tokens), slots_(slots) {}
  absl::Status Issue(size_t index);   // queues the upload of items_[index] into its slot

  Backend& backend_;
  WindowGeometry geometry_;
  int64_t page_tokens_;
  int slots_;
  std::vector<DeviceBuffer> staging_;   // [slots] K then V of one page
  std::optional<StagedAttention> attend_;   // over one staged page (set by Create)
  std::vector<const OffloadedKv*> kvs_;
  std::vector<Item> items_;
  size_t next_ = 0;                     // the next item to attend
  uint64_t uploaded_bytes_ = 0;
};

}  // namespace tandem::gpu_worker
