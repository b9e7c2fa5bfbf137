// RemoteKv's per-step data path (remote_kv.h): appends of evicted KV, and the attend fan-out: one
// call per node holding heads of the layer, answers gathered into [tokens, q heads] rows, with
// the selection counters they carry; Reselect at a new turn. The session's lifecycle on the
// nodes is in remote_kv.cc.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "node_link.h"
#include "node_rpc.h"
#include "tandem/common/scan_rate.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {

absl::Status RemoteKv::Append(int64_t layer, const void* k, const void* v, const float* maw,
                              int64_t num_tokens, int64_t window_entries) {
  // window_entries sets the MAW threshold; pages sessions do not use it (0 allowed).
  const int64_t min_window = options_.selection == SelectionRule::kPages ? 0 : 1;
  if (layer < 0 || layer >= options_.num_layers || num_tokens <= 0 ||
      window_entries < min_window) {
    return absl::InvalidArgumentError("RemoteKv::Append: bad layer, token count or window");
  }
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n] || lost_[n]) continue;
    const std::vector<uint32_t> heads = HeadsOf(n, layer);
    if (heads.empty()) continue;
    if (suspect_[n]) {   // it would miss these entries: rebuilt elsewhere instead
      MarkLost(n, absl::UnavailableError(absl::StrCat(
                      "CPU node ", pool_.address(n), " is out of placement (a missed deadline) "
                      "while evicted KV must be appended")));
      continue;
    }
    const absl::Status s =
        shm_[n] != nullptr
            ? shm_[n]->Append(layer, heads, k, v, maw, num_tokens, window_entries,
                              &shm_append_chunks_)
            : Grpc(n).Append(layer, heads, k, v, maw, num_tokens, window_entries);
    // The node's shards miss these entries now: they are rebuilt elsewhere (RebuildLost).
    if (!s.ok()) MarkLost(n, s);
  }
  if (layer == options_.num_layers - 1) {
    offloaded_tokens_ += num_tokens;
    UpdateClaim();
  }
  return absl::OkStatus();
}

absl::Status RemoteKv::StartAttend(int64_t layer, const float* q, int64_t num_tokens,
                                   const PageSelection* pages) {
  if (attend_layer_ >= 0) return absl::FailedPreconditionError("an Attend is already in flight");
  if (layer < 0 || layer >= options_.num_layers || num_tokens <= 0) {
    return absl::InvalidArgumentError("RemoteKv::StartAttend: bad layer or token count");
  }
  if (pages != nullptr) {
    if (options_.selection != SelectionRule::kPages) {
      return absl::InvalidArgumentError(
          "RemoteKv::StartAttend: pages given for a session with maw selection");
    }
    if (pages->per_head < 0 || pages->per_head > (int64_t{1} << 20) ||
        (pages->per_head > 0 && pages->ids == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RemoteKv::StartAttend: pages per_head ", pages->per_head,
          " outside 0..2^20 or ids missing"));
    }
    if (pages->per_head == 0) pages = nullptr;   // no ids: dense, as without pages
  }
  SyncWithPool();
  attend_layer_ = layer;
  attend_tokens_ = num_tokens;
  last_attend_compute_s_ = 0;
  last_attend_handle_s_ = 0;
  attend_deadline_ = Clock::now() + std::chrono::milliseconds(options_.attend_deadline_ms);
  NodeQuery query{layer, q, num_tokens, pages, 0};
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n] || lost_[n] || suspect_[n] || HeadsOf(n, layer).empty()) continue;
    if (shm_[n] != nullptr) {
      // The node answers for every head it holds, shards still migrating in included.
      query.answer_heads = static_cast<int64_t>(HeadsOf(n, layer).size());
      for (const auto& [shard, to] : migrating_) {
        if (to == n && static_cast<int64_t>(shard) / options_.num_kv_heads == layer) {
          ++query.answer_heads;
        }
      }
      const ShmLink::Start started = shm_[n]->StartAttend(query);
      if (started == ShmLink::Start::kSent) {
        shm_calls_.push_back(n);
        ++shm_attends_;
      }
      // A busy channel leaves the node unanswered (degraded); a query too large for the areas
      // goes over gRPC.
      if (started != ShmLink::Start::kTooLarge) continue;
    }
    Grpc(n).StartAttend(query);
    grpc_calls_.push_back(n);
  }
  return absl::OkStatus();
}

