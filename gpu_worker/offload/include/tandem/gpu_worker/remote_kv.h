// RemoteKv: one sequence's offloaded KV cache, spread over the CPU attention nodes of a NodePool.
// It places the (layer, kv head) shards on the nodes, opens the session on each node that got
// some, appends evicted blocks, runs the per-layer Attend in the background while the device
// attends over its window, and closes the session (also from the destructor, best effort).
//
// Placement (issue 5; placement_planner.h): a shard is one kv head with its G query heads, so a
// GQA group never splits. At Open the shards are planned over the accepting nodes (balanced:
// LPT + local search on the cost model; uniform: (layer·H_kv + head) mod nodes), with each
// node's free memory from Stats against the shards' projected bytes (expected_tokens): a session
// that fits nowhere is RESOURCE_EXHAUSTED before any block is sent. Every Attend reply refreshes
// the shards' costs (selected entries × D × 2 × dtype bytes) and the nodes' scan rates;
// Maintain(), called between decode steps, re-plans every replan_every_steps steps or when a
// node joins or stops accepting, and migrates the shards whose node changed without stopping
// the session (shard_migrator.h: copy in the background, then between two steps copy the tail,
// switch the shard's traffic, free it on the old node).
//
// Failure model (DESIGN.md, issue 14): every call has a deadline. A node that fails a call
// leaves its heads' partial state empty (LSE -inf, valid by the merge): the step is degraded
// and counted, and the request goes on. A node that misses an Attend deadline is *suspect*:
// the pool takes it out of placement (NodePool::ReportFailure) and this session skips it
// (degraded steps) until the pool's health watch hears from it again; if an eviction must be
// appended meanwhile, it becomes lost. A node that fails otherwise (connection lost, shm peer
// process gone: noticed within ~2 ms, its session gone after a restart) is *lost* for this
// session at once: nothing more is sent to it, and the session it held there is closed when it
// answers again (NodePool::DeferClose). The lost node's shards are rebuilt on the nodes that remain by
// RebuildLost(): new nodes are planned for them, and K/V of every offloaded position is
// recomputed by the caller (a GPU prefill of the session's tokens) and appended there; steps
// are degraded until then and not after. A request fails only when no node can hold its KV
// (Open: UNAVAILABLE / RESOURCE_EXHAUSTED naming why); Open retries without a node that fails
// its OpenSession.
//
// Transport (per node, chosen at Open; see NodeTransport): the data path goes through a node
// link (src/node_link.h): over shared memory (a node on this host) StartAttend writes q into the
// session's segment and wakes the node, FinishAttend spins and then sleeps in a futex until the
// answer or the attend deadline, and Append streams the blocks in chunks that fill the request
// area; otherwise gRPC. An Attend too large for the areas (a long prefill chunk) goes over gRPC.
// A node that has not answered the previous shm request yet (it missed a deadline) is skipped
// for the next Attend (degraded). Control calls (OpenSession, Reselect, CloseSession) always
// use gRPC.
//
// Not thread-safe: one thread (the engine's executor) drives a RemoteKv; the gRPC completions
// of StartAttend land on gRPC threads and are joined by FinishAttend.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/dtype.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/page_selection.h"
#include "tandem/gpu_worker/placement_planner.h"
#include "tandem/gpu_worker/shard_migrator.h"
#include "tandem/kv_store/block_format.h"

