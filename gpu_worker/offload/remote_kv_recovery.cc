// RemoteKv's recovery from node loss (remote_kv.h, "Failure model"): marking a node lost for the
// session, noticing what the pool learned, and rebuilding the lost shards on the remaining nodes
// from recomputed K/V. Placement and migrations are in remote_kv_placement.cc.
#include <algorithm>
#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"
#include "node_link.h"
#include "node_rpc.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {
namespace {

// Rebuilt shards of MAW sessions select every entry (the threshold beta / window_entries is
// then below any MAW of 1) until the next turn's Reselect measures their salience.
constexpr float kRebuiltMaw = 1.0f;
constexpr int64_t kRebuiltWindowEntries = int64_t{1} << 30;

}  // namespace

void RemoteKv::MarkLost(size_t node, const absl::Status& why) {
  GrowNodeSlots();
  if (lost_[node]) return;
  if (IsNodeFailure(why)) pool_.ReportFailure(node, why);
  lost_[node] = true;
  suspect_[node] = false;
  ++counters_.nodes_lost;
  spdlog::warn("session {}: CPU node {} lost ({}); its shards are degraded until rebuilt",
               options_.session_id, pool_.address(node), std::string(why.message()));
  // Copies from or to the node cannot finish; the others start again after the rebuild.
  if (migrator_ != nullptr && !migrating_.empty()) {
    for (const MigrationJob& job : migrator_->CancelAll()) AbandonMigration(job);
    replan_due_ = true;
  }
  if (grpc_[node] != nullptr) {
    grpc_[node]->Join();
    grpc_[node].reset();
  }
  shm_[node].reset();
  if (opened_[node]) {
    // Its session there (if the process still runs) is closed once it answers again.
    pool_.DeferClose(node, options_.session_id, node_ids_[node]);
    opened_[node] = false;
  }
  // A lost node without shards of ours needs no rebuild: it is just unused from now on.
  if (ShardsOn(node) == 0) lost_[node] = false;
}

void RemoteKv::NodeFailed(size_t node, const absl::Status& why) {
  if (why.code() != absl::StatusCode::kDeadlineExceeded) {
    MarkLost(node, why);
    return;
  }
  pool_.ReportFailure(node, why);
  if (!suspect_[node]) {
    spdlog::warn(
        "session {}: CPU node {} missed a deadline; its heads are degraded until it "
        "answers again",
        options_.session_id, pool_.address(node));
  }
  suspect_[node] = true;
  synced_generation_ = 0;  // the next SyncWithPool looks again
}

void RemoteKv::SyncWithPool() {
  const uint64_t generation = pool_.generation();
  if (generation == synced_generation_) return;
  synced_generation_ = generation;
  GrowNodeSlots();
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n]) continue;
    if (absl::Status lost = PoolSaysLost(n); !lost.ok()) {
      MarkLost(n, lost);
      continue;
    }
    // Out of placement after someone's missed deadline: skipped until it answers again.
    suspect_[n] = !pool_.state(n).reachable;
  }
}

absl::Status RemoteKv::PoolSaysLost(size_t n) const {
  const NodeState st = pool_.state(n);
  if (n < node_ids_.size() && !node_ids_[n].empty() && !st.node_id.empty() &&
      st.node_id != node_ids_[n]) {
    return absl::NotFoundError(
        absl::StrCat("CPU node ", st.address, " restarted: its sessions are gone"));
  }
  // Refusing calls (connection refused or reset): its process is gone with our shards.
  if (!st.reachable && st.refused) {
    return absl::UnavailableError(
        absl::StrCat("CPU node ", st.address, " refuses calls: its process is taken as gone"));
  }
  return absl::OkStatus();
}

void RemoteKv::CheckNodes() {
  GrowNodeSlots();
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n] || lost_[n] || ShardsOn(n) == 0) continue;
    grpc::ClientContext ctx;
    SetDeadline(ctx, options_.attend_deadline_ms);
    v1::StatsResponse stats;
    const grpc::Status s = pool_.stub(n).Stats(&ctx, v1::StatsRequest(), &stats);
    if (!s.ok()) {
      NodeFailed(n, NodeError(pool_.address(n), "Stats", s));
    } else if (!node_ids_[n].empty() && stats.node_id() != node_ids_[n]) {
      MarkLost(n, absl::NotFoundError(absl::StrCat("CPU node ", pool_.address(n),
                                                   " restarted: its sessions are gone")));
    }
  }
}

bool RemoteKv::needs_rebuild() const {
  for (const std::unique_ptr<ShmLink>& link : shm_) {
    if (link != nullptr && link->peer_exited()) return true;
  }
  for (int node : placement_) {
    if (node >= 0 && static_cast<size_t>(node) < lost_.size() && lost_[node]) return true;
  }
  if (pool_.generation() == synced_generation_) return false;
  // The pool changed since the session looked: what SyncWithPool would mark lost, once per
  // node that holds shards.
  std::vector<bool> seen(lost_.size(), false);
  for (int node : placement_) {
    if (node < 0 || static_cast<size_t>(node) >= lost_.size() || seen[node]) continue;
    seen[node] = true;
    if (!PoolSaysLost(node).ok()) return true;
  }
  return false;
}