GrpcLink& RemoteKv::Grpc(size_t node) {
  if (grpc_[node] == nullptr) grpc_[node] = std::make_unique<GrpcLink>(pool_, node, Session());
  return *grpc_[node];
}

void RemoteKv::TakeAnswer(size_t node, const NodeAnswer& answer, float* o, float* lse,
                          LayerSelection* selection) {
  const int64_t T = attend_tokens_, Hq = options_.num_q_heads, D = options_.head_dim;
  const int64_t G = Hq / options_.num_kv_heads;
  const std::span<const uint32_t> kv_heads = answer.kv_heads;
  const int64_t own = static_cast<int64_t>(kv_heads.size());
  // Heads outside the model or not placed on this node are skipped.
  auto mine = [&](int64_t h) {
    return kv_heads[h] < options_.num_kv_heads && NodeOf(attend_layer_, kv_heads[h]) == node;
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < own; ++h) {
      if (!mine(h)) continue;
      const int64_t kv_head = kv_heads[h];
      for (int64_t j = 0; j < G; ++j) {
        const int64_t src_row = t * own * G + h * G + j;
        const int64_t dst_row = t * Hq + kv_head * G + j;
        std::memcpy(o + dst_row * D, answer.o + src_row * D, D * sizeof(float));
        lse[dst_row] = answer.lse[src_row];
      }
    }
  }
  if (answer.selected.empty()) return;   // (a gRPC answer without counters)
  for (int64_t h = 0; h < own; ++h) {
    if (!mine(h)) continue;
    selection->selected += answer.selected[h];
    selection->held += answer.held[h];
  }
  last_attend_handle_s_ = std::max(last_attend_handle_s_, answer.handle_micros * 1e-6);
  RecordAnswer(node, kv_heads, answer.selected, answer.held, answer.compute_micros,
               answer.bytes_scanned);
}

absl::StatusOr<bool> RemoteKv::FinishAttend(float* o, float* lse) {
  if (attend_layer_ < 0) return absl::FailedPreconditionError("no Attend in flight");
  const int64_t T = attend_tokens_, Hq = options_.num_q_heads, D = options_.head_dim;
  std::fill_n(o, T * Hq * D, 0.0f);
  std::fill_n(lse, T * Hq, -std::numeric_limits<float>::infinity());
  const int64_t layer = attend_layer_;
  bool degraded = false;
  // A node without a call (lost, busy, or its session never opened) owns heads nobody answers
  // for.
  std::vector<bool> answered(opened_.size(), false);
  LayerSelection selection;
  std::vector<std::pair<size_t, absl::Status>> failed;
  for (size_t n : shm_calls_) {
    if (std::optional<NodeAnswer> answer = shm_[n]->FinishAttend(attend_deadline_)) {
      TakeAnswer(n, *answer, o, lse, &selection);
      answered[n] = true;
    } else {
      failed.emplace_back(n, shm_[n]->error());
    }
  }
  shm_calls_.clear();
  for (size_t n : grpc_calls_) {
    if (std::optional<NodeAnswer> answer = grpc_[n]->FinishAttend()) {
      TakeAnswer(n, *answer, o, lse, &selection);
      answered[n] = true;
    } else {
      const absl::Status s = grpc_[n]->status();
      failed.emplace_back(n, s.ok() ? absl::DataLossError("malformed Attend answer") : s);
    }
  }
  grpc_calls_.clear();
  // (Every call has been joined: the failed nodes' links may go.)
  for (const auto& [n, why] : failed) NodeFailed(n, NodeError(pool_.address(n), "Attend", why));
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!HeadsOf(n, layer).empty() && !answered[n]) degraded = true;
  }
  attend_layer_ = -1;
  last_selection_[layer] = selection;
  if (selection.held > 0) {
    share_sum_[layer] += static_cast<double>(selection.selected) / selection.held;
    share_count_[layer] += 1;
  }
  if (degraded) ++degraded_attends_;
  return degraded;
}