namespace tandem::gpu_worker {

class GrpcLink;
class ShmLink;
struct LinkSession;
struct NodeAnswer;

// How a node stores a session's K/V rows: int8 on an int8 node, else the dtype the worker
// sends (f32 or bf16) — what the node charges its memory in (kv_store::BlockFormat).
inline kv_store::KvDType NodeStorageDType(bool int8_rows, DType sent) {
  if (int8_rows) return kv_store::KvDType::kInt8;
  return sent == DType::kF32 ? kv_store::KvDType::kF32 : kv_store::KvDType::kBf16;
}

// kBalanced: cost-model planning and live re-planning. kUniform: the cost-blind spread (the
// baseline); its shards move only off nodes that stop accepting.
enum class PlacementPolicy { kUniform, kBalanced };
// "uniform" or "balanced"; INVALID_ARGUMENT otherwise.
absl::StatusOr<PlacementPolicy> ParsePlacementPolicy(const std::string& name);

struct RemoteKvOptions {
  std::string session_id;
  int64_t num_layers = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  DType kv_dtype = DType::kBF16;  // kBF16 or kF32 (as stored on the device window)
  float beta = 1.0f;               // kMaw only
  uint32_t block_tokens = 0;      // 0 = the node's default
  // Sent at OpenSession on every node (also on nodes that get shards later by migration).
  // kPages: the nodes keep no selected copy; each StartAttend names the pages (or none =
  // every held entry); Reselect is a no-op.
  SelectionRule selection = SelectionRule::kMaw;
  uint32_t page_tokens = 16;      // kPages: entries per page, 1..4096
  int attend_deadline_ms = 1000;
  int control_deadline_ms = 30000;   // OpenSession, AppendKv, Reselect, CloseSession (ms)
  // Unset: the pool's transport (NodePoolOptions::transport).
  std::optional<NodeTransport> transport;
  // Shared-memory channel per node (reserved in /dev/shm while the session is open): the
  // request area holds two Append chunks or the q of one Attend, the response area the
  // (o, lse) of one Attend (T * H_q * (D + 1) * 4 bytes at most). The defaults carry a
  // 512-token prefill chunk of Llama-3-8B (H_q 32, D 128) in both directions.
  uint64_t shm_request_bytes = (16ull << 20) + (64 << 10);
  uint64_t shm_response_bytes = 9ull << 20;
  uint32_t shm_spin_us = 10;          // spin before sleeping while waiting for an answer
  // Bytes of one Append chunk over shm (at most half the request area: two chunks alternate).
  uint64_t shm_append_chunk_bytes = 8ull << 20;

  // --- Placement.
  // Offloaded entries per shard the session is expected to reach (prompt + generated tokens -
  // window - sink): the capacity check and the memory side of the plan. 0 = unknown (nothing is
  // projected beyond what is held; the nodes' own RESOURCE_EXHAUSTED then is the limit).
  int64_t expected_tokens = 0;
  // Share of a shard's entries expected in the node's selected copy before the first Attend
  // measures it (beta = 0 selects everything and always projects 1). HGCA keeps <1%..30%; a
  // shard that selects more than projected can meet RESOURCE_EXHAUSTED on its node later.
  double expected_selected_share = 0.3;
  PlacementPolicy placement = PlacementPolicy::kBalanced;
  int replan_every_steps = 16;       // Maintain() calls between cost re-plans; 0 = never
  // A cost re-plan migrates only for a modelled step gain of at least replan_min_gain (relative)
  // and replan_min_gain_seconds, that repays the copy before the session reaches
  // expected_tokens (gain × remaining decode steps ≥ moved bytes / copy rate; the horizon is at
  // least replan_every_steps). The copy rate is migration_bytes_per_second until a bulk copy has
  // been timed, then the measured one; 0 = migrations need not repay themselves.
  double replan_min_gain = 0.05;
  double replan_min_gain_seconds = 50e-6;
  double migration_bytes_per_second = 1e9;
  double attend_overhead_seconds = 100e-6;   // fixed cost of one Attend on a node (model)
  // Plan nodes with the same attention thread count (Stats.threads) as equally fast (the mean
  // of their measured rates, see PoolRatesByClass); false: each node's own measured rate.
  bool pool_rates_by_threads = true;
  std::chrono::microseconds plan_budget{3000};   // planner time budget
  uint32_t migration_chunk_entries = 4096;
};

// Counters of the placement machinery (since Open).
struct PlacementCounters {
  uint64_t replans = 0;             // re-plans computed
  uint64_t migrations_started = 0;
  uint64_t migrations_done = 0;     // switched to the new node
  uint64_t migrations_failed = 0;   // abandoned (the shard stayed where it was)
  uint64_t bytes_migrated = 0;
  uint64_t nodes_lost = 0;          // nodes this session lost (a failed call, a restart)
  uint64_t shards_rebuilt = 0;      // shards re-created on other nodes by RebuildLost
  double last_rebuild_ms = 0;       // wall time of the last RebuildLost that rebuilt shards
  double modelled_step_seconds = 0;   // of the current placement (the planner's model)
  double last_plan_ms = 0;            // wall time of the last plan
};

// RebuiltLayerSink and RecomputeKv (what RebuildLost appends) are offload_tier.h's.

// Selection counters of one layer, summed over its kv heads.
struct LayerSelection {
  uint64_t selected = 0;
  uint64_t held = 0;
};

class RemoteKv {
 public:
  static absl::StatusOr<std::unique_ptr<RemoteKv>> Open(NodePool& pool,
                                                        const RemoteKvOptions& options);
  ~RemoteKv();
  RemoteKv(const RemoteKv&) = delete;
  RemoteKv& operator=(const RemoteKv&) = delete;

