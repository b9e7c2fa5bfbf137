#include "tandem/gpu_worker/node_tier.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

}  // namespace

NodeTier::NodeTier(std::unique_ptr<RemoteKv> remote, std::unique_ptr<PageIndex> pages)
    : remote_(std::move(remote)), pages_(std::move(pages)) {}

absl::StatusOr<std::unique_ptr<OffloadTier>> NodeTier::Fork(const TierFork& fork) const {
  std::unique_ptr<PageIndex> pages;
  if (pages_ != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(PageIndex copy, pages_->Fork(fork.expected_tokens));
    pages = std::make_unique<PageIndex>(std::move(copy));
  }
  absl::StatusOr<std::unique_ptr<RemoteKv>> remote =
      remote_->Fork(fork.session_id, fork.expected_tokens);
  if (!remote.ok()) return MarkShortOf(MemoryKind::kNodes, remote.status());
  auto tier = std::make_unique<NodeTier>(std::move(*remote), std::move(pages));
  tier->policy_ = policy_;
  tier->set_recompute(fork.recompute);
  return tier;
}

double NodeTier::off_device_work() const {
  // What the nodes scanned per row at the last attend of each layer; before any, everything
  // they hold (an upper bound: MAW keeps a share, pages a budget).
  const RemoteKvOptions& o = remote_->options();
  double entries = 0;
  for (const LayerSelection& layer : remote_->last_selection()) entries += layer.selected;
  if (entries == 0) {
    entries = static_cast<double>(remote_->offloaded_tokens()) * o.num_layers * o.num_kv_heads;
  }
  return entries * 2.0 * o.head_dim * DTypeBytes(o.kv_dtype);   // K and V of each entry
}

absl::Status NodeTier::BeginPass(TierContext&, size_t) {
  speculated_ = {};
  // Low-rank bases finished since the last pass are installed before this pass selects.
  return pages_ != nullptr ? pages_->AdvanceLowRank() : absl::OkStatus();
}

absl::Status NodeTier::ParkDevice(ParkingPool& pool) {
  return pages_ != nullptr ? pages_->Park(pool) : absl::OkStatus();
}

absl::Status NodeTier::UnparkDevice() {
  return pages_ != nullptr && pages_->parked() ? pages_->Unpark() : absl::OkStatus();
}

size_t NodeTier::ParkBytes() const { return pages_ != nullptr ? pages_->ParkBytes() : 0; }
size_t NodeTier::parked_bytes() const { return pages_ != nullptr ? pages_->parked_bytes() : 0; }
size_t NodeTier::resident_bytes() const {
  return pages_ != nullptr ? pages_->resident_bytes() : 0;
}

TierFootprint NodeTier::footprint() const {
  return {pages_ != nullptr ? pages_->device_bytes() : 0, 0, remote_->NodeBytes()};
}

absl::Status NodeTier::PrepareAttend(TierContext& context, const AttendRows& rows) {
  const WindowAttentionParams& w = rows.window;
  const size_t row_bytes = w.num_q_heads * w.head_dim * 4;
  context.QueueDownload(rows.q_host, row_bytes, w.q, w.q_row_stride * 4, row_bytes, w.num_tokens);
  paged_ = false;
  if (pages_ == nullptr) return absl::OkStatus();
  int64_t per_head = 0;
  if (speculated_.layer == rows.layer && speculated_.num_tokens == w.num_tokens) {
    per_head = speculated_.per_head;   // chosen during the previous layer (Speculate)
  } else {
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<int64_t> chosen = ChoosePages(context, rows);
    context.profile().select_s += Seconds(t0);
    TANDEM_RETURN_IF_ERROR(chosen.status());
    per_head = *chosen;
  }
  speculated_ = {};
  if (per_head > 0) DownloadPages(context, w.num_tokens, w.num_kv_heads, per_head);
  paged_ = per_head > 0;
  return absl::OkStatus();
}

