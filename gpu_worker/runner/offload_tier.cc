#include "tandem/gpu_worker/offload_tier.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

TierContext::TierContext(Backend& backend, int64_t num_q_heads, int64_t max_rows,
                         bool measure_captured_mass)
    : backend_(backend),
      num_q_heads_(num_q_heads),
      max_rows_(max_rows),
      measure_captured_mass_(measure_captured_mass) {}

TierContext::~TierContext() = default;

void TierContext::BeginPass(size_t segments) {
  pass_segments_ = segments;
  for (const auto& shared : shared_) shared->BeginPass(segments);
}

absl::Status TierContext::StartPass() {
  for (const auto& shared : shared_) TANDEM_RETURN_IF_ERROR(shared->StartPass());
  return absl::OkStatus();
}

absl::StatusOr<void*> TierContext::SelectScratch(size_t bytes) {
  if (select_scratch_.bytes() < bytes) {
    select_scratch_.Reset();
    TANDEM_ASSIGN_OR_RETURN(select_scratch_, backend_.Allocate(bytes));
  }
  return select_scratch_.data();
}

void TierContext::QueueDownload(void* dst_host, size_t dst_pitch, const void* src,
                                size_t src_pitch, size_t row_bytes, size_t rows) {
  if (!downloads_.empty()) {
    HostCopy2D& last = downloads_.back();
    if (last.dst_pitch == dst_pitch && last.src_pitch == src_pitch &&
        last.row_bytes == row_bytes &&
        static_cast<char*>(last.dst_host) + last.rows * dst_pitch == dst_host &&
        static_cast<const char*>(last.src) + last.rows * src_pitch == src) {
      last.rows += rows;
      return;
    }
  }
  downloads_.push_back({dst_host, dst_pitch, src, src_pitch, row_bytes, rows});
}

void TierContext::QueueSelect(const SelectPagesParams& p, int phase) {
  selects_[std::clamp(phase, 0, kSelectPhases - 1)].push_back(p);
}

absl::Status TierContext::FlushSelects() {
  // One scratch region per selection of every phase (a batch may run its selections together),
  // 256-byte aligned.
  auto scratch_bytes = [](const SelectPagesParams& p) {
    return (SelectPagesScratchBytes(p.num_tokens, p.num_kv_heads, p.num_pages) + 255) / 256 * 256;
  };
  size_t total = 0;
  for (const auto& phase : selects_) {
    for (const SelectPagesParams& p : phase) total += scratch_bytes(p);
  }
  if (total == 0) return absl::OkStatus();
  if (batch_select_scratch_.bytes() < total) {
    batch_select_scratch_.Reset();   // (freeing waits for the selections that used it)
    TANDEM_ASSIGN_OR_RETURN(batch_select_scratch_, backend_.Allocate(total));
  }
  char* next = static_cast<char*>(batch_select_scratch_.data());
  absl::Status status;
  for (auto& phase : selects_) {
    for (SelectPagesParams& p : phase) {
      p.scratch = next;
      next += scratch_bytes(p);
    }
    if (status.ok() && !phase.empty()) {
      status = backend_.SelectPagesBatch(phase.data(), phase.size());
    }
    phase.clear();
  }
  return status;
}

absl::Status TierContext::FlushDownloads() {
  TANDEM_RETURN_IF_ERROR(FlushSelects());
  // One wait for the device's queued work, whatever the number of copies.
  const absl::Status status = backend_.CopyToHostBatch(downloads_.data(), downloads_.size());
  downloads_.clear();
  return status;
}

void TierContext::QueueMerge(const HostState& state) {
  if (!merges_.empty()) {
    HostState& last = merges_.back();
    const int64_t d = last.head_dim, r = last.rows;
    if (d == state.head_dim && last.o_host + r * d == state.o_host &&
        last.lse_host + r == state.lse_host && last.part_o + r * d == state.part_o &&
        last.part_lse + r == state.part_lse && last.o + r * d == state.o &&
        last.lse + r == state.lse) {
      last.rows += state.rows;
      return;
    }
  }
  merges_.push_back(state);
}

absl::Status TierContext::FlushMerges() {
  for (const HostState& m : merges_) {
    TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(m.part_o, m.o_host, m.rows * m.head_dim * 4));
    TANDEM_RETURN_IF_ERROR(backend_.CopyToDevice(m.part_lse, m.lse_host, m.rows * 4));
    TANDEM_RETURN_IF_ERROR(
        backend_.MergeStates({m.o, m.lse, m.part_o, m.part_lse, m.rows, m.head_dim}));
  }
  merges_.clear();
  return absl::OkStatus();
}

void TierContext::ClearQueues() {
  for (auto& phase : selects_) phase.clear();
  downloads_.clear();
  merges_.clear();
}