absl::Status RemoteKv::Reselect(int64_t layer, const float* q, int64_t num_tokens,
                                std::optional<float> beta) {
  // Pages sessions keep no salience index on the nodes: nothing to re-evaluate.
  if (options_.selection == SelectionRule::kPages) return absl::OkStatus();
  // A copy in flight would keep the old flags of entries re-evaluated here: start over later.
  if (migrator_ != nullptr && !migrating_.empty()) {
    for (const MigrationJob& job : migrator_->CancelAll()) AbandonMigration(job);
    replan_due_ = true;
  }
  const size_t q_bytes = num_tokens * options_.num_q_heads * options_.head_dim * sizeof(float);
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n] || lost_[n] || HeadsOf(n, layer).empty()) continue;
    if (suspect_[n]) {   // its salience would stay stale: rebuilt elsewhere instead
      MarkLost(n, absl::UnavailableError(absl::StrCat("CPU node ", pool_.address(n),
                                                      " is out of placement (a missed deadline) "
                                                      "at a new turn's Reselect")));
      continue;
    }
    v1::ReselectRequest request;
    request.set_session_id(options_.session_id);
    request.set_layer(layer);
    auto* qt = request.mutable_q();
    qt->set_dtype(v1::DTYPE_F32);
    qt->add_shape(num_tokens);
    qt->add_shape(options_.num_q_heads);
    qt->add_shape(options_.head_dim);
    qt->mutable_data()->assign(reinterpret_cast<const char*>(q), q_bytes);
    if (beta.has_value()) request.set_beta(*beta);
    grpc::ClientContext ctx;
    SetDeadline(ctx, options_.control_deadline_ms);
    v1::ReselectResponse response;
    const grpc::Status s = pool_.stub(n).Reselect(&ctx, request, &response);
    if (!s.ok()) MarkLost(n, NodeError(pool_.address(n), "Reselect", s));
  }
  if (beta.has_value()) options_.beta = *beta;
  return absl::OkStatus();
}

void RemoteKv::RecordAnswer(size_t node, std::span<const uint32_t> kv_heads,
                            std::span<const uint64_t> selected, std::span<const uint64_t> held,
                            uint64_t compute_micros, uint64_t bytes_scanned) {
  last_attend_compute_s_ = std::max(last_attend_compute_s_, compute_micros * 1e-6);
  for (size_t i = 0; i < kv_heads.size(); ++i) {
    if (kv_heads[i] >= options_.num_kv_heads) continue;
    const size_t shard = attend_layer_ * options_.num_kv_heads + kv_heads[i];
    if (placement_[shard] != static_cast<int>(node)) continue;
    shard_selected_[shard] = selected[i];
    shard_held_[shard] = held[i];
  }
  // The node's scan rate, from calls large enough to measure (a moving average).
  if (compute_micros > 0 && bytes_scanned >= kMinTimedScanBytes && node < node_rate_.size()) {
    const double rate = static_cast<double>(bytes_scanned) / (compute_micros * 1e-6);
    node_rate_[node] = node_rate_[node] > 0 ? 0.8 * node_rate_[node] + 0.2 * rate : rate;
  }
}

std::vector<double> RemoteKv::MeanSelectedShare() const {
  std::vector<double> share(options_.num_layers, 0.0);
  for (int64_t l = 0; l < options_.num_layers; ++l) {
    if (share_count_[l] > 0) share[l] = share_sum_[l] / share_count_[l];
  }
  return share;
}

}  // namespace tandem::gpu_worker