absl::Status NodeTier::Speculate(TierContext& context, const AttendRows& next) {
  speculated_ = {};
  if (pages_ == nullptr) return absl::OkStatus();
  // selected_ is free: the current layer's ids were downloaded before its StartAttend, and
  // page_ids_ (which its attend in flight reads) is not touched before the next PrepareAttend.
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<int64_t> chosen = ChoosePages(context, next);
  context.profile().select_s += Seconds(t0);
  TANDEM_RETURN_IF_ERROR(chosen.status());
  speculated_ = {next.layer, next.window.num_tokens, *chosen};
  return absl::OkStatus();
}

absl::Status NodeTier::StartAttend(TierContext&, const AttendRows& rows) {
  const int64_t n = rows.window.num_tokens;
  // (A no-op for pages sessions: their pages are chosen with every step's queries.)
  if (rows.policy.reselect) {
    TANDEM_RETURN_IF_ERROR(
        remote_->Reselect(rows.layer, rows.q_host, n, rows.policy.reselect_beta));
  }
  attend_sent_ = Clock::now();
  return remote_->StartAttend(rows.layer, rows.q_host, n, paged_ ? &selection_ : nullptr);
}

absl::StatusOr<bool> NodeTier::FinishAttend(TierContext& context, const AttendRows& rows) {
  const WindowAttentionParams& w = rows.window;
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<bool> degraded = remote_->FinishAttend(rows.o_host, rows.lse_host);
  context.profile().cpu_wait_s += Seconds(t0);
  TANDEM_RETURN_IF_ERROR(degraded.status());
  context.profile().attend_round_trip_s += Seconds(attend_sent_);
  context.profile().node_handle_s += remote_->last_attend_handle_s();
  context.profile().node_compute_s += remote_->last_attend_compute_s();
  if (context.measure_captured_mass() && pages_ != nullptr &&
      rows.policy.captured_mass != nullptr) {
    TANDEM_RETURN_IF_ERROR(MeasureCapturedMass(rows, rows.lse_host));
  }
  context.QueueMerge({rows.o_host, rows.lse_host, rows.part_o, rows.part_lse, w.o, w.lse,
                      w.num_tokens * w.num_q_heads, w.head_dim});
  return *degraded;
}

void NodeTier::CancelAttend(TierContext&, const AttendRows& rows) {
  (void)remote_->FinishAttend(rows.o_host, rows.lse_host);
}

absl::Status NodeTier::Append(TierContext& context, WindowCache& window,
                              const std::vector<EvictedBlock>& blocks) {
  // Summaries first, from the window's K before the blocks are released.
  if (pages_ != nullptr) {
    const Clock::time_point start = Clock::now();
    TANDEM_RETURN_IF_ERROR(pages_->AppendEvicted(window, blocks));
    context.profile().evict_index_s += Seconds(start);
  }
  return context.ReadEvicted(
      window, blocks,
      [this](int64_t layer, const void* k, const void* v, const float* maw, int64_t tokens,
             int64_t window_entries) {
        return remote_->Append(layer, k, v, maw, tokens, window_entries);
      },
      TierContext::SinkUses::kHostOnly);
}

absl::StatusOr<int64_t> NodeTier::AppendLimit() {
  if (pages_ == nullptr || pages_->parked()) return kAnyTokens;
  TANDEM_RETURN_IF_ERROR(pages_->AdvanceLowRank());
  if (pages_->low_rank_solving()) return 0;
  const int64_t until_due = pages_->tokens_until_low_rank_due();
  return until_due > 0 ? until_due : kAnyTokens;
}

absl::StatusOr<bool> NodeTier::Rebuild() {
  if (recompute_ == nullptr || !remote_->needs_rebuild() || Clock::now() < next_rebuild_) {
    return false;
  }
  const uint64_t before = remote_->placement_counters().shards_rebuilt;
  if (absl::Status s = remote_->RebuildLost(recompute_); !s.ok()) {
    next_rebuild_ = Clock::now() + kRebuildRetry;
    return s;
  }
  return remote_->placement_counters().shards_rebuilt != before;
}