size_t TierContext::EvictStagingBytes(const WindowGeometry& geometry, int64_t block_tokens) {
  const int64_t tokens = std::max(kEvictGroupTokens, block_tokens);
  return 2 * static_cast<size_t>(geometry.num_kv_heads) * tokens * geometry.head_dim *
         DTypeBytes(geometry.dtype);
}

absl::Status TierContext::ReadEvicted(WindowCache& window, const std::vector<EvictedBlock>& blocks,
                                      const EvictedLayerSink& sink, SinkUses uses,
                                      size_t overlap_min_bytes) {
  const WindowGeometry& g = window.geometry();
  int64_t total = 0;
  for (const EvictedBlock& b : blocks) total += b.count;
  const size_t kv_bytes = g.num_kv_heads * total * g.head_dim * DTypeBytes(g.dtype);
  if (evict_k_.bytes() < kv_bytes) {
    evict_k_ = {};   // the old staging goes before the larger one is pinned
    evict_v_ = {};
    const size_t bytes = std::max(kv_bytes, EvictStagingBytes(g, 1) / 2);
    TANDEM_ASSIGN_OR_RETURN(evict_k_, backend_.AllocateHost(bytes));
    TANDEM_ASSIGN_OR_RETURN(evict_v_, backend_.AllocateHost(bytes));
  }
  // Two slots of the staging (layer l in slot l % 2) when the sink runs apart, the group is
  // large enough to pay for a thread and fits half of the staging; one otherwise.
  const bool overlap = uses == SinkUses::kHostOnly && kv_bytes >= overlap_min_bytes &&
                       2 * kv_bytes <= evict_k_.bytes() && g.num_layers > 1;
  const size_t slot_bytes = overlap ? evict_k_.bytes() / 2 / 64 * 64 : 0;
  const size_t maw_slot = g.num_kv_heads * total;
  evict_maw_.resize((overlap ? 2 : 1) * maw_slot);
  auto slot_k = [&](int64_t l) { return static_cast<char*>(evict_k_.data()) + (l % 2) * slot_bytes; };
  auto slot_v = [&](int64_t l) { return static_cast<char*>(evict_v_.data()) + (l % 2) * slot_bytes; };
  auto slot_maw = [&](int64_t l) { return evict_maw_.data() + (overlap ? l % 2 : 0) * maw_slot; };
  // n_gpu of the selection threshold: the entries on the device when these leave it (at most
  // the configured sink + window after a widened prefill: WindowCache::eviction_entries).
  const int64_t window_entries = window.eviction_entries();
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  if (!overlap) {
    for (int64_t l = 0; l < g.num_layers; ++l) {
      const auto start = Clock::now();
      TANDEM_RETURN_IF_ERROR(window.ReadBlocks(l, blocks, slot_k(l), slot_v(l), slot_maw(l)));
      profile_.evict_read_s += seconds_since(start);
      const auto read = Clock::now();
      TANDEM_RETURN_IF_ERROR(sink(l, slot_k(l), slot_v(l), slot_maw(l), total, window_entries));
      profile_.evict_append_s += seconds_since(read);
    }
    return absl::OkStatus();
  }
  // The sink thread takes layer l once it is read; the reads of layer l wait until the sink of
  // layer l - 2 (the slot's last user) is done. A failure on either side stops both.
  std::mutex mu;
  std::condition_variable cv;
  int64_t layers_read = 0, layers_sunk = 0;   // guarded by mu
  bool stop = false;                          // guarded by mu
  absl::Status sink_status;                   // guarded by mu
  double sink_s = 0;                          // the sink thread's, read after the join
  std::thread sinker([&] {
    for (int64_t l = 0; l < g.num_layers; ++l) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || layers_read > l; });
        if (stop) return;
      }
      const auto start = Clock::now();
      absl::Status s = sink(l, slot_k(l), slot_v(l), slot_maw(l), total, window_entries);
      sink_s += seconds_since(start);
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!s.ok()) {
          sink_status = std::move(s);
          stop = true;
        } else {
          layers_sunk = l + 1;
        }
      }
      cv.notify_all();
      if (!s.ok()) return;
    }
  });
  absl::Status read_status;
  for (int64_t l = 0; l < g.num_layers; ++l) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || layers_sunk >= l - 1; });
      if (stop) break;
    }
    const auto start = Clock::now();
    read_status = window.ReadBlocks(l, blocks, slot_k(l), slot_v(l), slot_maw(l));
    profile_.evict_read_s += seconds_since(start);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!read_status.ok()) {
        stop = true;
      } else {
        layers_read = l + 1;
      }
    }
    cv.notify_all();
    if (!read_status.ok()) break;
  }
  sinker.join();
  profile_.evict_append_s += sink_s;
  TANDEM_RETURN_IF_ERROR(read_status);
  return sink_status;
}

}  // namespace tandem::gpu_worker
