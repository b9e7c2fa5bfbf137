#include "tandem/gpu_worker/exact_tier.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/scan_rate.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/host_page_streams.h"
#include "tandem/gpu_worker/memory_shortage.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Copies entries [from, from + count) of every head of a head-major block
// [heads, tokens, row_bytes] into dst [heads, count, row_bytes].
void CopyEntries(const void* src, int64_t heads, int64_t tokens, size_t row_bytes, int64_t from,
                 int64_t count, char* dst) {
  const char* s = static_cast<const char*>(src);
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(dst + h * count * row_bytes, s + (h * tokens + from) * row_bytes,
                count * row_bytes);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ExactTier>> OpenExactTier(Backend& backend, NodePool& pool,
                                                         ExactRateBook& rates, RemoteKvOptions ro,
                                                         const WindowGeometry& geometry,
                                                         int64_t page_tokens,
                                                         const ExactTierOptions& options) {
  if (pool.accepting_count() == 0) {
    return absl::UnavailableError(
        "exact mode needs CPU attention nodes and none is accepting (check --cpu_nodes and the "
        "nodes' health); offload mode streams all offloaded KV over PCIe without them");
  }
  // Exactness needs the nodes to keep K/V as sent: int8 rows (--node_kv_dtype=int8) would make
  // the node share approximate.
  for (const NodeState& node : pool.Snapshot()) {
    if (node.accepting() && node.int8_kv) {
      return absl::FailedPreconditionError(absl::StrCat(
          "exact mode needs CPU nodes that store K/V as sent; node ", node.address,
          " stores int8 rows (--node_kv_dtype=int8): use offload mode, or nodes with bf16"));
    }
  }
  const ExactPlan plan =
      PlanExactSplit(rates.rates(), options.geometry, options.expected_tokens, options.plan);
  ro.selection = SelectionRule::kPages;  // dense attends (no pages named), no selected copy
  const int64_t host_entries =
      static_cast<int64_t>(std::floor(plan.fetch_share * options.expected_tokens));
  ro.expected_tokens = std::max<int64_t>(0, options.expected_tokens - host_entries);
  absl::StatusOr<std::unique_ptr<RemoteKv>> opened = RemoteKv::Open(pool, ro);
  // Refused for room: the nodes' pools are short (eviction closes a cached session holding some).
  if (!opened.ok()) return MarkShortOf(MemoryKind::kNodes, opened.status());
  std::unique_ptr<RemoteKv> remote = std::move(*opened);
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<OffloadedKv> host,
                          OffloadedKv::Create(backend, geometry, page_tokens));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<ExactTier> tier,
                          ExactTier::Create(std::move(host), std::move(remote), &rates, options));
  // The host share must fit the memory the system has (the nodes checked theirs at Open).
  TANDEM_RETURN_IF_ERROR(tier->Reserve(options.expected_tokens));
  return tier;
}

absl::StatusOr<std::unique_ptr<ExactTier>> ExactTier::Create(std::unique_ptr<OffloadedKv> host,
                                                             std::unique_ptr<RemoteKv> remote,
                                                             ExactRateBook* rates,
                                                             const ExactTierOptions& options) {
  if (host == nullptr || remote == nullptr || rates == nullptr) {
    return absl::InvalidArgumentError("exact tier: host pages, node session and rates needed");
  }
  if (remote->options().selection != SelectionRule::kPages) {
    return absl::InvalidArgumentError(
        "exact tier: the node session must be opened with pages "
        "selection (dense attends, no selected copy)");
  }
  auto tier =
      std::unique_ptr<ExactTier>(new ExactTier(std::move(host), std::move(remote), rates, options));
  tier->Replan(options.expected_tokens);
  spdlog::info("session {}: {} ({})", tier->remote_->options().session_id,
               FormatExactPlan(tier->plan_), FormatExactRates(rates->rates()));
  return tier;
}

ExactTier::ExactTier(std::unique_ptr<OffloadedKv> host, std::unique_ptr<RemoteKv> remote,
                     ExactRateBook* rates, const ExactTierOptions& options)
    : host_(std::move(host)),
      remote_(std::move(remote)),
      rates_(rates),
      options_(options),
      clock_(host_->geometry().num_layers) {
  // Recompute needs the model's weights; without them the plan keeps r = 0.
  if (options_.model == nullptr) options_.plan.allow_recompute = false;
}