  // Appends `num_tokens` entries of every kv head of `layer`, head-major:
  //   k, v: [num_kv_heads, num_tokens, head_dim] of kv_dtype; maw: [num_kv_heads, num_tokens]
  // window_entries: entries on the device when they were evicted (the β / n_gpu threshold).
  absl::Status Append(int64_t layer, const void* k, const void* v, const float* maw,
                      int64_t num_tokens, int64_t window_entries);

  // Sends q ([num_tokens, num_q_heads, head_dim] f32, host; copied) of `layer` to the nodes
  // that own heads of it. Exactly one FinishAttend must follow (unless an error is returned).
  // `pages` (kPages sessions; ids [num_tokens, num_kv_heads, per_head], copied): the pages each
  // (token, kv head) attends over; nullptr = every held entry (dense, exact). pages on a kMaw
  // session, or a negative per_head / null ids with per_head > 0: INVALID_ARGUMENT before
  // anything is sent. The nodes check the ids (ascending, -1 padding last, held).
  absl::Status StartAttend(int64_t layer, const float* q, int64_t num_tokens,
                           const PageSelection* pages = nullptr);
  // Waits for the replies of StartAttend and writes the partial states of all query heads:
  //   o: [num_tokens, num_q_heads, head_dim] f32, lse: [num_tokens, num_q_heads] f32
  // Heads without an answer (or without entries) get o = 0, lse = -inf. Returns true when
  // some node's answer is missing (a degraded step).
  absl::StatusOr<bool> FinishAttend(float* o, float* lse);

  // Re-evaluates the salience of `layer`'s offloaded entries with fresh queries (multi-turn).
  // kPages sessions: a no-op returning OK (pages are chosen with every step's query).
  absl::Status Reselect(int64_t layer, const float* q, int64_t num_tokens,
                        std::optional<float> beta);