int64_t NodeTier::SelectRowsPerCall(int64_t n, int64_t num_kv_heads, int64_t num_pages) {
  const size_t row_bytes = SelectPagesScratchBytes(1, num_kv_heads, num_pages);
  return std::clamp<int64_t>(static_cast<int64_t>(kMaxSelectScratchBytes / row_bytes), 1, n);
}

size_t NodeTier::SelectionBytesFor(int64_t num_tokens, int64_t num_kv_heads, int64_t num_pages,
                                   int64_t per_head) {
  // ChoosePages: the ids buffer, the bound's first pick (at most per_head ids a row), and the
  // scratch of a batched (queued) or a split selection (two when batched: the passes queue
  // apart).
  const size_t ids = static_cast<size_t>(num_tokens) * num_kv_heads * per_head * 4;
  const size_t whole = SelectPagesScratchBytes(num_tokens, num_kv_heads, num_pages);
  if (whole <= kMaxBatchedSelectScratchBytes) return 2 * ids + 2 * ((whole + 255) / 256 * 256);
  return 2 * ids + SelectPagesScratchBytes(SelectRowsPerCall(num_tokens, num_kv_heads, num_pages),
                                           num_kv_heads, num_pages);
}

absl::StatusOr<int64_t> NodeTier::ChoosePages(TierContext& context,
                                               const AttendRows& rows) {
  const WindowAttentionParams& w = rows.window;
  const int64_t Hkv = w.num_kv_heads, n = w.num_tokens;
  const PagePolicy& policy = policy_;
  const int64_t num_pages = pages_->num_pages(rows.layer);
  const int64_t per_head = std::max<int64_t>(1, policy.select_tokens / pages_->page_tokens());
  // Dense layers and budgets that cover every page attend over everything (exact): no ids.
  if (rows.layer < policy.dense_layers || per_head >= num_pages) return 0;

  // Two scores (PagePolicy::centroid_share): the bound picks `bound_pages` into first_, then
  // the centroid fills the row to per_head with those kept. One score: a single pass.
  // (Plain names, not a structured binding: the lambda below captures them, which clang before
  // C++20's rules refuses.)
  const PagePolicy::Split split = policy.SplitPages(per_head);
  const int64_t bound_pages = split.bound;
  const int64_t centroid_pages = split.centroid;
  const bool two_pass = bound_pages > 0 && centroid_pages > 0;
  const PageScore second_score = policy.low_rank && pages_->low_rank_ready(rows.layer)
                                     ? PageScore::kLowRank
                                     : PageScore::kCentroid;
  const PageScore final_score = bound_pages > 0 && !two_pass ? PageScore::kBound : second_score;
  const size_t ids = static_cast<size_t>(n) * Hkv * per_head;
  if (selected_.bytes() < ids * 4) {
    selected_.Reset();   // (its last reader, a download, has run)
    TANDEM_ASSIGN_OR_RETURN(selected_, context.backend().Allocate(ids * 4));
  }
  const size_t first_ids = static_cast<size_t>(n) * Hkv * bound_pages;
  if (two_pass && first_.bytes() < first_ids * 4) {
    first_.Reset();
    TANDEM_ASSIGN_OR_RETURN(first_, context.backend().Allocate(first_ids * 4));
  }
  // The selection of rows [r, r + count): its final params, after the bound's pass (queued or
  // run) when there are two.
  auto params_of = [&](int64_t r, int64_t count, void* scratch,
                       bool queue) -> absl::StatusOr<SelectPagesParams> {
    const float* q = w.q + r * w.q_row_stride;
    if (two_pass) {
      int32_t* first = first_.as<int32_t>() + r * Hkv * bound_pages;
      TANDEM_ASSIGN_OR_RETURN(SelectPagesParams bound,
                              pages_->SelectParams(rows.layer, q, w.q_row_stride, count,
                                                   w.num_q_heads, bound_pages, first, scratch,
                                                   PageScore::kBound, w.scale));
      if (queue) {
        context.QueueSelect(bound, /*phase=*/0);
      } else {
        TANDEM_RETURN_IF_ERROR(context.backend().SelectPages(bound));
      }
    }
    TANDEM_ASSIGN_OR_RETURN(SelectPagesParams p,
                            pages_->SelectParams(rows.layer, q, w.q_row_stride, count,
                                                 w.num_q_heads, per_head,
                                                 selected_.as<int32_t>() + r * Hkv * per_head,
                                                 scratch, final_score, w.scale));
    if (two_pass) {
      p.keep = first_.as<int32_t>() + r * Hkv * bound_pages;
      p.keep_per_head = bound_pages;
    }
    return p;
  };
  // Few rows (decode): queued, run with the micro-batch's other selections of this layer as
  // SelectPagesBatch calls before the downloads (FlushDownloads), each with its own scratch.
  if (SelectPagesScratchBytes(n, Hkv, num_pages) <= kMaxBatchedSelectScratchBytes) {
    TANDEM_ASSIGN_OR_RETURN(const SelectPagesParams p, params_of(0, n, nullptr, true));
    context.QueueSelect(p, /*phase=*/two_pass ? 1 : 0);
  } else {
    // Query rows per SelectPages call so that its scores stay within kMaxSelectScratchBytes
    // (a long prefill chunk over a long context is cut into several calls).
    const int64_t rows_per_call = SelectRowsPerCall(n, Hkv, num_pages);
    TANDEM_ASSIGN_OR_RETURN(void* const scratch,
                            context.SelectScratch(SelectPagesScratchBytes(rows_per_call, Hkv,
                                                                          num_pages)));
    for (int64_t r = 0; r < n; r += rows_per_call) {
      TANDEM_ASSIGN_OR_RETURN(const SelectPagesParams p,
                              params_of(r, std::min(rows_per_call, n - r), scratch, false));
      TANDEM_RETURN_IF_ERROR(context.backend().SelectPages(p));
    }
  }
  return per_head;
}

