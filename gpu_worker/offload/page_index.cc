#include "tandem/gpu_worker/page_index.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

absl::StatusOr<PageIndex> PageIndex::Create(Backend& backend, const WindowGeometry& geometry,
                                            int64_t page_tokens, int64_t reserve_tokens,
                                            const LowRankOptions& low_rank) {
  if (geometry.num_layers <= 0 || geometry.num_kv_heads <= 0 || geometry.head_dim <= 0) {
    return absl::InvalidArgumentError("page index: layers, kv heads and head_dim must be > 0");
  }
  if (geometry.dtype != DType::kF32 && geometry.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("page index: the KV dtype must be f32 or bf16");
  }
  if (page_tokens < 1 || page_tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_tokens must be in 1..4096, got ", page_tokens));
  }
  if (reserve_tokens < 0) return absl::InvalidArgumentError("page index: negative reserve");
  PageIndex index;
  index.backend_ = &backend;
  index.geometry_ = geometry;
  index.page_tokens_ = page_tokens;
  index.layers_.resize(geometry.num_layers);
  index.pages_.assign(geometry.num_layers, 0);
  if (low_rank.enabled()) {
    TANDEM_ASSIGN_OR_RETURN(index.low_rank_, LowRankIndex::Create(backend, geometry, low_rank, 0));
  }
  TANDEM_RETURN_IF_ERROR(index.Reserve((reserve_tokens + page_tokens - 1) / page_tokens));
  return index;
}

size_t PageIndex::BytesFor(const WindowGeometry& g, int64_t page_tokens, int64_t tokens,
                           const LowRankOptions& low_rank) {
  const int64_t pages = (tokens + page_tokens - 1) / page_tokens;
  return static_cast<size_t>(g.num_layers) * g.num_kv_heads * pages * kPageSummaryRows *
             g.head_dim * DTypeBytes(g.dtype) +
         LowRankIndex::BytesFor(g, low_rank, pages * page_tokens);
}

size_t PageIndex::PageBytes() const {
  return kPageSummaryRows * geometry_.head_dim * DTypeBytes(geometry_.dtype);
}

size_t PageIndex::device_bytes() const { return parked() ? 0 : resident_bytes(); }

size_t PageIndex::resident_bytes() const {
  return static_cast<size_t>(geometry_.num_layers) * geometry_.num_kv_heads * capacity_pages_ *
             PageBytes() +
         (low_rank_ ? low_rank_->resident_bytes() : 0);
}

absl::Status PageIndex::Reserve(int64_t pages) {
  if (parked()) return absl::FailedPreconditionError("page index: parked (Unpark first)");
  if (low_rank_) TANDEM_RETURN_IF_ERROR(low_rank_->Reserve(pages * page_tokens_));
  if (pages <= capacity_pages_) return absl::OkStatus();
  // Geometric growth keeps Append amortised O(1) in copies; an explicit reserve is exact.
  const int64_t grown = std::max(pages, capacity_pages_ + capacity_pages_ / 2);
  const size_t head_bytes = static_cast<size_t>(grown) * PageBytes();
  const size_t layer_bytes = head_bytes * geometry_.num_kv_heads;
  std::vector<DeviceBuffer> fresh(geometry_.num_layers);
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(layer_bytes);
    if (!buffer.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "page summaries of ", grown * page_tokens_, " offloaded tokens need ",
          FormatBytes(layer_bytes * geometry_.num_layers), " of device memory (",
          page_tokens_, "-token pages): ", buffer.status().message()));
    }
    fresh[l] = std::move(*buffer);
  }
  TANDEM_RETURN_IF_ERROR(CopyPagesInto(fresh, grown));
  layers_ = std::move(fresh);
  capacity_pages_ = grown;
  return absl::OkStatus();
}

absl::Status PageIndex::CopyPagesInto(std::vector<DeviceBuffer>& dst, int64_t dst_capacity) const {
  const size_t src_head_bytes = static_cast<size_t>(capacity_pages_) * PageBytes();
  const size_t dst_head_bytes = static_cast<size_t>(dst_capacity) * PageBytes();
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    const size_t used = static_cast<size_t>(pages_[l]) * PageBytes();
    for (int64_t g = 0; g < geometry_.num_kv_heads && used > 0; ++g) {
      TANDEM_RETURN_IF_ERROR(backend_->CopyOnDevice(dst[l].as<char>() + g * dst_head_bytes,
                                                    layers_[l].as<char>() + g * src_head_bytes,
                                                    used));
    }
  }
  return absl::OkStatus();
}

size_t PageIndex::ParkBytes() const {
  return SummaryParkBytes() + (low_rank_ ? low_rank_->ParkBytes() : 0);
}

size_t PageIndex::SummaryParkBytes() const {
  const int64_t written = *std::max_element(pages_.begin(), pages_.end());
  return static_cast<size_t>(geometry_.num_layers) * geometry_.num_kv_heads * written *
         PageBytes();
}

absl::Status PageIndex::Park(ParkingPool& pool) {
  if (parked()) return absl::FailedPreconditionError("page index: already parked");
  TANDEM_ASSIGN_OR_RETURN(ParkingSpace space, pool.Take(SummaryParkBytes()));
  // Host layout: [layers][heads][written pages], written = the most any layer wrote.
  const size_t used_head = SummaryParkBytes() / (geometry_.num_layers * geometry_.num_kv_heads);
  const size_t device_head = static_cast<size_t>(capacity_pages_) * PageBytes();
  size_t offset = 0;
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(space.CopyRowsFromDevice(offset, layers_[l].data(), device_head,
                                                    used_head, geometry_.num_kv_heads));
    offset += geometry_.num_kv_heads * used_head;
  }
  // The low-rank keys last: when they cannot park, the summaries' space goes back unused and
  // the index stays on the device as it was.
  if (low_rank_) TANDEM_RETURN_IF_ERROR(low_rank_->Park(pool));
  parked_ = std::move(space);
  for (DeviceBuffer& layer : layers_) layer = DeviceBuffer();
  return absl::OkStatus();
}