  // Re-checks capacity for `expected_tokens` entries per shard (a new turn of a kept session):
  // RESOURCE_EXHAUSTED when the nodes cannot hold them, else OK (shards may start migrating).
  absl::Status Reserve(int64_t expected_tokens);
  // Between decode steps (never while an Attend is in flight): completes finished migrations,
  // re-plans when due or when the node set changed, starts migrations. Cheap when idle.
  absl::Status Maintain();
  // Shards placed on a node this session lost (their entries are gone; their attends are
  // degraded) wait for RebuildLost; also true when a shm peer process exited, or when the pool
  // has seen, since the session last looked, a node holding its shards restart or refuse calls
  // (RebuildLost marks those lost), so that an idle session's next turn starts with its shards
  // rebuilt. Other changes of the pool (a lost node's later probes, nodes joining) are not.
  bool needs_rebuild() const;
  // At a new turn of a kept session (an idle session may have lost a node unnoticed): Stats of
  // each node holding its shards, with the attend deadline; a node that fails it or restarted
  // meanwhile is suspect / lost (RebuildLost then rebuilds before the turn's first pass).
  void CheckNodes();
  // Between decode steps: plans accepting nodes for the lost shards, opens them there and
  // appends the K/V `recompute` produces for all offloaded_tokens() entries (MAW selection:
  // every rebuilt entry selected, as with beta 0, until the next turn's Reselect). Afterwards
  // those shards attend normally. UNAVAILABLE / RESOURCE_EXHAUSTED when no node can take them
  // (the shards stay lost; call again later), or the recompute's error (likewise).
  absl::Status RebuildLost(const RecomputeKv& recompute);
  // Runs Maintain until no migration is pending or `timeout` passes (tests, benchmarks).
  absl::Status SettleMigrations(std::chrono::milliseconds timeout);
  // Forces a cost re-plan at the next Maintain() that ignores the copy's payback (not the
  // relative gain): the steady-state placement, for tests and benchmarks.
  void RequestReplan() { replan_due_ = steady_state_due_ = true; }

  absl::Status Close();

  // A session `session_id` on the same nodes holding this one's offloaded entries, its shards
  // placed as this one's and opened with fork_from (without it while none are offloaded): the
  // nodes share the blocks by reference (copy-on-write), nothing is copied. Options as this one's but the id and expected_tokens.
  // FAILED_PRECONDITION while a migration or a lost node's rebuild is pending (the fork would
  // not know where its shards are); a node's OpenSession error (the sessions opened so far are
  // closed).
  absl::StatusOr<std::unique_ptr<RemoteKv>> Fork(const std::string& session_id,
                                                 int64_t expected_tokens) const;

  // Node (pool index) of every shard, [layer * H_kv + kv_head].
  const std::vector<int>& placement() const { return placement_; }
  // Pool indices of the nodes holding shards of this session.
  std::vector<size_t> nodes_in_use() const;
  size_t migrations_pending() const { return migrating_.size(); }
  const PlacementCounters& placement_counters() const { return counters_; }
  // The planner's model of the CPU side of one step (Σ over layers of the slowest node) for
  // the current placement with the costs and rates measured so far.
  double ModelledStepSeconds() const;

  int64_t offloaded_tokens() const { return offloaded_tokens_; }   // per (layer, kv head)
  // Mean over Attend calls of selected/held per layer (entries held > 0 only).
  std::vector<double> MeanSelectedShare() const;
  // The last Attend's counters per layer.
  const std::vector<LayerSelection>& last_selection() const { return last_selection_; }
  // The last finished Attend's compute time on the slowest node that answered (the node's own
  // measure of its kernels, from waking its threads to the merged result), seconds.
  double last_attend_compute_s() const { return last_attend_compute_s_; }
  // The same for the node's whole handling of the call (shm nodes; 0 when none answered over
  // shm): checks, planning, the compute above and the answer's layout.
  double last_attend_handle_s() const { return last_attend_handle_s_; }
  uint64_t degraded_attends() const { return degraded_attends_; }
  // Nodes whose Attend / AppendKv go over shared memory, and the requests sent that way.
  size_t shm_nodes() const;
  uint64_t shm_attends() const { return shm_attends_; }
  uint64_t shm_append_chunks() const { return shm_append_chunks_; }
  const RemoteKvOptions& options() const { return options_; }
  // What this session's own entries take on the nodes now (ShardBytes of its offloaded entries
  // on each shard's node, less the prefix a fork shares with its parent); 0 once closed. O(1):
  // kept up to date by UpdateClaim.
  uint64_t NodeBytes() const { return closed_ ? 0 : node_bytes_; }