void NodeTier::DownloadPages(TierContext& context, int64_t num_tokens, int64_t num_kv_heads,
                             int64_t per_head) {
  const size_t ids = static_cast<size_t>(num_tokens) * num_kv_heads * per_head;
  page_ids_.resize(ids);
  context.QueueDownload(page_ids_.data(), ids * 4, selected_.data(), ids * 4, ids * 4, 1);
  selection_ = PageSelection{page_ids_.data(), per_head};
}

absl::Status NodeTier::MeasureCapturedMass(const AttendRows& rows, const float* selected_lse) {
  const WindowAttentionParams& w = rows.window;
  const int64_t n = w.num_tokens, Hq = w.num_q_heads, D = w.head_dim;
  const int64_t layer = rows.layer;
  CapturedMass& mass = *rows.policy.captured_mass;
  const int64_t layers = remote_->options().num_layers;
  if (mass.sum.empty()) {
    mass.sum.assign(layers, 0.0);
    mass.count.assign(layers, 0);
  }
  if (!paged_) {   // everything was attended: all of the mass
    mass.sum[layer] += static_cast<double>(n * Hq);
    mass.count[layer] += static_cast<uint64_t>(n * Hq);
    return absl::OkStatus();
  }
  // The same queries over every offloaded entry: the denominator of the captured share.
  dense_o_.resize(static_cast<size_t>(n) * Hq * D);
  dense_lse_.resize(static_cast<size_t>(n) * Hq);
  TANDEM_RETURN_IF_ERROR(remote_->StartAttend(layer, rows.q_host, n, nullptr));
  TANDEM_ASSIGN_OR_RETURN(const bool degraded,
                          remote_->FinishAttend(dense_o_.data(), dense_lse_.data()));
  if (degraded) return absl::OkStatus();   // nothing to compare against this step
  for (int64_t r = 0; r < n * Hq; ++r) {
    if (!std::isfinite(dense_lse_[r])) continue;
    const double share = std::isfinite(selected_lse[r])
                             ? std::exp(static_cast<double>(selected_lse[r]) - dense_lse_[r])
                             : 0.0;
    mass.sum[layer] += std::min(share, 1.0);
    mass.count[layer] += 1;
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