int64_t ExactTier::host_tokens() const { return host_->tokens(host_->geometry().num_layers - 1); }

std::optional<TierSplit> ExactTier::split() const {
  return TierSplit{plan_.fetch_share,        plan_.node_share,   plan_.recompute_share,
                   plan_.step_seconds,       plan_.fetch_only_seconds,
                   plan_.recompute_pays,     plan_.recompute_reason,
                   host_tokens(),            node_tokens()};
}

TierFootprint ExactTier::footprint() const {
  // Layer inputs kept for recompute are host rows too (exact_recompute.h).
  return {0, host_->host_bytes() + (recompute_ ? recompute_->host_bytes() : 0),
          recovery_.on_host ? 0 : remote_->NodeBytes()};
}

double ExactTier::off_device_work() const {
  const ExactGeometry& g = options_.geometry;
  return static_cast<double>(node_tokens()) * g.num_layers * g.kv_row_bytes();
}

void ExactTier::Replan(int64_t tokens) {
  options_.expected_tokens = std::max(options_.expected_tokens, tokens);
  plan_ =
      PlanExactSplit(rates_->rates(), options_.geometry, options_.expected_tokens, options_.plan);
  steps_since_plan_ = 0;
}

bool ExactTier::wants_layer_inputs() const {
  return options_.plan.allow_recompute && plan_.recompute_share > 0;
}

absl::Status ExactTier::TakeLayerInputs(TierContext& context, int64_t layer, const float* xn,
                                        int64_t rows, int64_t first_pos) {
  if (absl::Status made = EnsureRecompute(context.backend(), context.max_rows()); !made.ok()) {
    // Not this model (or no device room for the staging): the entries are fetched instead.
    spdlog::warn("session {}: no recompute: {}", remote_->options().session_id, made.ToString());
    options_.plan.allow_recompute = false;
    Replan(options_.expected_tokens);
    return absl::OkStatus();
  }
  return recompute_->Take(layer, xn, rows, first_pos);
}

absl::Status ExactTier::AppendRecomputeRows(Backend& backend, int64_t max_rows, const void* rows,
                                            int64_t n, int64_t first_pos) {
  TANDEM_RETURN_IF_ERROR(EnsureRecompute(backend, max_rows));
  return recompute_->AppendRows(rows, n, first_pos);
}

absl::Status ExactTier::EnsureRecompute(Backend& backend, int64_t max_rows) {
  if (recompute_ != nullptr) return absl::OkStatus();
  if (options_.model == nullptr) {
    return absl::FailedPreconditionError("exact tier: recompute needs the model");
  }
  TANDEM_ASSIGN_OR_RETURN(recompute_,
                          ExactRecompute::Create(backend, *options_.model, host_->geometry(),
                                                 host_->page_tokens(), max_rows));
  return absl::OkStatus();
}

ExactTier::BatchSplit ExactTier::SplitBatch(const std::vector<EvictedBlock>& blocks,
                                            int64_t tokens) const {
  // Keep the counts at round(r · total) recomputed and round((r + f) · total) recomputed or
  // fetched as entries arrive; entries whose layer inputs are missing (taken before the plan
  // had a recompute share) are fetched instead.
  const int64_t total = offloaded_tokens() + tokens;
  const int64_t rec_now = recompute_tokens();
  BatchSplit split;
  if (recompute_ != nullptr && plan_.recompute_share > 0) {
    const int64_t want =
        static_cast<int64_t>(std::llround(plan_.recompute_share * total)) - rec_now;
    int64_t left = std::clamp<int64_t>(want, 0, tokens);
    for (const EvictedBlock& b : blocks) {  // the prefix of the batch with rows
      const int64_t take = std::min(left, b.count);
      int64_t ok = 0;
      while (ok < take && recompute_->HasPending(b.first_pos + ok, 1)) ++ok;
      split.recompute += ok;
      left -= ok;
      if (ok < b.count) break;
    }
  }
  const double share = std::clamp(plan_.fetch_share + plan_.recompute_share, 0.0, 1.0);
  const int64_t want =
      static_cast<int64_t>(std::llround(share * total)) - host_tokens() - rec_now - split.recompute;
  split.host = std::clamp<int64_t>(want, 0, tokens - split.recompute);
  return split;
}

