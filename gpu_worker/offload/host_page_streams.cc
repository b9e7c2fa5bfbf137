#include "tandem/gpu_worker/host_page_streams.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

absl::StatusOr<HostPageStreams*> HostPageStreams::Of(TierContext& context,
                                                     const WindowGeometry& geometry,
                                                     int64_t page_tokens) {
  if (HostPageStreams* made = Find(context)) return made;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<KvStreamer> streamer,
                          KvStreamer::Create(context.backend(), geometry, page_tokens,
                                             context.num_q_heads(), context.max_rows()));
  return context.AddShared(
      std::unique_ptr<HostPageStreams>(new HostPageStreams(std::move(streamer))));
}

void HostPageStreams::BeginPass(size_t segments) {
  // A pass that failed midway may have left planned pages unread: its uploads still run in
  // order on the upload stream before any new one, so dropping the plan is safe.
  streamer_->Abandon();
  streams_.assign(segments, nullptr);
  streaming_ = false;
}

absl::Status HostPageStreams::AddPages(TierContext& context, size_t stream,
                                       const OffloadedKv& kv) {
  TANDEM_ASSIGN_OR_RETURN(HostPageStreams * self, Of(context, kv.geometry(), kv.page_tokens()));
  std::vector<const OffloadedKv*>& streams = self->streams_;
  const KvStreamer& streamer = *self->streamer_;
  if (stream >= streams.size()) {
    return absl::InvalidArgumentError(absl::StrCat("host pages of segment ", stream,
                                                   " in a pass of ", streams.size()));
  }
  const WindowGeometry& g = kv.geometry();
  const WindowGeometry& made = streamer.geometry();
  if (kv.page_tokens() != streamer.page_tokens() || g.num_kv_heads != made.num_kv_heads ||
      g.head_dim != made.head_dim || g.dtype != made.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host pages of ", kv.page_tokens(), " tokens x ", g.num_kv_heads, " kv heads x ",
        g.head_dim, " ", std::string(DTypeName(g.dtype)), "; the streamer was made for ",
        streamer.page_tokens(), " x ", made.num_kv_heads, " x ", made.head_dim, " ",
        std::string(DTypeName(made.dtype)), " (the host tiers of one runner share a page size)"));
  }
  streams[stream] = &kv;
  return absl::OkStatus();
}

absl::Status HostPageStreams::StartPass() {
  bool any = false;
  for (const OffloadedKv* kv : streams_) any = any || kv != nullptr;
  if (!any) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(streamer_->Begin(streams_));
  streaming_ = true;
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
