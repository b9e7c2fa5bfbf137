#include "tandem/gpu_worker/kv_streamer.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

namespace {

// One staging slot: K and V of one page of every kv head.
size_t StagingPageBytes(const WindowGeometry& geometry, int64_t page_tokens) {
  return 2 * geometry.num_kv_heads * page_tokens * geometry.head_dim * DTypeBytes(geometry.dtype);
}

}  // namespace

size_t KvStreamer::DeviceBytesFor(const WindowGeometry& geometry, int64_t page_tokens,
                                  int64_t num_q_heads, int64_t max_rows, int slots) {
  // Create's buffers: the slots and the staged attention's.
  return slots * StagingPageBytes(geometry, page_tokens) +
         StagedAttention::DeviceBytesFor(page_tokens, num_q_heads, geometry.head_dim, max_rows);
}

absl::StatusOr<std::unique_ptr<KvStreamer>> KvStreamer::Create(Backend& backend,
                                                               const WindowGeometry& geometry,
                                                               int64_t page_tokens,
                                                               int64_t num_q_heads,
                                                               int64_t max_rows, int slots) {
  if (slots < 2 || slots > Backend::kUploadSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv streamer: ", slots, " slots; must be 2..", Backend::kUploadSlots));
  }
  if (page_tokens < 1 || num_q_heads < 1 || max_rows < 1 || geometry.num_kv_heads < 1 ||
      geometry.head_dim < 1) {
    return absl::InvalidArgumentError("kv streamer: bad sizes");
  }
  auto streamer = std::unique_ptr<KvStreamer>(
      new KvStreamer(backend, geometry, page_tokens, slots));
  const size_t page_bytes = StagingPageBytes(geometry, page_tokens);
  for (int s = 0; s < slots; ++s) {
    TANDEM_ASSIGN_OR_RETURN(DeviceBuffer buffer, backend.Allocate(page_bytes));
    streamer->staging_.push_back(std::move(buffer));
  }
  TANDEM_ASSIGN_OR_RETURN(
      streamer->attend_,
      StagedAttention::Create(backend, page_tokens, num_q_heads, geometry.head_dim, max_rows));
  return streamer;
}

absl::Status KvStreamer::Begin(const std::vector<const OffloadedKv*>& kvs) {
  if (next_ < items_.size()) {
    return absl::FailedPreconditionError("kv streamer: the previous pass left pages unread");
  }
  kvs_ = kvs;
  items_.clear();
  next_ = 0;
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    for (size_t s = 0; s < kvs.size(); ++s) {
      if (kvs[s] == nullptr) continue;
      for (int64_t p = 0; p < kvs[s]->num_pages(l); ++p) items_.push_back({l, s, p});
    }
  }
  for (size_t i = 0; i < items_.size() && i < static_cast<size_t>(slots_); ++i) {
    TANDEM_RETURN_IF_ERROR(Issue(i));
  }
  return absl::OkStatus();
}

absl::Status KvStreamer::Issue(size_t index) {
  const Item& item = items_[index];
  const OffloadedKv::Page page = kvs_[item.seq]->page(item.layer, item.page);
  const size_t row = geometry_.head_dim * DTypeBytes(geometry_.dtype);
  const size_t pitch = page_tokens_ * row;
  const size_t half = geometry_.num_kv_heads * pitch;
  const int slot = static_cast<int>(index % slots_);
  char* dst = static_cast<char*>(staging_[slot].data());
  // Only the filled part of each head's rows crosses PCIe.
  for (int part = 0; part < 2; ++part) {
    UploadParams u;
    u.dst = dst + part * half;
    u.dst_pitch = pitch;
    u.src_host = part == 0 ? page.k : page.v;
    u.src_pitch = pitch;
    u.row_bytes = page.tokens * row;
    u.rows = geometry_.num_kv_heads;
    TANDEM_RETURN_IF_ERROR(backend_.UploadAsync(u, slot));
    uploaded_bytes_ += u.row_bytes * u.rows;
  }
  return absl::OkStatus();
}

absl::Status KvStreamer::AttendLayer(int64_t layer, size_t seq, const WindowAttentionParams& base) {
  const size_t row = geometry_.head_dim * DTypeBytes(geometry_.dtype);
  const size_t half = geometry_.num_kv_heads * page_tokens_ * row;
  while (next_ < items_.size() && items_[next_].layer == layer && items_[next_].seq == seq) {
    const Item& item = items_[next_];
    const int slot = static_cast<int>(next_ % slots_);
    TANDEM_RETURN_IF_ERROR(backend_.WaitUpload(slot));
    const char* staged = static_cast<const char*>(staging_[slot].data());
    TANDEM_RETURN_IF_ERROR(attend_->Attend(base, staged, staged + half, geometry_.dtype,
                                           kvs_[item.seq]->page(item.layer, item.page).tokens));
    // The merge reads only the partial state: the slot takes its next page meanwhile.
    TANDEM_RETURN_IF_ERROR(backend_.ReleaseUpload(slot));
    TANDEM_RETURN_IF_ERROR(attend_->Merge(base));
    const size_t refill = next_ + slots_;
    ++next_;
    if (refill < items_.size()) TANDEM_RETURN_IF_ERROR(Issue(refill));
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