absl::Status ExactTier::KeepInputs(const std::vector<EvictedBlock>& blocks, int64_t recompute) {
  if (recompute_ == nullptr) return absl::OkStatus();
  int64_t left = recompute;
  for (const EvictedBlock& b : blocks) {
    const int64_t keep = std::min(left, b.count);
    if (keep > 0) TANDEM_RETURN_IF_ERROR(recompute_->Keep(b.first_pos, keep));
    recompute_->Drop(b.first_pos + keep, b.count - keep);
    left -= keep;
  }
  return absl::OkStatus();
}

absl::Status ExactTier::BeginPass(TierContext& context, size_t stream) {
  if (host_->num_pages(0) > 0) {
    TANDEM_RETURN_IF_ERROR(HostPageStreams::AddPages(context, stream, *host_));
  }
  // The recomputed pages' first uploads, ahead of the fetched pages' (exact_recompute.h).
  if (recompute_tokens() > 0) TANDEM_RETURN_IF_ERROR(recompute_->BeginPass());
  // One pass in options_.time_every_steps with both paths is timed per path (exact_step_clock.h).
  timing_ = options_.time_every_steps > 0 && node_tokens() > 0 &&
            host_tokens() + recompute_tokens() > 0 && ++passes_ % options_.time_every_steps == 0;
  if (!timing_) clock_.Abandon();
  return absl::OkStatus();
}

absl::Status ExactTier::PrepareAttend(TierContext& context, const AttendRows& rows) {
  if (node_tokens() == 0) return absl::OkStatus();
  const WindowAttentionParams& w = rows.window;
  const size_t row_bytes = w.num_q_heads * w.head_dim * 4;
  context.QueueDownload(rows.q_host, row_bytes, w.q, w.q_row_stride * 4, row_bytes, w.num_tokens);
  return absl::OkStatus();
}

absl::Status ExactTier::StartAttend(TierContext&, const AttendRows& rows) {
  nodes_attending_ = false;
  if (node_tokens() == 0) return absl::OkStatus();
  // Dense: no pages named, every entry the nodes hold.
  TANDEM_RETURN_IF_ERROR(remote_->StartAttend(rows.layer, rows.q_host, rows.window.num_tokens));
  nodes_attending_ = true;
  if (timing_ && rows.window.num_tokens != 1) {
    // A prompt chunk's attend is compute-bound on the nodes: not a decode step's rates.
    timing_ = false;
    clock_.Abandon();
  }
  if (timing_) clock_.Start(rows.layer, Clock::now());
  return absl::OkStatus();
}

absl::StatusOr<bool> ExactTier::FinishAttend(TierContext& context, const AttendRows& rows) {
  const WindowAttentionParams& w = rows.window;
  // Recompute and the host pages first: queued on the device (cuda) while the nodes still work.
  absl::Status streamed = absl::OkStatus();
  if (recompute_tokens() > 0) streamed = recompute_->Attend(rows.layer, w);
  if (streamed.ok() && host_->num_pages(0) > 0) {
    KvStreamer* streamer = HostPageStreams::StreamerOf(context);
    streamed = streamer == nullptr ? absl::FailedPreconditionError("exact tier without a streamer")
                                   : streamer->AttendLayer(rows.layer, rows.stream, w);
  }
  if (!nodes_attending_) {
    TANDEM_RETURN_IF_ERROR(streamed);
    return recovery_.tainted();  // exact_rebuild.h
  }
  nodes_attending_ = false;
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<bool> degraded = remote_->FinishAttend(rows.o_host, rows.lse_host);
  context.profile().cpu_wait_s += Seconds(t0);
  TANDEM_RETURN_IF_ERROR(streamed);
  TANDEM_RETURN_IF_ERROR(degraded.status());
  if (timing_ && *degraded) {
    // A missed answer: the nodes' time is the deadline's, their bytes not all scanned.
    timing_ = false;
    clock_.Abandon();
  }
  if (timing_) {
    clock_.NodesDone(rows.layer, Clock::now());
    // The layer's fetched and recomputed pages are attended when a 4-byte read, queued after
    // them, is done (it waits for the device's queue, not for the next layer's prefetches).
    float probe = 0;
    TANDEM_RETURN_IF_ERROR(context.backend().CopyToHost(&probe, w.lse, sizeof(float)));
    clock_.DeviceDone(rows.layer, Clock::now());
  }
  // A degraded attend taints its rows' positions until the rebuild repairs them.
  TANDEM_RETURN_IF_ERROR(recovery_.NoteAttend(context.backend(), w.q_pos, *degraded));
  ++node_attends_;
  context.QueueMerge({rows.o_host, rows.lse_host, rows.part_o, rows.part_lse, w.o, w.lse,
                      w.num_tokens * w.num_q_heads, w.head_dim});
  // Until the repair, the window holds K/V that degraded steps computed: not exact either.
  return *degraded || recovery_.tainted();
}