 private:
  using Clock = std::chrono::steady_clock;
  RemoteKv(NodePool& pool, const RemoteKvOptions& options);
  std::vector<uint32_t> HeadsOf(size_t node, int64_t layer) const;
  size_t NodeOf(int64_t layer, int64_t kv_head) const {
    return static_cast<size_t>(placement_[layer * options_.num_kv_heads + kv_head]);
  }
  // Grows the per-node vectors to the pool's size (nodes join at any time).
  void GrowNodeSlots();
  v1::OpenSessionRequest OpenRequest(const std::vector<std::pair<uint32_t, uint32_t>>& shards) const;
  // The planner's view of the nodes and the shards now.
  std::vector<PlacementNode> PlannerNodes() const;
  std::vector<PlacementShard> PlannerShards(int64_t expected_tokens) const;
  // Projected node bytes of a shard of `entries` entries of which `selected_share` are selected
  // (kPages: no selected copy, share 0).
  // int8_rows: the node stores int8 rows (--node_kv_dtype=int8: head_dim + 4 bytes a row).
  uint64_t ShardBytes(int64_t entries, double selected_share, bool int8_rows) const;
  double SelectedShare(size_t shard) const;   // measured, or the projection before any Attend
  // Re-plans and starts the migrations: forced moves only (kForcedOnly), moves that repay
  // their copy (kCost), or the best placement whatever the copy costs (kSteadyState).
  enum class ReplanKind { kForcedOnly, kCost, kSteadyState };
  absl::Status ReplanAndMigrate(ReplanKind kind);
  // The planner's moves of `kind` from the current placement (counted in placement_counters);
  // RESOURCE_EXHAUSTED when they would overfill a node.
  absl::StatusOr<PlacementPlan> PlanMoves(ReplanKind kind, std::span<const PlacementNode> nodes,
                                          std::span<const PlacementShard> shards);
  // RESOURCE_EXHAUSTED when `node_of` puts more projected bytes on a node than it can take.
  absl::Status CheckCapacity(std::span<const PlacementNode> nodes,
                             std::span<const PlacementShard> shards,
                             std::span<const int> node_of) const;
  absl::Status StartMigration(size_t shard, size_t to);
  absl::Status CompleteMigration(const ShardMigrator::Finished& finished);
  // Drops the target shard of an abandoned migration; closes the node's session if it has
  // no shard of ours left.
  void AbandonMigration(const MigrationJob& job);
  absl::Status Reshard(size_t node, const std::vector<size_t>& add, const std::vector<size_t>& drop);
  // Closes the session on one node (no-op where it is not open); the node's slot is free
  // afterwards whatever the node answered.
  absl::Status CloseOn(size_t node);
  // CloseOn for a node left without shards of ours mid-session: a failure is only logged.
  void CloseEmptyOn(size_t node);
  // Counts a node's shards (placed or arriving by migration).
  size_t ShardsOn(size_t node) const;
  absl::Status OpenOn(size_t node, NodeTransport transport, v1::OpenSessionRequest& request);
  // The migrator of a session opened (Open, Fork).
  void CreateMigrator();
  // Open() once over the accepting nodes (Open retries it without nodes that fail).
  static absl::StatusOr<std::unique_ptr<RemoteKv>> OpenOnce(NodePool& pool,
                                                            const RemoteKvOptions& options);
  // Node `node` failed `why` (or left the pool): see "Failure model". No call may be in flight
  // on its links except a gRPC Attend (joined here).
  void MarkLost(size_t node, const absl::Status& why);
  // A call to `node` failed: DEADLINE_EXCEEDED makes it suspect, anything else lost.
  void NodeFailed(size_t node, const absl::Status& why);
  // Marks lost the opened nodes that restarted or that the pool found refusing calls; marks
  // suspect those out of placement otherwise (a missed deadline).
  void SyncWithPool();
  // Why the pool's latest state says opened node `node` lost this session's shards (it
  // restarted, or refuses calls); OK when they may still be there.
  absl::Status PoolSaysLost(size_t node) const;
  // Tells the pool what this session will charge on each node by the end of its expected length
  // and has charged so far (NodePool "Claims"), and updates NodeBytes(). After every change of
  // placement, expected length or offloaded entries.
  void UpdateClaim();
  // The gRPC link to `node` (made on first use), and what links know of the session.
  GrpcLink& Grpc(size_t node);
  LinkSession Session() const;
  // Writes one node's answer (rows h*G+j of its owned heads) into the all-heads o and lse, and
  // records it (selection counters into *selection, RecordAnswer). Heads the placement does not
  // give to `node` (a shard still migrating in) are ignored.
  void TakeAnswer(size_t node, const NodeAnswer& answer, float* o, float* lse,
                  LayerSelection* selection);
  // Records one node's answer: per-head selection counters and its scan rate.
  void RecordAnswer(size_t node, std::span<const uint32_t> kv_heads,
                    std::span<const uint64_t> selected, std::span<const uint64_t> held,
                    uint64_t compute_micros, uint64_t bytes_scanned);

