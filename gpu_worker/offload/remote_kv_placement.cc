// RemoteKv's shard placement (remote_kv.h, "Placement"): the planner's view of the nodes and
// shards, capacity checks, re-plans and the live migrations they start. The session lifecycle
// is in remote_kv.cc, appends and attends over the two transports in remote_kv_attend.cc.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/remote_kv.h"
#include "tandem/kv_store/block_format.h"

namespace tandem::gpu_worker {

uint64_t RemoteKv::ShardBytes(int64_t entries, double selected_share, bool int8_rows) const {
  // As the node charges it (kv_store::BlockFormat::ShardBytes): whole blocks of K + V + MAW in
  // the node's storage dtype (the node's default of 64 tokens when the session leaves the block
  // size to it), plus the selected copy at one reservation's size (the placement weighs it
  // against the free bytes the nodes report, so the expected charge, not the 2x bound).
  const kv_store::KvDType dtype = NodeStorageDType(int8_rows, options_.kv_dtype);
  const kv_store::BlockFormat format{options_.block_tokens != 0 ? options_.block_tokens : 64,
                                     static_cast<uint32_t>(options_.head_dim), dtype};
  const uint64_t n = static_cast<uint64_t>(std::max<int64_t>(entries, 0));
  const double share =
      options_.selection == SelectionRule::kPages ? 0.0 : std::clamp(selected_share, 0.0, 1.0);
  return format.ShardBytes(n, static_cast<uint64_t>(std::ceil(static_cast<double>(n) * share)));
}

void RemoteKv::UpdateClaim() {
  GrowNodeSlots();
  if (closed_) {
    claim_.Reset();
    node_bytes_ = 0;
    return;
  }
  const int64_t final_tokens = std::max(expected_tokens_, offloaded_tokens_);
  // A fork's whole blocks of its first fork_prefix_tokens_ entries are its parent's, charged
  // once; the partial last block and the selected rows are copied on write (kv_store Shard).
  const int64_t block = options_.block_tokens != 0 ? options_.block_tokens : 64;
  const int64_t shared_entries = fork_prefix_tokens_ / block * block;
  auto own_bytes = [&](int64_t entries, size_t shard, size_t node) {
    const uint64_t all = ShardBytes(entries, SelectedShare(shard), node_int8_[node]);
    const uint64_t shared =
        ShardBytes(std::min(entries, shared_entries), /*selected_share=*/0.0, node_int8_[node]);
    return all - std::min(all, shared);
  };
  std::vector<uint64_t> projected(opened_.size(), 0);
  std::vector<uint64_t> charged(opened_.size(), 0);
  node_bytes_ = 0;
  for (size_t s = 0; s < placement_.size(); ++s) {
    if (placement_[s] < 0) continue;
    const size_t n = static_cast<size_t>(placement_[s]);
    projected[n] += own_bytes(final_tokens, s, n);
    charged[n] += own_bytes(offloaded_tokens_, s, n);
    node_bytes_ += ShardBytes(offloaded_tokens_, SelectedShare(s), node_int8_[n]);
  }
  // A shard being copied takes its whole size on the target (a copy shares no blocks).
  for (const auto& [shard, to] : migrating_) {
    projected[to] += ShardBytes(final_tokens, SelectedShare(shard), node_int8_[to]);
  }
  for (size_t n = 0; n < opened_.size(); ++n) claim_.Set(n, projected[n], charged[n]);
}

double RemoteKv::SelectedShare(size_t shard) const {
  if (options_.beta == 0.0f) return 1.0;
  if (shard_held_[shard] > 0) {
    return static_cast<double>(shard_selected_[shard]) / static_cast<double>(shard_held_[shard]);
  }
  return options_.expected_selected_share;
}

std::vector<PlacementNode> RemoteKv::PlannerNodes() const {
  // Free bytes less the other sessions' claims (ours is part of held_here).
  const std::vector<NodeState> states = pool_.Snapshot(claim_.id());
  std::vector<PlacementNode> nodes(states.size());
  std::vector<uint64_t> held_here(states.size(), 0);
  for (size_t s = 0; s < placement_.size(); ++s) {
    if (placement_[s] >= 0) {
      const size_t n = static_cast<size_t>(placement_[s]);
      held_here[n] += ShardBytes(static_cast<int64_t>(shard_held_[s]), SelectedShare(s),
                                 n < states.size() && states[n].int8_kv);
    }
  }
  for (size_t n = 0; n < states.size(); ++n) {
    // A node lost for this session takes no shards of it while our old session may linger
    // there (closed when it answers: NodePool::DeferClose); a restarted one (new node id) has
    // none left and takes them again.
    const bool restarted = n < node_ids_.size() && !node_ids_[n].empty() &&
                           !states[n].node_id.empty() && states[n].node_id != node_ids_[n];
    const bool lost = n < lost_.size() && lost_[n] && !restarted;
    nodes[n].accepting = states[n].accepting() && !lost;
    const double measured = n < node_rate_.size() ? node_rate_[n] : 0.0;
    nodes[n].scan_bytes_per_second = measured > 0 ? measured : states[n].scan_bytes_per_second;
    nodes[n].attend_overhead_seconds = options_.attend_overhead_seconds;
    nodes[n].capacity_bytes = states[n].free_bytes + held_here[n];
  }
  if (options_.pool_rates_by_threads) {
    std::vector<int> class_of(states.size(), -1);
    for (size_t n = 0; n < states.size(); ++n) {
      if (states[n].threads > 0) class_of[n] = static_cast<int>(states[n].threads);
    }
    PoolRatesByClass(nodes, class_of);
  }
  return nodes;
}

std::vector<PlacementShard> RemoteKv::PlannerShards(int64_t expected_tokens) const {
  // Memory as the accepting nodes charge it: int8 rows when every one of them stores int8.
  bool int8_rows = false;
  for (const NodeState& st : pool_.Snapshot()) {
    if (!st.accepting()) continue;
    if (!st.int8_kv) {
      int8_rows = false;
      break;
    }
    int8_rows = true;
  }
  const double row = static_cast<double>(options_.head_dim * DTypeBytes(options_.kv_dtype));
  std::vector<PlacementShard> shards(placement_.size());
  for (size_t s = 0; s < placement_.size(); ++s) {
    PlacementShard& shard = shards[s];
    shard.layer = static_cast<uint32_t>(s / options_.num_kv_heads);
    shard.kv_head = static_cast<uint32_t>(s % options_.num_kv_heads);
    const int64_t entries = std::max<int64_t>(static_cast<int64_t>(shard_held_[s]), expected_tokens);
    shard.memory_bytes = ShardBytes(entries, SelectedShare(s), int8_rows);
    // Before the first Attend the selection is unknown: every shard costs the same.
    shard.scan_bytes = shard_held_[s] > 0 ? static_cast<double>(shard_selected_[s]) * 2 * row
                                          : static_cast<double>(std::max<int64_t>(entries, 1)) * 2 * row;
    shard.current_node = placement_[s];
  }
  return shards;
}

absl::Status RemoteKv::CheckCapacity(std::span<const PlacementNode> nodes,
                                     std::span<const PlacementShard> shards,
                                     std::span<const int> node_of) const {
  std::vector<uint64_t> need(nodes.size(), 0);
  for (size_t s = 0; s < shards.size(); ++s) {
    if (node_of[s] < 0 || static_cast<size_t>(node_of[s]) >= nodes.size()) {
      return absl::InternalError("placement plan left a shard unplaced");
    }
    need[node_of[s]] += shards[s].memory_bytes;
  }
  for (size_t n = 0; n < nodes.size(); ++n) {
    if (need[n] > nodes[n].capacity_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "CPU node ", pool_.address(n), " would need ", FormatBytes(need[n]),
          " for this session's shards but has ", FormatBytes(nodes[n].capacity_bytes), " free"));
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteKv::StartMigration(size_t shard, size_t to) {
  GrowNodeSlots();
  const int from = placement_[shard];
  if (from < 0 || static_cast<size_t>(from) == to || to >= opened_.size()) {
    return absl::InvalidArgumentError("bad migration");
  }
  const auto layer = static_cast<uint32_t>(shard / options_.num_kv_heads);
  const auto head = static_cast<uint32_t>(shard % options_.num_kv_heads);
  if (opened_[to]) {
    TANDEM_RETURN_IF_ERROR(Reshard(to, {shard}, {}));
  } else {
    v1::OpenSessionRequest request = OpenRequest({{layer, head}});
    TANDEM_RETURN_IF_ERROR(OpenOn(to, transport_, request));
  }
  migrating_[shard] = to;
  migrator_->Enqueue({layer, head, static_cast<size_t>(from), to});
  ++counters_.migrations_started;
  UpdateClaim();
  return absl::OkStatus();
}

void RemoteKv::AbandonMigration(const MigrationJob& job) {
  const size_t shard = job.layer * options_.num_kv_heads + job.kv_head;
  migrating_.erase(shard);
  ++counters_.migrations_failed;
  UpdateClaim();
  if (opened_[job.to]) {
    if (ShardsOn(job.to) == 0) {
      CloseEmptyOn(job.to);
    } else if (absl::Status s = Reshard(job.to, {}, {shard}); !s.ok()) {
      spdlog::warn("session {}: dropping the partial copy of shard ({}, {}): {}",
                   options_.session_id, job.layer, job.kv_head, std::string(s.message()));
    }
  }
}

absl::Status RemoteKv::CompleteMigration(const ShardMigrator::Finished& finished) {
  const MigrationJob& job = finished.job;
  const size_t shard = job.layer * options_.num_kv_heads + job.kv_head;
  absl::Status status = finished.status;
  if (status.ok()) {
    // The entries appended since the bulk copy started; nothing appends while we are here.
    absl::StatusOr<uint64_t> tail = migrator_->CopyRange(job, finished.copied);
    status = tail.status();
  }
  if (!status.ok()) {
    spdlog::warn("session {}: migrating shard ({}, {}) from {} to {} failed: {}",
                 options_.session_id, job.layer, job.kv_head, pool_.address(job.from),
                 pool_.address(job.to), std::string(status.message()));
    AbandonMigration(job);
    return status;
  }
  if (finished.seconds > 0 && finished.copied > 0) {
    const double bytes = static_cast<double>(finished.copied) *
                         (2.0 * options_.head_dim * DTypeBytes(options_.kv_dtype) + sizeof(float));
    const double rate = bytes / finished.seconds;
    migration_rate_ = migration_rate_ > 0 ? 0.8 * migration_rate_ + 0.2 * rate : rate;
  }
  // Switch: from the next Attend and Append on, the shard lives on `to`; then free it on `from`.
  placement_[shard] = static_cast<int>(job.to);
  migrating_.erase(shard);
  ++counters_.migrations_done;
  // The copy holds all its blocks: claimed as not shared from here on (for every shard, on the
  // safe side: the claim tracks the prefix per session, not per shard).
  fork_prefix_tokens_ = 0;
  UpdateClaim();
  if (ShardsOn(job.from) == 0) {
    CloseEmptyOn(job.from);
  } else if (absl::Status s = Reshard(job.from, {}, {shard}); !s.ok()) {
    spdlog::warn("session {}: freeing migrated shard ({}, {}) on {}: {}", options_.session_id,
                 job.layer, job.kv_head, pool_.address(job.from), std::string(s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<PlacementPlan> RemoteKv::PlanMoves(ReplanKind kind,
                                                  std::span<const PlacementNode> nodes,
                                                  std::span<const PlacementShard> shards) {
  PlacementOptions po;
  po.time_budget = options_.plan_budget;
  po.min_relative_gain = kind == ReplanKind::kForcedOnly ? std::numeric_limits<double>::infinity()
                                                         : options_.replan_min_gain;
  if (kind == ReplanKind::kCost) {
    po.min_gain_seconds = options_.replan_min_gain_seconds;
    po.move_bytes_per_second =
        migration_rate_ > 0 ? migration_rate_ : options_.migration_bytes_per_second;
    // Decode steps left until the session reaches the size it was planned for.
    po.remaining_steps = static_cast<double>(std::max<int64_t>(
        expected_tokens_ - offloaded_tokens_, std::max(options_.replan_every_steps, 1)));
  }
  const auto t0 = Clock::now();
  absl::StatusOr<PlacementPlan> plan = gpu_worker::Replan(nodes, shards, po);
  counters_.last_plan_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  ++counters_.replans;
  if (!plan.ok()) return plan.status();
  TANDEM_RETURN_IF_ERROR(CheckCapacity(nodes, shards, plan->node_of));
  counters_.modelled_step_seconds = plan->step_seconds;
  return plan;
}

absl::Status RemoteKv::ReplanAndMigrate(ReplanKind kind) {
  GrowNodeSlots();
  const std::vector<PlacementNode> nodes = PlannerNodes();
  const std::vector<PlacementShard> shards = PlannerShards(expected_tokens_);
  TANDEM_ASSIGN_OR_RETURN(const PlacementPlan plan, PlanMoves(kind, nodes, shards));
  for (size_t s = 0; s < placement_.size(); ++s) {
    const int to = plan.node_of[s];
    if (to == placement_[s] || migrating_.count(s) > 0) continue;
    if (lost_[placement_[s]]) continue;   // its entries are gone; nothing to copy
    if (absl::Status st = StartMigration(s, static_cast<size_t>(to)); !st.ok()) {
      spdlog::warn("session {}: cannot start migrating shard ({}, {}) to {}: {}",
                   options_.session_id, s / options_.num_kv_heads, s % options_.num_kv_heads,
                   pool_.address(to), std::string(st.message()));
      ++counters_.migrations_failed;
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteKv::Reserve(int64_t expected_tokens) {
  if (closed_) return absl::FailedPreconditionError("the session is closed");
  // Adopted only once the reservation holds: a refused turn leaves the projection (and so every
  // later re-plan) where it was.
  const int64_t expected = std::max(expected_tokens_, expected_tokens);
  GrowNodeSlots();
  std::vector<PlacementNode> nodes = PlannerNodes();
  const std::vector<PlacementShard> shards = PlannerShards(expected);
  if (!CheckCapacity(nodes, shards, placement_).ok()) {
    // The pool's free bytes are as fresh as its last Stats: look again before moving shards.
    (void)pool_.Refresh();
    nodes = PlannerNodes();
  }
  if (CheckCapacity(nodes, shards, placement_).ok()) {
    expected_tokens_ = expected;
    UpdateClaim();
    return absl::OkStatus();
  }
  // Some node would overflow: move shards now (the copies run while the turn prefills).
  if (!migrating_.empty()) {
    for (const MigrationJob& job : migrator_->CancelAll()) AbandonMigration(job);
  }
  // Only the moves that make room (a full reshuffle only when no such moves suffice); a move
  // that cannot start fails the reservation.
  TANDEM_ASSIGN_OR_RETURN(const PlacementPlan plan,
                          PlanMoves(ReplanKind::kForcedOnly, nodes, shards));
  for (size_t s = 0; s < placement_.size(); ++s) {
    if (plan.node_of[s] != placement_[s] && !lost_[placement_[s]]) {
      absl::Status started = StartMigration(s, static_cast<size_t>(plan.node_of[s]));
      if (!started.ok()) {
        UpdateClaim();
        return started;
      }
    }
  }
  expected_tokens_ = expected;
  UpdateClaim();
  return absl::OkStatus();
}

absl::Status RemoteKv::Maintain() {
  if (closed_ || attend_layer_ >= 0) return absl::OkStatus();
  GrowNodeSlots();
  SyncWithPool();
  for (const ShardMigrator::Finished& f : migrator_->TakeFinished()) {
    (void)CompleteMigration(f);   // a failed migration leaves the shard where it was
  }
  ++steps_since_plan_;
  const uint64_t generation = pool_.generation();
  if (generation != pool_generation_) {   // a node joined, left, or changed its accepting state
    pool_generation_ = generation;
    nodes_changed_ = true;
  }
  if (!migrating_.empty()) return absl::OkStatus();   // one round of moves at a time
  const bool balanced = options_.placement == PlacementPolicy::kBalanced;
  const bool periodic = balanced && options_.replan_every_steps > 0 &&
                        steps_since_plan_ >= options_.replan_every_steps;
  if (!nodes_changed_ && !replan_due_ && !periodic) return absl::OkStatus();
  // Uniform placement only moves what must move (shards on nodes that stopped accepting).
  const ReplanKind kind = !balanced          ? ReplanKind::kForcedOnly
                          : steady_state_due_ ? ReplanKind::kSteadyState
                                              : ReplanKind::kCost;
  steps_since_plan_ = 0;
  nodes_changed_ = false;
  replan_due_ = steady_state_due_ = false;
  return ReplanAndMigrate(kind);
}

absl::Status RemoteKv::SettleMigrations(std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  TANDEM_RETURN_IF_ERROR(Maintain());
  while (!migrating_.empty()) {
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(migrating_.size(), " shard migrations still running"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    for (const ShardMigrator::Finished& f : migrator_->TakeFinished()) (void)CompleteMigration(f);
  }
  return absl::OkStatus();
}

double RemoteKv::ModelledStepSeconds() const {
  return StepSeconds(PlannerNodes(), PlannerShards(expected_tokens_), placement_);
}

}  // namespace tandem::gpu_worker