void ExactTier::CancelAttend(TierContext&, const AttendRows& rows) {
  if (nodes_attending_) (void)remote_->FinishAttend(rows.o_host, rows.lse_host);
  nodes_attending_ = false;
  clock_.Abandon();
}

absl::Status ExactTier::Append(TierContext& context, WindowCache& window,
                               const std::vector<EvictedBlock>& blocks) {
  int64_t batch = 0;
  for (const EvictedBlock& b : blocks) batch += b.count;
  if (batch == 0) return absl::OkStatus();
  // The same split in every layer (decided once: the counts must agree across layers): the
  // batch's first entries are recomputed, the next fetched, the rest on the nodes.
  const BatchSplit split = SplitBatch(blocks, batch);
  const int64_t to_rec = split.recompute, to_host = split.host;
  const int64_t to_nodes = batch - to_rec - to_host;
  TANDEM_RETURN_IF_ERROR(KeepInputs(blocks, to_rec));
  // The positions of the nodes' entries, for a rebuild after node loss, and how far the window
  // has moved, also when the whole batch went to recompute (exact_rebuild.h: tainted positions
  // that left the window can no longer be repaired).
  recovery_.NoteEvicted(blocks, to_rec + to_host, to_nodes);
  if (to_rec == batch) return absl::OkStatus();
  const WindowGeometry& g = host_->geometry();
  const int64_t heads = g.num_kv_heads;
  const size_t row = g.head_dim * DTypeBytes(g.dtype);
  return context.ReadEvicted(
      window, blocks,
      [&](int64_t layer, const void* k, const void* v, const float* maw, int64_t tokens,
          int64_t) -> absl::Status {
        if (to_rec == 0 && to_nodes == 0) return host_->Append(layer, k, v, tokens);
        if (to_rec == 0 && to_host == 0) return remote_->Append(layer, k, v, maw, tokens, 0);
        if (to_host > 0) {
          host_k_.resize(heads * to_host * row);
          host_v_.resize(heads * to_host * row);
          CopyEntries(k, heads, tokens, row, to_rec, to_host, host_k_.data());
          CopyEntries(v, heads, tokens, row, to_rec, to_host, host_v_.data());
          TANDEM_RETURN_IF_ERROR(host_->Append(layer, host_k_.data(), host_v_.data(), to_host));
        }
        if (to_nodes == 0) return absl::OkStatus();
        const int64_t from = to_rec + to_host;
        node_k_.resize(heads * to_nodes * row);
        node_v_.resize(heads * to_nodes * row);
        node_maw_.resize(heads * to_nodes);
        CopyEntries(k, heads, tokens, row, from, to_nodes, node_k_.data());
        CopyEntries(v, heads, tokens, row, from, to_nodes, node_v_.data());
        CopyEntries(maw, heads, tokens, sizeof(float), from, to_nodes,
                    reinterpret_cast<char*>(node_maw_.data()));
        return remote_->Append(layer, node_k_.data(), node_v_.data(), node_maw_.data(), to_nodes,
                               0);
      });
}

