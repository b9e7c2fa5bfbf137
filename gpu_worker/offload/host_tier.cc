#include "tandem/gpu_worker/host_tier.h"

#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/host_page_streams.h"

namespace tandem::gpu_worker {

absl::StatusOr<std::unique_ptr<OffloadTier>> HostTier::Fork(const TierFork&) const {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<OffloadedKv> copy, kv_->Clone());
  return std::make_unique<HostTier>(std::move(copy));
}

absl::Status HostTier::BeginPass(TierContext& context, size_t stream) {
  if (kv_->num_pages(0) == 0) return absl::OkStatus();
  return HostPageStreams::AddPages(context, stream, *kv_);
}

absl::StatusOr<bool> HostTier::FinishAttend(TierContext& context, const AttendRows& rows) {
  KvStreamer* streamer = HostPageStreams::StreamerOf(context);
  if (streamer == nullptr) return absl::FailedPreconditionError("host tier without a streamer");
  TANDEM_RETURN_IF_ERROR(streamer->AttendLayer(rows.layer, rows.stream, rows.window));
  return false;
}

absl::Status HostTier::Append(TierContext& context, WindowCache& window,
                              const std::vector<EvictedBlock>& blocks) {
  return context.ReadEvicted(window, blocks,
                             [this](int64_t layer, const void* k, const void* v, const float*,
                                    int64_t tokens, int64_t) {
                               return kv_->Append(layer, k, v, tokens);
                             });
}

}  // namespace tandem::gpu_worker
