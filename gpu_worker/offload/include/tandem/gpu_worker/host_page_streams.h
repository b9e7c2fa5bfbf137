// HostPageStreams: the page streamer the host tiers of a runner's passes share (offload and
// exact modes: HostTier, ExactTier, PrefillSpillTier). One KvStreamer walks the pinned host
// pages of every such sequence of a pass in the order the pass attends them, so that one
// upload queue keeps PCIe busy across sequences and layers.
//
// It lives in the runner's TierContext as a PassShared (offload_tier.h), made by the first tier
// that streams or by the engine ahead of time (Of). Per pass:
//   TierContext::BeginPass   forgets the last plan (BeginPass)
//   tier BeginPass           AddPages(context, stream, pages) for each sequence with pages
//   TierContext::StartPass   plans the pass over the added pages and queues the first uploads
//   tier FinishAttend        StreamerOf(context)->AttendLayer(layer, stream, rows)
//
// Not thread-safe: the runner's pass drives it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/kv_streamer.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/offloaded_kv.h"

namespace tandem::gpu_worker {

class HostPageStreams : public PassShared {
 public:
  // The context's streams, made now if it has none: staging for pages of `page_tokens` tokens
  // of `geometry` (KvStreamer::DeviceBytesFor of the context's query heads and rows). The engine
  // makes them when it opens a session with a host tier, before that session's prompt widens its
  // window: the widening takes what the device has left without --kv_cache_bytes, and must not
  // take the streamer's memory and fail the first decode step. An error leaves the context
  // without streams.
  static absl::StatusOr<HostPageStreams*> Of(TierContext& context, const WindowGeometry& geometry,
                                             int64_t page_tokens);
  // The context's streams, or null when none were made.
  static HostPageStreams* Find(TierContext& context) {
    return context.FindShared<HostPageStreams>();
  }
  static const HostPageStreams* Find(const TierContext& context) {
    return context.FindShared<HostPageStreams>();
  }

  // Adds the pages of segment `stream` of this pass to the context's streams, made for kv's
  // geometry and page size if there are none yet (kv outlives the pass). INVALID_ARGUMENT when
  // their page size or geometry is not the streamer's, or `stream` is not of the pass.
  static absl::Status AddPages(TierContext& context, size_t stream, const OffloadedKv& kv);
  // The streamer of the context's pass; null when no sequence of the pass added pages.
  static KvStreamer* StreamerOf(TierContext& context) {
    HostPageStreams* streams = Find(context);
    return streams != nullptr && streams->streaming_ ? streams->streamer_.get() : nullptr;
  }

  void BeginPass(size_t segments) override;
  absl::Status StartPass() override;

 private:
  explicit HostPageStreams(std::unique_ptr<KvStreamer> streamer)
      : streamer_(std::move(streamer)) {}

  std::unique_ptr<KvStreamer> streamer_;
  std::vector<const OffloadedKv*> streams_;   // [segments] of the pass; nullptr = none
  bool streaming_ = false;
};

}  // namespace tandem::gpu_worker