absl::Status ExactTier::Reserve(int64_t tokens) {
  remote_->CheckNodes();
  Replan(tokens);
  const int64_t total = options_.expected_tokens;
  const double host_share = std::clamp(plan_.fetch_share + plan_.recompute_share, 0.0, 1.0);
  // Host pages come whole: the fetched share rounded up to pages, per layer; the recompute
  // share's layer inputs (an activation row per layer and entry, geometry.activation_bytes).
  const int64_t page = host_->page_tokens();
  const int64_t host_entries = static_cast<int64_t>(std::ceil(host_share * total));
  const int64_t rec_entries = options_.plan.allow_recompute
                                  ? static_cast<int64_t>(std::ceil(plan_.recompute_share * total))
                                  : 0;
  const int64_t fetch_entries = std::max<int64_t>(0, host_entries - rec_entries);
  const int64_t pages_needed = (fetch_entries + page - 1) / page;
  const int64_t pages_held = host_->num_pages(0);
  const double more_rows =
      static_cast<double>(std::max<int64_t>(0, rec_entries - recompute_tokens()));
  const double more_bytes =
      static_cast<double>(std::max<int64_t>(0, pages_needed - pages_held)) *
          host_->geometry().num_layers * host_->page_bytes() +
      more_rows * options_.geometry.num_layers * options_.geometry.activation_row_bytes();
  const long avail_pages = sysconf(_SC_AVPHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  if (avail_pages > 0 && page_size > 0 &&
      more_bytes > static_cast<double>(avail_pages) * static_cast<double>(page_size)) {
    return MarkShortOf(MemoryKind::kHost, absl::ResourceExhaustedError(absl::StrCat(
        "exact mode: the host share of the offloaded KV (", host_entries,
        " entries per (layer, kv head)) needs ", static_cast<int64_t>(more_bytes / (1 << 20)),
        " MiB more of pinned host memory and ",
        static_cast<int64_t>(static_cast<double>(avail_pages) * page_size / (1 << 20)),
        " MiB are available: ask for fewer tokens or add CPU nodes")));
  }
  const int64_t node_entries = total - std::min(total, host_entries);
  if (recovery_.on_host) return absl::OkStatus();  // the node session is closed
  return MarkShortOf(MemoryKind::kNodes, remote_->Reserve(std::max(node_entries, node_tokens())));
}

absl::Status ExactTier::Maintain() {
  absl::Status maintained = remote_->Maintain();
  // Timed steps correct the rates every plan uses (ExactRateBook::RecordStep): what crossed
  // PCIe (fetched K/V, recomputed layer inputs) and what the nodes scanned, per step.
  if (const ExactStepTimes timed = clock_.Take(); timed.steps > 0) {
    const ExactGeometry& g = options_.geometry;
    const double fetched =
        g.num_layers * (static_cast<double>(host_tokens()) * g.kv_row_bytes() +
                        static_cast<double>(recompute_tokens()) * g.activation_row_bytes());
    rates_->RecordStep(timed.PerStep(), fetched,
                       static_cast<double>(node_tokens()) * g.num_layers * g.kv_row_bytes(),
                       g.num_layers);
  }
  if (options_.replan_every_steps <= 0 || ++steps_since_plan_ < options_.replan_every_steps) {
    return maintained;
  }
  // The nodes' aggregate rate as the placement planner models this session's step from the
  // rates its Attend replies measured: bytes scanned per step over the modelled seconds less
  // the per-call overheads.
  const ExactGeometry& g = options_.geometry;
  const double bytes = static_cast<double>(node_tokens()) * g.num_layers * g.kv_row_bytes();
  const double overhead = g.num_layers * remote_->options().attend_overhead_seconds;
  const double modelled = remote_->ModelledStepSeconds() - overhead;
  // Only while the nodes' calls are large enough to be timed (RemoteKv measures a node's rate
  // from replies of >= kMinTimedScanBytes; below that its model holds a default, not a rate).
  const size_t nodes = std::max<size_t>(1, remote_->nodes_in_use().size());
  const bool timed = bytes / g.num_layers / nodes >= static_cast<double>(kMinTimedScanBytes);
  if (node_attends_ >= kMinNodeSamples && timed && modelled > 0) {
    rates_->RecordNodeRate(bytes / modelled);
  }
  const ExactPlan before = plan_;
  Replan(options_.expected_tokens);
  if (std::fabs(plan_.fetch_share - before.fetch_share) > 0.01) {
    spdlog::info("session {}: re-planned: {}", remote_->options().session_id,
                 FormatExactPlan(plan_));
  }
  return maintained;
}

}  // namespace tandem::gpu_worker