absl::Status RemoteKv::RebuildLost(const RecomputeKv& recompute) {
  if (closed_ || attend_layer_ >= 0) return absl::OkStatus();
  SyncWithPool();
  for (size_t n = 0; n < shm_.size(); ++n) {
    if (shm_[n] != nullptr && shm_[n]->peer_exited()) {
      MarkLost(n, absl::UnavailableError(absl::StrCat("CPU node ", pool_.address(n),
                                                      ": the shm peer process exited")));
    }
  }
  if (!needs_rebuild()) return absl::OkStatus();
  const auto t0 = Clock::now();
  if (migrator_ != nullptr && !migrating_.empty()) {
    for (const MigrationJob& job : migrator_->CancelAll()) AbandonMigration(job);
    replan_due_ = true;
  }
  // New nodes for the lost shards only (lost nodes do not accept): the planner's forced moves.
  const std::vector<PlacementNode> nodes = PlannerNodes();
  const std::vector<PlacementShard> shards = PlannerShards(expected_tokens_);
  absl::StatusOr<PlacementPlan> plan = PlanMoves(ReplanKind::kForcedOnly, nodes, shards);
  if (!plan.ok()) {
    return absl::Status(
        plan.status().code(),
        absl::StrCat("rebuilding the shards of lost CPU nodes: ", plan.status().message()));
  }
  std::map<size_t, std::vector<size_t>> to_node;  // target -> shards
  std::vector<int> from(placement_.size(), -1);
  for (size_t s = 0; s < placement_.size(); ++s) {
    if (!lost_[placement_[s]]) continue;
    const int to = plan->node_of[s];
    if (to < 0 || !nodes[to].accepting) {
      return absl::UnavailableError("no CPU node accepts the shards of the lost nodes");
    }
    to_node[static_cast<size_t>(to)].push_back(s);
    from[s] = placement_[s];
  }
  // Open the shards (empty) on their new nodes, then point the placement at them.
  for (const auto& [to, list] : to_node) {
    absl::Status opened;
    if (opened_[to]) {
      opened = Reshard(to, list, {});
    } else {
      std::vector<std::pair<uint32_t, uint32_t>> ids;
      for (size_t s : list) {
        ids.emplace_back(static_cast<uint32_t>(s / options_.num_kv_heads),
                         static_cast<uint32_t>(s % options_.num_kv_heads));
      }
      v1::OpenSessionRequest request = OpenRequest(ids);
      opened = OpenOn(to, transport_, request);
    }
    if (!opened.ok()) {
      MarkLost(to, opened);
      return opened;
    }
  }
  // Undoes the switch of the shards whose rebuild did not complete: they stay lost.
  auto undo = [&](const absl::Status& why) {
    std::vector<bool> source(lost_.size(), false);
    for (size_t s = 0; s < from.size(); ++s) {
      if (from[s] >= 0) {
        placement_[s] = from[s];
        source[from[s]] = true;
      }
    }
    for (const auto& [to, list] : to_node) {
      if (!opened_[to] || lost_[to]) continue;
      if (source[to]) {  // a restarted node rebuilt onto: lost again, session closed there
        MarkLost(to, why);
      } else if (ShardsOn(to) == 0) {
        CloseEmptyOn(to);
      } else if (absl::Status st = Reshard(to, {}, list); !st.ok()) {
        MarkLost(to, st);
      }
    }
    for (size_t n = 0; n < source.size(); ++n) {
      if (source[n]) lost_[n] = true;
    }
    UpdateClaim();
    return why;
  };
  for (const auto& [to, list] : to_node) {
    for (size_t s : list) placement_[s] = static_cast<int>(to);
  }
  const int64_t tokens = offloaded_tokens_;
  if (tokens > 0) {
    std::vector<float> maw(static_cast<size_t>(options_.num_kv_heads * tokens), kRebuiltMaw);
    absl::Status appended = recompute(
        tokens, [&](int64_t layer, const void* k, const void* v, int64_t count) -> absl::Status {
          if (count != tokens || layer < 0 || layer >= options_.num_layers) {
            return absl::InternalError(absl::StrCat("recomputed ", count, " entries of layer ",
                                                    layer, ", expected ", tokens));
          }
          for (const auto& [to, list] : to_node) {
            std::vector<uint32_t> heads;
            for (size_t s : list) {
              if (static_cast<int64_t>(s) / options_.num_kv_heads == layer) {
                heads.push_back(static_cast<uint32_t>(s % options_.num_kv_heads));
              }
            }
            if (heads.empty()) continue;
            const absl::Status s =
                shm_[to] != nullptr ? shm_[to]->Append(layer, heads, k, v, maw.data(), tokens,
                                                       kRebuiltWindowEntries, &shm_append_chunks_)
                                    : Grpc(to).Append(layer, heads, k, v, maw.data(), tokens,
                                                      kRebuiltWindowEntries);
            // A node failure loses the node; a refusal (RESOURCE_EXHAUSTED: the rebuilt
            // shards select every entry) only drops the partial copies (undo below).
            if (!s.ok()) {
              if (IsNodeFailure(s)) MarkLost(to, s);
              return s;
            }
          }
          return absl::OkStatus();
        });
    if (!appended.ok()) {
      return undo(absl::Status(appended.code(),
                               absl::StrCat("rebuilding lost shards: ", appended.message())));
    }
  }
  size_t rebuilt = 0;
  for (const auto& [to, list] : to_node) rebuilt += list.size();
  for (size_t n = 0; n < lost_.size(); ++n) {
    if (lost_[n] && ShardsOn(n) == 0) lost_[n] = false;
  }
  counters_.shards_rebuilt += rebuilt;
  fork_prefix_tokens_ = 0;   // rebuilt shards share nothing (see CompleteMigration)
  UpdateClaim();
  counters_.last_rebuild_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  spdlog::info("session {}: rebuilt {} shards ({} entries each) on {} node(s) in {:.1f} ms",
               options_.session_id, rebuilt, tokens, to_node.size(), counters_.last_rebuild_ms);
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