absl::Status PageIndex::Unpark() {
  if (!parked()) return absl::FailedPreconditionError("page index: not parked");
  const size_t device_head = static_cast<size_t>(capacity_pages_) * PageBytes();
  std::vector<DeviceBuffer> fresh(geometry_.num_layers);
  for (int64_t l = 0; l < geometry_.num_layers && capacity_pages_ > 0; ++l) {
    TANDEM_ASSIGN_OR_RETURN(fresh[l], backend_->Allocate(device_head * geometry_.num_kv_heads));
  }
  const size_t used_head = SummaryParkBytes() / (geometry_.num_layers * geometry_.num_kv_heads);
  size_t offset = 0;
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    TANDEM_RETURN_IF_ERROR(parked_.CopyRowsToDevice(fresh[l].data(), device_head, offset,
                                                    used_head, geometry_.num_kv_heads));
    offset += geometry_.num_kv_heads * used_head;
  }
  if (low_rank_) TANDEM_RETURN_IF_ERROR(low_rank_->Unpark());
  layers_ = std::move(fresh);
  parked_.Release();
  return absl::OkStatus();
}

absl::StatusOr<PageIndex> PageIndex::Fork(int64_t reserve_tokens) const {
  if (parked()) return absl::FailedPreconditionError("page index: parked (Unpark first)");
  int64_t written = 0;
  for (int64_t pages : pages_) written = std::max(written, pages);
  TANDEM_ASSIGN_OR_RETURN(
      PageIndex fork,
      Create(*backend_, geometry_, page_tokens_,
             std::max(reserve_tokens, written * page_tokens_)));
  TANDEM_RETURN_IF_ERROR(CopyPagesInto(fork.layers_, fork.capacity_pages_));
  fork.pages_ = pages_;
  if (low_rank_) {
    TANDEM_ASSIGN_OR_RETURN(fork.low_rank_, low_rank_->Fork(fork.capacity_pages_ * page_tokens_));
  }
  return fork;
}

absl::Status PageIndex::Append(int64_t layer, const void* k_cache, int64_t capacity,
                               int64_t first_slot, int64_t count) {
  if (layer < 0 || layer >= geometry_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("page index: layer ", layer));
  }
  if (count <= 0 || count % page_tokens_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("page index: ", count,
                                                   " entries are not whole pages of ",
                                                   page_tokens_));
  }
  const int64_t pages = count / page_tokens_;
  TANDEM_RETURN_IF_ERROR(Reserve(pages_[layer] + pages));
  SummarizePagesParams p;
  p.k_cache = k_cache;
  p.capacity = capacity;
  p.first_slot = first_slot;
  p.num_pages = pages;
  p.page_tokens = page_tokens_;
  p.summaries = layers_[layer].data();
  p.max_pages = capacity_pages_;
  p.first_page = pages_[layer];
  p.dtype = geometry_.dtype;
  p.num_kv_heads = geometry_.num_kv_heads;
  p.head_dim = geometry_.head_dim;
  TANDEM_RETURN_IF_ERROR(backend_->SummarizePages(p));
  if (low_rank_) {
    TANDEM_RETURN_IF_ERROR(low_rank_->Append(layer, k_cache, capacity, first_slot, count));
  }
  pages_[layer] += pages;
  return absl::OkStatus();
}

absl::Status PageIndex::AppendEvicted(const WindowCache& window,
                                      const std::vector<EvictedBlock>& blocks) {
  // Runs of consecutive slots, not blocks: a 4096-token settle slice of 16-token blocks is one
  // or two runs, so a layer costs one summary kernel and one staging copy or projection per
  // run instead of ~9 device calls per block.
  const std::vector<EvictedBlock> runs = SlotRuns(blocks);
  for (int64_t l = 0; l < geometry_.num_layers; ++l) {
    for (const EvictedBlock& run : runs) {
      TANDEM_RETURN_IF_ERROR(Append(l, window.k(l), window.capacity(), run.first_slot, run.count));
    }
  }
  // The layers whose staging these filled start their bases together, off the step.
  return AdvanceLowRank();
}

absl::StatusOr<SelectPagesParams> PageIndex::SelectParams(int64_t layer, const float* q,
                                                          int64_t q_row_stride,
                                                          int64_t num_tokens,
                                                          int64_t num_q_heads, int64_t select,
                                                          int32_t* pages, void* scratch,
                                                          PageScore score,
                                                          float softmax_scale) const {
  if (layer < 0 || layer >= geometry_.num_layers || pages_[layer] == 0) {
    return absl::FailedPreconditionError(absl::StrCat("page index: layer ", layer,
                                                      " has no page to select from"));
  }
  SelectPagesParams p;
  p.q = q;
  p.q_row_stride = q_row_stride;
  p.summaries = layers_[layer].data();
  p.dtype = geometry_.dtype;
  p.max_pages = capacity_pages_;
  p.num_pages = pages_[layer];
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = geometry_.num_kv_heads;
  p.head_dim = geometry_.head_dim;
  p.select = select;
  p.score = score;
  if (score == PageScore::kLowRank) {
    if (!low_rank_) return absl::FailedPreconditionError("page index: no low-rank keys kept");
    TANDEM_ASSIGN_OR_RETURN(p.low_rank, low_rank_->Keys(layer, page_tokens_, softmax_scale));
  }
  p.pages = pages;
  p.scratch = scratch;
  return p;
}

}  // namespace tandem::gpu_worker