  NodePool& pool_;
  RemoteKvOptions options_;
  std::vector<bool> opened_;    // per node: OpenSession succeeded
  // Per node: lost (see "Failure model"): shards placed there have no entries until rebuilt.
  std::vector<bool> lost_;
  std::vector<bool> suspect_;   // per node: missed a deadline, out of placement (skipped)
  std::vector<std::string> node_ids_;   // per node: Stats.node_id when our session was opened
  std::vector<bool> node_int8_;         // per node: stores int8 rows (Stats.kv_storage)
  uint64_t synced_generation_ = 0;      // pool generation SyncWithPool last looked at
  // Per node: its shared-memory link, or null when it is served over gRPC; its gRPC link (for
  // appends and attends without shm, and attends too large for the channel).
  std::vector<std::unique_ptr<ShmLink>> shm_;
  std::vector<std::unique_ptr<GrpcLink>> grpc_;
  bool closed_ = false;
  int64_t offloaded_tokens_ = 0;
  int64_t fork_prefix_tokens_ = 0;   // entries shared with the parent (Fork), charged to it
  NodeClaim claim_;                  // what this session will charge on each node
  uint64_t node_bytes_ = 0;          // NodeBytes()

  // The Attend in flight.
  int64_t attend_layer_ = -1;
  int64_t attend_tokens_ = 0;
  std::vector<size_t> shm_calls_;        // nodes with an Attend sent over shm
  std::vector<size_t> grpc_calls_;       // nodes with an Attend sent over gRPC
  Clock::time_point attend_deadline_;

  // Placement: node per shard, and the shards being copied to another node (shard -> target).
  std::vector<int> placement_;
  std::map<size_t, size_t> migrating_;
  std::unique_ptr<ShardMigrator> migrator_;
  std::vector<uint64_t> shard_selected_;   // [shards] last Attend's selected entries
  std::vector<uint64_t> shard_held_;       // [shards] last Attend's held entries
  std::vector<double> node_rate_;          // [nodes] measured bytes/s (EMA), 0 = unknown
  double migration_rate_ = 0;              // measured bulk-copy bytes/s (EMA), 0 = unknown
  uint64_t pool_generation_ = 0;
  int64_t expected_tokens_ = 0;
  int steps_since_plan_ = 0;
  bool replan_due_ = false;
  bool steady_state_due_ = false;   // the due re-plan ignores the copy's payback
  bool nodes_changed_ = false;
  NodeTransport transport_ = NodeTransport::kAuto;
  PlacementCounters counters_;

  std::vector<LayerSelection> last_selection_;
  double last_attend_compute_s_ = 0;   // the Attend in flight's, once answered (max over nodes)
  double last_attend_handle_s_ = 0;
  std::vector<double> share_sum_;
  std::vector<uint64_t> share_count_;
  uint64_t degraded_attends_ = 0;
  uint64_t shm_attends_ = 0;
  uint64_t shm_append_chunks_ = 0;
};

}  // namespace tandem::gpu_worker
